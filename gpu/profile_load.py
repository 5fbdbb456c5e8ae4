"""Profile a few steps of a running SGLang server under a fixed concurrent load.

Usage: python3 profile_load.py URL OUT_DIR [--concurrency 64] [--max-tokens 200] [--steps 12]
       python3 profile_load.py URL OUT_DIR --prompt-tokens 1024 [--rounds 3] ...   (prefill mode)

Sends CONCURRENCY streaming-free completions (ignore_eos, temperature 0), asks the server
for a torch profile of STEPS forward steps once all requests are decoding
(POST /start_profile), waits for every request, then for the trace file. The server writes
the trace (chrome JSON, gzipped) under OUT_DIR; gpu/trace_steps.py summarises it.
Bounded: one request per worker, every wait has a deadline. Stdlib only.

The prompts are a dozen tokens, so prefill is over well within --settle seconds; the decode
must outlast it: MAX_TOKENS x step time > settle (400 x 4.5 ms on the H200's 8B shape). If the
load ends before the profiled steps ran, no trace comes; that is reported after a short wait
instead of waiting out the whole timeout.

Prefill mode (--prompt-tokens N): the profiled window holds prefill steps among decode steps, as
a closed loop of CONCURRENCY clients does (each sends its next request when its last one is
answered). Prompts are N random token ids sent to /generate (as gpu/shapes_device.py's sweep
levels send them: ids 10..999, every prompt its own, so no prefix is cached). Every client sends
--rounds requests back to back. The profile starts when the first answer of the first wave comes
(plus --settle, default 0), and the clients' second requests are held until it has started, so
the window opens before the second wave's prefills: it holds them (and the decode steps of any
first-wave request still running), then the second wave's decodes. Give it enough --steps (each
prefill batch and each decode batch is one step) to cover the prefill chunks. A refused
/start_profile is reported (profile_error) and the exit status is 1.
"""
import argparse
import glob
import json
import os
import random
import sys
import threading
import time
import urllib.request


def post(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def prompt_ids(rnd, tokens):
    return [rnd.randrange(10, 1000) for _ in range(tokens)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out_dir")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--settle", type=float, default=None,
                    help="seconds from sending to profiling (default 0.5); in prefill mode from the first "
                         "answer to profiling (default 0)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="prefill mode: prompts of this many token ids, profiled from the second wave on")
    ap.add_argument("--rounds", type=int, default=None,
                    help="requests per client, back to back (default 1; prefill mode 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument("--no-stack", action="store_true",
                    help="no Python stacks in the trace: the host runs at nearly full speed, so the "
                         "GPU's idle gaps between steps show whether the host keeps up")
    args = ap.parse_args()
    prefill = args.prompt_tokens > 0
    rounds = args.rounds or (3 if prefill else 1)
    settle = args.settle if args.settle is not None else (0.0 if prefill else 0.5)
    os.makedirs(args.out_dir, exist_ok=True)
    errors, answered = [], []
    first_answer, profiling = threading.Event(), threading.Event()
    t_start = time.time()
    deadline = t_start + args.timeout
    rnd = random.Random(args.seed)  # drawn here, in one thread: the same prompts on every run
    prompts = [[prompt_ids(rnd, args.prompt_tokens) for _ in range(rounds)] if prefill else None
               for _ in range(args.concurrency)]

    def request(i, r):
        if prefill:
            post(args.url + "/generate", {"input_ids": prompts[i][r], "sampling_params": {
                "temperature": 0, "max_new_tokens": args.max_tokens, "ignore_eos": True}}, args.timeout)
        else:
            post(args.url + "/v1/completions", {"model": "default", "prompt": f"def f{i}(x):\n    return",
                                                "max_tokens": args.max_tokens, "temperature": 0,
                                                "ignore_eos": True}, args.timeout)

    def client(i):
        try:
            for r in range(rounds):
                if r == 1 and prefill:  # the second wave waits until the profile has started
                    first_answer.set()
                    profiling.wait(max(0.0, deadline - time.time()))
                if time.time() >= deadline:
                    return
                request(i, r)
                answered.append(time.time() - t_start)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            errors.append(repr(exc))
        finally:
            first_answer.set()  # a failed or one-round client holds nothing back

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    if prefill:
        first_answer.wait(max(0.0, deadline - time.time()))
    time.sleep(settle)  # decode: all prefills done, decoding at full batch
    profile_error = None
    try:
        post(args.url + "/start_profile", {"output_dir": args.out_dir, "num_steps": args.steps,
                                           "activities": ["CPU", "GPU"], "with_stack": not args.no_stack}, 30)
    except Exception as exc:  # noqa: BLE001 - reported; the clients still finish
        profile_error = repr(exc)
    profile_at = time.time() - t_start
    profiling.set()
    deadline = time.time() + args.timeout
    for t in threads:
        t.join(max(0.1, deadline - time.time()))
    # the trace is written right after the profiled steps; with the load over, none will come
    # (nor when the profile was refused, or every client failed before the load could run)
    no_trace = profile_error or len(errors) == args.concurrency
    deadline = min(deadline, time.time() + 15)
    while not no_trace and time.time() < deadline and not glob.glob(os.path.join(args.out_dir, "*.json*")):
        time.sleep(0.5)
    time.sleep(0.0 if no_trace else 2.0)  # let the writer finish
    files = glob.glob(os.path.join(args.out_dir, "*"))
    report = {"url": args.url, "mode": "prefill" if prefill else "decode", "errors": len(errors),
              "first_error": errors[:1], "answered": len(answered), "profile_at_s": round(profile_at, 3),
              "answered_before_profile": sum(1 for t in answered if t <= profile_at), "files": files}
    if profile_error:
        report["profile_error"] = profile_error
    if not files:
        report["hint"] = ("no trace: the load ended before the profiled steps; raise --max-tokens"
                          + (" or --rounds" if prefill else ""))
    print(json.dumps(report))
    return 1 if profile_error else 0


if __name__ == "__main__":
    sys.exit(main())

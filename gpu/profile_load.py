"""Profile a few decode steps of a running SGLang server under a fixed concurrent load.

Usage: python3 profile_load.py URL OUT_DIR [--concurrency 64] [--max-tokens 200] [--steps 12]

Sends CONCURRENCY streaming-free completions (ignore_eos, temperature 0), asks the server
for a torch profile of STEPS forward steps once all requests are decoding
(POST /start_profile), waits for every request, then for the trace file. The server writes
the trace (chrome JSON, gzipped) under OUT_DIR; gpu/trace_steps.py summarises it.
Bounded: one request per worker, every wait has a deadline. Stdlib only.

The prompts are a dozen tokens, so prefill is over well within --settle seconds; the decode
must outlast it: MAX_TOKENS x step time > settle (400 x 4.5 ms on the H200's 8B shape). If the
load ends before the profiled steps ran, no trace comes; that is reported after a short wait
instead of waiting out the whole timeout.
"""
import argparse
import glob
import json
import os
import threading
import time
import urllib.request


def post(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out_dir")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds from sending to profiling")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument("--no-stack", action="store_true",
                    help="no Python stacks in the trace: the host runs at nearly full speed, so the "
                         "GPU's idle gaps between steps show whether the host keeps up")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    errors = []

    def one(i):
        body = {"model": "default", "prompt": f"def f{i}(x):\n    return", "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True}
        try:
            post(args.url + "/v1/completions", body, args.timeout)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    time.sleep(args.settle)  # all prefills done, decoding at full batch
    post(args.url + "/start_profile", {"output_dir": args.out_dir, "num_steps": args.steps,
                                       "activities": ["CPU", "GPU"], "with_stack": not args.no_stack}, 30)
    deadline = time.time() + args.timeout
    for t in threads:
        t.join(max(0.1, deadline - time.time()))
    # the trace is written right after the profiled steps; with the load over, none will come
    deadline = min(deadline, time.time() + 15)
    while time.time() < deadline and not glob.glob(os.path.join(args.out_dir, "*.json*")):
        time.sleep(0.5)
    time.sleep(2.0)  # let the writer finish
    files = glob.glob(os.path.join(args.out_dir, "*"))
    report = {"url": args.url, "errors": len(errors), "first_error": errors[:1], "files": files}
    if not files:
        report["hint"] = "no trace: the load ended before the profiled steps; raise --max-tokens"
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""Device-side GPU checks for dyn-disable's rare paths (issue #33 items 2-4), written for the lead
to run; not run yet. From the repo root, after gpu/run_dyn.sh setup (see gpu/README.md):

  python3 gpu/rare_paths_device.py CHECK[,CHECK...] --out DIR [--budget-s 540] [--gpus 0,1]

checks:
  sampling   item 2: eagle3-v2-dyn at TP=2 (the first two --gpus; skipped with one GPU), threshold
             5, 24 bursts across the threshold at temperature 1, top_p 0.9 (seeded per request).
             Ranks that sampled different tokens would finish different requests: the batch sizes,
             then the switch decisions and the collectives would differ (a hang, a crash, or switch
             log lines that differ between the ranks). Pass: every request answered, the server
             alive, both ranks' switch lines identical, transitions > 0, no error lines. (No per-rank
             hash of the sampled ids: that needs a hook in the server.)
  logit      item 3: baseline, eagle3-v2 and eagle3-v2-dyn (threshold 5) with
             --enable-custom-logit-processor, the `sharp` pair. One greedy prompt alone gives the
             token to ban (the first token of its answer); the same prompt with SGLang's
             DisallowedTokensLogitsProcessor banning it is sent alone (below the threshold) and amid
             16 requests of 1500 tokens (above it: sent once the dyn server reports drafting off).
             Pass: the banned request ran above the threshold (drafting was off when it came, all
             16 still decoding when it ended, forced_spec_steps moved), and on eagle3-v2-dyn both
             answers are equal (what the request gets does not depend on load) and equal to
             stock eagle3-v2's; recorded too
             whether each server's answer contains the banned token (stock v2's verify ignores the
             processor; baseline obeys it).
  memory     item 4: for eagle3-v2 and eagle3-v2-dyn on the `big` pair (dummy weights, 8B shape,
             context 4096), bisection over --mem-fraction-static for stock eagle3-v2's largest
             fraction at which the server starts and survives one full chunk: --chunked-prefill-size
             4096 and a prompt of 4088 tokens (it must fit the context: a request the server rejects
             proves nothing, so a 4xx answer stops the check as a harness error); then eagle3-v2-dyn
             at that fraction, and one step (0.005) below only if it fails there. The bracket is
             [0.80, 0.97] unless MEMORY_BRACKET="LO,HI" says where to look (HI: a fraction at which
             stock already failed to start in an earlier call, cited in the report and not tried
             again). Pass: stock's bracket narrowed to <= 0.006 and dyn survives within one step of
             stock's largest fraction (the plain path's memory comes out of the KV cache, not the
             activation headroom). The start-up line of every dyn start is recorded.
Writes DIR/rare_paths.json (updated as it goes); server logs under /tmp/dyn-logs.
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes_device  # noqa: E402
from dyn_device import LOGS, PROMPTS, el, say, server_info, wait_health  # noqa: E402
from shapes_device import Server  # noqa: E402

BUDGET = 540.0
REPORT = {}


class HarnessError(RuntimeError):
    """The server answered, but refused the request: the check measured nothing."""

OUT_DIR = "/tmp/out"


def left():
    return BUDGET - el()


def save(out):
    with open(os.path.join(out, "rare_paths.json"), "w") as f:
        json.dump(REPORT, f, indent=1)


def group(name, index, gpus, tp=1, mem=0.3, **extra):
    return dict({"name": name, "index": index, "gpus": gpus, "tp": tp, "mem": mem, "kv_tokens": 32768,
                 "max_running": 64}, **extra)


async def post(s, srv, body):
    """The answer of /generate. A 4xx is a HarnessError: the server refused what the harness
    sent, so whatever the check waited for was not tested."""
    async with s.post(srv.base + "/generate", json=body) as r:
        text = await r.text()
    if 400 <= r.status < 500:
        raise HarnessError(f"{srv.name}: HTTP {r.status}: {text[:300]}")
    if r.status != 200:
        raise RuntimeError(f"{srv.name}: HTTP {r.status}: {text[:300]}")
    return json.loads(text)


async def up(s, servers, timeout=300):
    for srv in servers:
        srv.start()
    ok = await asyncio.gather(*(wait_health(s, srv, timeout) for srv in servers))
    return {srv.name: w for srv, w in zip(servers, ok)}


def stop(servers):
    for srv in servers:
        srv.stop()


def sampling_server(gpus):
    return Server(group("sampling", 0, ",".join(gpus[:2]), tp=2, mem=0.2),
                  {"profile": "eagle3-v2-dyn", "pair": "sharp", "backend": "triton"}, 0, 5)


def logit_servers(gpus):
    flags = ["--enable-custom-logit-processor"]
    return [Server(group("logit", 1, gpus[0], mem=0.08),
                   {"profile": p, "pair": "sharp", "backend": "triton", "flags": flags}, i, 5)
            for i, p in enumerate(["baseline", "eagle3-v2", "eagle3-v2-dyn"])]


# the big pair's context (make_models.llama_config) bounds the prompt: one full chunk of prefill
# plus the answer must fit in it, or the server rejects the request before it reaches the GPU
MEMORY_CHUNK = 4096
MEMORY_ANSWER = 4
MEMORY_PROMPT = MEMORY_CHUNK - MEMORY_ANSWER - 4


def memory_server(profile, mem, gpu):
    # kv_tokens None: the KV cache sized from the fraction alone
    return Server(group("memory", 2, gpu, mem=mem, kv_tokens=None),
                  {"profile": profile, "pair": "big", "backend": "triton",
                   "flags": ["--chunked-prefill-size", str(MEMORY_CHUNK)], "label": f"{profile}-{mem:.3f}"}, 0, 8)


def memory_bracket(text):
    """MEMORY_BRACKET "LO,HI" -> (lo, hi, hi_known_failed); unset -> the full range, HI tried."""
    if not text:
        return 0.80, 0.97, False
    lo, hi = (float(x) for x in text.split(","))
    if not 0 < lo < hi < 1:
        raise ValueError(f"MEMORY_BRACKET {text!r}: want LO,HI with 0 < LO < HI < 1")
    return lo, hi, True


async def check_sampling(s, gpus):
    if len(gpus) < 2:
        return {"skipped": "needs two GPUs (nvidia-h200-x2)"}
    srv = sampling_server(gpus)
    rep = {"server": srv.name, "healthy": await up(s, [srv])}
    try:
        before = await server_info(s, srv)
        answered, errors = 0, []
        for c in range(24):
            if left() < 60:
                errors.append(f"budget: stopped after {c} bursts")
                break
            bodies = [{"text": PROMPTS[(c * 12 + k) % 32],
                       "sampling_params": {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 24 + k % 7,
                                           "sampling_seed": c * 100 + k}} for k in range(12)]
            res = await asyncio.gather(*(post(s, srv, b) for b in bodies), return_exceptions=True)
            errors += [repr(r)[:200] for r in res if isinstance(r, Exception)]
            answered += sum(not isinstance(r, Exception) for r in res)
        after = await server_info(s, srv)
        d0 = (before or {}).get("dyn_spec_disable") or {}
        d1 = (after or {}).get("dyn_spec_disable") or {}
        seqs = srv.switch_sequences()
        log = srv.scan_log()
        rep.update(answered=answered, errors=errors[:8], alive=srv.alive(),
                   transitions=sum(d1.get(k, 0) - d0.get(k, 0) for k in ("switches_off", "switches_on")),
                   ranks=sorted(seqs), ranks_agree=len({json.dumps(v) for v in seqs.values()}) <= 1,
                   error_lines=log["error_lines"], first_errors=log["first_errors"])
        rep["pass"] = (not errors and rep["alive"] and rep["ranks_agree"] and len(seqs) == 2
                       and rep["transitions"] > 0 and log["error_lines"] == 0)
    finally:
        stop([srv])
    return rep


async def dyn_state(s, srv):
    return (await server_info(s, srv) or {}).get("dyn_spec_disable") or {}


async def until_plain(s, srv, deadline_s=10.0):
    """Seconds until the dyn server reports drafting off (None: it did not within the deadline)."""
    t0 = time.time()
    while time.time() - t0 < deadline_s:
        if (await dyn_state(s, srv)).get("speculating") is False:
            return round(time.time() - t0, 2)
        await asyncio.sleep(0.05)
    return None


async def check_logit(s, gpus):
    servers = logit_servers(gpus)
    rep = {"healthy": await up(s, servers)}
    try:
        from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor
        processor = DisallowedTokensLogitsProcessor().to_str()
        prompt = PROMPTS[3]
        for srv in servers:
            plain = await post(s, srv, {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 24}})
            banned = plain["output_ids"][0]
            body = {"text": prompt, "custom_logit_processor": processor,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 24,
                                        "custom_params": {"token_ids": [banned]}}}
            alone = await post(s, srv, body)
            before = await dyn_state(s, srv)
            # long enough that the 16 still decode when the banned request ends: the tiny pair
            # decodes 64 tokens in well under a second (a first version slept 1 s and sent its
            # "loaded" request to an idle server)
            load = [{"text": PROMPTS[(k + 5) % 32], "sampling_params": {"temperature": 0, "max_new_tokens": 1500,
                                                                        "ignore_eos": True}} for k in range(16)]
            background = [asyncio.ensure_future(post(s, srv, b)) for b in load]
            waited = await until_plain(s, srv) if srv.label == "eagle3-v2-dyn" else await asyncio.sleep(0.3)
            loaded = await post(s, srv, body)
            overlapped = sum(not t.done() for t in background)
            await asyncio.gather(*background, return_exceptions=True)
            after = await dyn_state(s, srv)
            moved = {k: after.get(k, 0) - before.get(k, 0) for k in after if isinstance(after.get(k), int)
                     and not isinstance(after.get(k), bool)}
            rep[srv.label] = {"banned": banned, "alone": alone["output_ids"], "loaded": loaded["output_ids"],
                              "banned_in_alone": banned in alone["output_ids"],
                              "banned_in_loaded": banned in loaded["output_ids"],
                              "background_still_running_at_answer": overlapped,
                              "seconds_until_drafting_off": waited, "dyn_during_load": moved or None}
        dyn, stock = rep["eagle3-v2-dyn"], rep["eagle3-v2"]
        moved = dyn["dyn_during_load"] or {}
        # the banned request really ran above the threshold: drafting was off when it came, the 16
        # were still decoding when it ended, and steps were forced to speculate for it
        rep["loaded_ran_above_threshold"] = (dyn["seconds_until_drafting_off"] is not None
                                             and dyn["background_still_running_at_answer"] == 16
                                             and moved.get("forced_spec_steps", 0) > 0)
        rep["pass"] = (rep["loaded_ran_above_threshold"] and dyn["alone"] == dyn["loaded"]
                       and dyn["alone"] == stock["alone"])
    finally:
        stop(servers)
    return rep


async def survives(s, profile, mem, gpu):
    srv = memory_server(profile, mem, gpu)
    try:
        healthy = (await up(s, [srv], timeout=240))[srv.name]
        if healthy is None:
            return False, None
        ids = [random.Random(0).randrange(10, 1000) for _ in range(MEMORY_PROMPT)]
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": MEMORY_ANSWER}}
        before = len(srv.log_lines())
        try:
            await post(s, srv, body)
        except HarnessError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:  # a crashed or hung server is the answer
            say(f"{srv.name}: {e!r}"[:300])
        await asyncio.sleep(2)
        line = [l for l in srv.log_lines() if "plain step is a decode forward" in l][:1]
        oom = any("out of memory" in l.lower() for l in srv.log_lines()[before:])
        return srv.alive() and not oom, line[0] if line else None
    finally:
        stop([srv])


async def check_memory(s, gpus):
    # Stock is bisected; dyn is then started at stock's largest fraction and, only if it fails
    # there, one step below. A second bisection would need ~5 more server starts (~50 s each on
    # the 8B shape): the two together do not fit one 10-minute call with the logit check.
    lo, hi, hi_known = memory_bracket(os.environ.get("MEMORY_BRACKET"))
    tries = []
    ok_hi = False
    if hi_known:  # HI failed in an earlier call; LO must be shown to hold here
        ok_lo, line = await survives(s, "eagle3-v2", lo, gpus[0])
        tries.append((lo, ok_lo, line))
        if not ok_lo:
            lo, hi = 0.80, lo
    else:
        ok_hi, line = await survives(s, "eagle3-v2", hi, gpus[0])
        tries.append((hi, ok_hi, line))
        if ok_hi:
            lo = hi
    while hi - lo > 0.006 and left() > 125 and not ok_hi:
        mid = round((lo + hi) / 2, 4)
        ok, line = await survives(s, "eagle3-v2", mid, gpus[0])
        tries.append((mid, ok, line))
        lo, hi = (mid, hi) if ok else (lo, mid)
    rep = {"eagle3-v2": {"largest_ok": lo, "smallest_failed": None if ok_hi else hi,
                         "resolution": round(hi - lo, 4), "tries": tries,
                         "largest_ok_was_tried": any(ok and m == lo for m, ok, _ in tries),
                         "bracket_from_env": os.environ.get("MEMORY_BRACKET") or None,
                         "prompt_tokens": MEMORY_PROMPT, "chunked_prefill_size": MEMORY_CHUNK}}
    REPORT["memory"] = rep
    save(OUT_DIR)
    dyn_tries = []
    for mem in (lo, round(lo - 0.005, 4)):
        if left() < 60:
            dyn_tries.append((mem, None, "budget: not started"))
            break
        ok, line = await survives(s, "eagle3-v2-dyn", mem, gpus[0])
        dyn_tries.append((mem, ok, line))
        if ok:
            break
    rep["eagle3-v2-dyn"] = {"tries": dyn_tries,
                            "largest_ok": max((m for m, ok, _ in dyn_tries if ok), default=None)}
    # pass: dyn serves a full chunk within one step (0.005) of stock's largest fraction, which is
    # only meaningful where stock's bracket got down to about that step
    rep["pass"] = (rep["eagle3-v2-dyn"]["largest_ok"] is not None and rep["eagle3-v2"]["resolution"] <= 0.006)
    return rep


async def main():
    global BUDGET, OUT_DIR
    ap = argparse.ArgumentParser()
    ap.add_argument("checks")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--gpus", default=os.environ.get("GPUS", "0"))
    a = ap.parse_args()
    BUDGET = a.budget_s
    shapes_device.BUDGET = a.budget_s
    os.makedirs(LOGS, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    OUT_DIR = a.out
    gpus = a.gpus.split(",")
    runs = {"sampling": check_sampling, "logit": check_logit, "memory": check_memory}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for name in a.checks.split(","):
            t0 = time.time()
            try:
                REPORT[name] = await runs[name](s, gpus)
            except Exception as e:  # noqa: BLE001 - the next check still runs
                REPORT[name] = {"error": repr(e)[:400]}
            REPORT[name]["wall_s"] = round(time.time() - t0, 1)
            say(f"{name}: pass={REPORT[name].get('pass')} {json.dumps(REPORT[name])[:300]}")
            save(a.out)


if __name__ == "__main__":
    asyncio.run(main())

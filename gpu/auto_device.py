"""threshold=auto against the best fixed threshold (issue #29), one workload per call, on the
trained pair (gpu/train_pair.py), simulation off. First run: docs/evidence/auto-threshold/1-first-gpu-run.

Usage (repo root, after gpu/run_auto.sh has prepared /tmp/site and the pair):
  python3 gpu/auto_device.py --out DIR --workload own|random [--budget-s 420]
      [--fixed 2,8,16,64] [--levels 1,4,16,32,64] [--rounds 3] [--min-s 1.2] [--no-baseline]

Servers side by side on one GPU (shapes_device.Server, the flags the profiles give), on the same
pair: eagle3-v2-dyn `fixed-N` with SGLANG_SPEC_DISABLE_THRESHOLD=N for each N of --fixed (64 =
the largest batch: never plain, stock speculation), eagle3-v2-dyn `auto` with
SGLANG_SPEC_DISABLE_THRESHOLD=auto, and `baseline` (the target alone, no draft: the fastest
server a user runs where speculation never pays; no fixed threshold stops drafting at one
request, so without it the sweep has no plain side at c=1). Workloads: `own` = the pair's held-out text, greedy (the
draft accepts 2.5-2.6 tokens per step, docs/evidence/real-acceptance), `random` = random token
ids sampled at temperature 1 (the first GPU run used greedy decoding there, and a small target's
greedy continuation of random ids is as predictable as its own text: the draft accepted 2.4-3.6
tokens per step, so the crossovers did not differ; sampling makes the draft mostly wrong). Per
level c of --levels: a warm-up of c requests on every server, then --rounds rounds; in each, the
servers one at a time, in an order that rotates from round to round, each for
a closed loop of c requests in flight (each answer followed at once by the next request) for
--min-s seconds, then its drain; --in-tokens prompt tokens, --out-tokens generated, ignore_eos;
output tok/s over the whole wall time, the median of the rounds; beside it each round's
`server_decode_tok_s`, the median of the server's own 100-step `Decode batch` intervals at c
running requests in that round (the 4-gpu-bound call's client rounds of identical servers
differed by 3-5 %; their logs are the steadier measure). Short
interleaved runs, not one long run per server: on the second GPU run (5-s runs, one after the
other) every server of a level drifted together by 8-10 % from one round to the next, and
servers doing identical steps differed by 19-30 % when measured 10-20 s apart. Then
the bursty trace: a closed loop whose concurrency moves between --burst-low and --burst-high every
--period-s seconds for --bursty-s seconds; tok/s over the trace and its drain, with the load each
server was offered (mean requests in flight over the trace: a closed loop cannot take back the
requests of a high phase, so when waves end against the phase edges differs from server to
server) and every request's send and done times, and on a dyn server what its controller did in
that round (`dyn_delta`: /server_info's counters after the round minus before it, read outside
the timed window). With --segment-cycles, the same load as a fixed
sequence of work beside it (level bursty-segments: segments of --segment-waves waves at the high
and the low concurrency, each starting when the one before has drained; the same requests for
every server). After each level
auto's /server_info dyn_spec_disable (its buckets' estimates) is kept.
With --acc-mix (a config-only pair, the site's simulated acceptance drawn per request: SIM_ACCEPT=per-request,
gpu/sim_accept.py), level acc-mix: phases of the given mean accept lengths at one concurrency
(--acc-mix-c), --acc-mix-waves waves each, --acc-mix-cycles times a round, --acc-mix-rounds rounds, the
same requests for every server; each server reads the phase's acceptance from its own file
(acc_file), written by the driver before each phase. There the crossover itself moves, so every fixed
threshold is wrong in part of the load; auto_summary judges it by the bursty goal.
--auto-variants adds auto servers with one controller knob changed (not judged; their state in
DIR/auto_variant_state.jsonl). --fixed-twins N adds a second fixed-N server (`fixed-N-twin`, not
judged), the fixed side's A/A pair.
Writes DIR/records.jsonl, DIR/auto_state.jsonl, DIR/part-WORKLOAD.json (auto_summary's shape).
"""
import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
import zlib

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import auto_summary  # noqa: E402
import cpu_pin  # noqa: E402
import sim_accept  # noqa: E402
import steady_state  # noqa: E402

T0 = time.time()
BUDGET = 420.0


def el():
    return time.time() - T0


def left():
    return BUDGET - el()


def say(*a):
    print(f"[t={el():.1f}s]", *a, flush=True)


def prompts_for(workload, models, n, in_tokens, seed=0, pair="trained"):
    """n prompts of in_tokens ids: the pair's held-out text, or random ids of its vocabulary."""
    rnd = random.Random(seed)
    if workload == "own":
        held = json.load(open(os.path.join(models, "heldout.json")))["prompts"]
        held = [p for p in held if len(p) >= in_tokens] or held
        return [list(held[i % len(held)][:in_tokens]) for i in range(n)]
    vocab = json.load(open(os.path.join(models, f"target-{pair}", "config.json")))["vocab_size"]
    return [[rnd.randrange(3, vocab) for _ in range(in_tokens)] for _ in range(n)]


# sim: a config-only pair (dummy weights) whose acceptance SGLANG_SIMULATE_ACC_LEN sets; the
# prompts are random ids, decoded greedily (what they say does not matter)
TEMPERATURE = {"own": 0.0, "random": 1.0, "sim": 0.0}
temperature = 0.0  # the workload's, set in main()
out_spread = 0.0   # --out-spread, set in main()


def out_tokens_for(ids, out_tokens, spread):
    """A request's max_new_tokens: out_tokens, or with spread s > 0 an even draw in
    [(1 - s), (1 + s)] x out_tokens keyed on the prompt's ids, so every server gets the same
    lengths. With one length for all, plain steps (a token per request each) finish a closed
    loop's requests together, one batched prefill per wave, while speculation's requests
    (acceptance drawn apart) finish one by one and pay a prefill each, which may charge
    speculation with a cost of the harness's equal lengths where real answers differ in
    length (gpu/README row 1x)."""
    if spread <= 0:
        return out_tokens
    u = zlib.crc32(json.dumps(ids).encode()) / 0xFFFFFFFF
    return max(1, round(out_tokens * (1.0 - spread + 2.0 * spread * u)))


async def generate(s, srv, ids, out_tokens):
    body = {"input_ids": ids, "sampling_params": {"temperature": temperature, "ignore_eos": True,
                                                  "max_new_tokens": out_tokens_for(ids, out_tokens, out_spread)}}
    for attempt in (0, 1):
        try:
            async with s.post(srv.base + "/generate", json=body) as r:
                j = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {str(j)[:200]}")
                return j["meta_info"]["completion_tokens"]
        except aiohttp.ServerDisconnectedError:  # a kept-alive connection the server closed
            if attempt:
                raise


async def fixed_level(s, srv, prompts, c, n, out_tokens, min_s=0.0):
    """Rounds of n requests at concurrency c until min_s seconds have passed (at least one)."""
    sem = asyncio.Semaphore(c)
    toks = []

    async def one(ids):
        async with sem:
            toks.append(await generate(s, srv, ids, out_tokens))

    t0 = time.time()
    sent = 0
    while sent == 0 or time.time() - t0 < min_s:
        await asyncio.gather(*(one(prompts[(sent + i) % len(prompts)]) for i in range(n)))
        sent += n
    wall = time.time() - t0
    return {"requests": sent, "out_tokens": sum(toks), "wall_s": round(wall, 3),
            "out_tok_per_s": round(sum(toks) / wall, 1)}


async def steady_level(s, srv, prompts, c, min_s, out_tokens):
    """A closed loop: c requests in flight, each answered one followed at once by the next, for
    min_s seconds, then the drain; tokens over the whole wall time. (Batches of 4c that each
    drain, as fixed_level runs them, empty the server several times per measurement: every
    drain is a tail of small batches and an idle gap that a steady load does not have.)"""
    toks, sent = [], [0]
    t0 = time.time()

    async def worker():
        while time.time() - t0 < min_s:
            ids = prompts[sent[0] % len(prompts)]
            sent[0] += 1
            toks.append(await generate(s, srv, ids, out_tokens))

    await asyncio.gather(*(worker() for _ in range(c)))
    t1 = time.time()
    wall = t1 - t0
    # epoch seconds, so that gpu/host_sampler.py's samples can be set beside the round
    return {"requests": sent[0], "out_tokens": sum(toks), "wall_s": round(wall, 3),
            "out_tok_per_s": round(sum(toks) / wall, 1), "loop": "closed",
            "t_start": round(t0, 3), "t_end": round(t1, 3)}


def log_size(srv):
    try:
        return os.path.getsize(srv.log_path)
    except OSError:
        return 0


def server_rate(srv, offset, c):
    """The server's own decode rate over one round: the median of the `Decode batch` intervals
    (100 steps each) logged since `offset` at exactly c running requests, leaving out the first
    (it began before the round: idle time in it). Client-side rounds of identical servers
    disagreed by 3-5 % (docs/evidence/auto-threshold/4-gpu-bound), so the records carry both."""
    try:
        with open(srv.log_path, errors="replace") as f:
            f.seek(offset)
            text = f.read()
    except OSError:
        return {"server_decode_tok_s": None, "server_intervals": 0, "server_accept_len": None}
    lines = [(int(m.group(1)), float(m.group(2))) for m in steady_state.LINE.finditer(text)][1:]
    at_c = [rate for running, rate in lines if running == c]
    # what the server accepted in its speculative intervals at c (none on one that ran plain)
    accept, _ = steady_state.median_accept(text, c)
    return {"server_decode_tok_s": round(statistics.median(at_c), 1) if at_c else None,
            "server_intervals": len(at_c), "server_accept_len": accept}


def bursty_order(live, auto, rnd):
    """The servers of bursty round `rnd`: auto first (the server the trace judges: when the budget
    runs out, a fixed server's trace is what goes missing, not auto's), the others rotated by round."""
    rest = [srv for srv in live if srv is not auto]
    k = rnd % len(rest) if rest else 0
    return ([auto] if auto in live else []) + rest[k:] + rest[:k]


def offered_load(sends, dones, until_s):
    """Requests in flight on average over [0, until_s] (seconds from the trace's start): the time
    integral of the in-flight count is the sum of the done times minus the sum of the send times,
    each clipped to the window, so no request needs pairing with its own. The trace lowers its
    target at a phase edge but cannot take back requests already sent, so a server whose waves
    happen to end just after an edge carries more load into the low phase: two servers' tok/s
    compare fairly only at like loads."""
    if until_s <= 0:
        return 0.0
    return (sum(min(t, until_s) for t in dones) - sum(min(t, until_s) for t in sends)) / until_s


async def bursty(s, srv, prompts, low, high, period_s, total_s, out_tokens):
    """A closed loop: `high` requests in flight in odd periods, `low` in even ones. Besides tok/s
    over the trace and its drain, each record keeps every request's send and done times and the
    load the server was offered (offered_load) over the trace's window."""
    toks, inflight, started = [], set(), 0
    sends, dones = [], []
    t0 = time.time()

    async def one(ids):
        sends.append(time.time() - t0)
        toks.append(await generate(s, srv, ids, out_tokens))
        dones.append(time.time() - t0)

    while time.time() - t0 < total_s:
        target = high if int((time.time() - t0) / period_s) % 2 else low
        inflight = {t for t in inflight if not t.done()}
        while len(inflight) < target:
            inflight.add(asyncio.ensure_future(one(prompts[started % len(prompts)])))
            started += 1
        await asyncio.sleep(0.02)
    await asyncio.gather(*inflight)
    wall = time.time() - t0
    return {"requests": started, "out_tokens": sum(toks), "wall_s": round(wall, 3),
            "out_tok_per_s": round(sum(toks) / wall, 1), "low": low, "high": high,
            "period_s": period_s, "total_s": total_s,
            "mean_inflight": round(offered_load(sends, dones, total_s), 2),
            # in time order each (as shapes_device's records keep theirs), not paired per request
            "timeline_ms": {"send": [round(1000 * t) for t in sends], "done": [round(1000 * t) for t in dones]}}


async def run_segments(s, srv, prompts, segments, out_tokens):
    """Segments of fixed work in order, each (c, n, before): before() (or nothing), then n requests
    as a closed loop at concurrency c, starting when the segment before has drained; the prompts
    move on from segment to segment, so every server gets the same requests. (tokens, wall s,
    [(tokens, wall s) of each segment, in order])."""
    toks, sent, t0, parts = 0, 0, time.time(), []
    for c, n, before in segments:
        if before is not None:
            before()
        res = await fixed_level(s, srv, prompts[sent:] + prompts[:sent], c, n, out_tokens)
        toks += res["out_tokens"]
        parts.append((res["out_tokens"], res["wall_s"]))
        sent = (sent + n) % len(prompts)
    return toks, time.time() - t0, parts


async def segmented_bursty(s, srv, prompts, low, high, waves, cycles, out_tokens):
    """The bursty load as a fixed sequence of work: `cycles` times a segment of waves[0] * high
    requests at concurrency `high`, then one of waves[1] * low requests at `low`, each segment a
    closed loop that starts when the one before has drained. Every server gets the same requests
    at the same concurrency pattern, so tok/s tells the servers apart and not where their waves
    ended against a clock (the time-based trace's offered load differs from server to server)."""
    high_waves, low_waves = waves
    segments = [(high, high_waves * high, None), (low, low_waves * low, None)] * cycles
    toks, wall, _ = await run_segments(s, srv, prompts, segments, out_tokens)
    return {"requests": cycles * (high_waves * high + low_waves * low), "out_tokens": toks,
            "wall_s": round(wall, 3), "out_tok_per_s": round(toks / wall, 1), "low": low, "high": high,
            "waves": list(waves), "cycles": cycles}


ACC_DIR = "/tmp/lab-acc"   # one file per server: the mean accept length of the current phase


def acc_file(label):
    return os.path.join(ACC_DIR, label)


def set_acc(path, value):
    """The phase's mean accept length where the server reads it (gpu/sim_accept.py); None removes it
    (the server's own SGLANG_SIMULATE_ACC_LEN again). One rename, so the server never reads half."""
    if value is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(f"{value}\n")
    os.replace(path + ".tmp", path)


async def acc_mix(s, srv, prompts, c, phases, waves, cycles, out_tokens, path):
    """A load whose crossover moves and whose concurrency does not: `cycles` times, for each
    (acceptance, waves) of the phases, waves * c requests at concurrency c with the server's mean
    accept length set to that acceptance, each phase starting when the one before has drained. At
    one concurrency every fixed threshold takes one side in every phase, so where speculation pays at
    one acceptance and not at the other each is wrong in part of the trace; auto can follow it. The
    same requests and phases for every server. "phase_times" keeps each phase's tokens and wall
    time in order (cycles x phases), from which auto_summary.py sets auto against an oracle that
    takes the faster fixed server in every phase."""
    segments = [(c, w * c, lambda acc=acc: set_acc(path, acc)) for acc, w in zip(phases, waves)] * cycles
    try:
        toks, wall, parts = await run_segments(s, srv, prompts, segments, out_tokens)
    finally:
        set_acc(path, None)
    accs = list(phases) * cycles
    return {"requests": cycles * c * sum(waves), "out_tokens": toks, "wall_s": round(wall, 3),
            "out_tok_per_s": round(toks / wall, 1), "c": c, "acc_phases": list(phases), "waves": list(waves),
            "cycles": cycles,
            "phase_times": [{"acc": acc, "out_tokens": n, "wall_s": w} for acc, (n, w) in zip(accs, parts)]}


def parse_acc_mix(acc_text, waves_text):
    """--acc-mix "2.5,1.6" --acc-mix-waves "20,20" -> ([2.5, 1.6], [20, 20])."""
    try:
        phases = [float(x) for x in acc_text.split(",")]
        waves = [int(x) for x in waves_text.split(",")]
    except ValueError:
        raise ValueError(f"--acc-mix {acc_text!r} / --acc-mix-waves {waves_text!r}: numbers, comma-separated") from None
    if len(phases) < 2 or any(p <= 0 for p in phases):
        raise ValueError(f"--acc-mix {acc_text!r}: two or more accept lengths, each above 0")
    if len(waves) != len(phases) or any(w < 1 for w in waves):
        raise ValueError(f"--acc-mix-waves {waves_text!r}: one whole number of waves (at least 1) per phase of "
                         f"--acc-mix ({len(phases)})")
    return phases, waves


def parse_waves(text):
    """--segment-waves "3,8" -> (3, 8): waves of the high segment, waves of the low one."""
    try:
        high, low = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--segment-waves: {text!r} is not HIGH,LOW (two whole numbers of waves)") from None
    if high < 1 or low < 1:
        raise ValueError(f"--segment-waves: {text!r}: each segment needs at least one wave")
    return high, low


async def dyn_state(s, srv):
    try:
        async with s.get(srv.base + "/server_info") as r:
            info = await r.json()
        return info["internal_states"][0].get("dyn_spec_disable")
    except Exception as exc:  # noqa: BLE001 (kept as evidence, the run goes on)
        return {"error": repr(exc)}


async def read_state(s, srv):
    """{"state": dyn_state, "read_at": this machine's epoch seconds once it came}: with the state's
    clock_s, each probe of its probe_log placed on the records' clock (gpu/probe_rounds.py)."""
    state = await dyn_state(s, srv)
    return {"read_at": round(time.time(), 3), "state": state}


ROUND_COUNTERS = ("spec_steps", "plain_steps", "forced_spec_steps", "switches_off", "switches_on", "probe_steps")


def dyn_delta(before, after):
    """What a dyn server's controller did during one round: its /server_info counters after the
    round minus before it (steps of each kind, switches, probe steps; auto's speculative and
    plain seconds, counted and left out, and its probes summed over the buckets). None when
    either read failed or the server has no dyn state (the baseline)."""
    if not isinstance(before, dict) or not isinstance(after, dict) or "error" in before or "error" in after:
        return None
    out = {k: after[k] - before[k] for k in ROUND_COUNTERS
           if isinstance(after.get(k), (int, float)) and isinstance(before.get(k), (int, float))}
    ta, tb = after.get("time_accounting") or {}, before.get("time_accounting") or {}
    for side in ("spec", "plain"):
        a, b = ta.get(side) or {}, tb.get(side) or {}
        if all(isinstance(x.get(k), (int, float)) for x in (a, b) for k in ("counted_s", "uncounted_s")):
            out[f"{side}_s"] = round(a["counted_s"] + a["uncounted_s"] - b["counted_s"] - b["uncounted_s"], 4)
    if isinstance(after.get("buckets"), dict) and isinstance(before.get("buckets"), dict):
        def probes(state):
            return sum(b.get("probes", 0) for b in state["buckets"].values() if isinstance(b, dict))
        out["probes"] = probes(after) - probes(before)
    return out or None


async def timed_round(s, srv, run):
    """run() for one server, with its controller's counters read around it (dyn servers only;
    outside the timed window) and kept as the result's "dyn_delta"."""
    dyn = srv.threshold_label != "none"
    before = await dyn_state(s, srv) if dyn else None
    res = await run()
    if dyn:
        res["dyn_delta"] = dyn_delta(before, await dyn_state(s, srv))
    return res


def parse_variants(text):
    """--auto-variants "probe=0.0001,margin=0.05" -> [("auto-probe0.0001", {env}), ...]: auto
    servers beside the judged one, each with one controller knob changed (diagnostics). draft_kv is
    the native plain path's SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV (write, skip or defer; the profile's
    own otherwise): with write a plain bucket's speculative probes draft over a complete context."""
    knobs = {"probe": "SGLANG_SPEC_DISABLE_AUTO_PROBE_BUDGET", "margin": "SGLANG_SPEC_DISABLE_AUTO_MARGIN",
             "hysteresis": "SGLANG_SPEC_DISABLE_AUTO_HYSTERESIS",
             "probe_steps": "SGLANG_SPEC_DISABLE_AUTO_PROBE_STEPS",
             "draft_kv": "SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV",
             "deferred_accept": "SGLANG_SPEC_DISABLE_AUTO_DEFERRED_ACCEPT"}
    out = []
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        knob, sep, value = item.partition("=")
        if not sep or knob not in knobs or not value:
            raise ValueError(f"--auto-variants: {item!r} is not KNOB=VALUE with KNOB one of {sorted(knobs)}")
        out.append((f"auto-{knob}{value}", {knobs[knob]: value}))
    return out


def parse_fixed_twins(text, fixed):
    """--fixed-twins "2" with --fixed "2,8" -> [2]: each a threshold of the sweep, once."""
    sweep = {int(t) for t in fixed.split(",")}
    out = []
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        if not item.isdigit() or int(item) not in sweep:
            raise ValueError(f"--fixed-twins: {item!r} is not one of the --fixed thresholds {sorted(sweep)}")
        if int(item) in out:
            raise ValueError(f"--fixed-twins: {item} is given twice")
        out.append(int(item))
    return out


DYN_PROFILES = ("eagle3-v2-dyn", "eagle3-v2-dyn-native")   # the plain step path, the native one (defer)


def make_servers(fixed, mem, baseline=True, pair="trained", acc_len=2.5, kv_tokens=32768, variants=(),
                 dyn_profile="eagle3-v2-dyn", fixed_twins=(), acc_files=False):
    """The fixed-threshold and auto servers all run `dyn_profile`, so that a sweep compares
    thresholds on one plain path. Every server with --sleep-on-idle (the group's sleep_on_idle):
    an idle 0.5.11 scheduler busy-polls its sockets (one core at 100 %), and six idle servers
    beside the measured one put host noise into its
    host-bound steps (the real-acceptance c=1 rounds scattered by up to 40 % with seven servers
    resident). The scheduler sleeps only when it has no request at all (Scheduler.on_idle), and a
    request wakes its poll at once, so a measured server runs as without the flag. With acc_files
    every server reads its mean accept length from its own file (acc_file, for --acc-mix)."""
    import shapes_device

    def lab_env(label, env):
        return {**env, sim_accept.ACC_LEN_FILE_ENV: acc_file(label)} if acc_files else env

    group = {"name": "auto", "index": 0, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
             "mem": mem, "kv_tokens": kv_tokens, "max_running": 64, "pair": pair, "acc_len": acc_len,
             "sleep_on_idle": True}
    servers = []
    for k, threshold in enumerate([*fixed, "auto"]):
        label = "auto" if threshold == "auto" else f"fixed-{threshold}"
        env = lab_env(label, {"TRITON_CACHE_DIR": f"/tmp/triton-{label}"})
        # the threshold, "auto" included, goes through the profile as `invoke server start --threshold` passes it
        spec = {"profile": dyn_profile, "label": label, "pair": pair, "env": env}
        srv = shapes_device.Server(group, spec, k, threshold)
        srv.threshold_label = threshold
        servers.append(srv)
    # an identical fixed-N server beside fixed-N (an A/A pair on the fixed side), labelled apart so that
    # auto_summary keeps it beside the sweep, not in it
    for threshold in fixed_twins:
        label = f"fixed-{threshold}-twin"
        spec = {"profile": dyn_profile, "label": label, "pair": pair,
                "env": lab_env(label, {"TRITON_CACHE_DIR": f"/tmp/triton-{label}"})}
        srv = shapes_device.Server(group, spec, len(servers), threshold)
        srv.threshold_label = f"{threshold}-twin"
        servers.insert(len(servers) - 1, srv)
    # the judged auto server stays last (main() takes servers[-1]); variants go before it
    for label, knob_env in variants:
        env = lab_env(label, {"TRITON_CACHE_DIR": f"/tmp/triton-{label}", **knob_env})
        spec = {"profile": dyn_profile, "label": label, "pair": pair, "env": env}
        srv = shapes_device.Server(group, spec, len(servers), "auto")
        srv.threshold_label = label
        servers.insert(len(servers) - 1, srv)
    if baseline:
        spec = {"profile": "baseline", "label": "baseline", "pair": pair,
                "env": {"TRITON_CACHE_DIR": "/tmp/triton-baseline"}}
        srv = shapes_device.Server(group, spec, len(servers), 0)
        srv.threshold_label = "none"
        servers.insert(0, srv)
    return servers


def auto_variants(servers):
    """The --auto-variants servers among the others (fixed-N have an int threshold label, the
    baseline "none", the judged auto server "auto")."""
    return [s for s in servers if isinstance(s.threshold_label, str) and s.threshold_label.startswith("auto-")]


def pin_servers(servers, labels_text, ap):
    """Give each server --pin names a physical core of its own (srv.cpus); refuse a label no
    server has, or more servers than the host's node has cores for."""
    labels = [lab.strip() for lab in labels_text.split(",") if lab.strip()]
    known = {srv.label: srv for srv in servers}
    unknown = [lab for lab in labels if lab not in known]
    if unknown:
        ap.error(f"--pin: no server labelled {', '.join(unknown)} (the servers: {', '.join(known)})")
    if not labels:
        return
    rows = cpu_pin.topology()
    try:
        cores = cpu_pin.pick_cores(rows, len(labels))
    except ValueError as exc:
        ap.error(f"--pin: {exc}")
    say("host:", cpu_pin.describe(rows))
    for lab, cpus in zip(labels, cores):
        known[lab].cpus = cpus


@contextlib.contextmanager
def inherited_affinity(cpus):
    """The driver's own CPU affinity set to cpus while a server starts, so that the launcher and
    everything it forks inherit it from the first instruction (memory first touched there too)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def start_order(servers):
    """The order the servers start in: the auto servers (the judged one and its variants) between
    the others, not after them. In the two calls of docs/evidence/auto-threshold/4-gpu-bound and
    5-low-load-spread every auto server started last and ran 3-5 % under the fixed servers at the
    same side, so the start order was a confound; alternating takes it out."""
    variants = auto_variants(servers)
    autos = [srv for srv in servers if srv.threshold_label == "auto" or srv in variants]
    others = [srv for srv in servers if srv not in autos]
    order = []
    for k in range(max(len(autos), len(others))):
        order += others[k:k + 1] + autos[k:k + 1]
    return order


async def main():
    global BUDGET, temperature, out_spread
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workload", choices=sorted(TEMPERATURE), required=True)
    ap.add_argument("--name", help="the workload's name in records and part-NAME.json (default: --workload)")
    ap.add_argument("--pair", default="trained",
                    help="the pair in --models: trained, or a config-only one (big, kimi, ...) with --workload sim")
    ap.add_argument("--acc-len", type=float, default=2.5, help="SGLANG_SIMULATE_ACC_LEN of a config-only pair")
    ap.add_argument("--kv-tokens", type=int, default=32768)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--models", default="/tmp/models")
    ap.add_argument("--fixed", default="2,8,16,64")
    ap.add_argument("--levels", default="1,4,16,32,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-baseline", action="store_true", help="no target-only server in the sweep")
    ap.add_argument("--mem", type=float, default=0.08)
    ap.add_argument("--in-tokens", type=int, default=128)
    ap.add_argument("--out-tokens", type=int, default=96)
    ap.add_argument("--out-spread", type=float, default=0.0,
                    help="each request's output length an even draw in [1 - S, 1 + S] x --out-tokens, keyed on "
                         "its prompt (the same on every server; 0: all --out-tokens)")
    ap.add_argument("--burst-low", type=int, default=2)
    ap.add_argument("--burst-high", type=int, default=48)
    ap.add_argument("--period-s", type=float, default=3.0)
    ap.add_argument("--bursty-s", type=float, default=10.0)
    ap.add_argument("--bursty-rounds", type=int, default=1)
    ap.add_argument("--segment-cycles", type=int, default=0,
                    help="also the segmented bursty load (level bursty-segments) in each bursty round: this many "
                         "cycles of a high segment and a low one (0: not run)")
    ap.add_argument("--segment-waves", default="3,8",
                    help="HIGH,LOW: waves of --burst-high requests in a high segment, of --burst-low in a low one")
    ap.add_argument("--acc-mix", default="",
                    help='level acc-mix: phases of these mean accept lengths at one concurrency, e.g. "2.5,1.6" '
                         "(--workload sim on a site whose draw is per request: SIM_ACCEPT=per-request; TP=1)")
    ap.add_argument("--acc-mix-c", type=int, default=16, help="the acc-mix level's concurrency")
    ap.add_argument("--acc-mix-waves", default="20,20", help="waves of --acc-mix-c requests in each phase")
    ap.add_argument("--acc-mix-cycles", type=int, default=2, help="times the acc-mix phases run in a round")
    ap.add_argument("--acc-mix-rounds", type=int, default=2, help="rounds of the acc-mix level")
    ap.add_argument("--min-s", type=float, default=1.2, help="seconds each round's measurement lasts at least")
    ap.add_argument("--auto-variants", default="",
                    help='more auto servers, one knob each, not judged: "probe=0.0001,margin=0.05" '
                         "(SGLANG_SPEC_DISABLE_AUTO_PROBE_BUDGET / _MARGIN / _HYSTERESIS; "
                         "probe_steps=N: _PROBE_STEPS; draft_kv=write|skip|defer: "
                         "SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV of the native plain path; deferred_accept=correct|raw: "
                         "_AUTO_DEFERRED_ACCEPT)")
    ap.add_argument("--pin", default="",
                    help="servers by label (\"fixed-2,auto\") each pinned from its start to a physical core of its "
                         "own (gpu/cpu_pin.py): an unpinned twin beside a pinned server shows whether the "
                         "host's placement of its one busy thread is the rounds' noise")
    ap.add_argument("--fixed-twins", default="",
                    help="thresholds of --fixed to run twice, the second server not judged (fixed-N-twin): "
                         "the spread of identical fixed servers beside auto's twin")
    ap.add_argument("--dyn-profile", choices=DYN_PROFILES, default="eagle3-v2-dyn",
                    help="the profile of the fixed and auto servers: eagle3-v2-dyn (plain steps inside a "
                         "speculative batch) or eagle3-v2-dyn-native (plain steps as a non-speculative batch, defer)")
    a = ap.parse_args()
    try:
        variants = parse_variants(a.auto_variants)
        waves = parse_waves(a.segment_waves)
        fixed_twins = parse_fixed_twins(a.fixed_twins, a.fixed)
        mix = parse_acc_mix(a.acc_mix, a.acc_mix_waves) if a.acc_mix else None
    except ValueError as exc:
        ap.error(str(exc))
    BUDGET = a.budget_s
    temperature = TEMPERATURE[a.workload]
    if not 0.0 <= a.out_spread < 1.0:
        ap.error(f"--out-spread must be in [0, 1), got {a.out_spread}")
    out_spread = a.out_spread
    name = a.name or a.workload
    import accept_device
    import shapes_device
    if (a.workload == "sim") != (a.pair in shapes_device.CONFIG_ONLY):
        ap.error("--workload sim goes with a config-only --pair (dummy weights), and only with one")
    if mix and a.workload != "sim":
        ap.error("--acc-mix sets a simulated acceptance: it goes with --workload sim")
    draw = sim_accept.mode(sim_accept.SITE) if mix else None
    if mix and draw != sim_accept.PER_REQUEST:
        ap.error(f"--acc-mix needs {sim_accept.SITE}'s simulated acceptance drawn per request, which reads its "
                 f"mean from a file (it is {draw or 'not there'}): SIM_ACCEPT=per-request bash "
                 "gpu/run_dyn.sh setup, or SIM_ACCEPT=per-request in front of gpu/run_auto.sh")
    shapes_device.BUDGET = a.budget_s
    os.makedirs(a.out, exist_ok=True)
    levels = [int(c) for c in a.levels.split(",")]
    prompts = prompts_for(a.workload, a.models, 4 * max(levels), a.in_tokens, pair=a.pair)
    servers = make_servers([int(t) for t in a.fixed.split(",")], a.mem, baseline=not a.no_baseline,
                           pair=a.pair, acc_len=a.acc_len, kv_tokens=a.kv_tokens, variants=variants,
                           fixed_twins=fixed_twins, acc_files=bool(mix),
                           dyn_profile=a.dyn_profile)
    pin_servers(servers, a.pin, ap)
    records_path = os.path.join(a.out, "records.jsonl")
    state_path = os.path.join(a.out, "auto_state.jsonl")
    auto = servers[-1]

    def keep(path, rec):
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    async def keep_states(s, c, **extra):
        keep(state_path, {"after": f"c={c}", **extra, **await read_state(s, auto)})
        for srv in auto_variants(live):
            keep(os.path.join(a.out, "auto_variant_state.jsonl"),
                 {"after": f"c={c}", **extra, "server": srv.label, **await read_state(s, srv)})

    live, measured = [], None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        try:
            starts = start_order(servers)
            say("start order:", [srv.label for srv in starts])
            for srv in starts:
                with inherited_affinity(getattr(srv, "cpus", None)):
                    await shapes_device.start_servers([srv], False, 2)
            wait_s = min(240, left() - 60)
            health = await shapes_device.wait_up(s, servers, wait_s)
            live = [srv for srv in servers if health.get(srv.name) is not None]
            for srv in live:
                if getattr(srv, "cpus", None):
                    threads = cpu_pin.pin_tree(srv.proc.pid, srv.cpus)
                    say(f"{srv.label}: {threads} threads on CPUs {srv.cpus}")
            say("live:", [srv.label for srv in live])
            if not live:
                say(f"no server was healthy within {wait_s:.0f} s: nothing measured "
                    "(a larger BUDGET_S gives them longer to start)")
                raise TimeoutError("no server healthy")
            for li, c in enumerate(levels):
                measured = c  # a level the budget cuts still leaves auto's state (costcheck reads it)
                for srv in live:
                    await fixed_level(s, srv, prompts, c, c, a.out_tokens)      # warm-up
                for rnd in range(a.rounds):
                    k = (li + rnd) % len(live)
                    order = live[k:] + live[:k]
                    for srv in order:
                        if left() < 30:
                            say("budget: stopping before", srv.label, "c =", c)
                            raise TimeoutError("budget")
                        offset = log_size(srv)
                        res = await steady_level(s, srv, prompts[c:], c, a.min_s, a.out_tokens)
                        res.update(server_rate(srv, offset, c))
                        # backend, architecture, TP size with every record (srv.meta()); the level's own keys last
                        rec = {**res, **srv.meta(), "cpus": getattr(srv, "cpus", None), "workload": name,
                               "level": str(c), "server": srv.label, "threshold": srv.threshold_label,
                               "round": rnd, "temperature": temperature, "out_spread": out_spread}
                        keep(records_path, rec)
                        say(name, "c =", c, srv.label, res["out_tok_per_s"], "tok/s")
                await keep_states(s, c)
                measured = None
            for rnd in range(a.bursty_rounds):
                for srv in bursty_order(live, auto, rnd):
                    if left() < a.bursty_s + 15:
                        say("budget: no bursty trace for", srv.label)
                        continue
                    res = await timed_round(s, srv, lambda: bursty(
                        s, srv, prompts, a.burst_low, a.burst_high, a.period_s, a.bursty_s, a.out_tokens))
                    keep(records_path, {**res, **srv.meta(), "workload": name, "level": "bursty",
                                        "server": srv.label, "threshold": srv.threshold_label, "round": rnd,
                                        "temperature": temperature, "out_spread": out_spread})
                    say(name, "bursty", srv.label, res["out_tok_per_s"], "tok/s")
                for srv in bursty_order(live, auto, rnd) if a.segment_cycles > 0 else ():
                    if left() < 30:
                        say("budget: no segmented bursty load for", srv.label)
                        continue
                    res = await timed_round(s, srv, lambda: segmented_bursty(
                        s, srv, prompts, a.burst_low, a.burst_high, waves, a.segment_cycles, a.out_tokens))
                    keep(records_path, {**res, **srv.meta(), "workload": name, "level": "bursty-segments",
                                        "server": srv.label, "threshold": srv.threshold_label, "round": rnd,
                                        "temperature": temperature, "out_spread": out_spread})
                    say(name, "bursty-segments", srv.label, res["out_tok_per_s"], "tok/s")
            if a.bursty_rounds > 0:   # without bursty rounds it would repeat the last level's state
                keep(state_path, {"after": "bursty", **await read_state(s, auto)})
            for rnd in range(a.acc_mix_rounds if mix else 0):
                for srv in bursty_order(live, auto, rnd):
                    if left() < 45:
                        say("budget: no acc-mix round for", srv.label)
                        continue
                    res = await timed_round(s, srv, lambda: acc_mix(
                        s, srv, prompts, a.acc_mix_c, mix[0], mix[1], a.acc_mix_cycles, a.out_tokens,
                        acc_file(srv.label)))
                    keep(records_path, {**res, **srv.meta(), "workload": name, "level": "acc-mix",
                                        "server": srv.label, "threshold": srv.threshold_label, "round": rnd,
                                        "temperature": temperature, "out_spread": out_spread})
                    say(name, "acc-mix", srv.label, res["out_tok_per_s"], "tok/s")
            if mix:
                keep(state_path, {"after": "acc-mix", **await read_state(s, auto)})
        except TimeoutError:
            if measured is not None and auto in live:
                await keep_states(s, measured, cut_by_budget=True)
        finally:
            accept_device.stop_all(servers)
            scans = {srv.label: srv.scan_log() for srv in servers}
            with open(os.path.join(a.out, "logs_scan.json"), "w") as f:
                json.dump(scans, f, indent=1)
            for lab, sc in scans.items():
                say(f"log {lab}: {sc['error_lines']} error lines; first={sc['first_errors'][:2]}")
            if os.path.exists(records_path):
                part = auto_summary.workload_summary(auto_summary.read_records(records_path), name)
                with open(os.path.join(a.out, f"part-{name}.json"), "w") as f:
                    json.dump(part, f, indent=1)
                for level, e in part["levels"].items():
                    say("summary", name, level, json.dumps({k: e[k] for k in (
                        "auto", "best_fixed", "best_fixed_threshold", "auto_over_best", "oracle_tok_s",
                        "auto_over_oracle") if k in e}))
    return 0 if live else 3


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

"""Summarise torch-profiler traces of SGLang decode steps (from gpu/profile_load.py).

Usage: python3 trace_steps.py TRACE.json.gz [BASE_TRACE.json.gz] [--log SERVER.log] [--base-log SERVER.log]

For one trace: the window, GPU busy time, CUDA-graph launches, the heaviest kernels, every
host-blocking CUDA call (stream/event synchronize, memcpy) with the SGLang functions it was
called from, and the steps: per replay of the target's graph (one decode forward, or a
speculative step's verify), its GPU time, the other graphs replayed before the next one (side
graphs: a plain step's draft KV-only update, or the draft's decode and extend graphs around a
verify), the GPU work outside graphs, and the GPU's idle gap before the next replay of it. A gap near
zero means the host keeps the GPU fed; a larger one means the host sets the pace (read it from a
trace taken without Python stacks, `profile_load.py --no-stack`: stacks slow the host several
times). With a second (baseline) trace: the kernels the first adds per graph launch of the
baseline's, i.e. the extra GPU work per step. Stdlib only; runs on the dev machine.

Prefill: SGLang (0.5.11) wraps every forward in a profiler span `step[MODE bs=N]`, an EXTEND one
`step[EXTEND bs=N toks=T]`. Each span's GPU time is the busy time of the kernels launched inside
it (linked by their correlation ids). The prefill forwards (EXTEND, MIXED, SPLIT_PREFILL) are
listed with their tokens, GPU time and extend-attention kernels (triton's `_fwd_kernel`, not the
decode's `_fwd_grouped_kernel_stage1` / `_fwd_kernel_stage2`); a speculative server's draft runs its
own EXTEND of the same tokens right after the target's, told apart by its far smaller kernel count.
With two traces: the prefill GPU time per token of each (`profile_load.py --prompt-tokens` puts
prefills into the profiled window).

Context length: a decode step's attention time grows with the KV tokens it reads, which a trace
does not hold, so two traces taken at different places in a wave differ in attention time for no
reason of the servers'. With `--log` (and `--base-log` for the second trace) the server's own
`Decode batch` lines just before and after the `Profiling starts` line of the trace's profile id
(the trace file's name) are printed: the running requests and KV tokens that bracket the traced
steps.
"""
import argparse
import bisect
import collections
import gzip
import json
import os
import re
import statistics


def load(path):
    with gzip.open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def gpu_events(events):
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def busy_us(intervals):
    total, current = 0, None
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            total += current[1] - current[0] if current else 0
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    return total + (current[1] - current[0] if current else 0)


def kernel_totals(events):
    totals, counts = collections.Counter(), collections.Counter()
    for e in gpu_events(events):
        totals[e["name"][:80]] += e["dur"]
        counts[e["name"][:80]] += 1
    return totals, counts


def graph_launches(events):
    return sum(1 for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in e["name"])


def summary(path, events):
    kernels = gpu_events(events)
    t0 = min(e["ts"] for e in kernels)
    t1 = max(e["ts"] + e["dur"] for e in kernels)
    busy = busy_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    print(f"== {path}\nwindow {(t1 - t0) / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({busy / (t1 - t0):.0%}), "
          f"CUDA-graph launches {graph_launches(events)}")
    totals, counts = kernel_totals(events)
    for name, dur in totals.most_common(10):
        print(f"  {dur / 1e3:8.2f} ms x{counts[name]:5d}  {name}")


def blocking_calls(events):
    """Host-blocking CUDA calls, grouped by the innermost three SGLang frames around them (a trace
    taken with Python stacks), else by the innermost three torch ops (cpu_op: a trace without
    stacks still tells an `aten::to` that waits for the GPU from the scheduler's own waits)."""
    python = [e for e in events if e.get("cat") == "python_function" and "sglang" in e["name"]]
    ops = python or [e for e in events if e.get("cat") == "cpu_op"]
    calls = [e for e in events if e.get("cat") == "cuda_runtime"
             and ("Synchronize" in e["name"] or e["name"] == "cudaMemcpyAsync")]
    grouped, time_us = collections.Counter(), collections.Counter()
    for call in calls:
        frames = sorted((p for p in ops if p["tid"] == call["tid"] and p["ts"] <= call["ts"]
                         and p["ts"] + p["dur"] >= call["ts"] + call["dur"]), key=lambda p: p["ts"])
        where = " <- ".join(p["name"].split("sglang/srt/")[-1][:60] for p in reversed(frames[-3:]))
        grouped[(call["name"], where)] += 1
        time_us[(call["name"], where)] += call["dur"]
    print("host-blocking / copy calls (count, host time, where; the longest first):")
    for key, us in time_us.most_common(12):
        print(f"  x{grouped[key]:3d} {us / 1e3:6.2f} ms {key[0]}: {key[1]}")


SAME_GRAPH_KERNELS = 0.1  # replays within 10 % of the main graph's kernel count are that graph


def steps(events):
    """Per step: (main graph ms, side graphs ms, other GPU ms, idle ms) until the next step.

    A step starts at a replay of the main graph: the graph whose replays take longest by their
    median, graphs told apart by their kernel count (replays within SAME_GRAPH_KERNELS of it are
    that graph), which is the target's forward: a decode graph without speculation, the
    TARGET_VERIFY graph in a speculative step. The median, not the single longest replay: at
    TP>1 one replay of a short graph can wait many ms in an all-reduce for the other rank. Every other
    replay (a plain step's draft KV-only update, the draft's multi-step decode and its extend
    around a verify) is a side graph of the step it falls in, however long it runs."""
    launches = {e["args"]["correlation"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "GraphLaunch" in e["name"] and "correlation" in e.get("args", {})}
    kernels = sorted(gpu_events(events), key=lambda e: e["ts"])
    spans, counts = {}, collections.Counter()
    for k in kernels:
        corr = k.get("args", {}).get("correlation")
        if corr in launches:
            span = spans.setdefault(corr, [k["ts"], k["ts"] + k["dur"]])
            span[1] = max(span[1], k["ts"] + k["dur"])
            counts[corr] += 1
    if not spans:
        return []
    durations = collections.defaultdict(list)
    for corr, (start, end) in spans.items():
        durations[counts[corr]].append(end - start)
    main_kernels = max(durations, key=lambda n: statistics.median(durations[n]))
    replays = sorted(spans.values())
    mains = sorted(span for corr, span in spans.items()
                   if abs(counts[corr] - main_kernels) <= SAME_GRAPH_KERNELS * main_kernels)
    rows = []
    for (start, end), nxt in zip(mains, mains[1:]):
        side = busy_us([(a, b) for a, b in replays if end <= a < nxt[0]])
        between = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if end <= k["ts"] < nxt[0]
                   and k.get("args", {}).get("correlation") not in launches]
        other = busy_us(between)
        rows.append(((end - start) / 1e3, side / 1e3, other / 1e3, max(0.0, nxt[0] - end - side - other) / 1e3))
    return rows


def print_steps(rows):
    if not rows:
        print("steps: fewer than two CUDA-graph replays in the trace")
        return
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    graph, side, other, gap = (med([r[i] for r in rows]) for i in range(4))
    busy = graph + side + other
    print(f"steps ({len(rows)} between replays of the target's graph, decode or verify; medians): "
          f"target graph {graph:.3f} ms, "
          f"side graphs {side:.3f} ms, other GPU work {other:.3f} ms, GPU idle {gap:.3f} ms "
          f"-> step {busy + gap:.3f} ms; {'host-bound' if gap > 0.1 * busy else 'GPU-bound'}")
    for i, (g, sg, o, idle) in enumerate(rows):
        print(f"  step {i}: graph {g:.3f} ms, side graphs {sg:.3f} ms, other {o:.3f} ms, idle {idle:.3f} ms")


def extra_per_step(events, base_events):
    steps = max(1, graph_launches(base_events))  # the baseline replays one graph per step
    ours, our_counts = kernel_totals(events)
    base, base_counts = kernel_totals(base_events)
    rows = sorted(((ours[k] - base.get(k, 0), k) for k in set(ours) | set(base)), reverse=True)
    extra = (sum(ours.values()) - sum(base.values())) / steps / 1e3
    print(f"extra GPU time per step vs the baseline trace: {extra:.3f} ms "
          f"(baseline {sum(base.values()) / steps / 1e3:.3f} ms per step)")
    for delta, name in rows[:10]:
        print(f"  {delta / steps / 1e3:7.3f} ms/step  x{base_counts.get(name, 0) / steps:.0f} -> "
              f"x{our_counts.get(name, 0) / steps:.0f}  {name}")


STEP_SPAN = re.compile(r"^step\[(\w+) bs=(\d+)(?: toks=(\d+))?\]$")
PREFILL_MODES = {"EXTEND", "MIXED", "SPLIT_PREFILL", "DLLM_EXTEND"}  # not DRAFT_EXTEND: a decode step's
EXTEND_ATTENTION = re.compile(r"^_fwd_kernel(_unified)?$|BatchPrefillWith|flash_fwd|FlashAttnFwd|fmha", re.I)
DRAFT_KERNELS = 0.5  # an EXTEND with under half the kernels of the largest one is the draft's


def forwards(events):
    """One row per `step[...]` span, in order: mode, bs, toks (EXTEND only, else None), GPU ms
    (busy time of the kernels launched inside the span), kernel count, extend-attention kernels
    by name, and "draft" (an EXTEND far smaller than the trace's largest: the draft model's)."""
    spans = sorted((e for e in events if e.get("cat") == "user_annotation" and STEP_SPAN.match(e["name"])),
                   key=lambda e: e["ts"])
    launches = collections.defaultdict(list)  # (pid, tid) -> sorted [(ts, correlation)]
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[(e.get("pid"), e.get("tid"))].append((e["ts"], e["args"]["correlation"]))
    for calls in launches.values():
        calls.sort()
    kernels = collections.defaultdict(list)
    for k in gpu_events(events):
        kernels[k.get("args", {}).get("correlation")].append(k)
    rows = []
    for span in spans:
        mode, bs, toks = STEP_SPAN.match(span["name"]).groups()
        calls = launches.get((span.get("pid"), span.get("tid")), [])
        lo = bisect.bisect_left(calls, (span["ts"],))
        hi = bisect.bisect_right(calls, (span["ts"] + span["dur"], float("inf")))
        ks = [k for _, corr in calls[lo:hi] for k in kernels.get(corr, [])]
        attention = collections.Counter(k["name"] for k in ks if EXTEND_ATTENTION.search(k["name"]))
        rows.append({"mode": mode, "bs": int(bs), "toks": int(toks) if toks else None,
                     "gpu_ms": busy_us([(k["ts"], k["ts"] + k["dur"]) for k in ks]) / 1e3,
                     "kernels": len(ks), "attention": dict(attention), "draft": False})
    prefills = [r for r in rows if r["mode"] in PREFILL_MODES]
    if prefills:
        largest = max(r["kernels"] for r in prefills)
        for r in prefills:
            r["draft"] = r["kernels"] < DRAFT_KERNELS * largest
    return rows


def prefill_cost(rows):
    """(prefill tokens, target GPU ms, draft GPU ms) over the prefill forwards; tokens are the
    target's (the draft's EXTEND runs over the same ones)."""
    prefills = [r for r in rows if r["mode"] in PREFILL_MODES]
    tokens = sum(r["toks"] or 0 for r in prefills if not r["draft"])
    target = sum(r["gpu_ms"] for r in prefills if not r["draft"])
    return tokens, target, sum(r["gpu_ms"] for r in prefills if r["draft"])


def per_token_us(cost):
    tokens, target, draft = cost
    return (1e3 * (target + draft) / tokens) if tokens else None


def print_forwards(rows):
    if not rows:
        print("forwards: no step[...] spans in the trace (SGLang before 0.5.11?): prefill not told apart")
        return
    modes = collections.Counter(r["mode"] for r in rows)
    prefills = [r for r in rows if r["mode"] in PREFILL_MODES]
    print(f"forwards: {len(rows)} ({', '.join(f'{m} {n}' for m, n in sorted(modes.items()))}); "
          f"prefill forwards {len(prefills)}")
    for i, r in enumerate(prefills):
        attention = ", ".join(f"{name} x{n}" for name, n in r["attention"].items()) or "no extend-attention kernel"
        toks = f" toks={r['toks']}" if r["toks"] is not None else ""
        print(f"  prefill {i}: {r['mode']} bs={r['bs']}{toks}{' (draft)' if r['draft'] else ''}, "
              f"GPU {r['gpu_ms']:.3f} ms, {r['kernels']} kernels, {attention}")
    decode = [r["gpu_ms"] for r in rows if r["mode"] not in PREFILL_MODES]
    if decode:
        print(f"  other forwards (decode, verify, draft): median GPU {statistics.median(decode):.3f} ms")
    cost = prefill_cost(rows)
    if cost[0]:
        print(f"prefill: {cost[0]} tokens, target GPU {cost[1]:.3f} ms, draft GPU {cost[2]:.3f} ms "
              f"-> {per_token_us(cost):.2f} us per token")


def compare_prefill(rows, base_rows):
    ours, base = per_token_us(prefill_cost(rows)), per_token_us(prefill_cost(base_rows))
    if ours is None or base is None:
        print("prefill per token vs the baseline trace: a trace without prefill tokens, no comparison")
        return
    print(f"prefill GPU time per token: {ours:.2f} us vs the baseline trace's {base:.2f} us ({ours / base:.2f}x)")


DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+), #token: (\d+)")


def profile_id(trace_path):
    """SGLang names a trace `{profile id}-TP-{rank}.trace.json.gz`."""
    return os.path.basename(trace_path).split("-TP-")[0]


def kv_around_profile(log_text, pid):
    """The decode lines just before and after the profile `pid` started, each as (running
    requests, KV tokens), or None where there is none; None when the log has no such profile."""
    lines = log_text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Profiling starts" in line and pid in line), None)
    if start is None:
        return None

    def first(seq):
        return next(((int(m[1]), int(m[2])) for line in seq if (m := DECODE_LINE.search(line))), None)

    return {"before": first(reversed(lines[:start])), "after": first(lines[start + 1:])}


def print_kv(label, trace_path, log_path):
    with open(log_path, errors="replace") as f:
        around = kv_around_profile(f.read(), profile_id(trace_path))
    if around is None:
        print(f"{label}: no 'Profiling starts' line with profile id {profile_id(trace_path)} in {log_path}")
        return
    said = {k: f"{v[1]} KV tokens at {v[0]} running" if v else "no decode line" for k, v in around.items()}
    print(f"{label}: the server's decode lines around the profile: before {said['before']}, "
          f"after {said['after']}")


def main():
    ap = argparse.ArgumentParser(description="Where a decode step's time goes in a torch-profiler trace.")
    ap.add_argument("trace")
    ap.add_argument("base_trace", nargs="?")
    ap.add_argument("--log", help="the traced server's log: the KV tokens around the traced steps")
    ap.add_argument("--base-log", help="the same for the baseline trace's server")
    a = ap.parse_args()
    events = load(a.trace)
    summary(a.trace, events)
    blocking_calls(events)
    print_steps(steps(events))
    rows = forwards(events)
    print_forwards(rows)
    if a.log:
        print_kv("context", a.trace, a.log)
    if a.base_trace:
        base_events = load(a.base_trace)
        extra_per_step(events, base_events)
        compare_prefill(rows, forwards(base_events))
        if a.base_log:
            print_kv("baseline's context", a.base_trace, a.base_log)


if __name__ == "__main__":
    main()

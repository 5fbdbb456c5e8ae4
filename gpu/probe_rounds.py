"""Where in its rounds each probe of an auto server ran (stdlib only; tests/gpu/test_probe_rounds.py):
the buckets' probe_log (/server_info, kept by gpu/auto_device.py in auto_state.jsonl or
auto_variant_state.jsonl) placed on the records' clock, so that a probe's step time can be set
against how far into its round it ran (row 2d's question: are a level's first seconds dearer?).

  python3 gpu/probe_rounds.py RECORDS.jsonl STATES.jsonl [--server auto] [--early-s 2]

A probe's start on the records' clock is exact where the state carries the controller's clock
(`clock_s`, each bucket's `first_seen_s`, the driver's `read_at`: servers and drivers from
2026-12-07 on): read_at - (clock_s - first_seen_s - at_s). Older states have none of it; there the
bucket of the first level's size is anchored at that level's first round's start less
--warmup-s (its first launch was that level's warm-up, which runs just before the rounds), the
other buckets are left out, and the output says "anchor": "warm-up". Prints JSON: each probe with
its round and seconds into it, per side the probes in a round's first --early-s seconds against
the later ones (count, mean step time, range), and the speculative probes' accept means by their
step's place in the probe (`accepts_by_step`: does a resume's acceptance climb over its steps?).
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import auto_summary  # noqa: E402


def _states_of(states, server):
    """The server's level states in order; the judged auto's lines name no server."""
    want = None if server == "auto" else server
    return [e for e in states if e.get("server") == want and str(e.get("after", "")).startswith("c=")]


def place_probes(records, states, server="auto", warmup_s=0.4):
    rounds = sorted(((r["t_start"], r["t_end"], r["level"], r.get("round")) for r in records
                     if r.get("server") == server and "t_start" in r), key=lambda x: x[0])
    firsts = [r for r in records if "t_start" in r]
    first_level = min(firsts, key=lambda r: r["t_start"])["level"] if firsts else None
    first_start = min((r["t_start"] for r in firsts if r["level"] == first_level), default=None)
    seen, probes = set(), []
    anchor = None
    for entry in _states_of(states, server):
        state = entry.get("state") or {}
        exact = "clock_s" in state and entry.get("read_at") is not None
        for size, b in (state.get("buckets") or {}).items():
            if exact and b.get("first_seen_s") is not None:
                base = entry["read_at"] - (state["clock_s"] - b["first_seen_s"])
                anchor = "exact"
            elif not exact and size == first_level and first_start is not None:
                base = first_start - warmup_s
                anchor = anchor or "warm-up"
            else:
                continue
            for p in b.get("probe_log") or []:
                key = (size, p.get("at_s"), p.get("side"))
                if p.get("at_s") is None or key in seen:   # a probe stays in the log across states
                    continue
                seen.add(key)
                t = base + p["at_s"]
                inside = [(start, level, rnd) for start, end, level, rnd in rounds if start <= t <= end]
                row = {"bucket": int(size), "side": p.get("side"), "at_s": p["at_s"], "step_ms": p.get("step_ms"),
                       "samples": p.get("samples"), "accepts": p.get("accepts"),
                       "accepts_full": p.get("accepts_full"), "level": None, "round": None,
                       "into_round_s": None}
                if inside:
                    start, level, rnd = inside[0]
                    row.update(level=level, round=rnd, into_round_s=round(t - start, 2))
                probes.append(row)
    probes.sort(key=lambda r: (r["bucket"], r["at_s"]))
    return {"server": server, "anchor": anchor, "probes": probes}


def early_later(probes, early_s):
    """Per side: the probes inside a round, in its first early_s seconds and after."""
    out = {}
    for side in sorted({p["side"] for p in probes}):
        groups = {"early": [], "later": []}
        for p in probes:
            if p["side"] == side and p["into_round_s"] is not None and p["step_ms"] is not None:
                groups["early" if p["into_round_s"] < early_s else "later"].append(p["step_ms"])
        out[side] = {name: {"n": len(v), "mean_step_ms": round(statistics.fmean(v), 3) if v else None,
                            "range_ms": [min(v), max(v)] if v else None}
                     for name, v in groups.items()}
    return out


def accepts_by_step(probes):
    """The speculative probes' accept means by step (1 = the probe's first result): how many
    probes reached that step, their mean and range; and where the server marks deferred requests
    (probe_log's accepts_full, from 2026-12-07), the same steps' requests with their draft context."""
    by_step, full = {}, {}
    for p in probes:
        if p["side"] == "spec":
            for i, x in enumerate(p.get("accepts") or (), start=1):
                by_step.setdefault(i, []).append(x)
            for i, x in enumerate(p.get("accepts_full") or (), start=1):
                if x is not None:
                    full.setdefault(i, []).append(x)
    rows = []
    for i, v in sorted(by_step.items()):
        row = {"step": i, "n": len(v), "mean": round(statistics.fmean(v), 3), "range": [min(v), max(v)]}
        if full.get(i):
            row.update(full_n=len(full[i]), full_mean=round(statistics.fmean(full[i]), 3))
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records")
    ap.add_argument("states")
    ap.add_argument("--server", default="auto", help="the auto server's label (default auto, the judged one)")
    ap.add_argument("--early-s", type=float, default=2.0, help="a round's first seconds (default 2)")
    ap.add_argument("--warmup-s", type=float, default=0.4,
                    help="older states: how long before the first round the first level's bucket first ran")
    a = ap.parse_args(argv)
    records, states = auto_summary.read_records(a.records), auto_summary.read_records(a.states)
    placed = place_probes(records, states, a.server, a.warmup_s)
    placed["early_s"] = a.early_s
    placed["by_side"] = early_later(placed["probes"], a.early_s)
    placed["accepts_by_step"] = accepts_by_step(placed["probes"])
    print(json.dumps(placed, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU's idle gaps in a torch-profiler trace, and what ended each: the first GPU operation
after the gap (name, grid) and the host ops that ran inside it.

A gap that no host op fills and that ends at a triton kernel's launch is that kernel compiling
(triton compiles in Python, which the profiler does not record without stacks). Used on the
resume profiles of gpu/accept_device.py --profile-resume:

    python3 gpu/trace_gaps.py TRACE.json.gz [--min-ms 20]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_steps import gpu_events, load  # noqa: E402


def gaps(events: list[dict], min_ms: float) -> list[dict]:
    gpu = sorted(gpu_events(events), key=lambda e: e["ts"])
    gpu_ids = {id(e) for e in gpu}
    host = [e for e in events if id(e) not in gpu_ids]
    found = []
    if not gpu:
        return found
    busy_until = gpu[0]["ts"] + gpu[0]["dur"]
    seen = {}
    for event in gpu[1:]:
        name = event.get("name", "")
        seen[name] = seen.get(name, 0) + 1
        idle_us = event["ts"] - busy_until
        if idle_us >= min_ms * 1000:
            inside = sorted((h for h in host if busy_until <= h["ts"] < event["ts"] and h["dur"] >= 1000),
                            key=lambda h: -h["dur"])
            found.append({
                "idle_ms": round(idle_us / 1000, 1),
                "ended_by": name,
                "grid": event.get("args", {}).get("grid"),
                "launches_of_it_before": seen[name] - 1,
                "host_ops_over_1ms_inside": [(h["name"][:80], round(h["dur"] / 1000, 2)) for h in inside[:8]],
            })
        busy_until = max(busy_until, event["ts"] + event["dur"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--min-ms", type=float, default=20.0, help="the shortest idle gap listed (default 20)")
    args = parser.parse_args()
    found = gaps(load(args.trace), args.min_ms)
    print(f"{args.trace}: {len(found)} GPU idle gap(s) of at least {args.min_ms} ms")
    for gap in found:
        print(json.dumps(gap))


if __name__ == "__main__":
    main()

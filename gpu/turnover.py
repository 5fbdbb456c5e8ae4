"""How a server turns its requests over under load, from its own log (stdlib only; tested on the
CPU, tests/gpu/test_turnover.py).

    python3 gpu/turnover.py [--min-running N] [--interval STEPS] SERVER.log [SERVER.log ...]

SGLang logs a "Decode batch" line every --decode-log-interval decode steps (the lab's servers: 100)
and a "Prefill batch" line per prefill forward, with the requests it admitted (#new-seq). Between
two decode lines this counts the prefill forwards and the requests they admitted; over the decode
lines whose running count is at least --min-running, it prints per log the medians per 100 decode
steps, the requests per forward and the logged decode throughput. The steps between two lines are
the difference of the patched log's "spec steps" + "plain steps" counters where the line has them,
else --interval (an unpatched server, the baseline).

Why: on a host-bound pair every prefill forward is an eager launch of the target (and, while
speculating, of the draft) that costs several decode steps. With every request asking for the same
number of tokens, plain decoding finishes a closed loop's requests together and admits their
replacements in a few batched forwards; speculation, whose requests accept different lengths,
finishes them one by one and admits each in a forward of its own
(docs/evidence/auto-threshold/17-own-native: 7 forwards per 100 steps against 80 at 64 requests).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from steady_state import LINE as DECODE  # noqa: E402  (running count, gen throughput)

PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+)")
COUNTERS = re.compile(r"spec steps: (\d+), plain steps: (\d+)")


def intervals(lines, interval=100):
    """One row per decode line after the first: its running count, the decode steps since the
    line before, and the prefill forwards and admitted requests in between."""
    rows, forwards, admitted, last_count = [], 0, 0, None
    seen_decode = False
    for line in lines:
        m = PREFILL.search(line)
        if m:
            forwards += 1
            admitted += int(m.group(1))
            continue
        m = DECODE.search(line)
        if not m:
            continue
        c = COUNTERS.search(line)
        count = int(c.group(1)) + int(c.group(2)) if c else None
        steps = count - last_count if (count is not None and last_count is not None) else interval
        if seen_decode and steps > 0:
            rows.append({"running": int(m.group(1)), "steps": steps, "forwards": forwards,
                         "admitted": admitted, "tok_s": float(m.group(2))})
        seen_decode, last_count, forwards, admitted = True, count, 0, 0
    return rows


def summary(rows, min_running):
    """Medians over the rows at min_running or more; None when there are none."""
    rows = [r for r in rows if r["running"] >= min_running]
    if not rows:
        return None
    per100 = lambda key: statistics.median(100.0 * r[key] / r["steps"] for r in rows)
    per_forward = [r["admitted"] / r["forwards"] for r in rows if r["forwards"]]
    rates = [r["tok_s"] for r in rows]
    return {"intervals": len(rows),
            "forwards_per_100_steps": round(per100("forwards"), 1),
            "admitted_per_100_steps": round(per100("admitted"), 1),
            "admitted_per_forward": round(statistics.median(per_forward), 2) if per_forward else None,
            "gen_tok_s": round(statistics.median(rates), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--min-running", type=int, default=1,
                    help="only decode lines with at least this many running requests")
    ap.add_argument("--interval", type=int, default=100,
                    help="decode steps per log line where the line has no step counters")
    args = ap.parse_args(argv)
    if args.min_running < 1 or args.interval < 1:
        ap.error("--min-running and --interval must be at least 1")
    for path in args.logs:
        try:
            with open(path, errors="replace") as f:
                rows = intervals(f, args.interval)
        except OSError as e:
            print(f"{path}: {e.strerror}", file=sys.stderr)
            return 1
        s = summary(rows, args.min_running)
        if s is None:
            print(f"{path}: no decode line at {args.min_running} or more running requests")
            continue
        print(f"{path}: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

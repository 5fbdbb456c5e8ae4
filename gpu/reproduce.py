"""Does a new run reproduce an earlier evidence table? (dev machine, stdlib only)

Usage: python3 gpu/reproduce.py EARLIER/records.jsonl NEW/records.jsonl [--tolerance 0.03] [--json OUT]

Both files are gpu/shapes_device.py records. Every cell of the earlier table (group, input/output
length, concurrency, server label as summarize_shapes.py names it: the median output tok/s over
rounds) must be in the new run and within the tolerance of the earlier median, and so must every
ratio of a dyn server to the faster baseline of its group. Prints one markdown row per cell;
exit 0 when all hold, 1 when one is off by more than the tolerance, 2 when one is missing.
"""
import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import summarize_shapes  # noqa: E402


def cells(records):
    """{(group, in, out, c, name): median tok/s}, from the records with a measurement."""
    runs = defaultdict(list)
    for r in records:
        if "out_tok_per_s" in r:
            runs[r["group"], r["input_len"], r["output_len"], r["conc"], summarize_shapes.name(r)].append(
                r["out_tok_per_s"])
    return {key: statistics.median(v) for key, v in runs.items()}


def ratios(medians):
    """{(group, in, out, c, "dyn / baseline"): ratio} of every dyn server to the faster baseline."""
    out = {}
    for key, value in medians.items():
        *where, name = key
        if "-dyn" not in name:
            continue
        bases = [v for (*w, n), v in medians.items() if w == where and n.split("@")[0] == "baseline"]
        if bases:
            out[(*where, f"{name} / baseline")] = value / max(bases)
    return out


def compare(earlier, new, tolerance):
    """Rows (what, earlier, new, change, ok) and the exit code."""
    rows, code = [], 0
    old, now = cells(earlier), cells(new)
    old.update(ratios(old))
    now.update(ratios(now))
    for key in sorted(old, key=str):
        if key not in now:
            rows.append((key, old[key], None, None, False))
            code = 2
            continue
        change = now[key] / old[key] - 1
        ok = abs(change) <= tolerance
        rows.append((key, old[key], now[key], change, ok))
        if not ok and code == 0:
            code = 1
    return rows, code


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("earlier")
    ap.add_argument("new")
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--json", help="write the rows and the verdict here")
    a = ap.parse_args(argv)
    rows, code = compare(read(a.earlier), read(a.new), a.tolerance)
    print(f"| group | in/out | c | server | earlier | new | change | within {a.tolerance:.0%} |")
    print("|---|---|---|---|---|---|---|---|")
    for (group, i, o, c, name), before, after, change, ok in rows:
        fmt = "{:.3f}" if "/" in name else "{:.1f}"
        print(f"| {group} | {i}/{o} | {c} | {name} | {fmt.format(before)} | "
              f"{'missing' if after is None else fmt.format(after)} | "
              f"{'-' if change is None else f'{change:+.1%}'} | {'yes' if ok else 'NO'} |")
    verdict = {0: "reproduced", 1: "not reproduced: off by more than the tolerance", 2: "not reproduced: cells missing"}[code]
    print(f"\n{verdict}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"verdict": verdict, "tolerance": a.tolerance, "rows": [
                {"group": k[0], "input_len": k[1], "output_len": k[2], "conc": k[3], "server": k[4],
                 "earlier": b, "new": n, "change": ch, "ok": ok} for k, b, n, ch, ok in rows]}, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())

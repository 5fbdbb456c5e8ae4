"""Steady-state decode throughput from SGLang server logs (dev machine, stdlib only).

Usage: python3 gpu/steady_state.py BASELINE.log OTHER.log [OTHER.log ...] [--running 64,32,16]
       python3 gpu/steady_state.py --accept LOG [LOG ...] [--running 64,32]

SGLang logs a "Decode batch, #running-req: N, ... gen throughput (token/s): X" line every
--decode-log-interval steps (100 in the gpu/ scripts). For each running count N this takes the
three best intervals logged at exactly N (timed runs ramp up and drain, so most intervals are at
other counts) and prints their median, and each other log's median over the first log's. A ratio
is marked "unsettled" when either log has fewer than three intervals at N or its three are more
than 10 % apart: the load only passed through N there, and the ratio says little.

With --accept: each log's accept length at each running count, the median of the "accept len" of
the intervals logged at exactly N in which the dyn-disable counters show no plain step (a dyn
server's line averages its plain steps in as 1): what a server speculating at that load accepts.
"""
import argparse
import re
import statistics

LINE = re.compile(r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([0-9.]+)")


ACCEPT = re.compile(r"Decode batch, #running-req: (\d+),.*?accept len: ([0-9.]+)(?:.*?plain steps: (\d+))?")


def accept_lens(text, running):
    """The accept lengths of the speculative intervals logged at exactly `running` requests: a line
    whose cumulative plain-step count moved since the line before had plain steps in it, and one
    the first of a dyn log is left out (its plain steps since start are unknown)."""
    out, plain_before = [], None
    for m in ACCEPT.finditer(text):
        plain = None if m.group(3) is None else int(m.group(3))
        pure = plain is None or (plain_before is not None and plain == plain_before)
        if pure and int(m.group(1)) == running:
            out.append(float(m.group(2)))
        plain_before = plain
    return out


def median_accept(text, running):
    values = accept_lens(text, running)
    return (round(statistics.median(values), 3) if values else None), len(values)


def best_intervals(text, running, best=3):
    values = sorted((float(m.group(2)) for m in LINE.finditer(text) if int(m.group(1)) == running),
                    reverse=True)
    return values[:best]


def settled(values, limit=0.10):
    return len(values) == 3 and (max(values) - min(values)) / min(values) <= limit


def table(paths, running_counts):
    texts = {p: open(p, errors="replace").read() for p in paths}
    rows = []
    for n in running_counts:
        medians = {p: (statistics.median(v) if v else None, v)
                   for p, v in ((p, best_intervals(t, n)) for p, t in texts.items())}
        base, base_vals = medians[paths[0]]
        for p in paths:
            med, vals = medians[p]
            ratio = "" if p == paths[0] or not (med and base) else f"{med / base:.3f}"
            if ratio and not (settled(vals) and settled(base_vals)):
                ratio += " unsettled"
            rows.append((n, p, med, vals, ratio))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description="steady-state decode throughput from SGLang server logs")
    ap.add_argument("logs", nargs="+", help="server logs, the baseline's first")
    ap.add_argument("--running", default="64,32,16", help="running-request counts (default 64,32,16)")
    ap.add_argument("--accept", action="store_true",
                    help="each log's accept length at each running count (speculative intervals only)")
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.running.split(",")]
    if a.accept:
        print("| running | log | accept len (median) | intervals |\n|---|---|---|---|")
        for path in a.logs:
            text = open(path, errors="replace").read()
            for n in counts:
                med, k = median_accept(text, n)
                print(f"| {n} | {path.rsplit('/', 1)[-1]} | {med if med is not None else '-'} | {k} |")
        return
    print("| running | log | best three intervals (tok/s) | median | / first log |\n|---|---|---|---|---|")
    for n, path, med, vals, ratio in table(a.logs, counts):
        shown = " / ".join(f"{v:,.0f}" for v in vals) or "none logged"
        print(f"| {n} | {path.rsplit('/', 1)[-1]} | {shown} | {f'{med:,.0f}' if med else '-'} | {ratio} |")


if __name__ == "__main__":
    main()

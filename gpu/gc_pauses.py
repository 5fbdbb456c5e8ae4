"""Garbage-collection pauses of an accept run's servers against its resume gaps (dev machine, stdlib).

Usage: python3 gpu/gc_pauses.py EVIDENCE_DIR [--min-gap-ms 30]

EVIDENCE_DIR is gpu/run_accept.sh's evidence.tgz unpacked, from a run with GC_LOG_MS set: the server
logs (acc-LABEL-*.log, with gpu/gc_log/sitecustomize.py's "[lab-gc]" lines) and accept/ (accept_raw.json's
crossing windows, first_crossing.json's longest gap at each resume and when it ended). For each server it
prints one JSON line: how many collections took at least the logged threshold and how long (median,
max, by generation), and for every resume whose longest gap was at least --min-gap-ms, the collections
that overlapped that gap. A long gap with none inside is not a collection of the processes that log.
"""
import argparse
import glob
import json
import os
import re
import statistics

GC_LINE = re.compile(r"\[lab-gc\] pid=(\d+) gen=(\d+) start=([\d.]+) ms=([\d.]+)")


def pauses(log_text):
    """[(start epoch s, ms, generation, pid)] from a server log's [lab-gc] lines."""
    return [(float(m[3]), float(m[4]), int(m[2]), int(m[1])) for m in GC_LINE.finditer(log_text)]


def gap_intervals(run, windows):
    """[(crossing, start epoch s, end epoch s, gap ms)] of each resume's longest gap, where the run
    recorded when it ended (resume_max_gap_end_ms: ms after its burst's last request finished)."""
    out = []
    ends = run.get("resume_max_gap_end_ms") or []
    for k, (gap_ms, end_ms) in enumerate(zip(run.get("resume_max_gap_ms") or [], ends)):
        if gap_ms is None or end_ms is None or k >= len(windows):
            continue
        end = windows[k]["burst_t1"] + end_ms / 1000
        out.append((windows[k]["crossing"], end - gap_ms / 1000, end, gap_ms))
    return out


def overlapping(interval_start, interval_end, found):
    """The pauses of `found` that overlap [interval_start, interval_end], with the overlap in ms."""
    hits = []
    for start, ms, gen, pid in found:
        overlap = min(interval_end, start + ms / 1000) - max(interval_start, start)
        if overlap > 0:
            hits.append({"gen": gen, "ms": ms, "pid": pid, "overlap_ms": round(1000 * overlap, 1)})
    return hits


def log_owner(name, labels):
    """The server whose log `name` (acc-LABEL-PAIR-BACKEND.log) is: the longest label it starts with
    (eagle3-v2's logs must not take eagle3-v2-dyn-native-skip's)."""
    owners = [label for label in labels if name.startswith(f"acc-{label}-")]
    return max(owners, key=len) if owners else None


def report(evidence_dir, min_gap_ms=30.0):
    raw = json.load(open(os.path.join(evidence_dir, "accept", "accept_raw.json")))
    first = json.load(open(os.path.join(evidence_dir, "accept", "first_crossing.json")))
    labels = [run["server"] for run in first["runs"]]
    out = []
    for run in first["runs"]:
        label = run["server"]
        logs = [p for p in sorted(glob.glob(os.path.join(evidence_dir, "acc-*.log")))
                if log_owner(os.path.basename(p), labels) == label]
        found = pauses("".join(open(p, errors="replace").read() for p in logs))
        by_gen = {}
        for _, ms, gen, _ in found:
            by_gen.setdefault(gen, []).append(ms)
        gaps = []
        for crossing, start, end, gap_ms in gap_intervals(run, raw["windows"].get(label, [])):
            if gap_ms >= min_gap_ms:
                gaps.append({"crossing": crossing, "gap_ms": gap_ms, "collections": overlapping(start, end, found)})
        out.append({"server": label, "logs": [os.path.basename(p) for p in logs],
                    "collections_logged": len(found),
                    "by_generation": {str(g): {"n": len(v), "median_ms": round(statistics.median(v), 1),
                                               "max_ms": max(v)} for g, v in sorted(by_gen.items())},
                    "resume_gaps_over_min": gaps})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evidence_dir")
    ap.add_argument("--min-gap-ms", type=float, default=30.0, help="resume gaps to look into (default 30)")
    a = ap.parse_args()
    for line in report(a.evidence_dir, a.min_gap_ms):
        print(json.dumps(line))


if __name__ == "__main__":
    main()

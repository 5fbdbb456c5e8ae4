"""Each server's longest stream gap at every resume window beside how far apart its burst finished,
and the baseline's as the reference (dev machine, stdlib): for accept runs whose first_crossing.json
predates its baseline_burst_end field, re-derived from the run's own records.

Usage: python3 gpu/burst_end.py EVIDENCE_DIR   (gpu/run_accept.sh's evidence.tgz unpacked: accept/)

One JSON line per server: resume_window_max_gap_ms and burst_completion_spread_ms per crossing, and
their medians. The baseline never switches, so its gaps are what a burst's end costs without a resume.
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accept_analysis as an  # noqa: E402


def report(evidence_dir):
    accept = os.path.join(evidence_dir, "accept")
    records = [json.loads(line) for line in open(os.path.join(accept, "records.jsonl")) if line.strip()]
    windows = json.load(open(os.path.join(accept, "accept_raw.json")))["windows"]
    out = []
    for server, wins in windows.items():
        mine = [r for r in records if r.get("server") == server]
        ref = an.burst_end_reference(mine, wins, server=server)
        spreads = [s for s in ref["burst_completion_spread_ms"] if s is not None]
        ref["burst_completion_spread_median_ms"] = statistics.median(spreads) if spreads else None
        out.append(ref)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for line in report(sys.argv[1]):
        print(json.dumps(line))

"""A GPU call's rounds beside what the host and the GPU were doing during each (stdlib only;
tests/gpu/test_host_check.py): gpu/host_sampler.py's samples joined to gpu/auto_device.py's
records by their epoch t_start / t_end.

  python3 gpu/host_check.py RECORDS.jsonl HOST_SAMPLES.jsonl

Prints JSON: "rounds", each round's tok/s and the server's own decode rate beside the means of
its samples (CPU busy share, steal, the cores' clock, the GPU's SM clock, utilization and power,
the busiest process and its cores); and "servers", per level and server: the rounds' spread
(slowest to fastest), and the correlation across all rounds of the level of each measure with
tok/s relative to that server's median (a host cause moves with the rounds; a measure that stays
put while tok/s moves 40 % is not the cause).
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import auto_summary  # noqa: E402

MEASURES = ("busy", "steal", "mhz", "sm_mhz", "gpu_util", "power_w", "top_cores")


def _mean(values):
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def round_measures(rec, samples):
    """The means of the samples whose interval's middle lies inside the round."""
    inside = [h for h in samples if rec["t_start"] <= h["t"] - h.get("dt", 0.0) / 2 <= rec["t_end"]]
    gpus = [h["gpu"][0] for h in inside if h.get("gpu")]
    tops = [h["top"][0] for h in inside if h.get("top")]
    names = [t[1] for t in tops]
    return {"samples": len(inside),
            "busy": _mean(h["busy"] for h in inside),
            "steal": _mean(h["cpu"].get("steal") for h in inside),
            "mhz": _mean(h.get("mhz") for h in inside),
            "sm_mhz": _mean(g["sm_mhz"] for g in gpus),
            "gpu_util": _mean(g["util"] for g in gpus),
            "power_w": _mean(g["power_w"] for g in gpus),
            "top": max(set(names), key=names.count) if names else None,
            "top_cores": _mean(t[2] for t in tops)}


def correlation(xs, ys):
    """Pearson's r, or None where either side does not vary or fewer than 3 pairs have both."""
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    xs, ys = zip(*pairs)
    try:
        return round(statistics.correlation(xs, ys), 3)
    except statistics.StatisticsError:   # a constant side
        return None


def host_check(records, samples):
    timed = [r for r in records if "t_start" in r and "t_end" in r]
    rounds = []
    for rec in timed:
        rounds.append({"level": rec["level"], "server": rec["server"], "round": rec.get("round"),
                       "cpus": rec.get("cpus"), "tok_s": rec["out_tok_per_s"],
                       "server_decode_tok_s": rec.get("server_decode_tok_s"),
                       **round_measures(rec, samples)})
    servers, by_level = {}, {}
    for row in rounds:
        by_level.setdefault(row["level"], {}).setdefault(row["server"], []).append(row)
    for level, per_server in by_level.items():
        relative = []
        for server, rows in per_server.items():
            rates = [r["tok_s"] for r in rows]
            median = statistics.median(rates)
            servers.setdefault(level, {})[server] = {
                "rounds": len(rows), "median_tok_s": median, "cpus": rows[0]["cpus"],
                "spread": round(max(rates) / min(rates) - 1.0, 4) if min(rates) > 0 else None}
            relative += [(r["tok_s"] / median, r) for r in rows]
        servers[level]["correlation_with_relative_tok_s"] = {
            m: correlation([rel for rel, _ in relative], [r[m] for _, r in relative]) for m in MEASURES}
    return {"rounds": rounds, "servers": servers}


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    records, samples = (auto_summary.read_records(path) for path in argv)
    print(json.dumps(host_check(records, samples), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

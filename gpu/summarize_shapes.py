"""Markdown tables from gpu/shapes_device.py's records.jsonl (dev machine, stdlib only).

Usage: python3 gpu/summarize_shapes.py RECORDS.jsonl [RECORDS.jsonl ...]

One table per (group, input/output shape): output tok/s per profile and concurrency as the
median over rounds with the spread (max-min)/min when a level ran more than once, the ratio of
each speculative profile to the faster baseline measured in the same group (triton or
FlashInfer), and of each dyn profile to its own stock worker on the same backend. A ratio whose
two servers differ in whether a torch profile had been taken of them before (records'
"profiled_before") is marked with a dagger: round eight found two identical servers 26-28 %
apart at c=1 that way (docs/evidence/dyn-disable-8/README.md).

Where a plan runs two or more servers of one configuration (the same profile, pair, backend, TP size,
threshold, release, env and flags under different labels: an A/A pair), a second table follows:
each configuration's median over all its servers' rounds, how far apart its servers' own medians
are (the spread a difference has to beat), and for every two such configurations the ratio of
those medians with a 90 % bootstrap interval (rounds resampled within each server) and the range
of the per-round ratios (rounds run in turns, so a round's ratio leaves out drift they share).

Where records carry ms_per_verify_step (c=1 levels of speculative servers), a table of the time
per verify step beside the tokens per verify step: a simulated acceptance's draws move a short
c=1 round's tok/s, not its step time.
"""
import json
import random
import statistics
import sys
from collections import defaultdict
from itertools import combinations


def name(r):
    label = r.get("label", r["profile"])
    return label if r["attention_backend"] == "triton" else f"{label}@{r['attention_backend']}"


def stock_of(n, profiles, flagged, present):
    """The stock worker beside dyn server n among the servers `present` at the level: of profile
    eagle3-v2 (eagle3 for a v1 dyn) on n's backend, started without extra server flags (upstream's
    adaptive mode runs as profile eagle3-v2 with a flag: not the stock worker), whatever its label;
    of several, the one labelled as its profile; None where there is none or no telling which."""
    same = stock_candidates(n, profiles, flagged, present)
    if len(same) > 1:
        same = [m for m in same if m.partition("@")[0] == stock_profile(n, profiles)]
    return same[0] if len(same) == 1 else None


def stock_profile(n, profiles):
    return "eagle3-v2" if "v2" in profiles[n] else "eagle3"


def stock_candidates(n, profiles, flagged, present):
    """Every stock worker beside dyn server n (stock_of's candidates before it picks one)."""
    backend = n.partition("@")[2]
    return sorted(m for m in present if profiles[m] == stock_profile(n, profiles)
                  and m.partition("@")[2] == backend and m not in flagged)


CONFIG_KEYS = ("profile", "pair", "attention_backend", "tp_size", "threshold", "sglang", "sleep_on_idle")


def config_of(r):
    """What makes two servers alike: None for records written before shapes_device.py kept each
    server's env (settings such as the plain path's draft upkeep were set only there)."""
    if "env" not in r:
        return None
    return (tuple(str(r.get(k)) for k in CONFIG_KEYS) + (tuple(sorted(r["env"].items())),)
            + (tuple(sorted(r.get("extra_flags") or ())),))


def bootstrap_ratio(xs, ys, draws=2000, seed=0):
    """90 % interval of median(pooled xs) / median(pooled ys), each server's rounds resampled
    with replacement (xs, ys: lists of per-server round lists)."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        px = [rng.choice(v) for v in xs for _ in v]
        py = [rng.choice(v) for v in ys for _ in v]
        ratios.append(statistics.median(px) / statistics.median(py))
    ratios.sort()
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]


def replica_table(key, records):
    """Markdown for the configurations of group `key` that ran on two or more servers, or ''."""
    runs = defaultdict(lambda: defaultdict(dict))   # c -> server -> round -> tok/s
    config = {}
    for r in records:
        if "out_tok_per_s" not in r or (r["group"], r["input_len"], r["output_len"]) != key:
            continue
        runs[r["conc"]][name(r)][r.get("round", 0)] = r["out_tok_per_s"]
        config[name(r)] = config_of(r)
    servers_of = defaultdict(list)
    for n, cfg in sorted(config.items()):
        if cfg is not None:
            servers_of[cfg].append(n)
    replicated = [cfg for cfg, ns in servers_of.items() if len(ns) > 1]
    if not replicated:
        return ""
    out = ["#### Servers of one configuration (A/A) and between configurations\n",
           "| c | servers | median (all rounds) | servers' medians apart |",
           "|---|---|---|---|"]
    pairs = []
    for c in sorted(runs):
        by_server = runs[c]
        stats = {}
        for cfg in replicated:
            present = [n for n in servers_of[cfg] if n in by_server]
            if len(present) < 2:
                continue
            vals = [list(by_server[n].values()) for n in present]
            meds = [statistics.median(v) for v in vals]
            stats[cfg] = (present, vals)
            out.append(f"| {c} | {' + '.join(present)} | {statistics.median(sum(vals, [])):.0f} | "
                       f"{(max(meds) / min(meds) - 1) * 100:.1f} % |")
        for a, b in combinations(stats, 2):
            (na, va), (nb, vb) = stats[a], stats[b]
            ratio = statistics.median(sum(va, [])) / statistics.median(sum(vb, []))
            lo, hi = bootstrap_ratio(va, vb)
            rounds = sorted(set.intersection(*(set(by_server[n]) for n in na + nb)))
            per_round = [statistics.mean(by_server[n][k] for n in na) / statistics.mean(by_server[n][k] for n in nb)
                         for k in rounds]
            spread = f"{min(per_round):.3f}-{max(per_round):.3f}" if per_round else "-"
            pairs.append(f"| {c} | {' + '.join(na)} / {' + '.join(nb)} | {ratio:.3f} | "
                         f"{lo:.3f}-{hi:.3f} | {spread} ({len(per_round)}) |")
    if pairs:
        out += ["", "| c | ratio of | medians | 90 % bootstrap | per-round ratios (rounds) |",
                "|---|---|---|---|---|"] + pairs
    return "\n".join(out) + "\n"


LATE_WAVE_STEPS = 10  # a last wave sent over more steps than this ends its round with a part alone


def late_waves(key, records):
    """Rounds whose last wave of a closed loop was sent over more than LATE_WAVE_STEPS decode steps
    (records from shapes_device.py's timeline: a late part of the last wave decodes alone at the
    end of the round, which lowers its tok/s), with the client's own largest delay beside it: a
    small one puts the spread on the completions of the wave before, that is on the server."""
    lines = []
    for r in records:
        if (r.get("group"), r.get("input_len"), r.get("output_len")) != key or "last_wave_send_spread_ms" not in r:
            continue
        steps = r["last_wave_send_spread_ms"] / r["approx_step_ms"] if r.get("approx_step_ms") else 0
        if steps > LATE_WAVE_STEPS:
            lines.append(f"- c={r['conc']} round {r.get('round', 0)} {name(r)}: the last wave sent over "
                         f"{r['last_wave_send_spread_ms']:.0f} ms (~{steps:.0f} steps), the client's largest "
                         f"delay {r.get('send_lag_ms_max', 0):.1f} ms; {r['out_tok_per_s']:.0f} tok/s")
    if not lines:
        return ""
    return ("Rounds whose last wave arrived spread out (a part of it decoded alone at the end):\n"
            + "\n".join(lines) + "\n")


def verify_step_table(key, records):
    """At c=1, the wall time per verify step of each speculative server (records' ms_per_verify_step,
    shapes_device.py) with its measured tokens per verify step: tok/s at c=1 is about accept_len /
    step time, and a simulated acceptance draws accept_len anew in every step, so a short round's
    tok/s moves by a few per cent with the draws alone; the step time does not. The last column is
    each dyn server's step time against its own stock worker's (stock / dyn: above 1, dyn is faster);
    where several stock workers stand beside it and none is its own (an A/A pair of stock servers),
    against the median of all their rounds."""
    steps, accept, profiles, flagged = defaultdict(list), defaultdict(list), {}, set()
    for r in records:
        if (r.get("group"), r.get("input_len"), r.get("output_len")) != key or r.get("conc") != 1:
            continue
        if "ms_per_verify_step" in r:
            steps[name(r)].append(r["ms_per_verify_step"])
            accept[name(r)].append(r["accept_len"])
            profiles[name(r)] = r["profile"]
            if r.get("extra_flags"):
                flagged.add(name(r))
    if not steps:
        return ""
    med = {n: statistics.median(v) for n, v in steps.items()}
    out = ["At c=1, the time per verify step (the round's wall time over its verify steps) and the "
           "tokens each verify step gave:\n",
           "| server | ms / verify step (rounds) | tokens / verify step | stock / dyn step time |",
           "|---|---|---|---|"]
    for n in sorted(steps):
        vs = "-"
        if "-dyn" in profiles[n]:
            stock = stock_of(n, profiles, flagged, med)
            if stock is not None:
                vs = f"{med[stock] / med[n]:.3f}"
            elif pooled := [v for m in stock_candidates(n, profiles, flagged, med) for v in steps[m]]:
                vs = f"{statistics.median(pooled) / med[n]:.3f} (stock servers pooled)"
        rounds = ", ".join(f"{v:.3f}" for v in steps[n])
        out.append(f"| {n} | {med[n]:.3f} ({rounds}) | {statistics.median(accept[n]):.2f} | {vs} |")
    return "\n".join(out) + "\n"


def tables(records):
    by = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    profiled = defaultdict(set)   # (key, c, name) -> the profiled_before values seen
    meta = {}
    profiles = {}   # name -> profile: a baseline or a stock worker may carry any label
    flagged = set()  # names of servers started with extra flags
    for r in records:
        if "out_tok_per_s" not in r:
            continue
        key = (r["group"], r["input_len"], r["output_len"])
        by[key][r["conc"]][name(r)].append(r["out_tok_per_s"])
        profiled[key, r["conc"], name(r)].add(r.get("profiled_before"))
        meta[key] = (r["arch"], r["tp_size"], r.get("threshold"))
        profiles[name(r)] = r["profile"]
        if r.get("extra_flags"):
            flagged.add(name(r))

    def mark(key, c, a, b):
        seen = profiled[key, c, a] | profiled[key, c, b]
        return "†" if {True, False} <= seen else ""

    out = []
    for key in sorted(by):
        levels = by[key]
        names = sorted({n for c in levels.values() for n in c}, key=lambda n: (profiles[n] != "baseline", n))
        arch, tp, _ = meta[key]
        # a plan may mix fixed thresholds and "auto"
        thresholds = sorted({r.get("threshold") for r in records if r.get("group") == key[0] and r.get("threshold")},
                            key=str)
        out.append(f"### {key[0]}: {arch}, TP={tp}, input {key[1]} / output {key[2]}, "
                   f"dyn threshold {thresholds or '-'}\n")
        out.append("| c | " + " | ".join(names) + " | dyn / faster baseline | dyn / own stock |")
        out.append("|---" * (len(names) + 3) + "|")
        daggers = False
        for c in sorted(levels):
            med = {n: statistics.median(v) for n, v in levels[c].items()}
            cells = []
            for n in names:
                v = levels[c].get(n)
                if not v:
                    cells.append("-")
                    continue
                spread = f" ±{(max(v) - min(v)) / min(v) * 100:.0f}%" if len(v) > 1 else ""
                cells.append(f"{med[n]:.0f}{spread}")
            bases = [n for n in med if profiles[n] == "baseline"]
            best = max(bases, key=med.get) if bases else None
            dyn = [n for n in names if "-dyn" in profiles[n] and n in med]
            vs_base = ", ".join(f"{n}: {med[n] / med[best]:.3f}{mark(key, c, n, best)}"
                                for n in dyn) if best else "-"
            stocks = {n: stock_of(n, profiles, flagged, med) for n in dyn}
            vs_stock = ", ".join(f"{n}: {med[n] / med[stocks[n]]:.3f}{mark(key, c, n, stocks[n])}"
                                 for n in dyn if stocks[n] in med)
            out.append(f"| {c} | " + " | ".join(cells) + f" | {vs_base} | {vs_stock or '-'} |")
            daggers = daggers or "†" in vs_base + vs_stock
        if daggers:
            out.append("\n† the two servers of this ratio differ in whether a torch profile was "
                       "taken of them before the run (`profiled_before`); in round eight identical "
                       "servers were 26-28 % apart at c=1, the profiled ones slower.")
        out.append("")
        late = late_waves(key, records)
        if late:
            out.append(late)
        per_step = verify_step_table(key, records)
        if per_step:
            out.append(per_step)
        replicas = replica_table(key, records)
        if replicas:
            out.append(replicas)
    return "\n".join(out)


def main():
    records = []
    for path in sys.argv[1:]:
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    print(tables(records))


if __name__ == "__main__":
    main()

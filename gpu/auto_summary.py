"""threshold=auto's proof (issue #29): auto against the best fixed threshold of a sweep, from the
records gpu/auto_device.py writes (stdlib only; tested on the CPU, tests/gpu/test_auto_summary.py).

  python3 gpu/auto_summary.py part RECORDS.jsonl WORKLOAD OUT.json   # one call's workload
  python3 gpu/auto_summary.py merge OUT.json PART.json [PART.json ...]  # the evidence file
  python3 gpu/auto_summary.py accounting AUTO_STATE.jsonl  # where auto's decode time went, per level
  python3 gpu/auto_summary.py costcheck PART.json AUTO_STATE.jsonl [VARIANT]  # auto's step costs against the fixed servers'
  python3 gpu/auto_summary.py models CALL_DIR [CALL_DIR ...]  # each cost model's gain against the fixed servers', over calls

A record: {"workload", "level" ("1", "4", ..., "bursty", "bursty-segments"), "server" ("auto", "fixed-N" or
"baseline"), "threshold" ("auto", N, or "none" for the baseline: the target alone),
"out_tok_per_s", "round"}; a bursty record's "mean_inflight" (the load the server was offered)
goes beside its level as each server's median, and its "requests" (how many completed in the round)
as each server's list by round, with "completed_requests_differ" when the servers' lists are not the
same counts: the time-based trace's tok/s follows the number of waves a round completes
(docs/evidence/auto-threshold/9-bursty-segments: 514 or 558-562 requests on every server, 7-10 %
apart in tok/s), so there a ratio of medians compares the rounds' counts as much as the servers.
An acc-mix record's "phase_times" (each phase's tokens and wall time) give the level an oracle
(`oracle`): the faster fixed server in every phase, what following the phases could reach.
A bursty record's "dyn_delta" (what a dyn server's controller did in that round: steps of each
kind, switches, probes, seconds) goes beside its level as "controller_by_round", each server's
rounds in order with their tok/s, so that a low round can be set against its probes. Several rounds of one server at one level give their median. The
merged file has the issue's shape:
  {"workloads": [{"name": ..., "levels": {"1": {"auto": tok_s, "best_fixed": tok_s,
   "best_fixed_threshold": N, "auto_over_best": r, "fixed": {"N": tok_s, ...},
   "baseline": tok_s, "best_static": tok_s, "auto_over_best_static": r}, ...}}],
   "goal": ..., "met": {...}, "met_against_best_static": {...}}
"best_static" is the faster of the best fixed threshold and the baseline: what a user who picks
one server by hand gets. The issue's goal is checked against the best fixed threshold ("met"),
and beside it against the best static choice.
"""
import glob
import json
import os
import statistics
import sys

GOAL_LEVEL = 0.97    # auto >= 0.97x the best fixed threshold at every level of every workload
GOAL_BURSTY = 1.0    # and >= 1.0x on the bursty trace


def _level_key(level):
    return (0, int(level), "") if level.isdigit() else (1, 0, level)


def _bursty(level):
    """The loads that move across the crossover, judged by the bursty goal: the time-based trace
    ("bursty"), the segmented one ("bursty-segments") and acceptance phases at one concurrency
    ("acc-mix", where the crossover itself moves)."""
    return level.startswith("bursty") or level == "acc-mix"


def workload_summary(records, name):
    """{"name", "levels"} for one workload's records."""
    by, loads, completed, controller, phases, accepts = {}, {}, {}, {}, {}, {}
    for r in records:
        if r.get("workload") != name or r.get("out_tok_per_s") is None:
            continue
        if r.get("server_accept_len") is not None:  # the server's own log, speculative intervals at c
            accepts.setdefault(str(r["level"]), {}).setdefault(str(r["threshold"]), []).append(r["server_accept_len"])
        if r.get("phase_times"):  # acc-mix: each phase's tokens and wall time (auto_device.acc_mix)
            phases.setdefault(str(r["level"]), {}).setdefault(str(r["threshold"]), []).append(r["phase_times"])
        by.setdefault(str(r["level"]), {}).setdefault(str(r["threshold"]), []).append(r["out_tok_per_s"])
        if r.get("mean_inflight") is not None:  # the bursty trace's offered load (auto_device.offered_load)
            loads.setdefault(str(r["level"]), {}).setdefault(str(r["threshold"]), []).append(r["mean_inflight"])
        if _bursty(str(r["level"])) and r.get("requests") is not None:
            completed.setdefault(str(r["level"]), {}).setdefault(str(r["threshold"]), []).append(
                (r.get("round", 0), r["requests"]))
        if _bursty(str(r["level"])) and r.get("dyn_delta"):
            controller.setdefault(str(r["level"]), {}).setdefault(str(r["threshold"]), []).append(
                (r.get("round", 0), {"out_tok_per_s": r["out_tok_per_s"], **r["dyn_delta"]}))
    levels = {}
    for level in sorted(by, key=_level_key):
        medians = {t: statistics.median(v) for t, v in by[level].items()}
        fixed = {t: v for t, v in medians.items() if t.isdigit()}
        entry = {"auto": medians.get("auto"), "best_fixed": None, "best_fixed_threshold": None,
                 "auto_over_best": None,
                 "fixed": {t: fixed[t] for t in sorted(fixed, key=int)}}
        # diagnostic auto servers with other knobs (auto_device --auto-variants): beside, not judged
        variants = {t: v for t, v in medians.items() if t.startswith("auto-")}
        if variants:
            entry["auto_variants"] = dict(sorted(variants.items()))
        # identical fixed-N servers (auto_device --fixed-twins): beside, as auto's variants are
        twins = {t[:-len("-twin")]: v for t, v in medians.items() if t.endswith("-twin")}
        if twins:
            entry["fixed_twins"] = {t: twins[t] for t in sorted(twins, key=int)}
        if level.isdigit():
            entry.update(_replicates(fixed, int(level)))
        if fixed:
            best = max(fixed, key=lambda t: (fixed[t], -int(t)))
            entry["best_fixed"], entry["best_fixed_threshold"] = fixed[best], int(best)
            if entry["auto"] is not None and fixed[best] > 0:
                entry["auto_over_best"] = round(entry["auto"] / fixed[best], 4)
        if "none" in medians:
            static = [v for v in (entry["best_fixed"], medians["none"]) if v is not None]
            entry["baseline"] = medians["none"]
            entry["best_static"] = max(static)
            entry["auto_over_best_static"] = (round(entry["auto"] / entry["best_static"], 4)
                                              if entry["auto"] is not None and entry["best_static"] > 0 else None)
        fixed_accepts = {t: v for t, v in accepts.get(level, {}).items() if t.isdigit()}
        if fixed_accepts:   # what each fixed server that speculated at the level accepted there
            entry["fixed_accept_len"] = {t: round(statistics.median(fixed_accepts[t]), 3)
                                         for t in sorted(fixed_accepts, key=int)}
        if level in loads:
            entry["mean_inflight"] = {t: statistics.median(v) for t, v in sorted(loads[level].items())}
        if level in completed:
            counts = {t: [n for _, n in sorted(v)] for t, v in sorted(completed[level].items())}
            entry["completed_requests"] = counts
            entry["completed_requests_differ"] = len({tuple(sorted(v)) for v in counts.values()}) > 1
        if level in phases:
            entry.update(oracle(phases[level]))
        if level in controller:
            entry["controller_by_round"] = {t: [d for _, d in sorted(v, key=lambda x: x[0])]
                                            for t, v in sorted(controller[level].items())}
        levels[level] = entry
    out = {"name": name, "levels": levels}
    # the plain path the threshold servers ran (auto_device --dyn-profile); records before it had no key
    paths = sorted({r["plain_path"] for r in records
                    if r.get("workload") == name and r.get("threshold") != "none" and r.get("plain_path")})
    if paths and paths != ["step"]:
        out["plain_path"] = "/".join(paths)
    return out


def _replicates(fixed, c):
    """The harness's own noise at level c: a fixed-N server with N >= c never has more than N
    running, so it never goes plain (plain when running > N) and all such servers run the same
    steps. Their spread, (max - min) / median, is what one server measured against another
    differs by with nothing different between them; the best fixed threshold is the maximum of
    the sweep, so it sits high by up to that much."""
    same = sorted((t for t in fixed if int(t) >= c), key=int)
    values = [fixed[t] for t in same]
    spread = None
    if len(values) >= 2 and statistics.median(values) > 0:
        spread = round((max(values) - min(values)) / statistics.median(values), 4)
    return {"always_speculating": [int(t) for t in same], "replicate_spread": spread}


def oracle(phase_rounds):
    """Auto against an oracle that runs every phase of the acceptance phases on the faster fixed
    server of that phase: {threshold: [one round's phase_times, ...]} -> "oracle_tok_s",
    "auto_phases_tok_s", "auto_over_oracle" and, per phase in order, its acceptance, the fixed
    threshold the oracle takes, its time and auto's (each server's median over its rounds).
    Rates here are tokens over the phases' own wall times, on both sides alike (a round's wall time
    also holds the moments between phases). {} with fewer than two fixed servers."""
    def per_phase(rounds):
        n = min(len(r) for r in rounds)
        return [{"acc": rounds[0][k]["acc"],
                 "out_tokens": statistics.median(r[k]["out_tokens"] for r in rounds),
                 "wall_s": statistics.median(r[k]["wall_s"] for r in rounds)} for k in range(n)]

    servers = {t: per_phase(rounds) for t, rounds in phase_rounds.items() if rounds}
    fixed = {t: p for t, p in servers.items() if t.isdigit()}
    if len(fixed) < 2:
        return {}
    n = min(len(p) for p in fixed.values())
    auto = servers.get("auto")
    rows, tokens, wall = [], 0.0, 0.0
    for k in range(n):
        best = min(fixed, key=lambda t: (fixed[t][k]["wall_s"], int(t)))
        phase = fixed[best][k]
        tokens += phase["out_tokens"]
        wall += phase["wall_s"]
        row = {"acc": phase["acc"], "best_fixed_threshold": int(best), "oracle_s": round(phase["wall_s"], 3)}
        if auto is not None and k < len(auto):
            row["auto_s"] = round(auto[k]["wall_s"], 3)
        rows.append(row)
    if wall <= 0:
        return {}
    out = {"oracle_tok_s": round(tokens / wall, 1), "phases": rows}
    auto_wall = sum(p["wall_s"] for p in auto[:n]) if auto is not None and len(auto) >= n else 0.0
    if auto_wall > 0:
        auto_rate = sum(p["out_tokens"] for p in auto[:n]) / auto_wall
        out["auto_phases_tok_s"] = round(auto_rate, 1)
        out["auto_over_oracle"] = round(auto_rate / (tokens / wall), 4)
    return out


def merge(parts):
    """The evidence file from the workloads' summaries, with the goal checked level by level."""
    workloads = sorted(parts, key=lambda w: w["name"])
    met, met_static = {}, {}
    for w in workloads:
        for level, e in w["levels"].items():
            goal = GOAL_BURSTY if _bursty(level) else GOAL_LEVEL
            for into, key in ((met, "auto_over_best"), (met_static, "auto_over_best_static")):
                if key in e:
                    ratio = e[key]
                    into[f"{w['name']}/{level}"] = None if ratio is None else ratio >= goal
    out = {"workloads": workloads,
           "goal": {"every_level": GOAL_LEVEL, "bursty": GOAL_BURSTY},
           "met": met,
           "all_met": bool(met) and all(v is True for v in met.values())}
    if met_static:
        out["met_against_best_static"] = met_static
    return out


def accounting_by_level(states):
    """Per level, what auto's /server_info time_accounting gained since the state before: per side
    the seconds in intervals its estimates counted and in those they left out, the seconds above
    the clip, tokens, steps and tokens per second; the seconds across idle breaks; and, where the
    patch counts them, the decode results found out of step with their launches
    ("pairing_resyncs") and the probes started at once after one read speculation paying
    ("rechecks"); the share of the level's decode time that speculating cost against plain
    ("speculation_cost_share"); and, where the state has its buckets, the speculative and probe
    steps of the level and the probe steps of each bucket that took some ("probe_steps_by_bucket":
    which buckets the level's probes went to). States without time_accounting (older patches) are
    skipped."""
    rows, before = [], {}   # the last state with time_accounting
    for entry in states:
        state = entry.get("state") or {}
        acc = state.get("time_accounting")
        if acc is None:
            continue
        prev_acc = before.get("time_accounting", {})
        row = {"after": entry.get("after"), "idle_gaps_s": acc["idle_gaps_s"] - prev_acc.get("idle_gaps_s", 0.0)}
        for counter in ("pairing_resyncs", "rechecks"):
            if counter in state:
                row[counter] = state[counter] - before.get(counter, 0)
        for side in ("spec", "plain"):
            prev = prev_acc.get(side, {})
            d = {k: acc[side][k] - prev.get(k, 0) for k in ("counted_s", "uncounted_s", "clipped_s", "tokens", "steps")}
            total = d["counted_s"] + d["uncounted_s"]
            d["tokens_per_s"] = round(d["tokens"] / total, 1) if total > 0 else None
            d["left_out_share"] = round(d["uncounted_s"] / total, 4) if total > 0 else None
            row[side] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()}
        row["speculation_cost_share"] = _speculation_cost_share(row)
        if "buckets" in state:
            _probes_by_bucket(row, state, before)
        rows.append(row)
        before = state
    return rows


def _probes_by_bucket(row, state, before):
    for counter in ("spec_steps", "probe_steps"):
        row[counter] = state.get(counter, 0) - before.get(counter, 0)
    earlier = before.get("buckets", {})
    took = {size: b.get("probe_steps", 0) - earlier.get(size, {}).get("probe_steps", 0)
            for size, b in state["buckets"].items()}
    row["probe_steps_by_bucket"] = {size: n for size, n in sorted(took.items(), key=lambda kv: int(kv[0])) if n}


def _speculation_cost_share(row):
    """What the level's speculative steps cost beyond what its plain steps would have taken for the
    same tokens (at the plain side's delivered rate in that level), as a share of auto's decode time
    in it: above 0 speculation lost time, below 0 it saved some. None without both sides' time.
    The plain rate is the level's mix of buckets and carries its own turnover, so this reads what
    speculation cost where auto ran it, not what it would cost throughout."""
    spec, plain = row["spec"], row["plain"]
    total = spec["counted_s"] + spec["uncounted_s"] + plain["counted_s"] + plain["uncounted_s"]
    if not plain["tokens_per_s"] or spec["tokens_per_s"] is None or total <= 0:
        return None
    spec_s = spec["counted_s"] + spec["uncounted_s"]
    return round((spec_s - spec["tokens"] / plain["tokens_per_s"]) / total, 4)


def _ms(value):
    return None if value is None else round(value, 3)


def _modelled_steps(b):
    """(plain, spec) milliseconds per step of one bucket by each cost model the controller has:
    "wall" (every interval of the bucket's steps), "quiet" (steps with no prefill beside them) and
    "turnover" (quiet plus each side's prefill forwards per step: forward ms x forwards per finish x
    the bucket's finishes per token x its mean running count, x the accept length for speculation;
    the patch's step_costs) where both sides have those samples; and "turnover_run_side", the
    turnover model with both sides charged the prefill milliseconds per finish of the side the
    bucket runs (`_run_side`), the probed side's own being read from its probes alone."""
    acc = b.get("accept_len")
    models = {"wall": (b.get("plain_step_ms"), b.get("spec_step_ms")),
              "quiet": (b.get("plain_quiet_step_ms"), b.get("spec_quiet_step_ms"))}
    forward, share = b.get("prefill_forward_ms") or {}, b.get("forwards_per_finish") or {}
    sides = [forward.get(k) is not None and share.get(k) is not None for k in ("plain", "spec")]
    if all(sides) and acc and b.get("tokens") and None not in models["quiet"]:
        per_step = b.get("finishes", 0) / b["tokens"] * b.get("mean_bs", 0.0)
        per_finish = {k: forward[k] * share[k] for k in ("plain", "spec")}
        models["turnover"] = (models["quiet"][0] + per_finish["plain"] * per_step,
                              models["quiet"][1] + per_finish["spec"] * per_step * acc)
        run = per_finish[_run_side(b.get("samples") or {})]
        models["turnover_run_side"] = (models["quiet"][0] + run * per_step,
                                       models["quiet"][1] + run * per_step * acc)
    return models


def _run_side(samples):
    """The side with more of the bucket's step samples (the other is timed in probes)."""
    return "plain" if samples.get("plain", 0) >= samples.get("spec", 0) else "spec"


def cost_check(part, states, server=None):
    """Per numeric level of one workload: what auto's bucket for that level read when the level
    ended, set against what the fixed servers' throughputs at that level say. "gain_from_fixed" is
    the fastest fixed server speculating at the level (threshold >= c) over the fastest running
    plain there (threshold < c); each side's "from_fixed" is the milliseconds per step its
    throughput implies (plain: c / tok/s; speculation: c x that server's own accept length from its
    log, "accept_len_fixed", or auto's where the records have none / tok/s), beside the
    controller's cost models for the same step ("decided" is the one its gain used), and how far
    each side's decided cost is off (`_price_errors`). "gain_error" is the gain's relative standard
    error as the controller read it (servers from 2026-12-07 on; a move needs the gain past break-even
    by twice that), "fixed_off_by_errors" how many of them the fixed servers' gain lies from it. A
    model that reads one side dearer than its fixed server's throughput says is the error to chase. `server` picks one auto variant's states
    (auto_device's auto_variant_state.jsonl, e.g. "auto-probe0.01"); without it, the judged auto's
    (auto_state.jsonl, whose lines name no server)."""
    after = {entry.get("after"): entry.get("state") or {} for entry in states if entry.get("server") == server}
    rows = []
    for level, e in sorted(part["levels"].items(), key=lambda kv: _level_key(kv[0])):
        buckets = after.get(f"c={level}", {}).get("buckets")
        if not level.isdigit() or not buckets:
            continue
        c = int(level)
        fits = sorted((int(k) for k in buckets if int(k) >= c))
        if not fits:
            continue
        b = buckets[str(fits[0])]
        spec_side = {str(t) for t in e.get("always_speculating", [])}
        spec = {t: v for t, v in e["fixed"].items() if t in spec_side}
        plain = {t: v for t, v in e["fixed"].items() if t not in spec_side}
        acc = b.get("accept_len")
        models = _modelled_steps(b)
        decided = "turnover" if b.get("cost_model") == "turnover" and "turnover" in models else "wall"
        row = {"level": c, "bucket": fits[0], "speculating": b.get("speculating"),
               "cost_model": b.get("cost_model"), "gain": b.get("gain"),
               "gain_error": b.get("gain_error"), "accept_len": acc,
               "gain_by_model": {m: (round(acc * p / s, 4) if None not in (acc, p, s) and s else None)
                                 for m, (p, s) in models.items()},
               "gain_from_fixed": None, "fixed": {"plain": None, "spec": None}}
        for i, side in enumerate(("plain", "spec")):
            row[f"{side}_ms"] = {"decided": _ms(models[decided][i]),
                                 **{m: _ms(v[i]) for m, v in models.items()}, "from_fixed": None}
        if spec and plain:
            best_spec = max(spec, key=spec.get)
            best_plain = max(plain, key=plain.get)
            row["fixed"] = {"plain": int(best_plain), "spec": int(best_spec)}
            row["gain_from_fixed"] = round(spec[best_spec] / plain[best_plain], 4)
            if row["gain"] and row["gain_error"]:
                row["fixed_off_by_errors"] = round(
                    (row["gain_from_fixed"] / row["gain"] - 1) / row["gain_error"], 2)
            row["plain_ms"]["from_fixed"] = _ms(c / plain[best_plain] * 1e3)
            # the speculating fixed server's own accept length where its log gave one (records from
            # 2026-12-07 on): a bucket running plain reads acceptance in its probes only, and row 2e's
            # read 0.78-0.82 of what fixed-64 accepted at the same load
            fixed_acc = (e.get("fixed_accept_len") or {}).get(best_spec)
            row["accept_len_fixed"] = fixed_acc
            spec_acc = fixed_acc or acc
            if spec_acc:
                row["spec_ms"]["from_fixed"] = _ms(c * spec_acc / spec[best_spec] * 1e3)
        _price_errors(row, b.get("samples") or {})
        rows.append(row)
    return rows


def _price_errors(row, samples):
    """"runs_on": the side with more of the bucket's step samples (the other is timed in probes);
    "price_error": each side's decided step cost over what its fixed server delivers; and
    "probed_over_run": the probed side's error over the run side's, the gain's error against the
    probed side (above 1 the bucket reads the side it probes dearer than the fixed servers say)."""
    row["runs_on"] = _run_side(samples)
    sides = {side: (row[f"{side}_ms"]["decided"], row[f"{side}_ms"]["from_fixed"]) for side in ("plain", "spec")}
    if any(None in v or not v[1] for v in sides.values()):
        return
    error = {side: decided / fixed for side, (decided, fixed) in sides.items()}
    probed = "spec" if row["runs_on"] == "plain" else "plain"
    row["price_error"] = {side: round(e, 3) for side, e in error.items()}
    row["probed_over_run"] = round(error[probed] / error[row["runs_on"]], 3)


SIDE_MARGIN = 0.05   # a level whose fixed servers lie within 5 % of each other has no wrong side


def model_check(rows):
    """Each cost model against the fixed servers over cost_check rows (many calls'): how many
    rows it priced, the median of |its gain / the fixed servers' gain - 1|, and of the rows
    whose fixed servers differ by more than SIDE_MARGIN, in how many it puts the faster side
    on the wrong side of break-even. The fixed servers' gain carries their rounds' noise."""
    out = {}
    for model in sorted({m for r in rows for m in r["gain_by_model"]}):
        pairs = [(r["gain_by_model"][model], r["gain_from_fixed"]) for r in rows
                 if r.get("gain_from_fixed") and r["gain_by_model"].get(model)]
        clear = [(g, f) for g, f in pairs if abs(f - 1.0) > SIDE_MARGIN]
        out[model] = {"rows": len(pairs),
                      "median_error": round(statistics.median(abs(g / f - 1.0) for g, f in pairs), 3) if pairs else None,
                      "clear_rows": len(clear), "wrong_side": sum((g > 1.0) != (f > 1.0) for g, f in clear)}
    return out


def call_rows(folder):
    """cost_check rows of one call folder (a device call's files as docs/evidence keeps them):
    its part-*.json against the judged auto's auto_state.jsonl and every server of its
    auto_variant_state.jsonl, each row naming the folder and the server."""
    judged = os.path.join(folder, "auto_state.jsonl")
    variants = os.path.join(folder, "auto_variant_state.jsonl")
    states = read_records(judged) if os.path.exists(judged) else []
    states += read_records(variants) if os.path.exists(variants) else []
    servers = [None] + sorted({e["server"] for e in states if e.get("server")})
    rows = []
    for part_path in sorted(glob.glob(os.path.join(folder, "part-*.json"))):
        with open(part_path) as f:
            part = json.load(f)
        for server in servers:
            rows += [{"call": folder, "server": server or "auto", **row} for row in cost_check(part, states, server)]
    return rows


def read_records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv):
    if len(argv) >= 4 and argv[0] == "part":
        out = workload_summary(read_records(argv[1]), argv[2])
        path = argv[3]
    elif len(argv) >= 3 and argv[0] == "merge":
        out = merge([json.load(open(p)) for p in argv[2:]])
        path = argv[1]
    elif len(argv) == 2 and argv[0] == "accounting":
        print(json.dumps(accounting_by_level(read_records(argv[1])), indent=1))
        return 0
    elif len(argv) in (3, 4) and argv[0] == "costcheck":
        server = argv[3] if len(argv) == 4 else None
        print(json.dumps(cost_check(json.load(open(argv[1])), read_records(argv[2]), server), indent=1))
        return 0
    elif len(argv) >= 2 and argv[0] == "models":
        rows = [row for folder in argv[1:] for row in call_rows(folder)]
        print(json.dumps({"models": model_check(rows),
                          "rows": [{k: r.get(k) for k in ("call", "server", "level", "runs_on", "gain_from_fixed",
                                                          "gain_by_model")} for r in rows]}, indent=1))
        return 0
    else:
        print(__doc__, file=sys.stderr)
        return 2
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps(out.get("met", out.get("levels")), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

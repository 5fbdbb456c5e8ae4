"""Turn the raw records of gpu/accept_device.py into the summaries of issues #24 and #25.

Standard library only (tested on the CPU: tests/gpu/test_accept_analysis.py).

A request record (one per /generate request, as accept_device writes them to records.jsonl):
  {"server": label, "phase": "before" | "ab_before" | "spec_eq" | "burst" | "span" | "resume" | "after"
   | "ab_after" | "burst_c1" | "burst_again", "crossing": int or None, "idx": prompt index, "prompt_ids": [...], "output_ids": [...],
   "completion_tokens": int, "spec_verify_ct": int or None, "t_start": s, "t_end": s,
   "arrivals": [s, ...] (streamed requests: when each chunk came), "counts": [n, ...] (the
   cumulative completion_tokens of each of those chunks), "error": str or None}
  ab_before / ab_after requests also carry "round" (the A/B round) and "visit" (the server's place
  in that round's order); records without them (older runs) give None for the A/B figures.

c=1 after the bursts against before (issue #24's goal: >= 0.98x): the "before"/"after" phases
measure each server alone, ~1 s a phase minutes apart, and identical work on stock servers moved
+-20-40 % between them (c1_raw_*). The goal's measure is ab_summary(): in each phase, rounds in which
the dyn server and its stock peer decode the same prompts in mirrored order (A B B A), the median
over rounds of dyn/stock tok/s, and after/before of those medians (c1_after_over_before). Its
verdict (c1_goal_verdict) is given only where the rounds resolve it: met when the ratio less twice its
uncertainty (from the rounds' interquartile range) still reaches the goal and the ratio is not above
C1_EXPLAINED_MAX, missed when the ratio plus twice its uncertainty falls short, None otherwise. Beside
it, the servers' own logs: the median decode step per phase (log_step_ms).

SGLang 0.5.11 sends spec_verify_ct only in a request's last event (tokenizer_manager's
_calculate_spec_decoding_metrics runs when the request has finished), so the accept length over a
token range comes from the streamed events: at --stream-interval 1 the scheduler sends one event
per step holding the tokens that step accepted. The tokenizer manager merges events the client has
not read yet (_wait_one_response joins its out_list), which can only make a chunk larger; the stock
server's request of the same prompt is read the same way, so a stale draft shows as dyn/stock < 1.
"""
import re
import statistics
import time

SWITCH_LINE = re.compile(r"Dynamic speculation disable: drafting (stopped|resumed) at (\d+)")
COUNTERS = re.compile(r"spec off/on switches: (\d+)/(\d+)")
DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+).*?accept len: ([\d.]+)")
# a Decode batch line with its time stamp (configure_logger: "[%Y-%m-%d %H:%M:%S{.ms}{ TP0}] ..."), running
# requests, accept length (speculative servers only) and gen throughput (tokens since the last line / the gap)
STEP_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(\.\d+)?[^\]]*\] Decode batch.*?#running-req: (\d+)"
                       r"(?:.*?accept len: ([\d.]+))?.*?gen throughput \(token/s\): ([\d.]+)")
# the goal of issue #24: c=1 throughput after the bursts >= 0.98 x before (dyn against its stock peer)
C1_GOAL = 0.98
# above this an after/before ratio has no mechanism (the team's rule: trace it before citing it)
C1_EXPLAINED_MAX = 1.03


def ok(records):
    return [r for r in records if not r.get("error")]


def accept_len(records):
    """SGLang's accept length over requests: completion tokens per verify step (None when no
    request reports a verify count: a server that does not speculate)."""
    rs = [r for r in ok(records) if r.get("spec_verify_ct")]
    if not rs:
        return None
    return sum(r["completion_tokens"] for r in rs) / sum(r["spec_verify_ct"] for r in rs)


def per_request_accept(records):
    return [r["completion_tokens"] / r["spec_verify_ct"] for r in ok(records) if r.get("spec_verify_ct")]


def phase(records, name, crossing=None):
    return [r for r in records if r["phase"] == name and (crossing is None or r.get("crossing") == crossing)]


def crossings(records):
    return sorted({r["crossing"] for r in records if r.get("crossing") is not None})


def ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def throughput(records):
    """Output tokens per second of requests sent one after another (c=1): tokens over the sum
    of their durations."""
    rs = ok(records)
    wall = sum(r["t_end"] - r["t_start"] for r in rs)
    return round(sum(r["completion_tokens"] for r in rs) / wall, 1) if wall > 0 else None


def ab_ratios(recs, ref, name):
    """Per A/B round of phase `name` ("ab_before" / "ab_after", accept_device.Run.ab_rounds): recs'
    c=1 tok/s over ref's, both measured in that round (the same prompts and tokens, visits in mirrored
    order A B B A, so a drift common to both servers cancels to first order). Rounds in which either
    side has a failed request are left out. Returns the per-round ratios in round order."""
    def by_round(rs):
        out = {}
        for r in rs:
            if r["phase"] == name and r.get("round") is not None:
                out.setdefault(r["round"], []).append(r)
        return out
    a, b = by_round(recs), by_round(ref)
    out = []
    for k in sorted(set(a) & set(b)):
        if any(r.get("error") for r in a[k] + b[k]):
            continue
        out.append(ratio(throughput(a[k]), throughput(b[k])))
    return [x for x in out if x is not None]


def median_rel_err(xs):
    """The relative standard error of the median of xs (the interquartile range as a robust spread:
    sigma = IQR / 1.349, the median's error 1.2533 sigma / sqrt(n)); None under 4 values."""
    if len(xs) < 4:
        return None
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return 1.2533 * (q3 - q1) / 1.349 / len(xs) ** 0.5 / statistics.median(xs)


def c1_verdict(after_over_before, before_rounds, after_rounds):
    """(met: True / False / None, uncertainty, why) for the A/B ratio of ratios: None when the
    rounds cannot resolve the goal or the ratio is above C1_EXPLAINED_MAX (no mechanism for it)."""
    errs = [median_rel_err(before_rounds), median_rel_err(after_rounds)]
    if after_over_before is None or None in errs:
        return None, None, "too few A/B rounds"
    u = round((errs[0] ** 2 + errs[1] ** 2) ** 0.5, 4)
    if after_over_before > C1_EXPLAINED_MAX:
        return None, u, f"above {C1_EXPLAINED_MAX}: no mechanism, a harness question"
    if after_over_before - 2 * u >= C1_GOAL:
        return True, u, f"met: {after_over_before} - 2 x {u} >= {C1_GOAL}"
    if after_over_before + 2 * u < C1_GOAL:
        return False, u, f"missed: {after_over_before} + 2 x {u} < {C1_GOAL}"
    return None, u, f"not resolved: {after_over_before} +- 2 x {u} straddles {C1_GOAL}"


def ab_summary(recs, ref, prefix):
    """The A/B figures of one server against its stock peer: median and range of the per-round
    ratios before and after the crossings, and after / before (ratio of ratios)."""
    res = {}
    for when in ("before", "after"):
        rs = ab_ratios(recs, ref, "ab_" + when)
        res[f"{prefix}_{when}"] = round(statistics.median(rs), 4) if rs else None
        res[f"{prefix}_{when}_rounds"] = rs
        res[f"{prefix}_{when}_spread"] = [min(rs), max(rs)] if rs else None
    return res


def log_step_ms(lines, t0, t1, running=1, min_tput=50.0):
    """The median decode step time (ms) from a server's Decode batch lines written at
    --decode-log-interval 1 with `running` requests in the window [t0, t1] (epoch s; the stamps have
    second resolution, so the window is widened to whole seconds): a line's gen throughput Y is the
    tokens since the last line over the gap, its accept len X the tokens per step, so a step is
    1000 * X / Y ms (1000 / Y without accept len: a plain server). Lines with Y < min_tput span an
    idle gap and are skipped. Returns (median ms or None, steps)."""
    lo, hi = int(t0), int(t1)
    steps = []
    for line in lines:
        m = STEP_LINE.match(line)
        if not m or int(m.group(3)) != running:
            continue
        t = int(time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")))
        y = float(m.group(5))
        if not lo <= t <= hi or y < min_tput:
            continue
        x = float(m.group(4)) if m.group(4) is not None else 1.0
        steps.append(1000.0 * x / y)
    return (round(statistics.median(steps), 4) if steps else None), len(steps)


def phase_window(records, name):
    """(first t_start, last t_end) of a server's requests of one phase, None without any."""
    rs = [r for r in records if r["phase"] == name and r.get("t_start") is not None and r.get("t_end") is not None]
    return (min(r["t_start"] for r in rs), max(r["t_end"] for r in rs)) if rs else None


C1_PHASES = ("before", "after", "ab_before", "ab_after")


def c1_step_ms(lines, records, phases=C1_PHASES):
    """Per c=1 phase: the server's median decode step (ms) over that phase's window and the number
    of steps it is taken over (log_step_ms)."""
    out = {}
    for name in phases:
        w = phase_window(records, name)
        med, n = log_step_ms(lines, *w) if w and lines is not None else (None, 0)
        out[name] = {"median_step_ms": med, "steps": n}
    return out


def first_diff(a, b):
    """First position where two token lists differ (the shorter length if one is a prefix of
    the other, None when equal)."""
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def key(r):
    return (r["phase"], r.get("crossing"), r["idx"])


def greedy_equality(recs, ref, phases, ref_phase=None):
    """Requests of `phases` in recs against the same (phase, crossing, prompt) in ref (with
    ref_phase: the same (crossing, prompt) of that phase in ref): the fraction with identical
    output ids, and each mismatch with its first differing position."""
    if ref_phase is None:
        by = {key(r): r for r in ok(ref) if r["phase"] in phases}
        k = key
    else:
        by = {(r.get("crossing"), r["idx"]): r for r in ok(ref) if r["phase"] == ref_phase}
        k = lambda r: (r.get("crossing"), r["idx"])  # noqa: E731
    equal, n, mism = 0, 0, []
    for r in ok(recs):
        if r["phase"] not in phases or k(r) not in by:
            continue
        n += 1
        o = by[k(r)]
        pos = first_diff(r["output_ids"], o["output_ids"])
        if pos is None:
            equal += 1
        else:
            mism.append({"server": r["server"], "ref_server": o["server"], "phase": r["phase"],
                         "ref_phase": o["phase"], "crossing": r.get("crossing"), "idx": r["idx"],
                         "first_diff": pos, "prompt_ids": r.get("prompt_ids"),
                         "common_prefix": o["output_ids"][:pos],
                         "token": r["output_ids"][pos] if pos < len(r["output_ids"]) else None,
                         "ref_token": o["output_ids"][pos] if pos < len(o["output_ids"]) else None})
    return {"equal": equal, "of": n, "fraction": round(equal / n, 4) if n else None, "mismatches": mism}


def mismatch_key(m):
    return (m["server"], m["ref_server"], m["phase"], m.get("ref_phase"), m["crossing"], m["idx"],
            m["first_diff"])


# One bf16 step (ulp) of a logit with |logit| in [16, 32): 2**(4 - 7). The first H200 run's margins
# were 0.0, 0.0625 and 0.125, i.e. ties and one step at |logit| in [8, 16) or [16, 32).
BF16_STEP = 0.125


def margin_class(margin, step=BF16_STEP):
    """"tie" (the top two logits are equal), "bf16_step" (apart by at most one bf16 step of a
    logit of magnitude below 32), "larger", or "unknown" (no margin measured)."""
    if margin is None:
        return "unknown"
    if margin <= 1e-6:
        return "tie"
    if margin <= step * (1 + 1e-3):
        return "bf16_step"
    return "larger"


def margin_counts(mismatches):
    """The counts of summary.json: below 1e-2 (a margin of exactly 0.0 counts), per class."""
    out = {"total": len(mismatches),
           "below_1e-2": sum(1 for m in mismatches if m.get("margin") is not None and m["margin"] < 1e-2)}
    for c in ("tie", "bf16_step", "larger", "unknown"):
        out[c] = sum(1 for m in mismatches if margin_class(m.get("margin")) == c)
    return out


def tokens_at(rec, t):
    """The request's streamed token count at time t (the last chunk that arrived by then)."""
    n = 0
    for a, c in zip(rec.get("arrivals") or [], rec.get("counts") or []):
        if a > t:
            break
        n = c
    return n


def range_accept(counts, start_tok):
    """(tokens, events) over the streamed events that begin at or after token start_tok."""
    toks = ev = prev = 0
    for c in counts:
        if prev >= start_tok and c > prev:
            toks += c - prev
            ev += 1
        prev = c
    return toks, ev


def stale_draft(dyn_recs, stock_recs, windows, span_phase="span"):
    """Per crossing, the accept length (tokens per streamed event) of the requests that spanned
    it, over their tail: the tokens after the burst drained (window "burst_t1": drafting has
    resumed), on the dyn server and on the stock server for the same prompts over the same token
    range (greedy: the same tokens). A draft whose KV was not written while plain collapses here;
    a request prefilled after the resume cannot show it. span_phase "late_span": the requests
    that arrived while the burst held drafting off (prefilled while plain)."""
    stock = {(r["crossing"], r["idx"]): r for r in ok(stock_recs) if r["phase"] == span_phase}
    out = []
    for w in crossing_windows(windows):
        c = w["crossing"]
        dt = de = st = se = 0
        starts = []
        for r in ok(phase(dyn_recs, span_phase, c)):
            s = stock.get((c, r["idx"]))
            start = tokens_at(r, w["burst_t1"])
            if s is None or not start or start >= r["completion_tokens"]:
                continue
            a, b = range_accept(r.get("counts") or [], start)
            x, y = range_accept(s.get("counts") or [], start)
            if b and y:
                dt, de, st, se = dt + a, de + b, st + x, se + y
                starts.append([tokens_at(r, w["burst_t0"]), start])
        dyn_tail = round(dt / de, 4) if de else None
        stock_tail = round(st / se, 4) if se else None
        out.append({"crossing": c, "dyn_tail": dyn_tail, "stock_tail": stock_tail,
                    "tail_over_stock": ratio(dyn_tail, stock_tail), "requests": len(starts),
                    "tail_tokens": dt, "burst_start_and_tail_start_tokens": starts})
    return out


def margin_from_top_logprobs(top):
    """The top-2 margin from SGLang's output_top_logprobs entry of one position (a list of
    [logprob, token_id, text]): log-softmax shifts every logit alike, so the logprob difference
    is the logit difference."""
    vals = sorted((float(t[0]) for t in top if t and t[0] is not None), reverse=True)
    return round(vals[0] - vals[1], 6) if len(vals) >= 2 else None


def stream_gaps(arrivals, t0, t1):
    """Gaps between consecutive chunk arrivals of one stream whose later arrival lies in [t0, t1]."""
    return [gap for gap, _ in stream_gap_ends(arrivals, t0, t1)]


def stream_gap_ends(arrivals, t0, t1):
    """stream_gaps with each gap's end (its later arrival): [(gap, end)]."""
    return [(b - a, b) for a, b in zip(arrivals, arrivals[1:]) if t0 <= b <= t1]


def window_max_gap(records, t0, t1):
    """(the window's longest gap in ms, when it ended), or (None, None)."""
    gaps = [ge for r in ok(records) for ge in stream_gap_ends(r.get("arrivals") or [], t0, t1)]
    if not gaps:
        return None, None
    gap, end = max(gaps)
    return round(1000 * gap, 2), end


def window_max_gap_ms(records, t0, t1):
    return window_max_gap(records, t0, t1)[0]


def median_gap_ms(records):
    gaps = [g for r in ok(records) for g in stream_gaps(r.get("arrivals") or [], float("-inf"), float("inf"))]
    return round(1000 * statistics.median(gaps), 2) if gaps else None


def crossing_windows(windows):
    """windows: per crossing {"crossing", "burst_t0", "burst_t1", "resume_t1"} as the driver
    recorded them. Returns them sorted by crossing."""
    return sorted(windows, key=lambda w: w["crossing"])


def stall_gaps(records, windows):
    """Per crossing: the longest inter-chunk gap of any stream while the burst ran (the
    crossing: drafting stops) and after it drained up to the last resume request (drafting
    resumes). Streams: the burst's and the requests spanning it. With each resume gap, when it
    ended after the burst did (ms): a gap at the switch itself ends within a step or two of the
    burst's end (the nineteenth session's first resumes: 111-130 ms after it, the gap 115-125 ms),
    one from later work ends later."""
    out = []
    for w in crossing_windows(windows):
        rs = [r for r in records if r.get("crossing") == w["crossing"]]
        resume_gap, end = window_max_gap(rs, w["burst_t1"], w["resume_t1"])
        out.append({"crossing": w["crossing"],
                    "crossing_max_gap_ms": window_max_gap_ms(rs, w["burst_t0"], w["burst_t1"]),
                    "resume_max_gap_ms": resume_gap,
                    "resume_max_gap_end_ms": None if end is None else round(1000 * (end - w["burst_t1"]), 1)})
    return out


def burst_completion_spread_ms(records, windows):
    """Per crossing, how far apart the burst's requests finished (ms, first to last). A server that
    decodes them plain finishes a burst of equal-length requests within a few steps, and the tail of
    its streams' gaps at the burst's end comes with that (the baseline too); speculation spreads the
    completions over hundreds of ms."""
    out = []
    for w in crossing_windows(windows):
        ends = [r["t_end"] for r in records
                if r.get("crossing") == w["crossing"] and r.get("phase") == "burst" and r.get("t_end") is not None]
        out.append(round(1000 * (max(ends) - min(ends)), 1) if ends else None)
    return out


def burst_end_reference(records, windows, server="baseline"):
    """The same resume-window gaps on a server that never switches (the baseline): what a burst's end
    costs the streams with no resume in it, to set the dyn servers' resume gaps against."""
    gaps = [g["resume_max_gap_ms"] for g in stall_gaps(records, windows)]
    return {"server": server, "resume_window_max_gap_ms": gaps,
            "median_ms": median_or_none(gaps), "max_ms": max((g for g in gaps if g is not None), default=None),
            "burst_completion_spread_ms": burst_completion_spread_ms(records, windows)}


def stall_summary(gaps, tp=1, server=None, median_step_ms=None):
    """Issue #25's first-crossing figures from stall_gaps(): the first crossing's and the first
    resume's longest gap against the median of the later ones."""
    cg = [g["crossing_max_gap_ms"] for g in gaps]
    rg = [g["resume_max_gap_ms"] for g in gaps]
    later_c, later_r = median_or_none(cg[1:]), median_or_none(rg[1:])
    first_c = cg[0] if cg else None
    first_r = rg[0] if rg else None
    return {"tp": tp, "server": server, "crossings": len(gaps),
            "first_crossing_max_gap_ms": first_c, "later_crossings_max_gap_ms_median": later_c,
            "first_resume_max_gap_ms": first_r, "later_resumes_max_gap_ms_median": later_r,
            "first_crossing_over_later": ratio(first_c, later_c),
            "first_resume_over_later": ratio(first_r, later_r),
            "goal_met": (None if None in (first_c, later_c, first_r, later_r) else
                         first_c <= 1.5 * later_c and first_r <= 1.5 * later_r),
            "median_step_ms": median_step_ms,
            "crossing_max_gap_ms": cg, "resume_max_gap_ms": rg,
            "resume_max_gap_end_ms": [g.get("resume_max_gap_end_ms") for g in gaps]}


def log_transitions(lines):
    """Switch lines ("drafting stopped/resumed at N") counted, and the last "spec off/on
    switches: X/Y" counters of the Decode batch lines."""
    stopped = resumed = 0
    counters = None
    for line in lines:
        m = SWITCH_LINE.search(line)
        if m:
            if m.group(1) == "stopped":
                stopped += 1
            else:
                resumed += 1
        c = COUNTERS.search(line)
        if c:
            counters = [int(c.group(1)), int(c.group(2))]
    return {"stopped_lines": stopped, "resumed_lines": resumed, "decode_line_counters": counters}


def log_accept(lines, tokens=32):
    """Server-side acceptance from a log written at --decode-log-interval 1: each Decode batch
    line is one step, its "accept len" the step's accepted tokens per running request (a plain
    step counts as one). steady: the mean over steps with one running request before the first
    "drafting stopped"; after_resume: per "drafting resumed" line, the mean over the steps that
    follow it until they add up to `tokens` tokens per request (the requests that lived through
    the plain steps are the ones a stale draft would hurt; a request prefilled after the resume
    gets its draft KV written by its own prefill)."""
    steady, after, cur, stopped = [], [], None, False
    for line in lines:
        m = SWITCH_LINE.search(line)
        if m:
            if cur is not None:
                after.append(cur)
                cur = None
            if m.group(1) == "stopped":
                stopped = True
            else:
                cur = []
            continue
        d = DECODE_LINE.search(line)
        if not d:
            continue
        running, acc = int(d.group(1)), float(d.group(2))
        if not stopped and running == 1:
            steady.append(acc)
        elif cur is not None and sum(cur) < tokens:
            cur.append(acc)
    if cur is not None:
        after.append(cur)
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    return {"steady": mean(steady), "steady_steps": len(steady),
            "after_resume": [mean(a) for a in after], "steps_after_resume": [len(a) for a in after]}


def new_entries(before, after):
    """Names present after and not before (JIT cache snapshots)."""
    return sorted(set(after) - set(before))


def tail_figures(stale):
    tails = [x["dyn_tail"] for x in stale]
    ratios = [x["tail_over_stock"] for x in stale]
    return tails, ratios, median_or_none(ratios)


def late_span_figures(recs, stock_recs, windows):
    """The tails of the requests that arrived while drafting was off (--late-spans): {} when the
    protocol had none."""
    if not phase(recs, "late_span"):
        return {}
    late = stale_draft(recs, stock_recs, windows or [], span_phase="late_span")
    _, ratios, med = tail_figures(late)
    return {"late_stale_draft": late, "late_tail_over_stock": ratios, "late_tail_over_stock_median": med}


def worker_summary(recs, ref_baseline, ref_stock, nc_recs=None, log=None, nc_log=None, windows=None,
                   nc_windows=None, stock_recs=None, stock_log=None, third="control"):
    """Issue #24's per-worker figures for one dyn server (recs, its log lines, its crossing
    windows), against the baseline's and the stock speculative server's records of the same
    protocol (stock_recs: the stock records whose spanning requests are the tail reference;
    ref_stock by default), and its third server (nc_recs; its figures under negative_control_*):
    a negative control (third="control": the verdict asks whether it collapses) or a healthy
    reference (third="reference": the verdict compares the two). The headline after-resume
    figures are the spanning requests' tails (stale_draft); the server log's figures stay beside
    them."""
    stock_recs = ref_stock if stock_recs is None else stock_recs
    before = accept_len(phase(recs, "before"))
    res = {
        "accept_len_before": round(before, 4) if before is not None else None,
        "accept_len_before_per_request": [round(x, 3) for x in per_request_accept(phase(recs, "before"))],
        "accept_len_spec_eq": ratio(accept_len(phase(recs, "spec_eq")), 1),
        "accept_len_steady_after_bursts": ratio(accept_len(phase(recs, "after")), 1),
        # raw c=1 tok/s of the dyn server alone (8 prompts x 64 tokens, ~1 s a phase, minutes
        # apart): stock servers moved +-20-40 % between these phases, so they are NOT the goal's measure
        "c1_raw_tok_s_before": throughput(phase(recs, "before")),
        "c1_raw_tok_s_after": throughput(phase(recs, "after")),
    }
    stale = stale_draft(recs, stock_recs, windows or [])
    tails, ratios, med = tail_figures(stale)
    res.update(accept_source="spanning requests' tails (tokens per streamed event after the burst drained)",
               accept_len_after_resume=tails, after_over_before=ratio(median_or_none(tails), before),
               min_after_over_before=ratio(min([x for x in tails if x is not None], default=None), before),
               stale_draft=stale, tail_over_stock=ratios, tail_over_stock_median=med)
    res.update(late_span_figures(recs, stock_recs, windows))
    if log is not None:
        la = log_accept(log)
        res.update(log_accept_len_steady=la["steady"], log_accept_len_after_resume=la["after_resume"],
                   log_after_over_before=ratio(median_or_none(la["after_resume"]), la["steady"]))
    res["c1_raw_after_over_before"] = ratio(res["c1_raw_tok_s_after"], res["c1_raw_tok_s_before"])
    # the goal's measure (issue #24): dyn against its stock peer in A/B rounds, after over before
    res.update(c1_measure="median over A/B rounds (A B B A) of dyn/stock c=1 tok/s; after/before = ratio "
                          f"of the two medians; goal >= {C1_GOAL}", **ab_summary(recs, ref_stock, "c1_dyn_over_stock"))
    res["c1_after_over_before"] = ratio(res["c1_dyn_over_stock_after"], res["c1_dyn_over_stock_before"])
    res["c1_goal_met"], res["c1_after_over_before_uncertainty"], res["c1_goal_verdict"] = c1_verdict(
        res["c1_after_over_before"], res["c1_dyn_over_stock_before_rounds"], res["c1_dyn_over_stock_after_rounds"])
    # the same question from the servers' own logs: median decode step (ms) per c=1 phase
    res["c1_step_ms"] = {"dyn": c1_step_ms(log, recs), "stock": c1_step_ms(stock_log, ref_stock)}
    if nc_recs is not None:
        res["c1_step_ms"]["nc"] = c1_step_ms(nc_log, nc_recs)
    step = {n: ratio(res["c1_step_ms"]["dyn"][n]["median_step_ms"], res["c1_step_ms"]["stock"][n]["median_step_ms"])
            for n in ("ab_before", "ab_after")}
    res["c1_step_dyn_over_stock_before"], res["c1_step_dyn_over_stock_after"] = step["ab_before"], step["ab_after"]
    # > 1: dyn's step grew against stock's after the bursts (the inverse sense of the tok/s ratio)
    res["c1_step_after_over_before"] = ratio(step["ab_after"], step["ab_before"])
    eq_plain = greedy_equality(recs, ref_baseline, {"burst"})
    eq_plain_c1 = greedy_equality(recs, ref_baseline, {"burst"}, ref_phase="burst_c1")
    eq_spec = greedy_equality(recs, ref_stock, {"before", "spec_eq", "after"})
    eq_span = greedy_equality(recs, ref_baseline, {"span"})
    res["greedy_equal_plain_vs_baseline"] = eq_plain["fraction"]
    res["greedy_equal_spec_vs_stock"] = eq_spec["fraction"]
    res["greedy_equal_across_crossing_vs_baseline"] = eq_span["fraction"]
    res["greedy_equal_plain_vs_baseline_c1"] = eq_plain_c1["fraction"]
    pairs = (("plain_vs_baseline", eq_plain), ("spec_vs_stock", eq_spec),
             ("across_crossing_vs_baseline", eq_span), ("plain_vs_baseline_c1", eq_plain_c1))
    res["equality_counts"] = {n: [e["equal"], e["of"]] for n, e in pairs}
    res["mismatches"] = {n: e["mismatches"] for n, e in pairs}
    if nc_recs is not None:
        nb = accept_len(phase(nc_recs, "before"))
        nstale = stale_draft(nc_recs, stock_recs, nc_windows or [])
        ntails, nratios, nmed = tail_figures(nstale)
        res.update(negative_control_accept_len_before=ratio(nb, 1),
                   negative_control_accept_len_after_resume=ntails,
                   negative_control_after_over_before=ratio(median_or_none(ntails), nb),
                   negative_control_stale_draft=nstale, negative_control_tail_over_stock=nratios,
                   negative_control_tail_over_stock_median=nmed)
        res.update({"negative_control_" + k: v for k, v in late_span_figures(nc_recs, stock_recs, nc_windows).items()})
        if nc_log is not None:
            nl = log_accept(nc_log)
            res["negative_control_log_after_over_before"] = ratio(median_or_none(nl["after_resume"]), nl["steady"])
        nab = ab_summary(nc_recs, ref_stock, "c1_nc_over_stock")
        res.update({"negative_control_" + k: v for k, v in nab.items()})
        res["negative_control_c1_after_over_before"] = ratio(nab["c1_nc_over_stock_after"],
                                                             nab["c1_nc_over_stock_before"])
        res["negative_control_greedy_equal_plain_vs_baseline"] = greedy_equality(
            nc_recs, ref_baseline, {"burst"})["fraction"]
        res["verdict"] = verdict(med, nmed) if third == "control" else reference_verdict(
            med, nmed, res.get("late_tail_over_stock_median"),
            res.get("negative_control_late_tail_over_stock_median"))
    return res


def reference_verdict(dyn, ref, dyn_late=None, ref_late=None):
    """A sentence comparing a dyn server's tails with a healthy reference's (not a negative
    control, so there is no collapse to test): the late spanning requests' first, if any."""
    parts = [f"{what}: tail / stock {d:.3f} against the reference's {r:.3f} ({d / r:.3f}x)"
             for what, d, r in (("late spanning requests", dyn_late, ref_late), ("spanning requests", dyn, ref))
             if d is not None and r]
    if not parts:
        return "no tail figures (no spanning requests with a stock reference)"
    return "against a healthy reference, not a negative control (no collapse to test): " + "; ".join(parts)


def verdict(dyn, nc, collapse=0.9):
    """A sentence on what the tails show: the negative control must fall below `collapse` x
    stock for the measure to see a stale draft at all."""
    if dyn is None or nc is None:
        return "no tail figures (no spanning requests with a stock reference)"
    if nc >= collapse:
        return (f"the negative control shows no collapse with this measure (tail / stock {nc:.3f} "
                f"against dyn {dyn:.3f}): the harness cannot tell a stale draft from a healthy one here")
    if dyn >= collapse:
        return (f"the negative control collapses (tail / stock {nc:.3f}) and dyn does not "
                f"({dyn:.3f}): the draft KV written while plain keeps the draft healthy")
    return f"both collapse: dyn tail / stock {dyn:.3f}, negative control {nc:.3f}"


def baseline_control(base_recs):
    """What the unpatched engine does with another batch composition: the baseline's burst
    outputs against the same prompts at c=1 and in the same burst shape again."""
    return {"baseline_burst_vs_baseline_c1": greedy_equality(base_recs, base_recs, {"burst"}, "burst_c1"),
            "baseline_burst_again_vs_baseline_burst": greedy_equality(base_recs, base_recs, {"burst_again"},
                                                                      "burst")}


def strip_mismatch(m):
    """A mismatch as it goes into summary.json (prompt ids and prefix dropped, margin kept)."""
    return {k: v for k, v in m.items() if k not in ("prompt_ids", "common_prefix")}

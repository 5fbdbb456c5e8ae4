"""gpu/accept_analysis.py on synthetic records: what summary.json and first_crossing.json say."""
import time

import pytest

from tests.gpu.scripts import load_gpu_script

an = load_gpu_script("accept_analysis")


def rec(server, phase, idx, out, crossing=None, verify=None, t=(0.0, 1.0), arrivals=None, error=None,
        prompt=None):
    return {"server": server, "phase": phase, "crossing": crossing, "idx": idx,
            "prompt_ids": prompt or [idx, 1, 2], "output_ids": out, "completion_tokens": len(out),
            "spec_verify_ct": verify, "t_start": t[0], "t_end": t[1], "arrivals": arrivals or [],
            "error": error}


def test_accept_len_is_tokens_per_verify_over_requests_and_none_without_verify_counts():
    rs = [rec("d", "before", 0, [1] * 30, verify=10), rec("d", "before", 1, [1] * 10, verify=10)]
    assert an.accept_len(rs) == pytest.approx(2.0)  # 40 tokens / 20 verifies, not mean(3, 1)
    assert an.per_request_accept(rs) == [3.0, 1.0]
    assert an.accept_len([rec("b", "before", 0, [1] * 30)]) is None
    # a failed request does not count
    assert an.accept_len(rs + [rec("d", "before", 2, [1] * 5, verify=5, error="boom")]) == pytest.approx(2.0)


def span(server, idx, steps, crossing=1, t0=0.0, dt=0.01):
    """A streamed spanning request: one event per step, `steps` the tokens each step accepted."""
    counts, n = [], 0
    for k in steps:
        n += k
        counts.append(n)
    r = rec(server, "span", idx, [7] * n, crossing=crossing,
            arrivals=[t0 + dt * (i + 1) for i in range(len(steps))])
    r["counts"] = counts
    return r


# 4 speculative steps (lead: 10 tokens), 20 plain steps (the burst), then the tail
LEAD, PLAIN = [3, 2, 3, 2], [1] * 20
WINDOW = [{"crossing": 1, "burst_t0": 0.045, "burst_t1": 0.245, "resume_t1": 1.0}]


def test_tokens_at_and_range_accept():
    r = span("d", 1, LEAD + PLAIN + [3, 3])
    assert an.tokens_at(r, 0.045) == 10 and an.tokens_at(r, 0.245) == 30 and an.tokens_at(r, 0.0) == 0
    assert an.range_accept(r["counts"], 30) == (6, 2)
    # an event that starts before the range is left out whole
    assert an.range_accept([2, 5, 9], 3) == (4, 1)


def test_stale_draft_tail_collapses_against_stock_over_the_same_tokens():
    stock = [span("s", i, [3, 2] * 20, dt=0.004) for i in (1, 2)]   # 2.5 all along
    healthy = [span("d", i, LEAD + PLAIN + [3, 2] * 8) for i in (1, 2)]
    stale = [span("n", i, LEAD + PLAIN + [1] * 10 + [3, 2] * 3) for i in (1, 2)]
    (h,) = an.stale_draft(healthy, stock, WINDOW)
    assert h["dyn_tail"] == pytest.approx(2.5) and h["stock_tail"] == pytest.approx(2.5)
    assert h["tail_over_stock"] == pytest.approx(1.0) and h["requests"] == 2
    assert h["burst_start_and_tail_start_tokens"] == [[10, 30], [10, 30]]
    (n,) = an.stale_draft(stale, stock, WINDOW)
    assert n["dyn_tail"] == pytest.approx(25 / 16) and n["tail_over_stock"] < 0.7
    # no stock request of the same prompt: nothing to compare
    assert an.stale_draft(healthy, [], WINDOW)[0]["tail_over_stock"] is None


def test_worker_summary_headline_is_the_tail_and_the_verdict_needs_a_collapsing_control():
    before = [rec("d", "before", 0, [1] * 30, verify=12)]  # 2.5
    stock = [span("s", 1, [3, 2] * 20, dt=0.004)]
    dyn = before + [span("d", 1, LEAD + PLAIN + [3, 2] * 8)]
    nc = [dict(r, server="n") for r in before] + [span("n", 1, LEAD + PLAIN + [1] * 10 + [3, 2] * 3)]
    s = an.worker_summary(dyn, [], stock, nc, windows=WINDOW, nc_windows=WINDOW)
    assert s["accept_len_before"] == pytest.approx(2.5)
    assert s["accept_len_after_resume"] == [2.5] and s["after_over_before"] == pytest.approx(1.0)
    assert s["negative_control_after_over_before"] == pytest.approx(25 / 16 / 2.5, abs=1e-3)
    assert s["verdict"].startswith("the negative control collapses")
    # a negative control that stays healthy: the summary says the harness sees nothing
    nc_ok = [dict(r, server="n") for r in dyn]
    s2 = an.worker_summary(dyn, [], stock, nc_ok, windows=WINDOW, nc_windows=WINDOW)
    assert s2["verdict"].startswith("the negative control shows no collapse")
    # a third server that is a healthy reference (defer's skip): compared, not tested for a collapse
    s3 = an.worker_summary(dyn, [], stock, nc, windows=WINDOW, nc_windows=WINDOW, third="reference")
    assert s3["verdict"] == ("against a healthy reference, not a negative control (no collapse to test): "
                             "spanning requests: tail / stock 1.000 against the reference's 0.625 (1.600x)")


def test_the_reference_verdict_puts_the_late_requests_first_and_skips_missing_figures():
    assert an.reference_verdict(1.01, 0.996, 0.991, 0.996).startswith(
        "against a healthy reference, not a negative control (no collapse to test): late spanning requests: "
        "tail / stock 0.991 against the reference's 0.996 (0.995x); spanning requests: tail / stock 1.010")
    assert an.reference_verdict(None, 0.9, None, None) == "no tail figures (no spanning requests with a stock reference)"


def test_margin_classes_and_the_counter_take_an_exact_tie_as_a_tie():
    ms = [{"margin": 0.0}, {"margin": 0.0625}, {"margin": 0.125}, {"margin": 0.5}, {}, {"margin": 0.004}]
    assert [an.margin_class(m.get("margin")) for m in ms] == [
        "tie", "bf16_step", "bf16_step", "larger", "unknown", "bf16_step"]
    assert an.margin_counts(ms) == {"total": 6, "below_1e-2": 2, "tie": 1, "bf16_step": 3, "larger": 1,
                                    "unknown": 1}


def test_baseline_control_compares_the_burst_with_c1_and_the_burst_again():
    b = [rec("b", "burst", 1, [5, 6, 7], crossing=1), rec("b", "burst", 2, [5, 6, 7], crossing=1),
         rec("b", "burst_c1", 1, [5, 6, 7], crossing=1), rec("b", "burst_c1", 2, [5, 0, 7], crossing=1),
         rec("b", "burst_again", 1, [5, 6, 7], crossing=1), rec("b", "burst_c1", 3, [1], crossing=1)]
    c = an.baseline_control(b)
    c1 = c["baseline_burst_vs_baseline_c1"]
    assert (c1["equal"], c1["of"]) == (1, 2)
    (m,) = c1["mismatches"]
    assert (m["idx"], m["phase"], m["ref_phase"], m["first_diff"], m["common_prefix"]) == (2, "burst", "burst_c1", 1, [5])
    again = c["baseline_burst_again_vs_baseline_burst"]
    assert (again["equal"], again["of"]) == (1, 1)


def test_greedy_equality_matches_phase_crossing_and_prompt_and_reports_first_difference():
    base = [rec("b", "burst", 1, [5, 6, 7, 8], crossing=1), rec("b", "burst", 2, [5, 6, 7], crossing=1),
            rec("b", "burst", 1, [9, 9, 9], crossing=2)]
    dyn = [rec("d", "burst", 1, [5, 6, 0, 8], crossing=1), rec("d", "burst", 2, [5, 6, 7], crossing=1),
           rec("d", "burst", 1, [9, 9, 9], crossing=2), rec("d", "burst", 3, [1], crossing=2)]  # no ref
    e = an.greedy_equality(dyn, base, {"burst"})
    assert (e["equal"], e["of"], e["fraction"]) == (2, 3, pytest.approx(0.6667, abs=1e-4))
    (m,) = e["mismatches"]
    assert (m["crossing"], m["idx"], m["first_diff"], m["token"], m["ref_token"]) == (1, 1, 2, 0, 7)
    assert (m["server"], m["ref_server"]) == ("d", "b")
    assert m["common_prefix"] == [5, 6]
    assert an.greedy_equality(dyn, base, {"span"})["fraction"] is None


def test_first_diff_handles_prefixes():
    assert an.first_diff([1, 2, 3], [1, 2, 3]) is None
    assert an.first_diff([1, 2], [1, 2, 3]) == 2
    assert an.first_diff([4], [1]) == 0


def test_margin_is_the_top_two_logprob_difference_in_any_order():
    assert an.margin_from_top_logprobs([[-0.7, 3, "a"], [-0.2, 4, "b"]]) == pytest.approx(0.5)
    assert an.margin_from_top_logprobs([[-0.2, 4, "b"]]) is None


def test_window_gaps_take_only_arrivals_inside_the_window():
    r = rec("d", "burst", 1, [1] * 5, crossing=1, arrivals=[10.0, 10.01, 10.51, 10.52, 12.0])
    # gaps ending in [10.0, 11.0]: 0.01, 0.5, 0.01; the 1.48 one ends at 12.0, outside
    assert an.window_max_gap_ms([r], 10.0, 11.0) == pytest.approx(500.0)
    assert an.window_max_gap_ms([r], 11.0, 13.0) == pytest.approx(1480.0)
    assert an.window_max_gap_ms([r], 20.0, 30.0) is None


def test_stall_summary_first_crossing_and_resume_against_later_medians():
    recs, windows = [], []
    for c in range(1, 5):
        t = 100.0 * c
        burst_gap = 2.0 if c == 1 else 0.010   # the first crossing stalls
        resume_gap = 0.5 if c == 1 else 0.020  # and so does the first resume
        recs.append(rec("d", "burst", c, [1] * 3, crossing=c, arrivals=[t, t + 0.005, t + 0.005 + burst_gap]))
        recs.append(rec("d", "resume", 50 + c, [1] * 3, crossing=c,
                        arrivals=[t + 10, t + 10.01, t + 10.01 + resume_gap]))
        windows.append({"crossing": c, "burst_t0": t - 0.1, "burst_t1": t + 5, "resume_t1": t + 20})
    gaps = an.stall_gaps(recs, windows)
    assert [g["crossing_max_gap_ms"] for g in gaps] == pytest.approx([2000.0, 10.0, 10.0, 10.0])
    s = an.stall_summary(gaps, tp=1, server="d")
    # when each resume's longest gap ended, after the burst's end: the first at t + 10.51 (burst_t1 t + 5)
    assert s["resume_max_gap_end_ms"] == pytest.approx([5510.0, 5030.0, 5030.0, 5030.0])
    assert s["first_crossing_max_gap_ms"] == pytest.approx(2000.0)
    assert s["later_crossings_max_gap_ms_median"] == pytest.approx(10.0)
    assert s["first_resume_max_gap_ms"] == pytest.approx(500.0)
    assert s["later_resumes_max_gap_ms_median"] == pytest.approx(20.0)
    assert s["goal_met"] is False
    even = an.stall_summary([dict(g, crossing_max_gap_ms=10.0, resume_max_gap_ms=20.0) for g in gaps])
    assert even["goal_met"] is True


def test_the_baseline_gives_the_gaps_a_bursts_end_costs_with_no_switch_in_it():
    """The twenty-first session: the native path's later resumes ran 60-83 ms, and the baseline's
    resume windows, with no switch in them, ran up to 87 ms where its burst finished within 16-90 ms."""
    recs, windows = [], []
    for c in (1, 2):
        t = 100.0 * c
        windows.append({"crossing": c, "burst_t0": t - 1, "burst_t1": t, "resume_t1": t + 5})
        for k in range(3):  # the burst's requests end 0, 20 and 40 ms apart (crossing 2: 0, 200, 400)
            recs.append(dict(rec("b", "burst", 10 * c + k, [1] * 3, crossing=c), t_end=t - 0.04 * c * k))
        gap = 0.060 if c == 1 else 0.015
        recs.append(rec("b", "span", c, [1] * 3, crossing=c, arrivals=[t - 0.05, t - 0.05 + gap, t + 0.1]))
    assert an.burst_completion_spread_ms(recs, windows) == [80.0, 160.0]
    ref = an.burst_end_reference(recs, windows)
    # gaps ending inside [burst_t1, resume_t1]: crossing 1's 60 ms (to t + 10 ms) and 90 ms (to t + 100 ms);
    # crossing 2's 15 ms ends before the burst did, its 135 ms (to t + 100 ms) inside
    assert ref["resume_window_max_gap_ms"] == pytest.approx([90.0, 135.0])
    assert ref["server"] == "baseline" and ref["max_ms"] == pytest.approx(135.0)
    assert ref["burst_completion_spread_ms"] == [80.0, 160.0]


def test_log_transitions_counts_switch_lines_and_reads_the_last_counters():
    lines = ["[2026 TP0] Dynamic speculation disable: drafting stopped at 20 running decode requests (a)",
             "Decode batch, #running-req: 20, spec off/on switches: 1/0",
             "[2026 TP0] Dynamic speculation disable: drafting resumed at 5 running decode requests (a)",
             "Decode batch, #running-req: 5, spec off/on switches: 1/1",
             "Dynamic speculation disable enabled: threshold=8 hysteresis=2"]
    assert an.log_transitions(lines) == {"stopped_lines": 1, "resumed_lines": 1, "decode_line_counters": [1, 1]}
    assert an.log_transitions([])["decode_line_counters"] is None


def test_c1_throughput_sums_durations_not_the_span():
    rs = [rec("d", "before", 0, [1] * 50, t=(0.0, 1.0)), rec("d", "before", 1, [1] * 50, t=(5.0, 6.0))]
    assert an.throughput(rs) == pytest.approx(50.0)


def test_new_jit_entries():
    assert an.new_entries(["triton:a", "triton:b"], ["triton:b", "triton:c", "flashinfer:x"]) == [
        "flashinfer:x", "triton:c"]


def decode(running, acc):
    return f"[2026 TP0] Decode batch, #running-req: {running}, #token: 9, accept len: {acc:.2f}, accept rate: 0.5, "


def switch(kind, n):
    return f"[2026 TP0] Dynamic speculation disable: drafting {kind} at {n} running decode requests (x)"


def test_log_accept_steady_and_the_steps_after_each_resume():
    lines = ([decode(1, 3.0), decode(1, 2.0), decode(2, 1.0)]          # steady: c=1 lines only
             + [switch("stopped", 20)] + [decode(20, 1.0)] * 5 + [switch("resumed", 1)]
             + [decode(1, 1.0), decode(1, 1.0)] + [decode(1, 3.0)] * 20   # a collapse, then back
             + [switch("stopped", 20), decode(20, 1.0), switch("resumed", 2)]
             + [decode(2, 2.5)] * 20)
    la = an.log_accept(lines, tokens=8)
    assert la["steady"] == pytest.approx(2.5) and la["steady_steps"] == 2
    # after resume 1: 1 + 1 + 3 + 3 = 8 tokens in 4 steps; after resume 2: 2.5 x 4 = 10 >= 8
    assert la["after_resume"] == pytest.approx([2.0, 2.5])
    assert la["steps_after_resume"] == [4, 4]
    # worker_summary keeps the log's figures beside the tails (32 tokens per resume)
    s = an.worker_summary([], [], [], log=lines, nc_log=None)
    assert s["log_accept_len_after_resume"] == pytest.approx([32 / 12, 2.5], abs=1e-4)
    assert s["log_after_over_before"] == pytest.approx((32 / 12 + 2.5) / 2 / 2.5, abs=1e-4)


def ab_visits(name, rounds, order_of, drift=0.05, slow=None, tokens=128, step=0.002):
    """A/B records of phase `name`: per round the servers' visits in order_of(round) (one request
    each), the step time drifting by `drift` per visit across the whole phase; slow: {server:
    factor} on its steps."""
    out, t, v = [], 100.0, 0
    for r in range(rounds):
        for k, srv in enumerate(order_of(r)):
            d = tokens * step * (1 + drift * v) * (slow or {}).get(srv, 1.0)
            x = rec(srv, name, r % 3, [1] * tokens, t=(t, t + d))
            x.update(round=r, visit=k)
            out.append(x)
            t, v = t + d + 0.01, v + 1
    return out


def test_ab_rounds_in_mirrored_order_cancel_a_drift_common_to_the_pair():
    mirrored = lambda r: ["d", "s", "s", "d"] if r % 2 == 0 else ["s", "d", "d", "s"]  # noqa: E731
    recs = ab_visits("ab_before", 5, mirrored) + ab_visits("ab_after", 5, mirrored, drift=0.2)
    dyn = [r for r in recs if r["server"] == "d"]
    stock = [r for r in recs if r["server"] == "s"]
    assert an.ab_ratios(dyn, stock, "ab_before") == pytest.approx([1.0] * 5, abs=2e-4)
    s = an.ab_summary(dyn, stock, "x")
    assert s["x_before"] == pytest.approx(1.0, abs=2e-4) and s["x_after"] == pytest.approx(1.0, abs=2e-4)
    assert s["x_after_spread"][0] <= s["x_after"] <= s["x_after_spread"][1]
    # the same drift with one visit each (A B, B A): every round is off by the drift
    plain = ab_visits("ab_before", 5, lambda r: ["d", "s"] if r % 2 == 0 else ["s", "d"], drift=0.2)
    rs = an.ab_ratios([r for r in plain if r["server"] == "d"], [r for r in plain if r["server"] == "s"], "ab_before")
    assert all(abs(x - 1) > 0.05 for x in rs)
    # a failed request leaves its round out
    dyn[0]["error"] = "boom"
    assert len(an.ab_ratios(dyn, stock, "ab_before")) == 4


def test_worker_summary_c1_is_dyn_over_stock_after_over_before_and_keeps_the_raw_figures():
    mirrored = lambda r: ["d", "s", "n", "n", "s", "d"] if r % 2 == 0 else ["n", "s", "d", "d", "s", "n"]  # noqa: E731
    # after the bursts every server is 1.5x slower (common noise) and d 1.25x more on top
    recs = (ab_visits("ab_before", 5, mirrored)
            + ab_visits("ab_after", 5, mirrored, slow={"d": 1.5 * 1.25, "s": 1.5, "n": 1.5}))
    raw = [rec("d", "before", 0, [1] * 64, t=(0.0, 0.1)), rec("d", "after", 0, [1] * 64, t=(9.0, 9.15))]
    dyn = [r for r in recs if r["server"] == "d"] + raw
    stock = [r for r in recs if r["server"] == "s"]
    nc = [r for r in recs if r["server"] == "n"]
    s = an.worker_summary(dyn, [], stock, nc)
    assert s["c1_after_over_before"] == pytest.approx(0.8, abs=1e-3) and s["c1_goal_met"] is False
    assert s["negative_control_c1_after_over_before"] == pytest.approx(1.0, abs=1e-3)
    assert s["c1_raw_tok_s_before"] == pytest.approx(640.0) and s["c1_raw_after_over_before"] == pytest.approx(2 / 3, abs=1e-3)
    assert "c1_tok_s_before" not in s  # renamed: the raw figure is not the goal's measure
    # records of a run before the A/B rounds: the A/B figures are None, the rest still computes
    old = an.worker_summary(raw, [], [], [])
    assert old["c1_after_over_before"] is None and old["c1_goal_met"] is None
    assert old["c1_dyn_over_stock_before_rounds"] == [] and old["c1_raw_tok_s_after"] is not None


def stamped(t, running, y, acc=None, tp=" TP0"):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    a = f"accept len: {acc:.2f}, accept rate: 0.38, " if acc is not None else ""
    return (f"[{stamp}{tp}] Decode batch, #running-req: {running}, #full token: 300, full token usage: 0.01, {a}"
            f"cuda graph: True, gen throughput (token/s): {y:.2f}, #queue-req: 0")


def test_log_step_ms_from_accept_len_and_gen_throughput_inside_the_window():
    t = 1_800_000_000.0
    lines = ([stamped(t, 1, 1000.0, 2.0)] * 3           # 2 ms steps
             + [stamped(t + 1, 1, 12.0, 2.5)]            # spans an idle gap: skipped
             + [stamped(t + 1, 4, 3000.0, 2.0)]          # four running: not c=1
             + ["[2026-01-01 00:00:00] Prefill batch, #new-seq: 1", "no stamp"]
             + [stamped(t + 2, 1, 500.0, 2.5, tp="")]    # 5 ms, no TP prefix
             + [stamped(t + 10, 1, 100.0, 2.0)])         # outside the window
    med, n = an.log_step_ms(lines, t + 0.3, t + 2.9)
    assert n == 4 and med == pytest.approx(2.0)
    assert an.log_step_ms(lines, t + 1.5, t + 2.2) == (pytest.approx(5.0), 1)
    assert an.log_step_ms(lines, t + 20, t + 30) == (None, 0)
    # a plain server's lines have no accept len: one token a step
    assert an.log_step_ms([stamped(t, 1, 700.0)], t, t) == (pytest.approx(1000 / 700, abs=1e-3), 1)
    recs = [rec("d", "ab_before", 0, [1], t=(t + 0.2, t + 0.9)), rec("d", "ab_after", 0, [1], t=(t + 2.1, t + 2.5))]
    got = an.c1_step_ms(lines, recs)
    assert got["ab_before"] == {"median_step_ms": pytest.approx(2.0), "steps": 3}
    assert got["ab_after"]["median_step_ms"] == pytest.approx(5.0) and got["before"]["median_step_ms"] is None
    assert an.c1_step_ms(None, recs)["ab_before"]["median_step_ms"] is None


def test_c1_verdict_is_given_only_where_the_rounds_resolve_the_goal():
    tight = [1.0, 1.002, 0.998, 1.001, 0.999, 1.0]
    met, u, why = an.c1_verdict(0.99, tight, tight)
    assert met is True and u < 0.005 and why.startswith("met")
    # the same ratio from rounds that scatter as the fourth session's MLA call did: no verdict
    wide = [1.04, 1.01, 1.22, 1.12, 1.03, 1.06, 1.0, 0.86]
    met, u, why = an.c1_verdict(0.99, wide, wide)
    assert met is None and u > 0.03 and why.startswith("not resolved")
    # a clear loss is a miss even through that scatter
    assert an.c1_verdict(0.8, wide, wide)[0] is False
    # tight rounds, just short of the goal: a miss
    assert an.c1_verdict(0.97, tight, tight)[0] is False
    # a gain with no mechanism behind it is a harness question, however tight the rounds
    met, _, why = an.c1_verdict(1.06, tight, tight)
    assert met is None and "harness" in why
    # too few rounds to estimate their spread
    assert an.c1_verdict(1.0, tight[:3], tight)[:2] == (None, None)


def test_burst_end_script_rederives_every_servers_burst_end_from_a_runs_records(tmp_path):
    import json

    from .scripts import load_gpu_script

    burst_end = load_gpu_script("burst_end")
    (tmp_path / "accept").mkdir()
    windows = {"baseline": [{"crossing": 1, "burst_t0": 9.0, "burst_t1": 10.0, "resume_t1": 11.0}],
               "eagle3-v2": [{"crossing": 1, "burst_t0": 19.0, "burst_t1": 20.0, "resume_t1": 21.0}]}
    recs = [dict(rec("baseline", "burst", 0, [1], crossing=1), t_end=9.98),
            dict(rec("baseline", "burst", 1, [1], crossing=1), t_end=10.0),
            rec("baseline", "span", 2, [1, 1], crossing=1, arrivals=[9.95, 10.02]),
            dict(rec("eagle3-v2", "burst", 0, [1], crossing=1), t_end=19.7),
            dict(rec("eagle3-v2", "burst", 1, [1], crossing=1), t_end=20.0)]
    (tmp_path / "accept" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "accept" / "accept_raw.json").write_text(json.dumps({"windows": windows}))
    base, stock = burst_end.report(str(tmp_path))
    assert base["server"] == "baseline" and base["resume_window_max_gap_ms"] == pytest.approx([70.0])
    assert base["burst_completion_spread_ms"] == [20.0] and stock["burst_completion_spread_ms"] == [300.0]
    assert stock["resume_window_max_gap_ms"] == [None] and stock["median_ms"] is None

"""gpu/trace_steps.py's step analysis on small synthetic torch-profiler traces (the device's
traces are mostly too large for the repo; docs/evidence/dyn-disable-5 has the figures it gave), and one
small real trace for the prefill/decode split."""
import pathlib
import statistics

import pytest

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def trace_steps():
    return load_gpu_script("trace_steps")


def replay(corr, host_ts):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": host_ts, "dur": 5,
            "args": {"correlation": corr}}


def kernel(corr, ts, dur, name="k"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def graph(corr, start, kernels=((0, 400), (400, 600))):
    """A graph replay whose kernels (offset, duration in us) start at `start`."""
    return [replay(corr, start - 50)] + [kernel(corr, start + off, dur) for off, dur in kernels]


def test_back_to_back_replays_are_gpu_bound(trace_steps):
    events = graph(1, 0) + [kernel(90, 1000, 40)] + graph(2, 1050) + [kernel(91, 2050, 40)] + graph(3, 2100)
    rows = trace_steps.steps(events)
    assert rows == [(1.0, 0.0, 0.04, 0.01), (1.0, 0.0, 0.04, 0.01)]


def test_idle_gaps_between_replays_are_measured_and_other_work_is_not_counted_as_idle(trace_steps):
    # replay 2 starts 3 ms after replay 1 ends; 0.5 ms of eager kernels ran in between
    events = graph(1, 0) + [kernel(90, 1200, 300), kernel(91, 1600, 200)] + graph(2, 4000)
    rows = trace_steps.steps(events)
    assert rows == [(1.0, 0.0, 0.5, 2.5)]


def test_overlapping_eager_kernels_count_once(trace_steps):
    events = graph(1, 0) + [kernel(90, 1000, 300), kernel(91, 1100, 300)] + graph(2, 1500)
    ((_, _, other, idle),) = trace_steps.steps(events)
    assert (other, idle) == (0.4, 0.1)


def test_a_single_replay_gives_no_steps(trace_steps, capsys):
    assert trace_steps.steps(graph(1, 0)) == []
    trace_steps.print_steps([])
    assert "fewer than two" in capsys.readouterr().out


def test_the_verdict_reads_the_median_gap(trace_steps, capsys):
    trace_steps.print_steps([(4.2, 0.0, 0.2, 1.0), (4.2, 0.0, 0.2, 0.9), (4.2, 0.0, 0.2, 0.0)])
    out = capsys.readouterr().out
    assert "GPU idle 0.900 ms" in out and "host-bound" in out
    trace_steps.print_steps([(4.2, 0.0, 0.04, 0.03)] * 3)
    assert "GPU-bound" in capsys.readouterr().out


def test_a_short_replay_is_a_side_graph_of_the_step_it_falls_in(trace_steps):
    # each step: the 1 ms decode graph, then a 0.13 ms graph (a plain step's draft KV-only update)
    # and 0.6 ms of idle before the next decode graph
    short = ((0, 130),)
    events = (graph(1, 0) + graph(2, 1000, short) + graph(3, 1730)
              + graph(4, 2730, short) + graph(5, 3460))
    rows = trace_steps.steps(events)
    assert rows == [(1.0, 0.13, 0.0, 0.6), (1.0, 0.13, 0.0, 0.6)]


def test_side_graph_time_is_not_idle_and_the_step_adds_it(trace_steps, capsys):
    trace_steps.print_steps([(4.2, 0.13, 0.04, 0.03)] * 3)
    out = capsys.readouterr().out
    assert "side graphs 0.130 ms" in out and "step 4.400 ms" in out and "GPU-bound" in out


def test_a_speculative_step_runs_from_one_verify_graph_to_the_next(trace_steps):
    # each step: the draft's multi-step decode graph (6 kernels, 0.6 ms), the target's verify
    # graph (20 kernels, 2 ms) and the draft's extend graph (4 kernels, 1 ms: half the verify's
    # time, yet a side graph, since it is another graph), then 0.4 ms idle
    draft = tuple((100 * i, 100) for i in range(6))
    verify = tuple((100 * i, 100) for i in range(20))
    extend = tuple((250 * i, 250) for i in range(4))
    events, t, corr = [], 0, 1
    for _ in range(3):
        for kernels, length in ((draft, 600), (verify, 2000), (extend, 1000)):
            events += graph(corr, t, kernels)
            corr, t = corr + 1, t + length
        t += 400
    rows = trace_steps.steps(events)
    # from one verify to the next: extend and the next step's draft decode are its side graphs
    assert rows == [(2.0, 1.6, 0.0, 0.4), (2.0, 1.6, 0.0, 0.4)]


def test_one_long_replay_of_a_short_graph_does_not_make_it_the_main_graph(trace_steps):
    # round eight's TP=2 c=1 trace: one replay of the draft's decode graph waited 19.6 ms in an
    # all-reduce for the other rank; the verify graph is still the step's main graph by its median
    draft = tuple((100 * i, 100) for i in range(6))
    stalled = draft[:-1] + ((500, 19000),)
    verify = tuple((100 * i, 100) for i in range(20))
    events, t, corr = [], 0, 1
    for step in range(3):
        for kernels, length in ((stalled if step == 0 else draft, 19500 if step == 0 else 600),
                                (verify, 2000)):
            events += graph(corr, t, kernels)
            corr, t = corr + 1, t + length
        t += 400
    rows = trace_steps.steps(events)
    assert [main for main, _, _, _ in rows] == [2.0, 2.0]
    assert rows[0] == (2.0, 0.6, 0.0, 0.4)


# Prefill forwards: SGLang 0.5.11 names every forward's profiler span step[MODE bs=N] (EXTEND:
# step[EXTEND bs=N toks=T]); the kernels launched inside a span are its forward's.

def span(name, ts, dur, tid=7):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def launch(corr, ts, tid=7, name="cudaLaunchKernel"):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": 2,
            "args": {"correlation": corr}}


def eager_forward(first_corr, host_ts, gpu_ts, layers, attention="_fwd_kernel"):
    """An eager forward: per layer an attention kernel (100 us) and a matmul (200 us), back to back."""
    events, corr, t = [], first_corr, gpu_ts
    for layer in range(layers):
        for name, dur in ((attention, 100), ("nvjet_gemm", 200)):
            events += [launch(corr, host_ts + corr - first_corr), kernel(corr, t, dur, name)]
            corr, t = corr + 1, t + dur
    return events


def prefill_trace():
    """A decode graph step, a 4-layer target EXTEND of 2,048 tokens, the 1-layer draft's EXTEND of
    the same tokens, a decode graph step whose kernels include the decode attention kernels, and
    an eager kernel launched outside any span (sampling), which belongs to no forward."""
    decode_kernels = [kernel(1, 0, 300, "_fwd_grouped_kernel_stage1"), kernel(1, 300, 50, "_fwd_kernel_stage2"),
                      kernel(1, 350, 650, "nvjet_gemm")]
    events = [span("step[DECODE bs=3]", 0, 100), replay(1, 10)] + decode_kernels
    events += [span("step[EXTEND bs=2 toks=2048]", 200, 100)] + eager_forward(100, 210, 1100, layers=4)
    events += [span("step[EXTEND bs=2 toks=2048]", 400, 100)] + eager_forward(200, 410, 2300, layers=1)
    events += [launch(300, 550), kernel(300, 2600, 80, "argmax")]  # after the draft's span
    events += [span("step[DECODE bs=5]", 600, 100), replay(2, 610)]
    events += [dict(k, args={"correlation": 2}, ts=k["ts"] + 3000) for k in decode_kernels]
    for e in events:
        e.setdefault("pid", 1)
        e.setdefault("tid", 7 if e["cat"] != "kernel" else 13)
    return events


def test_prefill_forwards_are_told_from_decode_forwards_by_their_step_spans(trace_steps):
    rows = trace_steps.forwards(prefill_trace())
    assert [(r["mode"], r["bs"], r["toks"], r["draft"]) for r in rows] == [
        ("DECODE", 3, None, False), ("EXTEND", 2, 2048, False), ("EXTEND", 2, 2048, True), ("DECODE", 5, None, False)]
    # GPU time: the kernels launched inside each span; the argmax after the draft's span is no one's
    assert [round(r["gpu_ms"], 3) for r in rows] == [1.0, 1.2, 0.3, 1.0]
    # the decode attention kernels (_fwd_grouped_kernel_stage1, _fwd_kernel_stage2) are not extend attention
    assert [r["attention"] for r in rows] == [{}, {"_fwd_kernel": 4}, {"_fwd_kernel": 1}, {}]


def test_prefill_cost_per_token_counts_the_targets_tokens_once_and_adds_the_drafts_time(trace_steps, capsys):
    rows = trace_steps.forwards(prefill_trace())
    assert trace_steps.prefill_cost(rows) == (2048, 1.2, 0.3)
    assert trace_steps.per_token_us(trace_steps.prefill_cost(rows)) == pytest.approx(1500 / 2048)
    trace_steps.print_forwards(rows)
    out = capsys.readouterr().out
    assert "prefill forwards 2" in out and "(draft)" in out and "0.73 us per token" in out


def test_a_host_wait_in_a_trace_without_stacks_is_named_by_the_torch_ops_around_it(trace_steps, capsys):
    """Without Python stacks, a cudaStreamSynchronize inside `aten::to` (a device tensor read on the
    host while a prefill runs) is told from the scheduler's own cudaEventSynchronize, and the
    groups come longest first."""
    def op(name, ts, dur, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 7, "ts": ts, "dur": dur}
    events = [op("aten::to", 100, 30000), op("aten::_to_copy", 105, 29990), op("aten::copy_", 110, 29980),
              dict(launch(0, 120, name="cudaStreamSynchronize"), dur=29900)]
    events += [dict(launch(0, 40000 + 100 * i, name="cudaEventSynchronize"), dur=50) for i in range(5)]
    trace_steps.blocking_calls(events)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "  x  1  29.90 ms cudaStreamSynchronize: aten::copy_ <- aten::_to_copy <- aten::to"
    assert lines[2] == "  x  5   0.25 ms cudaEventSynchronize: "


def test_two_traces_compare_prefill_time_per_token(trace_steps, capsys):
    ours = trace_steps.forwards(prefill_trace())
    # a baseline: the same target EXTEND without a draft, each kernel twice as long
    base_events = [span("step[EXTEND bs=2 toks=2048]", 200, 100)] + eager_forward(100, 210, 1100, layers=4)
    for e in base_events:
        if e["cat"] == "kernel":
            e["dur"] *= 2
            e["ts"] = 1100 + 2 * (e["ts"] - 1100)
    base = trace_steps.forwards(base_events)
    assert trace_steps.prefill_cost(base) == (2048, 2.4, 0)
    trace_steps.compare_prefill(ours, base)
    assert "(0.62x)" in capsys.readouterr().out   # 1.5 ms against 2.4 ms for the same tokens


def test_a_trace_without_step_spans_says_prefill_is_not_told_apart(trace_steps, capsys):
    rows = trace_steps.forwards(graph(1, 0) + graph(2, 1050))
    assert rows == []
    trace_steps.print_forwards(rows)
    assert "no step[...] spans" in capsys.readouterr().out


REAL_TRACE = pathlib.Path(__file__).parent / "data" / "kimi16-baseline-c48-decode-only.trace.json.gz"


def test_the_devices_decode_only_window_holds_no_prefill_forward(trace_steps, capsys):
    """The 16-layer Kimi baseline's c=48 trace of the 2026-12-02 call (profile_load.py before its
    prefill mode, --no-stack): nine decode forwards of 48 requests, no prefill among them."""
    events = trace_steps.load(str(REAL_TRACE))
    rows = trace_steps.forwards(events)
    assert [(r["mode"], r["bs"]) for r in rows] == [("DECODE", 48)] * 9
    assert all(not r["attention"] for r in rows)
    # each decode forward's GPU time is its graph replay's, within the other GPU work of a step
    graph_ms = [g for g, _, _, _ in trace_steps.steps(events)]
    assert min(graph_ms) - 0.5 < statistics.median(r["gpu_ms"] for r in rows) <= max(graph_ms) + 0.5
    trace_steps.print_forwards(rows)
    trace_steps.compare_prefill(rows, rows)
    out = capsys.readouterr().out
    assert "prefill forwards 0" in out and "no comparison" in out


# the lines around a profile in a 0.5.11 server's log (2026-12-04, the dense FlashInfer defer server)
PROFILED_LOG = """\
[2026-12-04 19:23:53] Prefill batch, #new-seq: 2, #new-token: 19, #cached-token: 0, token usage: 0.01, #running-req: 34
[2026-12-04 19:23:54] Decode batch, #running-req: 36, #token: 3800, token usage: 0.12, accept len: 1.00, cuda graph: True
[2026-12-04 19:23:54] Profiling starts. Traces will be saved to: /tmp/t/nostack (with profile id: 1796412234.684371)
[2026-12-04 19:23:54] INFO:     127.0.0.1:50054 - "POST /start_profile HTTP/1.1" 200 OK
[2026-12-04 19:23:54] Stop profiling...
[2026-12-04 19:23:55] Decode batch, #running-req: 36, #token: 7400, token usage: 0.23, accept len: 1.00, cuda graph: True
[2026-12-04 19:24:40] Profiling starts. Traces will be saved to: /tmp/t/stack (with profile id: 1796412247.537607)
"""


def test_the_decode_lines_around_a_profile_bracket_the_traced_steps_context(trace_steps):
    pid = trace_steps.profile_id("/x/nostack/1796412234.684371-TP-0.trace.json.gz")
    assert pid == "1796412234.684371"
    assert trace_steps.kv_around_profile(PROFILED_LOG, pid) == {"before": (36, 3800), "after": (36, 7400)}
    # the later profile has no decode line after it; a profile id the log lacks gives None
    assert trace_steps.kv_around_profile(PROFILED_LOG, "1796412247.537607") == {"before": (36, 7400), "after": None}
    assert trace_steps.kv_around_profile(PROFILED_LOG, "1796412999.1") is None


def test_the_command_line_prints_both_servers_context_beside_the_comparison(trace_steps, tmp_path, capsys, monkeypatch):
    import gzip
    import json

    trace = tmp_path / "1796412234.684371-TP-0.trace.json.gz"
    base = tmp_path / "1796412208.2019176-TP-0.trace.json.gz"
    for path in (trace, base):
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": graph(1, 0) + graph(2, 1050)}, f)
    log = tmp_path / "dyn.log"
    log.write_text(PROFILED_LOG)
    base_log = tmp_path / "base.log"
    base_log.write_text(PROFILED_LOG.replace("3800", "701").replace("7400", "4301")
                        .replace("1796412234.684371", "1796412208.2019176"))
    monkeypatch.setattr("sys.argv", ["trace_steps.py", str(trace), str(base), "--log", str(log), "--base-log", str(base_log)])
    trace_steps.main()
    out = capsys.readouterr().out
    assert "context: the server's decode lines around the profile: before 3800 KV tokens at 36 running, " \
           "after 7400 KV tokens at 36 running" in out
    assert "baseline's context: the server's decode lines around the profile: before 701 KV tokens" in out

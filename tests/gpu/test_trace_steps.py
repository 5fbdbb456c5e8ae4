"""gpu/trace_steps.py's step analysis on small synthetic torch-profiler traces (the device's
traces are too large for the repo; docs/evidence/dyn-disable-5 has the figures it gave)."""
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

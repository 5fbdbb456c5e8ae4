"""gpu/trace_gaps.py on small synthetic torch-profiler traces: which GPU idle gaps it lists and
what it says ended each (docs/evidence/plain-at-baseline section 12 used it on a resume's trace)."""
import gzip
import json

import pytest

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def trace_gaps():
    return load_gpu_script("trace_gaps")


def kernel(name, ts, dur, grid=(1, 1, 1)):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"grid": list(grid)}}


def host(name, ts, dur):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur}


def test_a_gap_no_host_op_fills_is_listed_with_the_kernel_that_ended_it(trace_gaps):
    events = [kernel("graph", 0, 1000), kernel("assign", 1500, 10, (6, 1, 1)),
              kernel("assign", 2000, 10, (6, 1, 1)), kernel("assign", 92_000, 10, (6, 1, 1))]
    (gap,) = trace_gaps.gaps(events, min_ms=20)
    assert gap["idle_ms"] == 90.0 and gap["ended_by"] == "assign" and gap["grid"] == [6, 1, 1]
    assert gap["launches_of_it_before"] == 2 and gap["host_ops_over_1ms_inside"] == []


def test_host_ops_inside_a_gap_are_named_and_short_gaps_or_overlaps_are_not_gaps(trace_gaps):
    # the second kernel overlaps the first: the GPU is busy until 50 ms, so the gap is 30 ms, not 79
    events = [kernel("a", 0, 50_000), kernel("b", 1000, 100), kernel("c", 80_000, 10), kernel("d", 80_500, 10),
              host("aten::copy_", 60_000, 15_000), host("tiny", 61_000, 500)]
    (gap,) = trace_gaps.gaps(events, min_ms=20)
    assert gap["idle_ms"] == 30.0 and gap["ended_by"] == "c"
    assert gap["host_ops_over_1ms_inside"] == [("aten::copy_", 15.0)]
    assert trace_gaps.gaps(events, min_ms=31) == []


def test_the_command_reads_a_gzipped_trace(trace_gaps, tmp_path, monkeypatch, capsys):
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [kernel("a", 0, 10), kernel("b", 25_010, 10)]}, f)
    monkeypatch.setattr("sys.argv", ["trace_gaps.py", str(path)])
    trace_gaps.main()
    out = capsys.readouterr().out
    assert "1 GPU idle gap(s) of at least 20.0 ms" in out and '"ended_by": "b"' in out

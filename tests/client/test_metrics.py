"""The metric arithmetic on recorded token timings (no server)."""
from __future__ import annotations

import random

import pytest

from toolkit.bench.metrics import compute, percentile
from toolkit.client import RequestRecord


def done(ttft, chunk_times, latency, completion, prompt):
    return RequestRecord(ok=True, ttft=ttft, chunk_times=chunk_times, latency=latency,
                         completion_tokens=completion, prompt_tokens=prompt,
                         total_tokens=completion + prompt, finish_reason="length", chunks=len(chunk_times))


def test_metrics_from_recorded_timings():
    records = [
        done(0.1, [0.1, 0.2, 0.4], 0.5, completion=5, prompt=10),
        done(0.3, [0.3, 0.6], 0.7, completion=3, prompt=20),
        RequestRecord(ok=False, error="HTTP 500: boom"),
        RequestRecord(ok=True, ttft=0.1, chunk_times=[0.1], latency=0.2),   # no usage from the server
    ]
    m = compute(records, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 2)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 8)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(19.0)
    # TTFT 0.1 and 0.3 s; linear interpolation between order statistics
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    # ITL pooled over requests: 0.1, 0.2 (first) and 0.3 (second)
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["p90_itl_ms"] == pytest.approx(280.0)
    # TPOT (latency - ttft) / (tokens - 1): 0.4/4 and 0.4/2
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["median_tpot_ms"] == pytest.approx(150.0)
    assert m["mean_e2el_ms"] == pytest.approx(600.0)
    assert m["p99_e2el_ms"] == pytest.approx(698.0)
    # per request: 5 / 0.5 and 3 / 0.7 tokens per second
    assert m["mean_request_output_throughput_tok_s"] == pytest.approx((10 + 3 / 0.7) / 2)
    assert m["errors"] == {"HTTP 500: boom": 1, "server sent no usage (token counts unknown)": 1}


def test_single_token_answers_have_no_tpot_and_empty_answers_no_ttft():
    records = [done(0.2, [0.2], 0.2, completion=1, prompt=4),
               RequestRecord(ok=True, latency=0.3, completion_tokens=2, prompt_tokens=4, total_tokens=6,
                             finish_reason="stop")]   # tokens that decoded to no text
    m = compute(records, duration_s=1.0)
    assert m["completed"] == 2 and m["total_output_tokens"] == 3
    assert m["mean_tpot_ms"] is None
    assert m["mean_ttft_ms"] == pytest.approx(200.0)   # only the request with a first chunk
    assert m["mean_itl_ms"] is None


def test_all_failed_level():
    m = compute([RequestRecord(ok=False, error="timed out after 5 s")] * 3, duration_s=5.0)
    assert (m["completed"], m["failed"]) == (0, 3)
    assert m["output_throughput"] == 0.0 and m["request_throughput"] == 0.0
    assert m["median_ttft_ms"] is None and m["p99_e2el_ms"] is None
    assert m["errors"] == {"timed out after 5 s": 3}


def test_zero_duration_gives_no_rates():
    m = compute([], duration_s=0.0)
    assert m["request_throughput"] is None and m["completed"] == 0


def test_percentile_matches_numpy_linear():
    numpy = pytest.importorskip("numpy")
    rng = random.Random(7)
    for size in (1, 2, 5, 100):
        values = [rng.random() for _ in range(size)]
        for q in (50, 90, 99):
            assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))
    assert percentile([], 50) is None

"""The metric arithmetic on recorded token timings (no server)."""
from __future__ import annotations

import random

import pytest

from toolkit.bench.metrics import compute, percentile
from toolkit.check.client import RequestRecord


def done(ttft, arrivals, latency, completion, prompt, events=None, chars=None):
    return RequestRecord(ok=True, ttft=ttft, arrivals=arrivals, latency=latency,
                         arrival_chars=chars or [4] * len(arrivals),
                         completion_tokens=completion, prompt_tokens=prompt,
                         total_tokens=completion + prompt, finish_reason="length",
                         chunks=events or len(arrivals))


def test_metrics_from_recorded_timings():
    records = [
        done(0.1, [0.1, 0.2, 0.4], 0.5, completion=5, prompt=10),
        done(0.3, [0.3, 0.6], 0.7, completion=3, prompt=20),
        RequestRecord(ok=False, error="HTTP 500: boom"),
        RequestRecord(ok=True, ttft=0.1, arrivals=[0.1], arrival_chars=[3], latency=0.2),   # no usage
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
    # what was sent, by the server's count: prompts of 10 and 20 tokens
    assert m["mean_input_tokens"] == pytest.approx(15.0) and m["mean_output_tokens"] == pytest.approx(4.0)
    assert m["mean_arrivals_per_request"] == pytest.approx(2.5)
    assert m["mean_tokens_per_arrival"] == pytest.approx(8 / 5)
    assert m["coalesced_event_share"] == 0.0 and m["held_back_streams"] == 0


def test_stream_shape_metrics_count_events_that_arrived_together_and_held_back_streams():
    records = [
        # 8 events in 3 reads: 5 events came along with another
        done(0.1, [0.1, 0.2, 0.3], 0.3, completion=8, prompt=5, events=8, chars=[4, 16, 12]),
        # 40 tokens: the first token, then everything else in one read at the end
        done(0.05, [0.05, 0.9], 0.9, completion=40, prompt=5, events=2, chars=[3, 157]),
        # a short answer in one read is not a held-back stream: nothing to stream
        done(0.05, [0.05], 0.05, completion=3, prompt=5, events=1, chars=[12]),
    ]
    m = compute(records, duration_s=1.0)
    assert m["mean_events_per_request"] == pytest.approx(11 / 3)
    assert m["mean_arrivals_per_request"] == pytest.approx(2.0)
    assert m["coalesced_event_share"] == pytest.approx((11 - 6) / 11)
    assert m["mean_tokens_per_arrival"] == pytest.approx(51 / 6)
    assert m["held_back_streams"] == 1
    # ITL pools the gaps between arrivals only: 0.1, 0.1 and the held-back stream's 0.85
    assert m["p99_itl_ms"] == pytest.approx(100.0 + 750.0 * 0.98)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert "held back" in records[1].stream_shape() and "held back" not in records[0].stream_shape()
    assert m["held_back_replacement_share"] == 0.0  # no answer text recorded here: nothing undecodable


def test_held_back_streams_say_whether_invalid_utf8_explains_them():
    # random-weight output: byte tokens that do not form UTF-8 come out as U+FFFD
    garbled = done(0.05, [0.05, 0.9], 0.9, completion=40, prompt=5, events=2, chars=[1, 19])
    garbled.text = "ab\ufffd\ufffdcd\ufffd" + "x" * 13
    # ASCII text held back all the same: something other than the detokenizer's UTF-8 rule
    ascii_held = done(0.05, [0.05, 0.9], 0.9, completion=40, prompt=5, events=2, chars=[1, 19])
    ascii_held.text = "<t5><t9>" * 2 + "abcd"
    assert "3 of 20 characters are U+FFFD" in garbled.stream_shape()
    assert "valid UTF-8, so not" in ascii_held.stream_shape()
    assert compute([garbled], 1.0)["held_back_replacement_share"] == pytest.approx(3 / 20)
    assert compute([ascii_held], 1.0)["held_back_replacement_share"] == 0.0
    assert compute([garbled, ascii_held], 1.0)["held_back_replacement_share"] == pytest.approx(3 / 40)
    streamed = done(0.1, [0.1, 0.2, 0.3], 0.3, completion=8, prompt=5, chars=[4, 4, 4])
    assert compute([streamed], 1.0)["held_back_replacement_share"] is None  # nothing held back


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

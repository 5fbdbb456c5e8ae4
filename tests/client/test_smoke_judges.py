"""The smoke test's verdicts (toolkit/check/smoke.py judge_*), from request records written out here: no
server, no sockets. The real runs against `transformers serve` and the fake OpenAI server are
tests/client/test_smoke.py."""
from __future__ import annotations

import pytest

from toolkit.check.client import RequestRecord
from toolkit.check.smoke import (CheckFailed, GapReport, judge_burst, judge_burst_records, judge_log, judge_stream,
                           STALL_FLOOR_S)


def streamed(tokens=128, pieces=32, step=0.02) -> RequestRecord:
    """A stream whose content came in `pieces` arrivals, `step` seconds apart."""
    return RequestRecord(ok=True, completion_tokens=tokens, headers_at=0.0, first_event=0.001,
                         arrivals=[0.05 + i * step for i in range(pieces)], arrival_chars=[4] * pieces,
                         chunks=pieces, saw_done=True, text="x" * 4 * pieces)


def held_back(silence=1.0) -> RequestRecord:
    """All the content in one arrival after `silence` seconds of nothing."""
    return RequestRecord(ok=True, completion_tokens=128, headers_at=0.0, first_event=0.0, arrivals=[silence],
                         arrival_chars=[512], chunks=128, saw_done=True, text="y" * 512)


def test_a_stream_in_pieces_passes():
    text = judge_stream(streamed(), "128 tokens", loop_longest_s=0.0)
    assert "128 tokens in 32 content event(s), 32 arrival(s)" in text and "[DONE] seen" in text


def test_a_stream_held_back_fails():
    with pytest.raises(CheckFailed, match="not streamed: .*the stream was held back"):
        judge_stream(held_back(1.0), "", loop_longest_s=0.0)


def test_a_hold_this_machine_caused_is_not_judged():
    """The client's own event loop stalled for at least half of the hold: the server is not to blame."""
    text = judge_stream(held_back(1.0), "", loop_longest_s=0.6)
    assert "not judged: this machine kept the client from reading for 600 ms" in text
    with pytest.raises(CheckFailed):
        judge_stream(held_back(1.0), "", loop_longest_s=0.4)


def test_a_missing_done_is_tolerated():
    record = streamed()
    record.saw_done = False
    assert "no [DONE] (tolerated)" in judge_stream(record, "", 0.0)


def test_burst_records_must_all_complete_with_usage():
    judge_burst_records([streamed(), streamed()])
    failed = RequestRecord(ok=False, error="HTTP 500: boom")
    with pytest.raises(CheckFailed, match="1/3 failed; first: HTTP 500: boom"):
        judge_burst_records([streamed(), failed, streamed()])
    no_usage = streamed(tokens=None)
    with pytest.raises(CheckFailed, match="1/2 streams carried no usage"):
        judge_burst_records([streamed(), no_usage])


def gaps(longest, median=0.02, count=40) -> GapReport:
    return GapReport(gaps=count, longest_s=longest, median_s=median, stream=1, arrival=5, arrivals=32, at_s=0.5)


def test_a_burst_within_the_bound_passes_and_one_over_it_is_a_stall():
    records = [streamed(tokens=64), streamed(tokens=64)]
    text = judge_burst(records, 1.5, gaps(0.1), {})
    assert text.startswith("2 concurrent streams ok, 128 tokens in 1.50 s; longest gap 100 ms")
    with pytest.raises(CheckFailed, match="stalled: .*over the bound"):
        judge_burst(records, 1.5, gaps(STALL_FLOOR_S + 0.5), {})


def test_a_long_gap_is_not_a_stall_with_too_few_gaps_or_when_the_client_stalled():
    records = [streamed(tokens=64)]
    assert "too few gaps to judge a stall" in judge_burst(records, 1.0, gaps(10.0, count=3), {})
    busy = gaps(10.0)
    busy.client_stall_s = 6.0
    assert "not judged: this machine kept the client from running" in judge_burst(records, 1.0, busy, {})


def test_the_log_judge_names_the_problems_and_skips_known_harmless_lines():
    clean = "INFO started\nINFO ready\n"
    assert judge_log(clean) == "2 lines clean"
    bad = clean + "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom\n"
    with pytest.raises(CheckFailed, match="1 problem\\(s\\): .*ValueError: boom"):
        judge_log(bad)
    assert judge_log(bad, allow=((r"ValueError: boom", "expected here"),)) == "5 lines clean, 1 known-harmless skipped"

"""The client and the level runner against the fake server: the quirks and faults on demand."""
from __future__ import annotations

import asyncio
import errno

import aiohttp
import pytest

from toolkit.bench.metrics import compute
from toolkit.bench.prompts import BenchRequest, PromptSource
from toolkit.bench.runner import run_level
from toolkit.check.client import HELD_BACK_MIN_SILENCE, OpenAIClient, RequestRecord, _stale_connection


def chat(base_url, content="hello", **kwargs):
    async def go():
        async with OpenAIClient(base_url) as client:
            record = await client.chat([{"role": "user", "content": content}], **kwargs)
            return record, client
    return asyncio.run(go())


def test_stream_with_and_without_done(fake_server):
    server = fake_server(chunks=5, delay=0.02)
    with_done, _ = chat(server.base_url, max_tokens=5)
    without, _ = chat(server.base_url, "mode:no-done", max_tokens=5)
    for record in (with_done, without):
        assert record.ok, record.error
        assert record.chunks == 5 and record.completion_tokens == 5 and record.finish_reason == "length"
        # 5 writes 20 ms apart: up to 5 arrivals (a busy client may read two writes at once)
        assert 1 <= len(record.arrivals) <= 5 and sum(record.arrival_chars) == len("tok " * 5)
        assert len(record.itl) == len(record.arrivals) - 1 and record.ttft <= record.latency
        assert record.text == "tok " * 5
    assert with_done.saw_done and not without.saw_done
    assert server.requests[0]["stream_options"] == {"include_usage": True}


def test_events_written_together_are_one_arrival_and_no_zero_gap(fake_server):
    # 12 one-token events, written 4 at a time 30 ms apart: a streaming user sees (up to) 3
    # updates; the 4 events of one write always come in one arrival
    server = fake_server(chunks=12, group=4, delay=0.03)
    record, _ = chat(server.base_url, max_tokens=12)
    assert record.ok, record.error
    assert record.chunks == 12 and sum(record.arrival_chars) == 48
    assert 1 <= len(record.arrivals) <= 3 and all(chars % 16 == 0 for chars in record.arrival_chars)
    assert len(record.itl) == len(record.arrivals) - 1     # not 11 gaps of microseconds
    m = compute([record], duration_s=record.latency)
    assert m["coalesced_event_share"] == pytest.approx(9 / 12)
    assert m["mean_tokens_per_arrival"] == pytest.approx(4.0)
    assert m["held_back_streams"] == 0 and not record.held_back


def test_a_held_back_stream_is_visible_as_one_piece(fake_server):
    # the first token, then the other 39 made 20 ms apart but written in one piece at the end
    # (what the EAGLE servers did): 780 ms of silence, then 97% of the text
    server = fake_server(chunks=40, delay=0.02, mode="held")
    record, _ = chat(server.base_url, max_tokens=40)
    assert record.ok and record.chunks == 40 and len(record.arrivals) <= 2
    assert record.one_piece and record.held_back
    # the client sees the silence less however late it read the first token
    assert record.silence_before_largest > HELD_BACK_MIN_SILENCE
    assert "40 tokens in 40 content event(s), 2 arrival(s)" in record.stream_shape()
    assert "ms of silence before it: the stream was held back" in record.stream_shape()
    assert compute([record], duration_s=1.0)["held_back_streams"] == 1
    # the same answer streamed token by token is not held back
    streamed, _ = chat(fake_server(chunks=40, delay=0.02).base_url, max_tokens=40)
    assert len(streamed.arrivals) > 2 and not streamed.one_piece and not streamed.held_back


def test_an_answer_made_faster_than_a_read_is_one_piece_but_not_held_back(fake_server):
    # a fast server: the whole answer made and written within one read of the client
    server = fake_server(chunks=40, delay=0.0, mode="buffered")
    record, _ = chat(server.base_url, max_tokens=40)
    assert record.ok and len(record.arrivals) == 1 and record.one_piece
    assert not record.held_back
    assert "too fast to tell" in record.stream_shape()
    assert compute([record], duration_s=1.0)["held_back_streams"] == 0


def test_a_whole_answer_sent_at_the_end_is_held_back(fake_server):
    # nothing but the headers until the end, then all 40 events in one piece
    server = fake_server(chunks=40, delay=0.02, mode="buffered")
    record, _ = chat(server.base_url, max_tokens=40)
    assert record.ok and len(record.arrivals) == 1 and record.held_back
    assert record.headers_at is not None and record.arrivals[0] - record.headers_at > HELD_BACK_MIN_SILENCE


def test_the_servers_own_event_times_decide_where_they_are_exact(fake_server):
    # exact stamps: the server says it made the 39 held events over 39 x 20 ms at least
    held, _ = chat(fake_server(chunks=40, delay=0.02, mode="held", stamps="float").base_url, max_tokens=40)
    seconds, exact = held.server_production
    assert exact and seconds >= 0.78 and held.held_back
    assert "per the server's event times" in held.stream_shape()
    # whole-second stamps within one second say nothing: the client's silence decides
    coarse, _ = chat(fake_server(chunks=40, delay=0.02, mode="held").base_url, max_tokens=40)
    assert coarse.server_production in (None, (0.0, False))
    assert coarse.held_back and "of silence before it" in coarse.stream_shape()
    # exact stamps of a server that made the answer at once outweigh a long wait before it
    # (e.g. a queue or a prefill): nothing was held back
    fast = RequestRecord(ok=True, completion_tokens=40, arrivals=[0.9], arrival_chars=[160],
                         arrival_created=[(1000.25, 1000.26)])
    assert fast.one_piece and fast.silence_before_largest == pytest.approx(0.9)
    assert fast.server_production == pytest.approx((0.01, True)) and not fast.held_back


def test_several_tokens_per_event_count_by_usage(fake_server):
    server = fake_server(chunks=4, tokens_per_chunk=3, delay=0.05)
    record, _ = chat(server.base_url, max_tokens=4)
    assert record.ok and record.chunks == 4 and record.completion_tokens == 12
    m = compute([record], duration_s=record.latency)
    assert m["mean_tokens_per_arrival"] >= 3.0     # 3 a write; a busy client may read two at once
    # TPOT spreads the decode over tokens (3 per 50 ms); ITL is the gap the user sees (50 ms; a
    # client that reads a write late shortens the next gap, so no exact figure)
    assert m["median_itl_ms"] >= 15.0 and m["median_tpot_ms"] < m["median_itl_ms"] / 2


def test_stream_cut_or_ending_without_finish_is_a_failure(fake_server):
    server = fake_server(chunks=5)
    broken, _ = chat(server.base_url, "mode:break", max_tokens=5)
    assert not broken.ok and "stream broke after 2 chunk(s)" in broken.error
    truncated, _ = chat(server.base_url, "mode:truncated", max_tokens=5)
    assert not truncated.ok and "without finish_reason or [DONE]" in truncated.error


def test_http_error_is_a_failed_record_not_an_exception(fake_server):
    server = fake_server()
    record, _ = chat(server.base_url, "mode:error500")
    assert not record.ok and record.status_code == 500 and "HTTP 500" in record.error
    plain, _ = chat(server.base_url, "mode:error500", stream=False)
    assert not plain.ok and "HTTP 500" in plain.error


def test_rejected_fields_are_dropped_and_remembered(fake_server):
    server = fake_server(strict=True, chunks=3)

    async def go():
        async with OpenAIClient(server.base_url) as client:
            first = await client.chat([{"role": "user", "content": "a"}], max_tokens=3,
                                      extra={"ignore_eos": True, "top_k": 1})
            second = await client.chat([{"role": "user", "content": "b"}], max_tokens=3,
                                       extra={"ignore_eos": True, "top_k": 1})
            return first, second, client.rejected_fields
    first, second, rejected = asyncio.run(go())
    assert first.ok and second.ok
    assert rejected == {"ignore_eos", "top_k"}
    assert first.dropped_fields == ["ignore_eos", "top_k"]
    sent = [set(r) & {"ignore_eos", "top_k"} for r in server.requests if "messages" in r]
    # first request: with the fields (422), again without; second request: without at once
    assert sent == [{"ignore_eos", "top_k"}, set(), set()]


def test_unreachable_server_is_a_failed_record():
    record, _ = chat("http://127.0.0.1:9", max_tokens=3)
    assert not record.ok and record.error


def test_level_keeps_the_in_flight_count_and_counts_failures(fake_server):
    # 0.2 s a request: the four workers' requests overlap even when a busy client sends them late
    server = fake_server(chunks=4, delay=0.05)
    requests = [BenchRequest([{"role": "user", "content": "mode:break" if i % 5 == 0 else f"q{i}"}], 4)
                for i in range(20)]
    level = run_level(server.base_url, requests, 4)
    assert server.max_in_flight == 4
    assert len(level.records) == 20 and not level.stopped_early
    m = compute(level.records, level.duration_s)
    assert (m["completed"], m["failed"]) == (16, 4)
    assert m["total_output_tokens"] == 16 * 4
    assert list(m["errors"].values()) == [4]


def test_level_time_bound_stops_new_requests(fake_server):
    server = fake_server(chunks=4, delay=0.25)   # 1 s a request: 25 s for the 50 at c=2
    requests = PromptSource().requests(50, seed=1)
    level = run_level(server.base_url, requests, 2, max_seconds=2.0)
    assert level.stopped_early
    assert 2 <= len(level.records) < 50
    assert all(r.ok for r in level.records)


def test_prompt_order_repeats_with_the_seed():
    source = PromptSource()
    assert [r.messages for r in source.requests(30, 3)] == [r.messages for r in source.requests(30, 3)]
    assert [r.messages for r in source.requests(30, 3)] != [r.messages for r in source.requests(30, 4)]
    synthetic = PromptSource(dataset="synthetic", input_len=64, output_len=16)
    requests = synthetic.requests(3, 0)
    assert all(r.extra == {"ignore_eos": True} and r.max_tokens == 16 for r in requests)


def test_connections_are_kept_alive_and_stale_ones_replaced(fake_server):
    async def sequential(base_url, count):
        async with OpenAIClient(base_url) as client:
            return [await client.chat([{"role": "user", "content": f"q{i}"}], max_tokens=3, stream=i % 2 == 0)
                    for i in range(count)]

    steady = fake_server(chunks=3)
    records = asyncio.run(sequential(steady.base_url, 10))
    assert all(r.ok for r in records)
    assert steady.connections == 1          # models + 10 chats on one keep-alive connection
    # A server that closes idle connections without saying so: the client retries on a new one.
    closing = fake_server(chunks=3, close_idle=True)
    records = asyncio.run(sequential(closing.base_url, 6))
    assert all(r.ok for r in records), [r.error for r in records]
    assert closing.connections == 7


def test_request_timeout_is_a_failed_record(fake_server):
    slow = fake_server(chunks=5, delay=1.0)

    async def go():
        async with OpenAIClient(slow.base_url, timeout=1.5) as client:
            return await client.chat([{"role": "user", "content": "slow"}], max_tokens=5)
    record = asyncio.run(go())
    assert not record.ok and record.error.startswith("timed out after 2 s")


def test_only_a_close_or_reset_of_a_kept_alive_connection_is_retried():
    reset = aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer")
    assert _stale_connection(reset) and _stale_connection(aiohttp.ServerDisconnectedError())
    assert not _stale_connection(aiohttp.ClientOSError(errno.ETIMEDOUT, "timed out"))
    refused = aiohttp.ClientConnectorError(None, OSError(errno.ECONNREFUSED, "refused"))
    assert not _stale_connection(refused)
    # the body written onto a transport the server had closed: no errno, a reset as its cause
    unwritten = aiohttp.ClientOSError(None, "Can not write request body for http://127.0.0.1:1/v1/chat/completions")
    assert not _stale_connection(unwritten)
    unwritten.__cause__ = aiohttp.ClientConnectionResetError("Cannot write to closing transport")
    assert _stale_connection(unwritten)

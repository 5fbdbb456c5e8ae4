"""`invoke smoke`'s engine against the real CPU server, a killed one, and logs with problems.

The chat checks ask for fewer tokens than the command's 200 (CHAT_MAX_TOKENS): the reference
model always runs to max_tokens, and 200 tokens one at a time take ~10 s on a busy 2-core box.
"""
from __future__ import annotations

from toolkit.smoke import CHECK_NAMES, burst_size, run_smoke, scan_log

SHORT = 32

HARMLESS_SGLANG = """[2026-11-29 08:00:01] INFO server_args=ServerArgs(...)
[2026-11-29 08:00:09] Can not initialize OpenAIServingResponses, error: Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/http_server.py", line 370, in lifespan
    from sglang.srt.entrypoints.openai.serving_responses import OpenAIServingResponses
  File "/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/openai/serving_responses.py", line 20, in <module>
    from openai_harmony import Message
ModuleNotFoundError: No module named 'openai_harmony'

[2026-11-29 08:00:10] INFO:     Application startup complete.
"""

REAL_CRASH = """INFO:     127.0.0.1:5000 - "POST /v1/chat/completions HTTP/1.1" 200 OK
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/sglang/srt/managers/scheduler.py", line 2400, in event_loop
    self.run_batch(batch)
RuntimeError: CUDA error: an illegal memory access was encountered
INFO:     127.0.0.1:5000 - "GET /health HTTP/1.1" 200 OK
"""


def test_burst_size_crosses_the_threshold():
    assert burst_size(5) == 12
    assert burst_size(None) == 8


def test_log_scan_excuses_known_harmless_and_finds_real_problems():
    problems, excused = scan_log(HARMLESS_SGLANG)
    assert problems == [] and len(excused) == 1
    problems, _ = scan_log(HARMLESS_SGLANG + REAL_CRASH)
    assert len(problems) == 1
    assert "RuntimeError: CUDA error" in problems[0].summary()
    assert problems[0].line_number == HARMLESS_SGLANG.count("\n") + 2
    single, _ = scan_log("[2026-11-29 08:00:00 TP3] ERROR scheduler: watchdog timeout\nINFO fine\n")
    assert [p.line_number for p in single] == [1]
    clean, _ = scan_log("INFO: 422 Unprocessable Entity\nWARNING: errors=0 in the last window\n")
    assert clean == []


def test_smoke_passes_against_the_real_cpu_server(cpu_server):
    result = run_smoke(cpu_server.base_url, read_log=cpu_server.read_log, burst=burst_size(3),
                       chat_max_tokens=SHORT)
    by_name = {check.name: check for check in result.checks}
    assert [check.name for check in result.checks] == list(CHECK_NAMES)
    assert result.ok, [(c.name, c.detail) for c in result.checks if c.status != "pass"]
    assert all(check.status == "pass" for check in result.checks)
    assert "8 concurrent streams ok" in by_name["burst"].detail
    # the CPU server computes a repeated prompt exactly as the first time: three equal answers
    assert by_name["determinism"].detail.endswith("characters three times")
    assert "no [DONE] (tolerated)" in by_name["stream"].detail
    # transformers serve sends one token per event: as many events as tokens, over a span
    assert f"{SHORT} tokens in {SHORT} content event(s)" in by_name["stream"].detail
    assert "held back" not in by_name["stream"].detail
    # transformers serve rejects ignore_eos with HTTP 422; the burst went through without it
    assert result.rejected_fields == ["ignore_eos"]


def test_a_traceback_in_the_log_fails_the_log_check(cpu_server):
    result = run_smoke(cpu_server.base_url, read_log=lambda: cpu_server.read_log() + REAL_CRASH, burst=2,
                       chat_max_tokens=SHORT)
    by_name = {check.name: check for check in result.checks}
    assert not result.ok
    assert by_name["log"].status == "fail"
    assert "RuntimeError: CUDA error" in by_name["log"].detail
    assert all(check.status == "pass" for check in result.checks if check.name != "log")


def test_server_killed_mid_smoke_fails_named_checks(fresh_cpu_server):
    def kill_before_burst(name):
        if name == "burst":
            fresh_cpu_server.kill()

    result = run_smoke(fresh_cpu_server.base_url, read_log=fresh_cpu_server.read_log, burst=4,
                       on_check=kill_before_burst, request_timeout=30, chat_max_tokens=SHORT)
    status = {check.name: check.status for check in result.checks}
    assert status["models"] == status["chat"] == status["stream"] == "pass"
    assert status["burst"] == "fail" and status["health"] == "fail"
    burst = next(check for check in result.checks if check.name == "burst")
    assert "4/4 failed" in burst.detail and "Connect" in burst.detail
    assert not result.ok


def test_a_stream_held_back_until_the_end_fails_the_stream_check(fake_server):
    # the first token, then the other 31 in one piece (what the speculative SGLang servers sent)
    held = fake_server(chunks=SHORT, delay=0.005, mode="held")
    result = run_smoke(held.base_url, burst=2, chat_max_tokens=SHORT)
    stream = next(check for check in result.checks if check.name == "stream")
    assert stream.status == "fail" and not result.ok
    assert stream.detail.startswith("not streamed: first content at ")
    assert f"{SHORT} tokens in {SHORT} content event(s), 2 arrival(s)" in stream.detail
    assert "held back and reached the client in one piece" in stream.detail
    # its text is plain ASCII: the detail rules out the server's wait for complete UTF-8 characters
    assert "valid UTF-8, so not the server's hold-back of partial characters" in stream.detail
    # events written in groups of 4 still stream: 8 arrivals over time, the check passes
    grouped = fake_server(chunks=SHORT, delay=0.005, group=4)
    result = run_smoke(grouped.base_url, burst=2, chat_max_tokens=SHORT)
    stream = next(check for check in result.checks if check.name == "stream")
    assert stream.status == "pass", stream.detail
    assert f"{SHORT} tokens in {SHORT} content event(s), 8 arrival(s)" in stream.detail


def _determinism(result):
    return next(check for check in result.checks if check.name == "determinism")


def test_a_first_answer_that_parts_from_the_cached_repeats_is_reported_not_failed(fake_server):
    # what SGLang's prefix cache did on the GPU: the first answer parts from the later two,
    # which match each other
    words = [f"w{i}" for i in range(SHORT)]
    cold = " ".join(words[:20] + ["other"] * (SHORT - 20))
    server = fake_server(chunks=SHORT, delay=0.003, answer=lambda n: cold if n == 0 else " ".join(words))
    result = run_smoke(server.base_url, burst=2, chat_max_tokens=SHORT)
    check = _determinism(result)
    assert check.status == "pass", check.detail
    split = len(" ".join(words[:20])) + 1
    assert check.detail.startswith(f"same {len(' '.join(words))} characters twice; the first answer")
    assert f"parts from them at character {split}" in check.detail
    assert "'other other" in check.detail and "'w20 w21" in check.detail
    assert len(server.requests) >= 3


def test_repeats_that_differ_fail_the_determinism_check(fake_server):
    # a server that changes outputs (the noisy greedy sampler of gpu/smoke_determinism.sh):
    # every answer differs; the first 5 words are common to all of them
    server = fake_server(chunks=SHORT, delay=0.003, answer=lambda n: " ".join(["same"] * 5 + [chr(ord("p") + n) * 2] * (SHORT - 5)))
    result = run_smoke(server.base_url, burst=2, chat_max_tokens=SHORT)
    check = _determinism(result)
    assert check.status == "fail" and not result.ok
    assert check.detail.startswith("the same request twice in a row (prompt cached both times) "
                                   "gave different text at temperature 0, from character 25 on: 'qq qq")
    assert "vs 'rr rr" in check.detail
    # only the one check fails
    assert [c.name for c in result.checks if c.status == "fail"] == ["determinism"]

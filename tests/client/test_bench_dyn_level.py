"""Bench records say how much of each level ran without drafting: the dyn-disable switch read
before and after the level from the fake SGLang server's /metrics (SGLang 0.5.11's real body with the
counters set, tests/client/sglang_metrics.py) or its /server_info, whose counters move with the requests."""
from __future__ import annotations

from toolkit.bench.prompts import PromptSource
from toolkit.bench.runner import BenchOptions, RunningServer, run_sweep

from .fake_openai import FakeOpenAI
from .sglang_info import server_info
from .sglang_metrics import metrics_text

WARMUP = 1


def counters(server: FakeOpenAI) -> dict:
    """Every chat request the fake served is one speculative and three plain steps; every second
    one a switch off and back on."""
    n = len(server.requests)
    return {"threshold": 8, "hysteresis": 2, "speculating": n % 2 == 0, "spec_steps": n, "plain_steps": 3 * n,
            "forced_spec_steps": 0, "switches_off": (n + 1) // 2, "switches_on": n // 2}


def sweep(server: FakeOpenAI, requests: int = 4) -> list[dict]:
    options = BenchOptions(concurrency=[1, 2], requests=requests, warmup=WARMUP, prompts=PromptSource(output_len=4))
    records: list[dict] = []
    result = run_sweep(["eagle3-v2-dyn"], options, RunningServer(server.base_url), on_level=records.append)
    assert not result.errors, result.errors
    return records


def test_switches_and_plain_step_share_per_level_from_metrics():
    server = FakeOpenAI(chunks=4)
    server.metrics = lambda: metrics_text(running=1, dyn=counters(server), tp_ranks=(0, 1))
    with server:
        records = sweep(server)
    served_before = WARMUP
    for record in records:
        level = record["dyn_disable_level"]
        assert level["source"] == "metrics"
        assert level["before"]["spec_steps"] == served_before
        served_after = served_before + record["requests"]
        assert level["after"]["plain_steps"] == 3 * served_after
        assert (level["spec_steps"], level["plain_steps"]) == (record["requests"], 3 * record["requests"])
        assert level["plain_step_share"] == 0.75
        assert level["switches_off"] == (served_after + 1) // 2 - (served_before + 1) // 2
        assert level["switches_on"] == served_after // 2 - served_before // 2
        served_before = served_after


def test_server_info_when_the_server_exports_no_metrics():
    server = FakeOpenAI(chunks=4)
    server.server_info = lambda: server_info({}, accept_length=2.0, dyn=counters(server))
    with server:
        records = sweep(server, requests=3)
    level = records[0]["dyn_disable_level"]
    assert level["source"] == "server_info" and level["spec_steps"] == 3 and level["switches_off"] == 1


def test_no_entry_where_the_server_has_no_switch():
    with FakeOpenAI(chunks=4, metrics=lambda: metrics_text(running=1)) as server:
        records = sweep(server)
    assert records and all("dyn_disable_level" not in r for r in records)


def test_a_restart_during_the_level_keeps_the_readings_but_no_change():
    server = FakeOpenAI(chunks=4)
    # counters that fall back as a restarted server's do
    server.metrics = lambda: metrics_text(dyn={**counters(server), "plain_steps": 100 - len(server.requests)})
    with server:
        records = sweep(server)
    level = records[0]["dyn_disable_level"]
    assert level["before"]["plain_steps"] > level["after"]["plain_steps"]
    assert "plain_step_share" not in level and "switches_off" not in level

"""Reading SGLang's /metrics (toolkit/server/scrape.py) on the body SGLang 0.5.11 served on the H200 run
(docs/evidence/metrics/metrics-final.txt, as it came and with values set: tests/client/
sglang_metrics.py), and the shapes bench and watch take from it."""
from __future__ import annotations

import json

import pytest

from toolkit.server import scrape
from toolkit.patch import wheels

from .sglang_info import server_info
from .sglang_metrics import CAPTURE, READ, capture, metrics_text

DYN = {"threshold": 8, "hysteresis": 2, "speculating": False, "since": 1_767_000_000, "spec_steps": 10,
       "plain_steps": 30, "forced_spec_steps": 1, "switches_off": 2, "switches_on": 1}


def test_the_h200_body_as_it_came():
    """The switch, the serving gauges and counters of the real body; the counters agree with the
    /server_info the run read at the same time (check.json)."""
    values = scrape.parse(capture())
    check = json.loads((CAPTURE.parent / "check.json").read_text())
    state = scrape.Snapshot(0, values).dyn_state()
    assert {k: v for k, v in state.items() if k != "since"} == {
        k: v for k, v in check["server_info"].items() if k != "since"}
    assert state["switches_off"] == check["log"]["stopped_lines"] and state["since"] == pytest.approx(1796165466.49)
    snapshot = scrape.Snapshot(0, values)
    assert (snapshot.running, snapshot.queued, snapshot.token_usage) == (1, 0, 0)
    assert snapshot.accept_length == 1.0         # the random-weight sharp pair: no draft accepted
    assert snapshot.gen_throughput == pytest.approx(151.31, abs=0.01)
    assert values[scrape.GENERATION_TOKENS] == 31848
    assert values['sglang:cuda_graph_passes_total{mode="decode_cuda_graph"}'] == 4169
    assert values["sglang:time_to_first_token_seconds_count"] == 311
    assert values["sglang:num_retracted_reqs"] == 0          # its pid label is not part of the key
    assert not any(k.endswith(("_bucket", "_created")) for k in values)


def test_rank_0_only_and_set_values():
    values = scrape.parse(metrics_text(running=12, queued=3, token_usage=0.5, dyn=DYN, tp_ranks=(0, 1, 2)))
    assert values[scrape.RUNNING] == 12 and values[scrape.QUEUED] == 3      # rank 1 and 2 have x1000
    assert values[scrape.TOKEN_USAGE] == 0.5
    assert scrape.Snapshot(0, values).dyn_state() == DYN
    assert values['sglang:cuda_graph_passes_total{mode="decode_cuda_graph"}'] == 4169    # the capture's


def test_a_server_without_the_patch_has_no_switch():
    snapshot = scrape.Snapshot(0, scrape.parse(metrics_text(running=1)))
    assert snapshot.running == 1 and snapshot.dyn_state() is None


def test_not_prometheus_text():
    with pytest.raises(scrape.ScrapeError):
        scrape.parse("<html><body>Not Found</body></html>")


def test_server_info_gives_the_same_shape():
    info = server_info({}, dyn={k: v for k, v in DYN.items() if k != "since"})
    assert scrape.dyn_from_server_info(info) == {**DYN, "since": None}
    assert scrape.dyn_from_server_info(server_info({})) is None


def test_level_change():
    after = {**DYN, "spec_steps": 15, "plain_steps": 45, "switches_off": 4, "switches_on": 4}
    change = scrape.level_change(DYN, after)
    assert change == {"spec_steps": 5, "plain_steps": 15, "forced_spec_steps": 0, "switches_off": 2,
                      "switches_on": 3, "plain_step_share": 0.75}
    assert scrape.level_change(after, DYN) is None           # counters went down: a restart
    assert scrape.level_change(DYN, DYN)["plain_step_share"] is None


def test_the_names_read_are_sglang_s():
    """The SGLang metric names the readers read are in the 0.5.11 wheel's collector."""
    source = wheels.pristine("sglang", "0.5.11").read("sglang/srt/observability/metrics_collector.py").decode()
    assert set(READ) == {scrape.RUNNING, scrape.QUEUED, scrape.GEN_THROUGHPUT, scrape.TOKEN_USAGE,
                         scrape.ACCEPT_LENGTH, scrape.GENERATION_TOKENS}
    for name in [*READ, "sglang:cuda_graph_passes_total", "sglang:time_to_first_token_seconds"]:
        assert f'name="{name}"' in source, name

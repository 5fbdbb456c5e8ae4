"""Reading SGLang's /metrics (toolkit/scrape.py) on bodies written by prometheus_client the way
SGLang writes them (tests/client/sglang_metrics.py), and the shapes bench and watch take from it."""
from __future__ import annotations

import pytest

from toolkit import scrape, wheels

from .sglang_info import server_info
from .sglang_metrics import SCHEDULER_GAUGES, metrics_text

DYN = {"threshold": 8, "hysteresis": 2, "speculating": False, "since": 1_767_000_000, "spec_steps": 10,
       "plain_steps": 30, "forced_spec_steps": 1, "switches_off": 2, "switches_on": 1}


def test_rank_0_only_other_labels_in_the_key_and_no_buckets():
    values = scrape.parse(metrics_text(running=12, queued=3, token_usage=0.5, dyn=DYN, tp_ranks=(0, 1, 2)))
    assert values[scrape.RUNNING] == 12 and values[scrape.QUEUED] == 3      # rank 1 and 2 have x1000
    assert values['sglang:cuda_graph_passes_total{mode="decode_none"}'] == 1
    assert not any(k.endswith(("_bucket", "_created")) for k in values)
    assert values["sglang:time_to_first_token_seconds_count"] == 1
    assert scrape.Snapshot(0, values).dyn_state() == DYN


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


def test_fixture_names_are_sglang_s():
    """The SGLang metric names the fixture writes and the readers read are in the 0.5.11 wheel."""
    source = wheels.pristine("sglang", "0.5.11").read("sglang/srt/observability/metrics_collector.py").decode()
    for name in [*SCHEDULER_GAUGES, scrape.GENERATION_TOKENS, "sglang:cuda_graph_passes_total",
                 "sglang:time_to_first_token_seconds"]:
        assert f'name="{name}"' in source, name

"""The Grafana dashboard (dashboards/sglang-dyn-disable.json) and its PNG renderer, fed a synthetic
scrape written by the patched metrics code itself: the patch's SpecSwitch driven through load
bursts, exported by 0002's DynDisableMetrics with prometheus_client, read back from the
exposition text each simulated second, next to SGLang-shaped serving metrics."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.client.sglang_metrics import metrics_text
from toolkit.server import dashboard, scrape

from .conftest import PATCHSET, load_by_path, tree_with

T0 = 1_767_000_000.0
STEPS_PER_SECOND = 10


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    tree = tree_with(tmp_path_factory.mktemp("dash"), [PATCHSET / "0.5.11" / "0001-dyn-disable.patch",
                                                       PATCHSET / "0.5.11" / "0002-dyn-disable-metrics.patch"])
    speculative = tree / "sglang/srt/speculative"
    return (load_by_path("dyn_for_dashboard", speculative / "dyn_disable.py"),
            load_by_path("dyn_metrics_for_dashboard", speculative / "dyn_disable_metrics.py"))


def load_pattern(second: int) -> int:
    """Running requests: a burst to 20 for 20 s out of every 40 s, starting at 10 s."""
    return 20 if 10 <= second % 40 < 30 else 2


@pytest.fixture(scope="module")
def synthetic(modules, tmp_path_factory):
    dyn, metrics_mod = modules
    switch = dyn.SpecSwitch(dyn.DynDisableConfig(threshold=8, hysteresis=2))
    registry = CollectorRegistry()
    exported = metrics_mod.DynDisableMetrics(switch, {"model_name": "m", "tp_rank": 0}, registry=registry)
    path = tmp_path_factory.mktemp("scrape") / "scrape.jsonl"
    tokens, switch_times, token_history = 0, [], []
    for second in range(160):
        running = load_pattern(second)
        for _ in range(STEPS_PER_SECOND):
            if switch.decide(running):
                tokens += running * 3          # an accept length of 3 while drafting
            else:
                tokens += running
            if switch.last_switch:
                switch_times.append((second, switch.last_switch))
            exported.sync()
        values = scrape.parse(metrics_text(running=running, queued=0, gen_throughput=0.0, accept_length=3.0
                                           if switch.speculating else 1.0, generation_tokens=tokens))
        values.update(scrape.parse(generate_latest(registry).decode()))
        scrape.append_series(path, scrape.Snapshot(T0 + second, values))
        token_history.append(tokens)
    return path, switch, switch_times, token_history


def test_every_panel_has_a_recipe_reading_the_metrics_its_promql_reads():
    data = dashboard.load()
    titles = [p["title"] for p in data["panels"]]
    assert sorted(titles) == sorted(dashboard.RECIPES)
    for panel in data["panels"]:
        read = {name for t in panel["targets"] for name in re.findall(r"sglang:[a-z_:]+", t["expr"])}
        assert read == dashboard.RECIPES[panel["title"]][1], panel["title"]


def test_the_json_is_a_grafana_dashboard_model():
    data = json.loads(dashboard.DASHBOARD.read_text())
    assert data["uid"] and data["schemaVersion"] >= 30
    variables = {v["name"] for v in data["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    for panel in data["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
        assert all('instance=~"$instance"' in t["expr"] for t in panel["targets"])


def test_recipes_compute_what_the_simulation_did(synthetic):
    path, switch, switch_times, token_history = synthetic
    series = dashboard.Series(scrape.read_series(path))
    lines = {label: values for label, values, _ in dashboard._switches(series)}
    # switches in the trailing minute at second 159, against the simulation's own record
    expected_off = sum(1 for second, kind in switch_times if kind == "off" and 159 - 60 <= second <= 159)
    assert expected_off >= 1
    # the window starts at the first sample at or after t-60 s: switches at that very second fall before it
    in_window = sum(1 for second, kind in switch_times if kind == "off" and 159 - 60 < second <= 159)
    assert lines["off"][-1] == pytest.approx(in_window)     # a full minute of samples: per minute = count
    # younger than a minute: the switches since the start, per minute of samples (not the count)
    early = sum(1 for second, kind in switch_times if kind == "on" and 0 < second <= 35)
    assert early >= 1
    assert lines["on"][35] == pytest.approx(early / 35 * 60)
    share = dashboard._plain_share(series)[0][1]
    assert np.nanmax(share) <= 1 and np.nanmin(share) >= 0
    assert series(scrape.DYN_PREFIX + "plain_steps_total")[-1] == switch.plain_steps
    drafting = series(scrape.DYN_PREFIX + "drafting")
    assert drafting[5] == 1 and drafting[20] == 0      # before and inside the first burst
    tokens = dashboard._tokens(series)[0][1]
    assert tokens[100] == pytest.approx((token_history[100] - token_history[40]) / 60)   # the trailing minute
    assert tokens[20] == pytest.approx((token_history[20] - token_history[0]) / 20)   # younger than a minute


def test_increase_handles_a_counter_reset():
    snaps = [scrape.Snapshot(T0 + i, {"c_total": v}) for i, v in enumerate([0, 5, 10, 2, 4])]
    rise = dashboard.Series(snaps).increase("c_total", window=10)
    assert rise[-1] == 14          # 10 before the restart, then 2 and 2 more after it


def test_render_writes_a_png_of_every_panel(synthetic, tmp_path):
    path = synthetic[0]
    out = dashboard.render(path, tmp_path / "dash.png")
    head = out.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    assert width > 1000 and height > 600


def test_a_scrape_of_several_hosts_needs_one_named(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps({"t": T0 + i, "values": {scrape.RUNNING: i}, "host": h}) + "\n"
                            for i, h in enumerate(["a", "b", "a"])))
    with pytest.raises(scrape.ScrapeError, match="several hosts"):
        scrape.read_series(path)
    assert [s.running for s in scrape.read_series(path, host="a")] == [0, 2]


def test_invoke_server_dashboard(synthetic, tmp_path):
    from tests.helpers import invoke

    done = invoke("server", "dashboard", "--record", str(synthetic[0]), "--out", str(tmp_path / "d.png"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    missing = invoke("server", "dashboard", "--record", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "no such file" in missing.stderr

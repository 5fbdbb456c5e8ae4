"""`invoke server watch` against the sandbox sshd: the fake SGLang server (tests/server/fake_server.py
serving SGLang 0.5.11's real /metrics body with the test's values, its TP ranks as processes titled as SGLang's
schedulers) and the real CPU reference server (`transformers serve`); a rank that dies, a
server that dies mid-watch, Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.client.sglang_metrics import metrics_text
from tests.client.sglang_info import server_info
from tests.helpers import invoke
from toolkit.server import server
from toolkit.server.watch import HostWatch, poll_once

from .conftest import FAKE_SERVER, process_alive

DYN = {"threshold": 8, "hysteresis": 2, "speculating": False, "since": 1_700_000_000, "spec_steps": 900,
       "plain_steps": 340, "forced_spec_steps": 0, "switches_off": 7, "switches_on": 6}


@pytest.fixture
def sglang_like(fake_host, test_profiles, tmp_path):
    """A fake SGLang server at TP=2 with /metrics and /server_info from files the test rewrites."""
    metrics, info = tmp_path / "metrics.txt", tmp_path / "server_info.json"
    metrics.write_text(metrics_text(running=12, queued=3, gen_throughput=812.5, token_usage=0.41,
                                    accept_length=1.0, dyn=DYN, tp_ranks=(0, 1)))
    info.write_text(json.dumps(server_info({"tp_size": 2}, accept_length=2.4, dyn=DYN)))
    name = f"fake-sglang-{tmp_path.name}"
    (test_profiles / f"{name}.toml").write_text(
        f'summary = "test stand-in: fake SGLang"\nkind = "command"\ntp_size = 2\n'
        f'command = [{sys.executable!r}, "-u", {str(FAKE_SERVER)!r}, "{{bind}}", "{{port}}"]\n'
        f'flags = ["--tp", "2", "--scheduler-procs", "--metrics", {str(metrics)!r}, "--server-info", {str(info)!r}]\n'
        '[ready]\nendpoint = "/health"\n')
    state = server.start(fake_host, name, timeout=60)
    yield fake_host, state, metrics
    server.stop(fake_host, grace=5)


def test_a_row_from_sglang_metrics_then_a_rank_dies_then_the_server(sglang_like):
    host, state, metrics = sglang_like
    watch = HostWatch(host)
    try:
        view = watch.poll()
        assert view.state == "up", view.problem
        assert (view.profile, view.running, view.queued, view.gen_throughput) == (state.profile, 12, 3, 812.5)
        assert view.token_usage == pytest.approx(0.41) and view.source == "metrics"
        # SGLang's gauge over its last interval was 1.0 (no accepted draft: drafting off); shown as it is
        assert view.accept_length == 1.0
        assert view.dyn["speculating"] is False and view.dyn["since"] == DYN["since"]
        assert (view.dyn["switches_off"], view.dyn["switches_on"], view.dyn["plain_steps"]) == (7, 6, 340)
        assert view.ranks == {"0": "ok", "1": "ok"}

        metrics.write_text(metrics_text(running=2, dyn={**DYN, "speculating": True, "switches_on": 7},
                                        tp_ranks=(0, 1)))
        view = watch.poll()
        assert view.dyn["speculating"] is True and view.dyn["switches_on"] == 7 and view.running == 2

        rank1 = int(server.status(host).ranks["1"])
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_alive(host, rank1) and time.monotonic() < deadline:
            time.sleep(0.1)
        view = watch.poll()
        assert view.state == "up" and view.ranks == {"0": "ok", "1": "gone"}
        assert "TP1" in view.problem

        os.killpg(state.pid, signal.SIGKILL)     # the whole server dies mid-watch
        deadline = time.monotonic() + 10
        while process_alive(host, state.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        view = watch.poll()
        assert view.state == "down" and "gone" in view.problem and view.profile == state.profile
    finally:
        watch.close()
    server.stop(host, grace=1)
    [view] = poll_once([host])
    assert view.state == "no server"


def test_server_info_stands_in_where_there_are_no_metrics(sglang_like):
    host, state, metrics = sglang_like
    metrics.unlink()          # the fake then answers /metrics with an error, as a broken exporter would
    [view] = poll_once([host])
    assert view.state == "up" and view.source == "server_info" and "/metrics" in view.problem
    assert view.dyn["source"] == "server_info" and view.dyn["switches_off"] == 7
    assert view.accept_length == 2.4          # avg_spec_accept_length since start


def test_an_unreachable_host_is_a_row_not_a_traceback(fake_host):
    import dataclasses

    from tests.conftest import free_port
    gone = dataclasses.replace(fake_host, name="nowhere", port=free_port())   # nothing listens there
    [view] = poll_once([gone])
    assert view.state == "unreachable" and view.problem


@pytest.fixture
def cli(fake_host, sglang_like, tmp_path):
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(
        "[watched]\n"
        f'address = "127.0.0.1"\nport = {fake_host.port}\nuser = "{fake_host.user}"\n'
        f'key = "{fake_host.key}"\nknown_hosts = "{fake_host.known_hosts}"\n'
        f'state_dir = "{fake_host.state_dir}"\n')
    env = {"TOOLKIT_INVENTORY": str(inventory), "TOOLKIT_PROFILES": os.environ["TOOLKIT_PROFILES"]}

    def popen(*args: str) -> subprocess.Popen:
        return invoke("server", "watch", "--host", "watched", *args, env=env, columns=220, background=True)
    return popen


def test_once_json_for_scripts(cli, tmp_path):
    record = tmp_path / "scrape.jsonl"
    done = cli("--once", "--json", "--record", str(record))
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    [row] = json.loads(out)
    assert row["state"] == "up" and row["dyn"]["switches_off"] == 7 and row["ranks"] == {"0": "ok", "1": "ok"}
    [line] = [json.loads(x) for x in record.read_text().splitlines()]
    assert line["values"]["sglang:num_running_reqs"] == 12


def test_live_table_then_ctrl_c_leaves_cleanly(cli):
    table = cli("--polls", "2", "--interval", "0.2")
    out, err = table.communicate(timeout=120)
    assert table.returncode == 0, err
    assert "watched" in out and "off (>8)" in out and "7/6" in out and "2/2 ok" in out
    assert "watch ended after 2 poll(s)" in err

    live = cli("--json", "--interval", "0.2")
    first = live.stdout.readline()               # one JSON line per poll
    assert json.loads(first)[0]["state"] == "up"
    live.send_signal(signal.SIGINT)
    out, err = live.communicate(timeout=120)
    assert live.returncode == 0, err
    assert "Traceback" not in err and "watch ended after" in err


def test_ctrl_c_in_the_live_table(cli, tmp_path):
    record = tmp_path / "live.jsonl"
    live = cli("--interval", "0.2", "--record", str(record))
    deadline = time.monotonic() + 60
    while (not record.exists() or not record.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)                          # the first poll is done when its reading is on disk
    live.send_signal(signal.SIGINT)
    out, err = live.communicate(timeout=120)
    assert live.returncode == 0, err
    assert "Traceback" not in err and "watch ended after" in err and "off (>8)" in out


def test_the_cpu_reference_server(running_cpu_ref):
    host, state = running_cpu_ref
    [view] = poll_once([host])
    assert view.state == "up" and view.profile == "cpu-ref"
    assert view.ranks is None and view.dyn is None      # not SGLang: no scheduler ranks, no switch

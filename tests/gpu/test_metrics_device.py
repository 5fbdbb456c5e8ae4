"""gpu/metrics_device.py's end-of-run checks, on log text written by the patch's own messages
(the SpecSwitch of patchsets/dyn-disable, driven through bursts) at TP=1 and TP=2."""
from __future__ import annotations

import gzip
import json

import pytest

from tests.client.sglang_metrics import CAPTURE, capture
from tests.dyn.conftest import PATCHSET, load_by_path, tree_with

from toolkit.server import scrape

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def device():
    return load_gpu_script("metrics_device")


@pytest.fixture(scope="module")
def dyn(tmp_path_factory):
    tree = tree_with(tmp_path_factory.mktemp("md"), [PATCHSET / "0.5.11" / "0001-dyn-disable.patch"])
    return load_by_path("dyn_for_metrics_device", tree / "sglang/srt/speculative/dyn_disable.py")


def run_log(dyn, ranks=1, log_every=7):
    """(log text, the switch's final counters): bursts across threshold 4, a Decode batch line every
    `log_every` steps and a line per switch, as every TP rank prints them."""
    switch = dyn.SpecSwitch(dyn.DynDisableConfig(threshold=4, hysteresis=1))
    lines = []

    def emit(text):
        for rank in range(ranks):
            prefix = f"[2026-12-01 10:00:00 TP{rank}]" if ranks > 1 else "[2026-12-01 10:00:00]"
            lines.append(f"{prefix} {text}")

    step = 0
    for running in [1, 2, 6, 6, 8, 5, 3, 2, 7, 7, 2, 1, 9, 9, 9, 3, 1, 1]:
        switch.decide(running)
        step += 1
        message = switch.switch_message(running)
        if message:
            emit(message)
        if step % log_every == 0:
            emit(f"Decode batch, #running-req: {running}, accept len: 2.10, {switch.counters_message()}, "
                 f"cuda graph: True")
    return "\n".join(lines), switch.as_dict()


@pytest.mark.parametrize("ranks", [1, 2])
def test_final_metrics_equal_to_the_switch_pass(device, dyn, ranks):
    text, final = run_log(dyn, ranks)
    log = device.log_counters(text)
    assert (log["stopped_lines"], log["resumed_lines"]) == (final["switches_off"], final["switches_on"]) == (3, 3)
    verdicts = device.checks(dict(final), dict(final), log, failures=0)
    assert all(v["ok"] for v in verdicts), verdicts


def test_a_metric_that_missed_a_switch_or_a_step_fails(device, dyn):
    text, final = run_log(dyn)
    log = device.log_counters(text)
    missed = {**final, "switches_off": final["switches_off"] - 1}
    failed = {v["check"] for v in device.checks(missed, final, log, failures=0) if not v["ok"]}
    assert "switches_off == 'drafting stopped' lines" in failed and "every counter == /server_info" in failed
    behind = {**final, "plain_steps": 0}
    failed = {v["check"] for v in device.checks(behind, behind, log, failures=1) if not v["ok"]}
    assert failed == {"steps >= the last logged counters", "no failed request"}


class StandInServer:
    """In place of dyn_device.Server: an HTTP server on 127.0.0.1 that answers /generate as SGLang
    does and runs the patch's SpecSwitch and metrics (0001 + 0002) a few decode steps per request,
    logging the switch and counter lines the real server logs. The script's whole run goes
    through it: scrapes, load cycles, the end-of-run checks."""

    def __init__(self, dyn, metrics_mod, log_path, drop_a_switch=False):
        from prometheus_client import CollectorRegistry

        self.name, self.log_path = "eagle3-v2-dyn", str(log_path)
        self.switch = dyn.SpecSwitch(dyn.DynDisableConfig(threshold=5, hysteresis=1))
        self.registry = CollectorRegistry()
        self.metrics = metrics_mod.DynDisableMetrics(self.switch, {"model_name": "m", "tp_rank": 0},
                                                     registry=self.registry)
        self.in_flight = self.steps = 0
        self.drop_a_switch = drop_a_switch
        self.cmd: list[str] = []
        self._thread = self._runner = None

    def _log(self, text):
        with open(self.log_path, "a") as handle:
            handle.write(f"[2026-12-01 10:00:00] {text}\n")

    def _step(self):
        self.switch.decide(self.in_flight)
        self.steps += 1
        message = self.switch.switch_message(self.in_flight)
        if message and not (self.drop_a_switch and self.switch.switches_off == 1):
            self._log(message)
        if self.steps % 7 == 0:
            self._log(f"Decode batch, #running-req: {self.in_flight}, {self.switch.counters_message()}")
        self.metrics.sync()

    def start(self):
        import asyncio
        import threading

        from aiohttp import web
        from prometheus_client import generate_latest

        from tests.conftest import free_port

        async def generate(request):
            body = await request.json()
            self.in_flight += 1
            try:
                for _ in range(max(1, body["sampling_params"]["max_new_tokens"] // 16)):
                    await asyncio.sleep(0.002)
                    self._step()
            finally:
                self.in_flight -= 1
            return web.json_response({"text": "x", "meta_info": {"completion_tokens": 4}})

        async def metrics(request):
            return web.Response(body=generate_latest(self.registry), content_type="text/plain")

        async def info(request):
            return web.json_response({"internal_states": [{"dyn_spec_disable": self.switch.as_dict()}]})

        async def health(request):
            return web.Response(text="ok")

        app = web.Application()
        app.add_routes([web.post("/generate", generate), web.get("/metrics", metrics),
                        web.get("/server_info", info), web.get("/health_generate", health)])
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        ready = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            self._runner = web.AppRunner(app)
            self.loop.run_until_complete(self._runner.setup())
            self.loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", port).start())
            ready.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert ready.wait(10)

    def alive(self):
        return self._thread is not None and self._thread.is_alive()

    def stop(self):
        import asyncio

        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self._runner = None


@pytest.fixture(scope="module")
def metrics_mod(tmp_path_factory):
    tree = tree_with(tmp_path_factory.mktemp("md2"), [PATCHSET / "0.5.11" / "0001-dyn-disable.patch",
                                                      PATCHSET / "0.5.11" / "0002-dyn-disable-metrics.patch"])
    return (load_by_path("dyn_for_metrics_run", tree / "sglang/srt/speculative/dyn_disable.py"),
            load_by_path("dyn_metrics_for_metrics_run", tree / "sglang/srt/speculative/dyn_disable_metrics.py"))


@pytest.mark.parametrize("drop_a_switch", [False, True])
def test_the_whole_run_against_a_stand_in_server(device, metrics_mod, tmp_path, monkeypatch, drop_a_switch):
    import asyncio
    import json
    import types

    dyn, metrics = metrics_mod
    server = StandInServer(dyn, metrics, tmp_path / "server.log", drop_a_switch=drop_a_switch)
    monkeypatch.setattr(device.dd, "Server", lambda *a, **k: server)
    monkeypatch.setattr(device.dd, "THRESHOLD", 5)
    out = tmp_path / "out"
    args = types.SimpleNamespace(out=str(out), pair="sharp", tp=1, port=0, mem=0.5, cycles=2, interval=0.05,
                                 decode_log_interval=40, ready_timeout=30)
    code = asyncio.run(device.main_async(args))
    report = json.loads((out / "check.json").read_text())
    failed = {c["check"] for c in report["checks"] if not c["ok"]}
    if drop_a_switch:        # a log that lacks a switch line the metrics counted: caught
        assert code == 1 and "switches_off == 'drafting stopped' lines" in failed
    else:
        assert code == 0, report["checks"]
        assert report["metrics"]["switches_off"] >= 2 and report["failed_requests"] == 0
        lines = (out / "scrape.jsonl").read_text().splitlines()
        assert len(lines) == report["scrapes"] and json.loads(lines[-1])["values"][
            "sglang:spec_dyn_disable_switches_on_total"] == report["metrics"]["switches_on"]
        assert (out / "metrics-final.txt").read_text().startswith("# HELP")


def test_the_checks_on_the_h200_run_s_own_log_and_body(device):
    """The H200 run's server log and final /metrics body (docs/evidence/metrics/) pass the checks
    again here; the same log without its last 'drafting stopped' line fails them."""
    text = gzip.decompress((CAPTURE.parent / "server.log.gz").read_bytes()).decode()
    metrics = scrape.Snapshot(0, scrape.parse(capture())).dyn_state()
    info = json.loads((CAPTURE.parent / "check.json").read_text())["server_info"]
    verdicts = device.checks(metrics, info, device.log_counters(text), failures=0)
    assert all(v["ok"] for v in verdicts), verdicts
    lines = text.splitlines()
    last_stop = max(i for i, line in enumerate(lines) if "drafting stopped" in line)
    cut = device.log_counters("\n".join(lines[:last_stop] + lines[last_stop + 1:]))
    failed = {v["check"] for v in device.checks(metrics, info, cut, failures=0) if not v["ok"]}
    assert "switches_off == 'drafting stopped' lines" in failed

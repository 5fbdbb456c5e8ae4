"""The controller's rare paths, without sshd: the host calls are faked around the real
`run_fleet`/`run_host` (the journal calls `ctl`, the steps, the lease thread). Ctrl-C in a wave of two
hosts (worker threads), the failure report of a TP=8 start that failed, and a failure report that
cannot be read.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from toolkit import rollout
from toolkit.core.inventory import Host
from toolkit.hostside import server_ctl
from toolkit.server import server


class _Patchset:
    package = "sglang"

    def touched(self):
        return []


class FakeHosts:
    """Records every host call: (seconds since start, host, action, phase)."""

    def __init__(self, monkeypatch, overrides: dict | None = None, profile: str = "prof"):
        self.calls: list[tuple] = []
        self.started = time.monotonic()
        known = {"ps": _Patchset()}

        def plan_fleet(hosts, change, options, note=None):
            return [rollout.HostPlan(h.name, change.label, "roll out",
                                     server_after={"profile": profile, "overrides": dict(overrides or {})})
                    for h in hosts], known

        class Beat:
            def stop(self):
                return ""

        monkeypatch.setattr(rollout, "ctl", self.ctl)
        monkeypatch.setattr(rollout, "plan_fleet", plan_fleet)
        monkeypatch.setattr(rollout, "_Heartbeat", lambda *a, **k: Beat())
        monkeypatch.setattr(rollout, "_payloads", lambda host, plan: {})
        monkeypatch.setattr(rollout, "_guard_source", lambda: "")
        monkeypatch.setattr(rollout, "_change_files", lambda *a: ("pass", "1 file written"))
        monkeypatch.setattr(rollout, "_start_after", lambda *a: ("pass", "ready"))
        monkeypatch.setattr(rollout, "_after_rollback", lambda host, plan, journal, run, n: None)

    def ctl(self, host, action, timeout=120, **args):
        self.calls.append((round(time.monotonic() - self.started, 1), host.name, action, args.get("phase", "")))
        if action == "arm":
            return {"journal": {"lease": "/nonexistent"}}
        if action == "phase":
            return {"ok": True}
        return {"journal": {"phase": "rolled-back", "events": [{"detail": ""}]}}

    def requested(self) -> set[str]:
        return {c[1] for c in self.calls if c[2] == "request"}


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _hosts(n: int, state: Path) -> list[Host]:
    return [Host(name=f"h{i}", transport="local", state_dir=str(state / f"h{i}")) for i in range(n)]


def test_ctrl_c_in_a_wave_of_two_hosts_keeps_neither_and_asks_both_guards_to_roll_back(
        monkeypatch, tmp_path, cache):
    fake = FakeHosts(monkeypatch)
    in_smoke, release = threading.Semaphore(0), threading.Event()
    main_thread, problems = threading.main_thread().ident, []

    def smoke(host, run, max_tokens):   # a smoke that takes a while; Ctrl-C comes while both hosts run it
        in_smoke.release()
        release.wait(60)
        return "pass", "7 checks passed"

    def ctrl_c():
        if not all(in_smoke.acquire(timeout=60) for _ in range(2)):
            problems.append("the two smokes did not both start")
            release.set()
            return
        # to the main thread, as a terminal's Ctrl-C reaches an interactive controller
        signal.pthread_kill(main_thread, signal.SIGINT)
        deadline = time.monotonic() + 5      # let the smokes end once both guards were asked (or at 5 s)
        while fake.requested() != {"h0", "h1"} and time.monotonic() < deadline:
            time.sleep(0.05)
        release.set()

    monkeypatch.setattr(rollout, "_smoke_gate", smoke)
    # A shell starts a background job with SIGINT ignored, and Python then keeps it ignored: give the
    # test the handler an interactive `invoke rollout` has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=ctrl_c, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            rollout.run_fleet(_hosts(2, tmp_path), rollout.Change("ps"), rollout.Options(canary=0, parallel=2))
    finally:
        signal.signal(signal.SIGINT, previous)

    assert not problems, problems

    assert not [c for c in fake.calls if c[3] == "kept"], fake.calls
    assert fake.requested() == {"h0", "h1"}, fake.calls
    journal = json.loads(next((cache / "rollouts").glob("*.json")).read_text())
    assert journal["stopped"].startswith("interrupted (Ctrl-C)") and journal.get("finished_at")
    assert {name: h["outcome"] for name, h in journal["hosts"].items()} == {"h0": "interrupted", "h1": "interrupted"}


def _failed_tp8_start(host: Host, profile: str) -> tuple[str, str]:
    """A TP=8 server that dies during startup, ranks 2, 5, 6, 7 saying why (server_ctl's real start)."""
    lines = "".join(f"echo '[2026-01-01 00:00:0{r} TP{r}] Load weight end'\n" for r in range(8))
    lines += "".join(f"echo '[2026-01-01 00:00:09 TP{r}] ERROR NCCL error: rank {r} failed'\n" for r in (2, 5, 6, 7))
    answer = server_ctl.main({
        "action": "start", "root": os.path.join(host.state_dir, "server"), "timeout_s": 10, "wait_s": 10,
        "nvidia_smi": "/nonexistent", "shared_gpu": False, "required_paths": [], "keep_logs": 5,
        "patch_state": None, "script": lines + "exit 1\n",
        "plan": {"profile": profile, "bind": "127.0.0.1", "port": 1, "idle_memory_slack_mib": 512,
                 "log_lines": [], "rank_log_lines": ["Load weight end"], "tp_size": 8},
        "meta": {"base_url_on_host": "http://127.0.0.1:1", "health_endpoint": "/"}})
    assert answer["status"] == "failed", answer
    return "fail", answer["reason"]


@pytest.mark.parametrize("profile, overrides", [("prof", {"tp_size": 8}), ("baseline", {})],
                         ids=["tp-from-the-options", "tp-from-the-profile"])
def test_a_failed_tp8_start_files_each_ranks_errors_under_its_rank(monkeypatch, tmp_path, cache, profile, overrides):
    FakeHosts(monkeypatch, overrides, profile)
    monkeypatch.setattr(rollout, "_start_after", lambda host, plan, note: _failed_tp8_start(host, profile))
    host = dataclasses.replace(_hosts(1, tmp_path)[0], server={"model": "/models/m"})
    fleet = rollout.run_fleet([host], rollout.Change("ps"), rollout.Options(canary=0))
    errors = {rank: lines for rank, lines in fleet.results[0].rank_errors.items() if lines != ["(no error line)"]}
    assert sorted(errors) == ["TP2", "TP5", "TP6", "TP7"], fleet.results[0].rank_errors
    assert all(f"rank {rank[2:]} failed" in errors[rank][0] for rank in errors), errors
    assert len(fleet.results[0].log_paths) == 1


def test_a_failure_report_that_cannot_be_read_does_not_stop_the_rollback(monkeypatch, tmp_path, cache):
    fake = FakeHosts(monkeypatch)
    monkeypatch.setattr(rollout, "_smoke_gate", lambda *a: ("fail", "stream: broken"))

    def status(host, transport=None):
        raise server.ServerError(f"{host.name}: server status failed on the host: OSError: disk I/O error")

    monkeypatch.setattr(server, "status", status)
    fleet = rollout.run_fleet(_hosts(1, tmp_path), rollout.Change("ps"), rollout.Options(canary=0))
    result = fleet.results[0]
    assert fake.requested() == {"h0"}, fake.calls
    assert result.outcome == "rolled back" and result.failed_check == "smoke: stream: broken", result
    assert any("logs could not be read" in n and "disk I/O error" in n for n in result.notes), result.notes

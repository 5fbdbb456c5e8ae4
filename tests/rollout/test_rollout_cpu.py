"""Rollouts on the sandbox host (real sshd) with the real CPU reference server (`transformers serve`),
all on one host whose server starts once: a patch that breaks the server after three requests rolls
back by itself; the controller killed (SIGKILL) at each step leaves the host whole, old or new, with
its server answering, and the next command converges; a rollout that passes its gates is kept."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import invoke
from toolkit.patch import patching
from toolkit import rollout
from toolkit.server import server
from toolkit.rollout import Change, Options

from .conftest import (SERVE_FILE, SMOKE_TOKENS, guard_gone, invoke_cli, sha256, site_of, wait_final,
                       write_inventory)


def whole(host):
    """(stack, server state) of a host that is whole: files as its patch state says, server answering."""
    verified = patching.verify(host, package="transformers")
    state = server.status(host)
    assert verified.ok, [f for f in verified.files if f.status != "pristine"]
    assert state is not None and state.status == "ready" and state.healthy, state
    return verified.stack, state


def toggle(stack: list[str]) -> list[str]:
    """The rollout that changes this host: cpu-quiet on, or off again."""
    return ["cpu-quiet", "--revert"] if "cpu-quiet" in stack else ["cpu-quiet"]


@pytest.fixture
def cli_env(cpu_host, tmp_path):
    return {"TOOLKIT_INVENTORY": str(write_inventory(tmp_path / "hosts.toml", [cpu_host]))}


def test_a_patch_that_breaks_the_server_is_rolled_back_by_itself(cpu_host, transformers_wheel):
    host = cpu_host
    stack, old = whole(host)
    assert stack == []
    fleet = rollout.run_fleet([host], Change("cpu-breaks"), Options(smoke_max_tokens=SMOKE_TOKENS))
    result = fleet.results[0]
    assert not fleet.ok and result.outcome == "rolled back", result
    names = [(g.name, g.status) for g in result.gates]
    assert names == [("apply cpu-breaks", "pass"), ("restart cpu-ref", "pass"), ("smoke", "fail"),
                     ("files restored", "pass"), ("smoke (restored server)", "pass")], names
    # the failing check, each rank's first error lines and the failed run's log
    assert result.failed_check.startswith("smoke stream:"), result.failed_check
    assert any("cpu-breaks fixture: broken after 3 requests" in line for line in result.rank_errors["TP0"])
    assert len(result.log_paths) == 1 and "/cpu-ref/logs/cpu-ref-" in result.log_paths[0]
    # every file of the package hashes to RECORD again, and the old profile runs again (it passed smoke above)
    verified = patching.verify(host, all_files=True, package="transformers")
    assert verified.ok and verified.stack == [] and verified.all_files_checked > 1000
    assert sha256(site_of(Path(host.venv)) / SERVE_FILE) == transformers_wheel.record[SERVE_FILE]
    _, now = whole(host)
    assert now.profile == "cpu-ref" and now.patch_stack == [] and now.started_at != old.started_at
    journal = rollout.ctl(host, "status")["journal"]
    # the phase the rollout had reached when smoke failed, and who asked for the rollback and why
    assert journal["phase"] == "rolled-back" and journal["interrupted_phase"] == "restarted"
    assert journal["rolled_back_by"].startswith("asked by the controller: gate failed: smoke stream:")
    assert journal["result"]["files"]["restored"] == [SERVE_FILE] and journal["result"]["server"] == "restarted"
    assert guard_gone(host)
    assert rollout.status([host])[0][1] == "old"


def _killed_at(phase: str, change: list[str], env: dict, marker: Path) -> None:
    """Run `invoke rollout` until it reaches PHASE, then SIGKILL it."""
    proc = invoke("rollout", *change, "--host", "cpu1", "--smoke-max-tokens", str(SMOKE_TOKENS),
                  env={**env, "TOOLKIT_ROLLOUT_TEST_HOLD": f"{phase}:{marker}"}, background=True,
                  stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 480
    while not marker.exists():
        assert proc.poll() is None, f"the rollout ended before {phase}:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, f"the rollout did not reach {phase}"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()


@pytest.mark.parametrize("phase", ["armed", "applied"])
def test_killed_before_the_restart_the_guard_puts_the_files_back_under_the_untouched_server(
        cpu_host, cli_env, tmp_path, phase):
    host = cpu_host
    stack, before = whole(host)
    _killed_at(phase, toggle(stack), cli_env, tmp_path / "held")
    journal = wait_final(host)
    assert journal["phase"] == "rolled-back" and journal["interrupted_phase"] == phase
    assert f"the controller went away during {phase}" in journal["rolled_back_by"]
    assert journal["result"]["server"] == "unchanged"
    assert journal["result"]["files"]["restored"] == ([SERVE_FILE] if phase == "applied" else [])
    now_stack, now = whole(host)
    assert now_stack == stack and now.started_at == before.started_at and now.pid == before.pid
    done = invoke_cli("rollout", "--status", "--host", "cpu1", "--json", env=cli_env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cpu1"]["state"] == "old"


def test_killed_after_the_restart_the_next_rollout_rolls_back_then_keeps(cpu_host, cli_env, tmp_path):
    host = cpu_host
    stack, before = whole(host)
    change = toggle(stack)
    _killed_at("restarted", change, cli_env, tmp_path / "held")
    # half way: the new server runs on the new files, unproven; --status says so and fails
    done = invoke_cli("rollout", "--status", "--host", "cpu1", env=cli_env)
    assert done.returncode == 1 and "in flight" in done.stdout, done.stdout + done.stderr
    # the same rollout again: the old one is rolled back first (by its guard, asked or on its own)
    done = invoke_cli("rollout", *change, "--host", "cpu1", "--json", "--smoke-max-tokens", str(SMOKE_TOKENS),
                      env=cli_env)
    assert done.returncode == 0, done.stdout + done.stderr
    answer = json.loads(done.stdout)
    result = answer["hosts"][0]
    assert answer["ok"] and result["outcome"] == "kept", result
    assert [g["name"] for g in result["gates"]] == [f"{'revert' if '--revert' in change else 'apply'} cpu-quiet",
                                                    "restart cpu-ref", "smoke"]
    history = (Path(host.state_dir) / "rollout" / "history.jsonl").read_text().splitlines()
    assert json.loads(history[-1])["phase"] == "rolled-back"
    assert json.loads(history[-1])["interrupted_phase"] == "restarted"
    now_stack, now = whole(host)
    assert now_stack == ([] if "--revert" in change else ["cpu-quiet"])
    assert now.started_at != before.started_at and now.patch_stack == now_stack
    journal = rollout.ctl(host, "status")["journal"]
    assert [e["phase"] for e in journal["events"]] == ["armed", "applied", "restarted", "kept"]
    assert guard_gone(host)
    assert Path(answer["journal"]).exists()


def test_killed_once_kept_the_host_stays_new_and_a_rerun_changes_nothing(cpu_host, cli_env, tmp_path):
    host = cpu_host
    stack, before = whole(host)
    change = toggle(stack)
    _killed_at("kept", change, cli_env, tmp_path / "held")
    assert guard_gone(host)
    now_stack, now = whole(host)
    assert now_stack != stack and now.started_at != before.started_at
    done = invoke_cli("rollout", "--status", "--host", "cpu1", "--json", env=cli_env)
    assert done.returncode == 0 and json.loads(done.stdout)["cpu1"]["state"] == "new", done.stdout
    done = invoke_cli("rollout", *change, "--host", "cpu1", "--smoke-max-tokens", str(SMOKE_TOKENS), env=cli_env)
    assert done.returncode == 0 and "unchanged" in done.stdout, done.stdout + done.stderr
    assert whole(host)[1].started_at == now.started_at


def test_a_throughput_loss_beyond_the_tolerance_is_rolled_back(cpu_host):
    """The user's real failure was a loss under load, not a crash: the bench gate against the host's
    record of the same profile (here a record no CPU server can reach) rolls the change back."""
    host = cpu_host
    stack, before = whole(host)
    record = Path(host.state_dir) / "rollout" / "bench" / "cpu-ref.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"profile": "cpu-ref", "output_throughput": {"1": 1e9, "2": 1e9}}))
    change = Change("cpu-quiet", revert="--revert" in toggle(stack))
    fleet = rollout.run_fleet([host], change, Options(gate_bench=True, bench_levels=(1, 2), tolerance=0.05,
                                                      smoke_max_tokens=SMOKE_TOKENS))
    result = fleet.results[0]
    assert result.outcome == "rolled back", result
    assert [(g.name, g.status) for g in result.gates][2:] == [
        ("smoke", "pass"), ("bench", "fail"), ("files restored", "pass"), ("smoke (restored server)", "pass")]
    assert result.failed_check.startswith("bench: c=1: ") and "LOW" in result.failed_check
    assert "tolerance 5%" in result.failed_check
    now_stack, now = whole(host)
    assert now_stack == stack and now.started_at != before.started_at
    assert json.loads(record.read_text())["output_throughput"]["1"] == 1e9   # a failed bench is not recorded

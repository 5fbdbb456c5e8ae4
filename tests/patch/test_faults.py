"""Cut runs: the host-side apply killed at every point, the SSH connection cut, two applies at once.

After any cut, the next command (apply, verify or revert) must leave a host where no file is
half-patched and the state file agrees with the files. The faults are injected by a test
transport (tests/patch/faults.py), never through the shipped engine."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from toolkit.core import hostrun
from toolkit.patch import patching
from toolkit.core.transport import TransportError

from .conftest import sha256
from .faults import armed

COMMANDS = ("apply", "verify", "revert")
THREE_FILES = 3


def patch_dir(host) -> Path:
    return Path(host.toolkit_state_dir) / "patch"


def assert_consistent(host, site, sglang_wheel, name="twenty"):
    """No journal, no temporary files, every recorded file has its recorded hash, verify passes."""
    assert not (patch_dir(host) / "journal.json").exists()
    assert not list((site / "sglang").rglob("*.toolkit-new"))
    state_file = patch_dir(host) / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"stack": [], "files": {}}
    for path, entry in state["files"].items():
        assert sha256(site / path) == entry["expected"], path
    for path in patching.load_patchsets()[name].touched():
        if path not in state["files"]:
            assert sha256(site / path) == sglang_wheel.record[path], path
    assert patching.verify(host).ok
    return [s["name"] for s in state["stack"]]


def run_next(command, host, name):
    if command == "apply":
        return patching.apply(host, name)
    if command == "verify":
        return patching.verify(host)
    return patching.revert(host)


def params():
    """Every rename k of n (0..n) with each next command; the other cut points with one each."""
    cases = [(f"after-rename-{k}", c) for k in range(THREE_FILES + 1) for c in COMMANDS]
    others = ["after-backups", "after-prepare", "after-new-files", "after-state"]
    return cases + [(point, COMMANDS[i % 3]) for i, point in enumerate(others)] + [("after-state", "revert")]


@pytest.mark.parametrize("point, next_command", params())
def test_killed_host_run_is_finished_by_the_next_command(host, site, patchsets_dir, sglang_wheel, monkeypatch,
                                                         point, next_command):
    cut_and_finish(host, site, sglang_wheel, monkeypatch, point, next_command, "three")


def test_killed_midway_through_twenty_files(host, site, patchsets_dir, sglang_wheel, monkeypatch):
    cut_and_finish(host, site, sglang_wheel, monkeypatch, "after-rename-13", "verify", "twenty")


def cut_and_finish(host, site, sglang_wheel, monkeypatch, point, next_command, name):
    with armed(point), pytest.raises(hostrun.HostScriptError, match="exit 137"):
        patching.apply(host, name)
    journal_left = (patch_dir(host) / "journal.json").exists()
    assert journal_left == (point != "after-backups")
    result = run_next(next_command, host, name)
    if journal_left:
        assert result.recovered is not None
        expected = "rolled forward" if point.startswith("after-rename") or point == "after-state" else "rolled back"
        assert result.recovered["outcome"] == expected
    stack = assert_consistent(host, site, sglang_wheel, name)
    if next_command == "apply":
        assert stack == [name]
    if next_command == "revert":
        assert stack == []
        assert all(sha256(site / p) == sglang_wheel.record[p] for p in patching.load_patchsets()[name].touched())


def test_fault_switches_in_the_environment_reach_no_host(host, site, patchsets_dir, sglang_wheel, monkeypatch):
    """The old TOOLKIT_FAULT_* switches are gone from the shipped path: a user who sets them
    gets an ordinary, complete run."""
    for key, value in {"TOOLKIT_FAULT_AT": "after-rename-1", "TOOLKIT_FAULT_AFTER_RENAMES": "1",
                       "TOOLKIT_FAULT_ACTION": "exit"}.items():
        monkeypatch.setenv(key, value)
    assert patching.apply(host, "three").changed == THREE_FILES
    assert assert_consistent(host, site, sglang_wheel, "three") == ["three"]


def test_lost_new_file_makes_recovery_roll_back_from_backups(host, site, patchsets_dir, sglang_wheel, monkeypatch):
    with armed("after-rename-5"), pytest.raises(hostrun.HostScriptError):
        patching.apply(host, "twenty")
    journal = json.loads((patch_dir(host) / "journal.json").read_text())
    os.unlink(site / journal["entries"][12]["tmp"])  # as if the disk lost it
    result = patching.verify(host)
    assert result.recovered["outcome"] == f"rolled back (the new content of {journal['entries'][12]['path']} is gone)"
    assert assert_consistent(host, site, sglang_wheel) == []


def _ancestors(pid: int):
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        yield pid, comm
        pid = int(stat.rsplit(")", 1)[1].split()[1])


def _wait_for(path: Path, seconds: float = 60) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {seconds}s")


@pytest.mark.parametrize("host_process_survives", [False, True])
def test_ssh_connection_cut_mid_apply(host, site, patchsets_dir, sglang_wheel, sandbox_env, monkeypatch, tmp_path,
                                      host_process_survives):
    pidfile = tmp_path / "fault.pid"
    errors = []

    def cut_run():
        try:
            patching.apply(host, "twenty")
        except Exception as exc:  # the connection breaks under it
            errors.append(exc)

    # the host run waits at the checkpoint until released (not for a fixed time, which a busy
    # machine could outlast before the cut), so the connection always drops mid-apply
    release = tmp_path / "release"
    with armed("after-rename-7", action="sleep:120", pidfile=pidfile, release=release):
        worker = threading.Thread(target=cut_run)
        worker.start()
        script_pid = _wait_for(pidfile)
        session = next(pid for pid, comm in _ancestors(script_pid)
                       if comm.startswith("sshd") and pid != sandbox_env.pid)
        os.kill(session, signal.SIGKILL)  # the SSH connection drops
        if not host_process_survives:
            os.kill(script_pid, signal.SIGKILL)
        worker.join(60)
        release.touch()   # a surviving host run carries on without its connection
    assert not worker.is_alive() and errors and isinstance(errors[0], (TransportError, hostrun.HostScriptError))
    result = patching.verify(host)  # waits for a surviving host run (lock), or recovers a dead one
    if not host_process_survives:
        assert result.recovered["outcome"] == "rolled forward"
    assert assert_consistent(host, site, sglang_wheel) == ["twenty"]


HOLDER = """
import dataclasses, sys
from tests.patch.faults import armed
from toolkit.patch import patching
from toolkit.core.inventory import resolve_hosts
host = dataclasses.replace(resolve_hosts("sandbox")[0], venv=sys.argv[1])
with armed("after-backups", action="sleep:120", pidfile=sys.argv[2], release=sys.argv[3]):
    print(patching.apply(host, "twenty").changed)
"""


def test_two_concurrent_applies_never_both_write(host, host_venv, site, patchsets_dir, sglang_wheel, tmp_path,
                                                 monkeypatch):
    pidfile, release = tmp_path / "holder.pid", tmp_path / "release"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(host_venv), str(pidfile), str(release)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(pidfile)  # the holder has the lock and waits inside its run until released
        monkeypatch.setenv("TOOLKIT_PATCH_LOCK_TIMEOUT", "0.3")
        with pytest.raises(patching.PatchRefused, match="holds the lock"):
            patching.apply(host, "twenty")
        monkeypatch.setenv("TOOLKIT_PATCH_LOCK_TIMEOUT", "60")
        planned, outcome = threading.Event(), []

        def second_apply():
            try:
                patching.apply(host, "twenty", note=lambda text: "writing" in text and planned.set())
            except Exception as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=second_apply)
        waiter.start()
        assert planned.wait(60), "the second apply never got to its host-side run"
        release.touch()  # the holder finishes while the second run waits for the lock
        waiter.join(90)
        assert len(outcome) == 1 and isinstance(outcome[0], patching.PatchRefused)
        assert "changed since" in str(outcome[0]) and "nothing written" in str(outcome[0])
    finally:
        release.touch()
        out, _ = holder.communicate(timeout=90)
    assert holder.returncode == 0 and out.strip() == "20"
    assert assert_consistent(host, site, sglang_wheel) == ["twenty"]
    assert patching.apply(host, "twenty").changed == 0

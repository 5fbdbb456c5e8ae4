"""Rare paths of the host-side server_ctl, over real SSH with the stand-in server
(tests/server/fake_server.py): nvidia-smi failing after a stop, two starts at once, a recorded
pid reused by another process, a log longer than what `logs` reads, a malformed health answer.

nvidia-smi is a stand-in script (this machine has no GPU)."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import threading
import time

import pytest

from tests.server.test_server_processes import group_alive, with_nvidia_smi
from toolkit.check import smoke
from toolkit.core import hostrun
from toolkit.hostside import rollout_hostlib, server_ctl
from toolkit.server import server


def _broken_nvidia_smi(fake) -> None:
    """From now on the stand-in nvidia-smi fails as a wedged GPU's does."""
    fake.path.write_text("#!/bin/sh\necho 'Unable to determine the device handle for GPU0000:41:00.0: "
                         "Unknown Error' >&2\nexit 255\n")


def _processes_under(folder) -> list[int]:
    """Live processes whose command line names a path under `folder` (this test's servers)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                line = handle.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if str(folder) in line and state != "Z":
            found.append(int(entry))
    return found


# -- finding: stop after nvidia-smi fails -------------------------------------------------------

def test_a_stop_whose_gpu_check_fails_still_reports_the_server_stopped(fake_host, nvidia_smi):
    host = with_nvidia_smi(fake_host, nvidia_smi)
    state = server.start(host, "fake", timeout=30)
    _broken_nvidia_smi(nvidia_smi)
    result = server.stop(host, grace=5, memory_wait=1)
    assert result.stopped and result.was_running and result.signal == "TERM"
    assert "exit 255" in result.gpu_check_error and "Unable to determine the device handle" in result.gpu_check_error
    assert any(note.startswith("GPU memory not checked after the stop") for note in result.notes)
    assert result.gpu_memory is None
    assert group_alive(host, state.pid) == []
    assert server.status(host) is None


def test_the_guard_starts_the_old_server_again_when_the_stop_could_not_check_gpu_memory(fake_host, nvidia_smi,
                                                                                          tmp_path):
    """The guard's bring_back_server runs the stop and start payloads as it does on the host."""
    host = dataclasses.replace(with_nvidia_smi(fake_host, nvidia_smi), transport="local", name="local")
    running = server.start(host, "fake", timeout=30)
    folder = tmp_path / "payloads"
    folder.mkdir()
    launch = server.plan(host, "fake")
    stop_args = server.stop_args(host, grace=5, memory_wait=1, shared_gpu=False)
    start_args = server.start_args(host, launch, timeout=30)
    for name, args in (("stop", server.ctl_args(host, "stop", **stop_args)),
                       ("start", server.ctl_args(host, "start", **start_args)),
                       ("wait", server.ctl_args(host, "wait", wait_s=5))):
        (folder / f"{name}.py").write_text(hostrun.build_payload("server_ctl", args))
    journal = {"state_dir": host.toolkit_state_dir,
               "before": {"server": {"profile": "fake", "started_at": running.started_at - 100}},
               "payloads": {name: str(folder / f"{name}.py") for name in ("stop", "start", "wait")}}
    _broken_nvidia_smi(nvidia_smi)
    try:
        answer = rollout_hostlib.bring_back_server(journal)
        assert answer["stopped"]["stopped"] is True and answer["stopped"]["gpu_check_error"]
        # the start's own GPU check then refuses: said as the start's reason, not as a failed stop
        assert answer["server"] == "failed"
        assert answer["reason"].startswith("the old server did not start again: cannot read GPU state")
        type(nvidia_smi)(nvidia_smi.folder)   # nvidia-smi works again
        answer = rollout_hostlib.bring_back_server(journal)
        assert answer["server"] == "restarted", answer
        assert group_alive(host, running.pid) == []
        assert server.status(host).pid == answer["pid"]
    finally:
        server.stop(host, grace=5, memory_wait=0)


# -- finding: two starts at once -----------------------------------------------------------------

def test_two_starts_at_once_launch_one_server_and_refuse_the_other(fake_host, nvidia_smi, tmp_path):
    """Two starts of one host at the same moment (two operators, or a rollout's guard bringing the
    old server back while the controller starts the new one), on two ports. nvidia-smi takes half a
    while (each call), as on a host with 8 GPUs: both starts are in their checks at once."""
    text = nvidia_smi.path.read_text()
    nvidia_smi.path.write_text(text.replace("#!/bin/sh\n", "#!/bin/sh\nsleep 0.5\n", 1))
    host = with_nvidia_smi(fake_host, nvidia_smi)
    other_port = dataclasses.replace(host, server={**host.server, "port": host.server["port"] + 1})
    results: dict = {}
    gate = threading.Barrier(2)

    def start(name, host):
        gate.wait()
        try:
            results[name] = server.start(host, "fake", timeout=30)
        except server.ServerError as exc:
            results[name] = exc

    threads = [threading.Thread(target=start, args=(name, host))
               for name, host in (("a", host), ("b", other_port))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        ready = [r for r in results.values() if isinstance(r, server.ServerState)]
        refused = [r for r in results.values() if isinstance(r, server.ServerError)]
        assert len(ready) == 1 and len(refused) == 1, results
        assert isinstance(refused[0], server.ServerRefused)
        assert "already running" in str(refused[0])
        assert server.status(fake_host).pid == ready[0].pid
    finally:
        server.stop(fake_host, grace=5)
    assert _processes_under(tmp_path / "state") == [], "a server that no record names is still running"
    leftovers = [name for name in os.listdir(tmp_path / "state" / "server") if ".tmp" in name]
    assert leftovers == []


# -- finding: a recorded pid reused by another process --------------------------------------------

def _rewrite_record(host, **changes) -> None:
    record_path = os.path.join(host.toolkit_state_dir, "server", "fake", "server.json")
    with open(record_path) as handle:
        record = json.load(handle)
    record.update(changes)
    with open(record_path, "w") as handle:
        json.dump(record, handle)


@pytest.fixture
def reused_pid(fake_host):
    """A started server killed, and another program given its pid in the record (simulated: a
    session leader started after the server, its pid written into the record with the server's
    start time beside it); yields that program's Popen."""
    state = server.start(fake_host, "fake", timeout=30)
    recorded = server_ctl._start_time(state.pid)
    with fake_host.connect() as transport:
        transport.run(f"kill -9 -{state.pid}")
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        assert server_ctl._start_time(other.pid) != recorded
        _rewrite_record(fake_host, pid=other.pid, pid_start=recorded)
        yield other
    finally:
        other.kill()
        other.wait()


def test_a_recorded_pid_now_of_another_process_is_dead_and_stop_leaves_that_process_alone(fake_host, reused_pid):
    current = server.status(fake_host)
    assert current.status == "dead" and current.healthy is False
    result = server.stop(fake_host, grace=2)
    assert result.was_running is False and result.signal is None
    time.sleep(0.3)
    assert reused_pid.poll() is None, "stop signalled an unrelated process that was given the recorded pid"
    assert server.status(fake_host) is None


def test_a_start_clears_the_record_of_a_server_whose_pid_was_reused(fake_host, reused_pid):
    again = server.start(fake_host, "fake", timeout=30)
    assert any("its pid is now another process's" in note for note in again.notes)
    assert reused_pid.poll() is None
    server.stop(fake_host, grace=5)
    assert reused_pid.poll() is None


def test_a_record_without_a_start_time_keeps_the_old_behaviour(fake_host):
    """Records written before the start time was kept: the recorded pid's group is the server's."""
    state = server.start(fake_host, "fake", timeout=30)
    _rewrite_record(fake_host, pid_start=None)
    assert server.status(fake_host).status == "ready"
    result = server.stop(fake_host, grace=5)
    assert result.was_running and result.signal == "TERM"
    assert group_alive(fake_host, state.pid) == []


# -- finding: a log longer than what `logs` reads --------------------------------------------------

DECODE = "[2026-01-01 00:00:02 TP0] Decode batch. #running-req: 8, #token: 4096, gen throughput (token/s): 812.3\n"


def test_the_smoke_log_check_sees_a_traceback_before_the_last_4_mib(fake_host):
    state = server.start(fake_host, "fake", timeout=30)
    try:
        before = len(server.read_log(fake_host).splitlines())
        with open(state.log_path, "a") as log:
            log.write("[2026-01-01 00:00:01 TP5] Scheduler hit an exception: Traceback (most recent call last):\n"
                      '  File "scheduler.py", line 1, in run\n'
                      "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
            log.write(DECODE * (5 * 1024 * 1024 // len(DECODE)))
        text = server.read_log(fake_host)
        assert len(text) < 4.5 * 1024 * 1024
        with pytest.raises(smoke.CheckFailed) as failed:
            smoke.judge_log(text)
        # the log's own line number, and the whole traceback block
        assert f"line {before + 1}: [2026-01-01 00:00:01 TP5] Scheduler hit an exception" in str(failed.value)
        assert "torch.OutOfMemoryError: CUDA out of memory" in str(failed.value)
    finally:
        server.stop(fake_host, grace=5)


def test_a_long_clean_log_is_clean_with_its_whole_line_count(fake_host):
    state = server.start(fake_host, "fake", timeout=30)
    try:
        with open(state.log_path, "a") as log:
            log.write(DECODE * (5 * 1024 * 1024 // len(DECODE)))
        with open(state.log_path) as log:
            total = sum(1 for _ in log)
        assert smoke.judge_log(server.read_log(fake_host)) == f"{total} lines clean"
        assert server.read_log(fake_host, lines=3).count("Decode batch") == 3
    finally:
        server.stop(fake_host, grace=5)


# -- finding: a malformed answer on the health port --------------------------------------------------

def test_a_malformed_health_answer_is_not_healthy():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]

    def answer_badly():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            client.recv(4096)
            client.sendall(b"garbage that is no status line\r\n\r\n")
            client.close()

    threading.Thread(target=answer_badly, daemon=True).start()
    try:
        assert server_ctl._healthy(f"http://127.0.0.1:{port}/health") is False
    finally:
        listener.close()

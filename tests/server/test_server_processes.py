"""Process handling of `server start/stop` with a stand-in server (tests/server/fake_server.py)
over real SSH: TERM-ignoring servers, deaths at start, TP-rank readiness lines, GPU memory.

The GPU checks read a stand-in `nvidia-smi` that prints stored H200 outputs
(tests/data/nvidia-smi/): a mock, because this machine has no GPU. The real tool is
exercised on the GPU machine.
"""
from __future__ import annotations

import dataclasses
import urllib.request

import pytest

from toolkit.server import server


GROUP_MEMBERS = """
import os, sys
pgid = int(sys.argv[1])
for entry in os.listdir("/proc"):
    try:
        stat = open("/proc/%s/stat" % entry).read()
    except (OSError, ValueError):
        continue
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] != "Z" and int(fields[2]) == pgid:
        print(entry)
"""


def group_alive(host, pgid: int) -> list[int]:
    """Live pids (not zombies) of a process group on the host (from /proc: `ps` may be absent)."""
    with host.connect() as transport:
        done = transport.run(f"python3 - {pgid}", stdin=GROUP_MEMBERS)
    assert done.ok, done.stderr
    return sorted(int(p) for p in done.stdout.split())


def with_nvidia_smi(host, fake):
    return dataclasses.replace(host, server={**host.server, "nvidia_smi": str(fake.path)})


def test_stop_kills_a_server_that_ignores_term_after_the_grace(fake_host):
    state = server.start(fake_host, "fake-stubborn", timeout=60)
    assert len(group_alive(fake_host, state.pid)) == 2, "leader and its worker child run in one group"
    result = server.stop(fake_host, grace=1.5)
    assert result.stopped and result.signal == "KILL"
    assert group_alive(fake_host, state.pid) == []
    assert "SIGTERM ignored" in server.read_log(fake_host)


def test_server_dying_at_start_reports_its_log_and_leaves_nothing(fake_host):
    with pytest.raises(server.ServerError, match=r"exited during startup \(exit code 3\)") as failure:
        server.start(fake_host, "fake-dies", timeout=60)
    assert "RuntimeError: cannot load model" in failure.value.log_tail
    assert server.status(fake_host) is None
    assert group_alive(fake_host, failure.value.details["record"]["pid"]) == []


def test_not_ready_in_time_is_stopped_and_explained(fake_host):
    # the timeout is the expected end; it is long enough for the fake to start and say where it
    # listens on a busy machine
    with pytest.raises(server.ServerError, match=r"not ready after 10s: .*/health does not answer") as failure:
        server.start(fake_host, "fake-unhealthy", timeout=10)
    assert "listening on" in failure.value.log_tail
    assert group_alive(fake_host, failure.value.details["record"]["pid"]) == []


def test_every_tp_rank_must_print_its_line(fake_host):
    state = server.start(fake_host, "fake-tp", timeout=60)
    line = "Dynamic speculation disable enabled: threshold=5"
    assert state.expected_log_lines == [f"TP{r}: {line}" for r in range(4)]
    assert state.dyn_threshold == 5 and state.tp_size == 4
    rank2 = server.read_log(fake_host, rank=2)
    assert rank2.count(line) == 1 and "TP2]" in rank2 and "TP1]" not in rank2
    server.stop(fake_host, grace=5)


def test_a_missing_rank_line_fails_naming_the_rank(fake_host):
    with pytest.raises(server.ServerError, match=r"log lines never printed: TP3: Dynamic speculation") as failure:
        # long enough for ranks 0-2 to print their lines on a busy machine: only TP3 is missing
        server.start(fake_host, "fake-tp", timeout=10, overrides={"flags": ["--skip-rank", "3"]})
    assert "TP0:" not in str(failure.value)
    assert group_alive(fake_host, failure.value.details["record"]["pid"]) == []


def test_progress_is_reported_while_waiting(fake_host):
    lines = []
    with pytest.raises(server.ServerError):
        server.start(fake_host, "fake-unhealthy", timeout=10, wait_chunk=1, progress=lines.append)
    assert lines[0].startswith(f"{fake_host.name}: starting fake-unhealthy on 127.0.0.1:")
    assert any("waiting for fake-unhealthy" in line and "/health not answering" in line for line in lines)


def test_leftover_gpu_process_refuses_start_and_names_it(fake_host, nvidia_smi):
    """Mock nvidia-smi (no GPU here): a leftover python holds 80 GiB on GPU 0."""
    host = with_nvidia_smi(fake_host, nvidia_smi)
    nvidia_smi.show("h200-leftover")
    with pytest.raises(server.ServerRefused, match=r"GPU memory is held by leftover process\(es\): pid 48213 \(81920 MiB\)"
                                                   r".*kill 48213") as refused:
        server.start(host, "fake", timeout=30)
    assert refused.value.details["holders"][0]["pid"] == 48213
    assert server.status(host) is None


def test_a_shared_gpu_host_starts_and_stops_beside_other_gpu_processes(fake_host, nvidia_smi):
    """Mock nvidia-smi: another process holds 80 GiB, as a second server on the same GPU would."""
    host = with_nvidia_smi(fake_host, nvidia_smi)
    host = dataclasses.replace(host, server={**host.server, "shared_gpu": True})
    nvidia_smi.show("h200-leftover")
    state = server.start(host, "fake", timeout=30)
    assert any("shared_gpu" in note for note in state.notes) and state.idle_gpu_memory is None
    result = server.stop(host, grace=5, memory_wait=1)
    assert result.stopped and result.gpu_memory is None and not result.holders
    assert any("shared_gpu" in note for note in result.notes)


def test_stop_waits_for_gpu_memory_back_to_idle(fake_host, nvidia_smi):
    """Mock nvidia-smi (no GPU here): idle at start and after stop."""
    host = with_nvidia_smi(fake_host, nvidia_smi)
    state = server.start(host, "fake", timeout=30)
    assert [g["used_mib"] for g in state.idle_gpu_memory] == [0] * 8
    result = server.stop(host, grace=5)
    assert result.stopped and [g["used_mib"] for g in result.gpu_memory] == [0] * 8


def test_stop_fails_when_gpu_memory_stays_held_and_names_the_pids(fake_host, nvidia_smi):
    """Mock nvidia-smi (no GPU here): the memory is still held after the group is gone."""
    host = with_nvidia_smi(fake_host, nvidia_smi)
    server.start(host, "fake", timeout=30)
    nvidia_smi.show("h200-leftover")
    result = server.stop(host, grace=5, memory_wait=1)
    assert not result.stopped
    assert "GPU0 82437 MiB (idle 0)" in result.reason and "pid 48213 (81920 MiB)" in result.reason
    assert "kill -9 48213" in result.reason
    assert [h["pid"] for h in result.holders] == [48213]


def test_without_nvidia_smi_the_gpu_checks_are_skipped_and_said(fake_host):
    state = server.start(fake_host, "fake", timeout=30)
    assert state.round_trips == 1, "a server that is ready at once costs one round trip to start"
    assert any("GPU memory check skipped" in note for note in state.notes)
    assert state.idle_gpu_memory is None
    result = server.stop(fake_host, grace=5)
    assert result.stopped and result.round_trips == 1
    assert any("GPU memory check skipped" in note for note in result.notes)


def test_a_dead_recorded_server_shows_as_dead_and_does_not_block_start(fake_host):
    state = server.start(fake_host, "fake", timeout=30)
    with fake_host.connect() as transport:
        transport.run(f"kill -9 -{state.pid}")
    current = server.status(fake_host)
    assert current.status == "dead" and current.healthy is False
    again = server.start(fake_host, "fake", timeout=30)
    assert any("had died" in note for note in again.notes)
    both_runs = server.read_log(fake_host, since_start=False)
    assert both_runs.count("launch.sh: starting profile fake") == 2
    assert server.read_log(fake_host).count("launch.sh: starting profile fake") == 1
    server.stop(fake_host, grace=5)


def test_a_patch_state_that_cannot_be_read_refuses_start(fake_host):
    with pytest.raises(server.ServerRefused, match=r"cannot check that patchset\(s\) dyn-disable.*--skip-patch-check"):
        server.start(fake_host, "fake-needs-dyn", timeout=30)


def test_a_required_patchset_that_is_not_applied_refuses_start(fake_host, cpu_ref_venv):
    # The patch engine probes the host's venv for real: nothing is applied there, so start is refused.
    fake_host = dataclasses.replace(fake_host, venv=str(cpu_ref_venv))
    with pytest.raises(server.ServerRefused, match=r"requires patchset\(s\) dyn-disable.*invoke patch apply dyn-disable"):
        server.start(fake_host, "fake-needs-dyn", timeout=30)
    assert server.status(fake_host) is None
    state = server.start(fake_host, "fake-needs-dyn", timeout=30, check_patches=False)
    assert any("not checked" in note for note in state.notes)
    server.stop(fake_host, grace=5)


def _interrupt_on(word):
    def progress(line):
        if word in line:
            raise KeyboardInterrupt
    return progress


def test_an_interrupted_start_takes_down_what_it_launched(fake_host):
    with pytest.raises(KeyboardInterrupt):
        server.start(fake_host, "fake-unhealthy", timeout=60, wait_chunk=1, progress=_interrupt_on("waiting for"))
    assert server.status(fake_host) is None
    assert "launch.sh: starting profile fake-unhealthy" in server.read_log(fake_host)


def test_an_interrupted_start_whose_cleanup_fails_is_still_an_interrupt_and_says_so(fake_host, monkeypatch):
    """A Ctrl-C stays a Ctrl-C (a rollout gate would read a ServerError as a failed check and go on)."""
    from toolkit.core.transport import TransportError

    real_ctl, said = server._ctl, []

    def lost_on_status(transport, host, action, *args, **kwargs):
        if action == "status":
            raise TransportError("connection lost")
        return real_ctl(transport, host, action, *args, **kwargs)

    def progress(line):
        said.append(line)
        if "waiting for" in line:
            monkeypatch.setattr(server, "_ctl", lost_on_status)   # the cleanup cannot ask the host
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        server.start(fake_host, "fake-unhealthy", timeout=60, wait_chunk=1, progress=progress)
    assert any("start of fake-unhealthy was interrupted and the cleanup failed (connection lost)" in line
               for line in said), said
    monkeypatch.undo()
    server.stop(fake_host, grace=5)
    assert server.status(fake_host) is None


def test_an_interrupted_start_leaves_a_server_it_did_not_launch_alone(fake_host):
    running = server.start(fake_host, "fake", timeout=30)
    with pytest.raises(KeyboardInterrupt):
        server.start(fake_host, "fake", timeout=30, progress=_interrupt_on("starting"))
    current = server.status(fake_host)
    assert current is not None and current.pid == running.pid and current.status == "ready"
    server.stop(fake_host, grace=5)


def test_a_server_bound_to_ipv6_loopback_is_health_checked_and_reached_through_ssh(fake_host):
    host = dataclasses.replace(fake_host, server={**fake_host.server, "bind": "::1"})
    state = server.start(host, "fake", timeout=30)
    try:
        assert state.base_url_on_host == f"http://[::1]:{state.port}"
        assert server.status(host).healthy is True
        with server.endpoint(host, state) as url:
            assert url.startswith("http://127.0.0.1:")
            with urllib.request.urlopen(url + "/health", timeout=10) as answer:
                assert answer.status == 200
    finally:
        server.stop(host, grace=5)


def test_the_same_engine_works_on_this_machine_without_ssh(fake_host):
    local = dataclasses.replace(fake_host, name="local", transport="local")
    state = server.start(local, "fake", timeout=30)
    with server.endpoint(local, state) as url:
        assert url == state.base_url_on_host
    assert server.status(local).healthy is True
    result = server.stop(local, grace=5)
    assert result.stopped and group_alive(fake_host, state.pid) == []


def test_gpu_memory_held_by_an_unlisted_process_refuses_start(fake_host, nvidia_smi):
    """Mock nvidia-smi (no GPU here): memory in use on GPU 0, but no compute process listed."""
    host = with_nvidia_smi(fake_host, nvidia_smi)
    nvidia_smi.show("h200-hidden-holder")
    with pytest.raises(server.ServerRefused, match=r"GPU0 has 82437 MiB in use although nvidia-smi lists no process"):
        server.start(host, "fake", timeout=30)
    assert server.status(host) is None


def test_real_h200_capture_of_a_serving_process_refuses_start(fake_host, nvidia_smi):
    """nvidia-smi output captured on the H200 while an SGLang server was up (pid 726: 1580 MiB for
    the process, 1590 MiB used on the GPU), replayed through the stand-in: start refuses and names that process."""
    host = with_nvidia_smi(fake_host, nvidia_smi)
    nvidia_smi.show("h200x1-real-serving")
    with pytest.raises(server.ServerRefused, match=r"pid 726 \(1580 MiB\).*kill 726"):
        server.start(host, "fake", timeout=30)
    nvidia_smi.show("h200x1-real-idle")
    state = server.start(host, "fake", timeout=30)
    assert [g["used_mib"] for g in state.idle_gpu_memory] == [0]
    assert server.stop(host, grace=5).stopped

"""A state folder whose path holds a space, on the sandbox sshd: the rollout's lease is renewed and
its bench record written and read back; a lease or record that cannot be written is said."""
from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from toolkit import rollout


def test_the_lease_and_the_bench_record_work_in_a_state_dir_with_a_space(ssh_host, tmp_path):
    state = tmp_path / "my state"
    (state / "rollout").mkdir(parents=True)
    host = dataclasses.replace(ssh_host, state_dir=str(state))
    lease = state / "rollout" / "lease"
    lease.touch()
    os.utime(lease, (time.time() - 30, time.time() - 30))     # armed 30 s ago
    beat = rollout._Heartbeat(host, str(lease), every=0.5)
    deadline = time.monotonic() + 20
    while time.time() - lease.stat().st_mtime > 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    problem = beat.stop()
    assert time.time() - lease.stat().st_mtime < 5, "the lease was not renewed"
    assert sorted(os.listdir(tmp_path)) == ["my state"]
    assert not problem, problem

    rollout.write_bench_record(host, "cpu-ref", {"output_throughput": {"1": 9.5}})
    assert rollout.read_bench_record(host, "cpu-ref") == {"output_throughput": {"1": 9.5}}
    assert json.loads((state / "rollout" / "bench" / "cpu-ref.json").read_text())["output_throughput"] == {"1": 9.5}


def test_a_lease_or_bench_record_that_cannot_be_written_is_said(ssh_host, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    host = dataclasses.replace(ssh_host, state_dir=str(blocker))
    notes = []
    beat = rollout._Heartbeat(host, str(blocker / "rollout" / "lease"), every=0.3, note=notes.append)
    deadline = time.monotonic() + 20
    while not notes and time.monotonic() < deadline:
        time.sleep(0.1)
    problem = beat.stop()
    assert "Not a directory" in problem, problem
    assert len(notes) == 1 and "could not be renewed" in notes[0] and "Not a directory" in notes[0], notes
    with pytest.raises(rollout.RolloutError, match="bench record .* was not written"):
        rollout.write_bench_record(host, "cpu-ref", {"output_throughput": {}})



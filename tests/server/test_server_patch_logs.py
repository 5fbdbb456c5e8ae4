"""Patchsets and the running server, as the user types it (`python -m invoke`, real sshd, the real
SGLang 0.5.11 wheel files patched for real by the patch engine):

- `[logs] print` of the patchsets applied on the host: after ready, `invoke server start` prints
  the matching log lines, one per distinct text with the TP ranks that printed it;
- `patch apply` / `patch revert` under a running server say it still runs the old code and name
  `invoke server restart`, which then starts it again with the same options.

The server is the stand-in (tests/server/fake_server.py, two TP ranks): what is under test is what
the toolkit reads from the log and prints, not inference."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.helpers import invoke
from tests.patch.conftest import base_venv, sglang_wheel  # noqa: F401  (fixtures: the real wheel in a venv)
from toolkit.core.inventory import resolve_hosts

FIXTURE_PATCHSETS = Path(__file__).parent / "data" / "patchsets"
PRINTED = ["[TP0,TP1] print-lines fixture: on every rank", "[TP1] print-lines fixture: only rank 1"]


@pytest.fixture
def patched_cli(sandbox_env, base_venv, tmp_path, test_profiles):  # noqa: F811
    """`invoke ...` against host `pl` (the sandbox sshd) whose venv holds the real sglang wheel."""
    venv = tmp_path / "venv"
    subprocess.run(["cp", "-al", str(base_venv), str(venv)], check=True)
    patchsets = tmp_path / "patchsets"
    shutil.copytree(FIXTURE_PATCHSETS / "print-lines", patchsets / "print-lines")
    base = resolve_hosts("sandbox")[0]
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(
        f'[pl]\naddress = "127.0.0.1"\nport = {base.port}\nuser = "{base.user}"\nkey = "{base.key}"\n'
        f'known_hosts = "{base.known_hosts}"\nvenv = "{venv}"\n'
        f'[pl.server]\nport = {free_port()}\nbind = "127.0.0.1"\nmemory_wait_s = 5\n'
        f'nvidia_smi = "{tmp_path / "no-nvidia-smi-here"}"\n')
    env = {"TOOLKIT_INVENTORY": str(inventory), "TOOLKIT_PATCHSETS": str(patchsets), "TOOLKIT_PATCH_LOCK_TIMEOUT": "60"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return invoke(*args, env=env, columns=200)
    yield run
    run("server", "stop", "--host", "pl", "--grace", "5")
    shutil.rmtree(venv, ignore_errors=True)


def printed_lines(stdout: str) -> list[str]:
    block = stdout.split("ask you to see:\n", 1)
    return [row.strip() for row in block[1].splitlines() if row.startswith("  ")] if len(block) == 2 else []


def test_print_lines_of_applied_patchsets_and_the_restart_after_apply_and_revert(patched_cli):
    cli = patched_cli
    # nothing applied yet: the fixture's lines are in the log but no applied patchset asks for them
    plain = cli("server", "start", "fake-print", "--host", "pl", "--timeout", "60")
    assert plain.returncode == 0, plain.stderr
    assert printed_lines(plain.stdout) == [] and "ask you to see" not in plain.stdout
    pid = re.search(r"│ ready\s+│ (\d+)", plain.stdout).group(1)

    applied = cli("patch", "apply", "print-lines", "--host", "pl")
    assert applied.returncode == 0, applied.stderr
    assert "pl: 1 changed" in applied.stdout
    assert (f"pl: the fake-print server (pid {pid}, started " in applied.stdout
            and "still runs the code from before this apply; to load the patched files, restart it: "
                "invoke server restart --host pl" in applied.stdout), applied.stdout

    restarted = cli("server", "restart", "--host", "pl")                # the advice, as printed
    assert restarted.returncode == 0, restarted.stderr
    assert f"pl: stopped fake-print (pid {pid}, SIGTERM)" in restarted.stderr
    assert "pl: log lines the applied patchsets (print-lines) ask you to see:" in restarted.stdout
    assert printed_lines(restarted.stdout) == PRINTED
    assert "Load weight end" not in restarted.stdout.split("ask you to see:")[1]

    # an apply that changes nothing says nothing about the server
    again = cli("patch", "apply", "print-lines", "--host", "pl")
    assert again.returncode == 0 and "pl: 0 changed" in again.stdout and "still runs" not in again.stdout

    reverted = cli("patch", "revert", "--host", "pl")
    assert reverted.returncode == 0, reverted.stderr
    assert ("still runs the code from before this revert; to load the restored files, restart it: "
            "invoke server restart --host pl") in reverted.stdout

    rank1 = cli("server", "logs", "--host", "pl", "--rank", "1", "--lines", "0")
    assert rank1.returncode == 0 and "only rank 1" in rank1.stdout and "TP0]" not in rank1.stdout
    listed = cli("server", "logs", "--host", "pl", "--list")
    assert listed.returncode == 0 and listed.stdout.count("fake-print-") == 2 and "current" in listed.stdout


def test_restart_dry_run_says_what_it_would_do_and_does_nothing(patched_cli):
    cli = patched_cli
    started = cli("server", "start", "fake-print", "--host", "pl", "--timeout", "45")
    assert started.returncode == 0, started.stderr
    before = cli("server", "status", "--host", "pl", "--json")
    planned = cli("server", "restart", "--host", "pl", "-n")
    assert planned.returncode == 0, planned.stderr
    assert re.search(r"# dry run on pl: would stop fake-print \(pid \d+, ready\), then start fake-print with "
                     r"options: none \(reused from its start at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\); timeout 45s\. "
                     r"Nothing stopped or started\.", planned.stderr), planned.stderr
    assert planned.stdout.startswith("#!/usr/bin/env bash")
    after = cli("server", "status", "--host", "pl", "--json")
    pids = [re.findall(r'"pid": (\d+)', done.stdout) for done in (before, after)]
    assert pids[0] and pids[0] == pids[1]


def test_a_server_that_turns_the_patch_down_fails_fast_with_its_reason(patched_cli):
    """`[logs] refuse` of an applied patchset: start stops waiting for lines that will never come."""
    cli = patched_cli
    waited = cli("server", "start", "fake-refused", "--host", "pl", "--timeout", "4")
    assert waited.returncode != 0 and "not ready after 4s" in waited.stdout + waited.stderr
    assert "runs without what the profile needs" not in waited.stdout + waited.stderr  # not applied yet
    applied = cli("patch", "apply", "print-lines", "--host", "pl")
    assert applied.returncode == 0, applied.stderr
    failed = cli("server", "start", "fake-refused", "--host", "pl", "--timeout", "120")
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0
    assert ("the server runs without what the profile needs, it logged: "
            "print-lines fixture: refused (a stand-in reason); the feature stays off") in " ".join(out.split())
    assert "not ready after 120s" not in out


def test_a_profile_needing_a_file_the_applied_diffs_do_not_write_is_refused_before_it_starts(patched_cli):
    """`requires_patched_files` (eagle3-v2-dyn-native: the module only dyn-disable's 0.5.11 diffs add):
    checked against what the applied patchsets wrote on the host, before anything runs."""
    cli = patched_cli
    assert cli("patch", "apply", "print-lines", "--host", "pl").returncode == 0
    refused = cli("server", "start", "fake-needs-other-file", "--host", "pl", "--timeout", "60")
    out = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode != 0
    assert ("profile fake-needs-other-file needs sglang/srt/speculative/dyn_disable_native.py, which the "
            "patchset(s) applied for sglang 0.5.11 (print-lines) do not write") in out, out
    assert "Traceback" not in out
    status = cli("server", "status", "--host", "pl", "--json")
    assert '"pid"' not in status.stdout, status.stdout          # nothing was started
    planned = cli("server", "start", "fake-needs-other-file", "--host", "pl", "-n")
    assert planned.returncode == 0 and "sglang/srt/speculative/dyn_disable_native.py written by them" in planned.stderr
    started = cli("server", "start", "fake-needs-file", "--host", "pl", "--timeout", "60")
    assert started.returncode == 0, started.stdout + started.stderr

"""`invoke server ...` as a person types it, against the sandbox sshd with the real cpu-ref server."""
from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.helpers import invoke



@pytest.fixture
def cli(ssh_host, cpu_ref_venv, ref_model, tmp_path, test_profiles):
    """Run `invoke server ...` against a host `cpu-test` defined in a private inventory file."""
    inventory = tmp_path / "hosts.toml"
    port = free_port()
    inventory.write_text(
        "[cpu-test]\n"
        f'address = "127.0.0.1"\nport = {ssh_host.port}\nuser = "{ssh_host.user}"\n'
        f'key = "{ssh_host.key}"\nknown_hosts = "{ssh_host.known_hosts}"\n'
        f'venv = "{cpu_ref_venv}"\nstate_dir = "{tmp_path / "state"}"\n'
        "[cpu-test.server]\n"
        f'model = "{ref_model}"\nport = {port}\nbind = "127.0.0.1"\nmemory_wait_s = 5\n')
    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return invoke("server", *args, env={"TOOLKIT_INVENTORY": str(inventory)}, columns=200, timeout=timeout)
    run.port = port
    return run


def test_start_status_logs_stop_through_invoke(cli):
    started = cli("start", "cpu-ref", "--host", "cpu-test", "--timeout", "180")
    try:
        assert started.returncode == 0, started.stderr
        assert "ready" in started.stdout and f"127.0.0.1:{cli.port}" in started.stdout
        assert "starting cpu-ref on 127.0.0.1" in started.stderr

        again = cli("start", "cpu-ref", "--host", "cpu-test")
        assert again.returncode == 1 and "already running: profile cpu-ref" in again.stderr

        status = cli("status", "--host", "cpu-test", "--json")
        assert status.returncode == 0, status.stderr
        [entry] = json.loads(status.stdout)
        assert entry["server"]["profile"] == "cpu-ref" and entry["server"]["healthy"] is True

        logs = cli("logs", "--host", "cpu-test", "--lines", "4")
        assert logs.returncode == 0 and len(logs.stdout.splitlines()) == 4
        rank3 = cli("logs", "--host", "cpu-test", "--rank", "3")   # a rank a TP-1 server does not have
        assert rank3.returncode == 0 and rank3.stdout.strip() == ""
        assert "cpu-test: no TP3 lines in the server log" in rank3.stderr

        followed = cli("logs", "--host", "cpu-test", "-f", "--duration", "2", "--lines", "0")
        assert followed.returncode == 0 and "Application startup complete" in followed.stdout
    finally:
        stopped = cli("stop", "--host", "cpu-test", "--grace", "10")
    assert stopped.returncode == 0, stopped.stderr
    assert "SIGTERM" in stopped.stdout and "GPU check skipped" in stopped.stdout
    pid = entry["server"]["pid"]
    state = Path(f"/proc/{pid}/status")
    assert not state.exists() or "\tZ" in state.read_text().split("State:")[1].split("\n")[0], "server still running"
    status = cli("status", "--host", "cpu-test")
    assert status.returncode == 0 and "not running" in status.stdout


def test_the_already_running_refusal_advises_a_stop_of_that_host_which_works_pasted(cli):
    started = cli("start", "cpu-ref", "--host", "cpu-test", "--timeout", "180")
    try:
        assert started.returncode == 0, started.stderr
        again = cli("start", "cpu-ref", "--host", "cpu-test")
        assert again.returncode == 1
        assert "error: cpu-test: not starting cpu-ref: a server is already running" in again.stderr
        advice = again.stderr.split("stop it first with: ", 1)[1].split("\n")[0].strip()
        assert advice == "invoke server stop --host cpu-test"
        pasted = cli(*shlex.split(advice)[2:])                  # the advice, typed as printed
        assert pasted.returncode == 0 and "cpu-ref pid" in pasted.stdout, pasted.stderr
        assert "not running" in cli("status", "--host", "cpu-test").stdout
    finally:
        cli("stop", "--host", "cpu-test", "--grace", "10")


def test_stop_dry_run_says_what_it_would_stop_and_stops_nothing(cli):
    started = cli("start", "cpu-ref", "--host", "cpu-test", "--timeout", "180")
    try:
        assert started.returncode == 0, started.stderr
        pid = json.loads(cli("status", "--host", "cpu-test", "--json").stdout)[0]["server"]["pid"]

        planned = cli("stop", "--host", "cpu-test", "-n", "--grace", "7", "--memory-wait", "3")
        assert planned.returncode == 0, planned.stderr
        assert (f"would stop cpu-ref (pid {pid}, ready, 127.0.0.1:{cli.port}): SIGTERM to its process group, "
                f"SIGKILL after a grace of 7s; then wait up to 3s for GPU memory back to idle. Nothing stopped."
                in planned.stderr)
        [plan] = json.loads(cli("stop", "--host", "cpu-test", "-n", "-j").stdout)
        assert plan["dry_run"] and plan["running"]["pid"] == pid and plan["grace"] == 30
        still = json.loads(cli("status", "--host", "cpu-test", "--json").stdout)[0]["server"]
        assert (still["pid"], still["status"], still["healthy"]) == (pid, "ready", True)

        # a threshold for the running profile, which has none, is refused before anything is stopped
        restart = cli("restart", "--host", "cpu-test", "--threshold", "5")
        assert restart.returncode == 1 and "profile cpu-ref has no dyn-disable threshold" in restart.stderr
        assert json.loads(cli("status", "--host", "cpu-test", "--json").stdout)[0]["server"]["pid"] == pid
    finally:
        stopped = cli("stop", "--host", "cpu-test", "--grace", "10")
    assert stopped.returncode == 0 and f"cpu-ref pid {pid}: SIGTERM" in stopped.stdout, stopped.stderr


def test_model_dry_run_names_the_folder_and_makes_nothing(cli, tmp_path):
    out = tmp_path / "models" / "not-made"
    planned = cli("model", "--host", "cpu-test", "--out", str(out), "-n")
    assert planned.returncode == 0, planned.stderr
    assert f"would make the reference model (seed 0) in {out}" in planned.stderr and "Nothing made" in planned.stderr
    assert not out.exists()


def test_logs_of_a_profile_never_started_says_so_with_exit_1(cli):
    nothing = cli("logs", "--host", "cpu-test")
    assert nothing.returncode == 1
    assert "error: cpu-test: no server has been started on this host" in nothing.stderr
    never = cli("logs", "baseline", "--host", "cpu-test")
    assert never.returncode == 1
    assert "error: cpu-test: no log of profile baseline: it has not been started on this host" in never.stderr


def test_status_and_stop_of_an_unreachable_host_are_an_error_only_and_a_json_entry(cli, ssh_host, tmp_path):
    with open(tmp_path / "hosts.toml", "a") as inventory:    # an address where no sshd listens
        inventory.write(f'[gone]\naddress = "127.0.0.1"\nport = {free_port()}\nuser = "{ssh_host.user}"\n'
                        f'key = "{ssh_host.key}"\nknown_hosts = "{ssh_host.known_hosts}"\n'
                        f'state_dir = "{tmp_path / "gone-state"}"\n')
    table = cli("status", "--host", "gone")
    assert table.returncode == 1 and table.stdout == ""
    assert "error: gone: cannot reach 127.0.0.1:" in table.stderr
    both = cli("status", "--host", "cpu-test,gone", "--json")
    assert both.returncode == 1
    entries = {entry["host"]: entry for entry in json.loads(both.stdout)}
    assert entries["cpu-test"] == {"host": "cpu-test", "ok": True, "server": None}
    assert entries["gone"]["ok"] is False and entries["gone"]["error"].startswith("cannot reach 127.0.0.1:")
    stopped = cli("stop", "--host", "cpu-test,gone", "--json")
    assert stopped.returncode == 1
    entries = {entry["host"]: entry for entry in json.loads(stopped.stdout)}
    assert entries["cpu-test"]["stopped"] and not entries["cpu-test"]["was_running"]
    assert entries["gone"]["stopped"] is False and entries["gone"]["error"].startswith("cannot reach 127.0.0.1:")


def test_threshold_on_a_profile_without_one_is_refused_naming_those_that_take_it(cli):
    for args in (["render", "baseline", "--model", "/m", "--threshold", "5"],
                 ["start", "cpu-ref", "--threshold", "5"],
                 ["start", "cpu-ref", "--hysteresis", "2"]):
        refused = cli(*args, "--host", "cpu-test")
        assert refused.returncode == 2, refused.stderr
        assert f"profile {args[1]} has no dyn-disable threshold" in refused.stderr
        assert "eagle3-v2-dyn" in refused.stderr.split("use a profile that takes one: ", 1)[1]
    assert "not running" in cli("status", "--host", "cpu-test").stdout


def test_model_action_makes_the_reference_model_on_the_host_once(cli, ref_model):
    done = cli("model", "--host", "cpu-test")
    assert done.returncode == 0, done.stderr
    assert f"cpu-test: already current: {ref_model}" in done.stdout


def test_start_before_the_model_exists_names_the_command_that_makes_it(cli, tmp_path):
    model = tmp_path / "models" / "tiny"
    refused = cli("start", "cpu-ref", "--host", "cpu-test", "--model", str(model), "--timeout", "180")
    assert refused.returncode == 1
    assert "Traceback" not in refused.stderr and "Repo id" not in refused.stderr
    advice = refused.stderr.split("make the reference model there first: ", 1)[1].split("\n")[0].strip()
    assert advice == f"invoke server model --host cpu-test --out {model}"
    assert "not running" in cli("status", "--host", "cpu-test").stdout
    made = cli(*shlex.split(advice)[2:])                      # the advice, typed as printed
    assert made.returncode == 0 and f"cpu-test: made: {model}" in made.stdout, made.stderr
    started = cli("start", "cpu-ref", "--host", "cpu-test", "--model", str(model), "--timeout", "180")
    try:
        assert started.returncode == 0, started.stderr
    finally:
        assert cli("stop", "--host", "cpu-test", "--grace", "10").returncode == 0


def test_dry_run_prints_the_script_and_starts_nothing(cli):
    done = cli("start", "cpu-ref", "--host", "cpu-test", "--dry-run", "--port", "18999")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("#!/usr/bin/env bash") and "--port 18999" in done.stdout
    assert "Nothing started" in done.stderr
    assert "not running" in cli("status", "--host", "cpu-test").stdout


def test_dry_run_lists_the_patch_check_unless_it_is_skipped(cli):
    args = ("start", "eagle3-dyn", "--host", "cpu-test", "--dry-run", "--model", "/m", "--draft-model", "/d")
    checked, skipped = cli(*args), cli(*args, "--skip-patch-check")
    assert checked.returncode == skipped.returncode == 0, checked.stderr + skipped.stderr
    assert "patchset(s) applied: dyn-disable" in checked.stderr
    assert "patchset(s) applied" not in skipped.stderr and "Nothing started" in skipped.stderr


def test_threshold_and_hysteresis_reach_the_launch_script_and_bad_values_exit_2(cli):
    args = ("start", "eagle3-v2-dyn", "--host", "cpu-test", "--dry-run", "--model", "/m", "--draft-model", "/d")
    done = cli(*args, "--threshold", "18")
    assert done.returncode == 0, done.stderr
    assert "SGLANG_SPEC_DISABLE_THRESHOLD=18" in done.stdout and "SGLANG_SPEC_DISABLE_HYSTERESIS=4" in done.stdout
    assert "SGLANG_SPEC_DISABLE_HYSTERESIS=2" in cli(*args, "--threshold", "18", "--hysteresis", "2").stdout
    bad = cli(*args, "--threshold", "abc")
    assert bad.returncode == 2 and "--threshold takes an integer or auto, got 'abc'" in bad.stderr
    out_of_range = cli(*args, "--threshold", "18", "--hysteresis", "18")
    assert out_of_range.returncode == 2 and "0 <= hysteresis < threshold (18)" in out_of_range.stderr
    # auto: the patch's controller finds the crossover; no request-count hysteresis goes with it
    auto = cli(*args, "--threshold", "auto")
    assert auto.returncode == 0, auto.stderr
    assert "SGLANG_SPEC_DISABLE_THRESHOLD=auto" in auto.stdout and "SGLANG_SPEC_DISABLE_HYSTERESIS=4" not in auto.stdout
    auto_with_band = cli(*args, "--threshold", "auto", "--hysteresis", "2")
    assert auto_with_band.returncode == 2 and "takes no dyn_hysteresis" in auto_with_band.stderr


def test_a_failed_start_prints_the_log_tail_and_exits_1(cli, tmp_path):
    done = cli("start", "fake-dies", "--host", "cpu-test", "--timeout", "30")
    assert done.returncode == 1
    assert "RuntimeError: cannot load model" in done.stderr and "exited during startup" in done.stderr


def test_errors_quoting_log_lines_are_printed_verbatim(capsys):
    # Server errors quote log text such as "[2026-01-01 10:00:00 TP3]" or "[/x]": not console markup.
    from invoke.exceptions import Exit

    from toolkit.core.inventory import Host
    from toolkit.core.parallel import HostOutcome
    from toolkit_cli.server import finish

    message = "never printed: TP3: [2026-01-01 10:00:00 TP3] done [/x]"
    with pytest.raises(Exit):
        finish([HostOutcome(Host(name="h"), error=RuntimeError(message))])
    assert message in capsys.readouterr().err


def test_an_error_line_names_its_host_once(capsys):
    from invoke.exceptions import Exit

    from toolkit.core.inventory import Host
    from toolkit.core.parallel import HostOutcome
    from toolkit_cli.server import finish

    with pytest.raises(Exit):
        finish([HostOutcome(Host(name="h"), error=RuntimeError("h: not starting p: already running")),
                HostOutcome(Host(name="h2"), error=RuntimeError("cannot reach 127.0.0.1:9"))])
    err = capsys.readouterr().err
    assert "error: h: not starting p" in err and "h: h:" not in err
    assert "error: h2: cannot reach 127.0.0.1:9" in err


@pytest.mark.parametrize("args, message", [
    (["start"], "needs a profile; one of: "),
    (["frobnicate"], "unknown action 'frobnicate'"),
    (["stop", "cpu-ref"], "takes no profile"),
    (["start", "no-such-profile", "--host", "cpu-test"], "unknown profile 'no-such-profile'"),
    (["status", "--host", "nowhere"], "unknown host 'nowhere'"),
    (["logs", "--host", "cpu-test", "--run", "last"], "--run takes an integer, got 'last'"),
    (["logs", "--host", "cpu-test", "--run", "-1"], "--run must be >= 0, got -1"),
    (["logs", "--host", "cpu-test", "--lines", "-3"], "--lines must be >= 0, got -3"),
    (["logs", "--host", "cpu-test", "--rank", "-1"], "--rank must be >= 0, got -1"),
    (["logs", "--host", "cpu-test", "-f", "--duration", "abc"], "--duration takes a number of seconds, got 'abc'"),
    (["start", "cpu-ref", "--host", "cpu-test", "--timeout", "abc"], "--timeout takes a number of seconds, got 'abc'"),
    (["start", "cpu-ref", "--host", "cpu-test", "--timeout", "0"], "--timeout must be > 0 seconds, got 0"),
    (["start", "cpu-ref", "--host", "cpu-test", "--timeout", "-5"], "--timeout must be > 0 seconds, got -5"),
    (["stop", "--host", "cpu-test", "--grace", "abc"], "--grace takes a number of seconds, got 'abc'"),
    (["stop", "--host", "cpu-test", "--grace", "-1"], "--grace must be >= 0 seconds, got -1"),
    (["stop", "--host", "cpu-test", "--memory-wait", "-1"], "--memory-wait must be >= 0 seconds, got -1"),
    (["render", "cpu-ref", "--host", "cpu-test", "--tp", "0"], "--tp must be >= 1, got 0"),
    (["start", "cpu-ref", "--host", "cpu-test", "--tp", "-3"], "--tp must be >= 1, got -3"),
    (["status", "--host", "cpu-test", "-n"], "`invoke server status` changes nothing on a host and has no dry run"),
    (["logs", "--host", "cpu-test", "--dry-run"], "`invoke server logs` changes nothing on a host and has no dry run"),
    (["render", "cpu-ref", "--host", "cpu-test", "-n"], "`invoke server render` changes nothing"),
    (["watch", "--host", "cpu-test", "--once", "-n"], "`invoke server watch` changes nothing"),
    (["restart", "no-such-profile", "--host", "cpu-test"], "unknown profile 'no-such-profile'"),
])
def test_bad_input_is_named_with_exit_2(cli, args, message):
    done = cli(*args)
    assert done.returncode == 2 and message in done.stderr


def test_help_describes_every_argument(cli):
    done = invoke("--help", "server")
    assert done.returncode == 0
    for flag in ("--host", "--timeout", "--grace", "--follow", "--rank", "--lines", "--dry-run", "--threshold",
                 "--run", "--list"):
        assert flag in done.stdout

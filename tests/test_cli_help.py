"""Help, usage and short flags as the user meets them: `python -m invoke ...` in a subprocess,
through Invoke's own Program and the project's tasks.py."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.helpers import invoke

COMMANDS = ("bench", "demo", "facts", "patch", "provision", "rollout", "sandbox", "server", "smoke", "wheelhouse")
FLAG = re.compile(r"^  (-\w(?: \S+)?, )?--([\w-]+)")


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return invoke(*args, env=env, columns=200, timeout=120)


def options(help_text: str) -> dict[str, str | None]:
    """--long -> its short letter (or None), from the Options section of a help text."""
    found = {}
    section = help_text.split("\nOptions:\n", 1)[1]
    for row in section.splitlines():
        match = FLAG.match(row)
        if match:
            short = match.group(1)
            found[match.group(2)] = short.strip(", ").split()[0][1] if short else None
    return found


@pytest.mark.parametrize("name, line", [
    ("patch", "Usage: invoke patch ACTION [NAME] [options]"),
    ("server", "Usage: invoke server ACTION [PROFILE] [options]"),
    ("sandbox", "Usage: invoke sandbox ACTION [options]"),
    ("bench", "Usage: invoke bench [ACTION] [FILES] [options]"),
])
def test_help_shows_positionals_as_typed_not_as_options(name, line):
    done = cli("--help", name)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == line
    listed = options(done.stdout)
    assert "action" not in listed and "name" not in listed and "profile" not in listed
    assert "--action" not in done.stdout and "--name=" not in done.stdout


def test_every_help_way_prints_the_same_text():
    by_core = cli("--help", "patch")
    after = cli("patch", "--help")
    short = cli("patch", "-h")
    after_action = cli("patch", "verify", "-h")
    assert by_core.returncode == after.returncode == short.returncode == after_action.returncode == 0
    assert by_core.stdout == after.stdout == short.stdout == after_action.stdout
    assert "revert [NAME|--all]" in by_core.stdout and "Options:" in by_core.stdout


@pytest.mark.parametrize("name, actions", [
    ("patch", "list | check | apply | verify | revert | edit | refresh | port"),
    ("server", "start | stop | restart | status | watch | dashboard | logs | model | profiles | render"),
    ("sandbox", "up | down | status"),
    ("wheelhouse", "build"),
])
def test_a_missing_action_prints_the_usage_and_exits_2(name, actions):
    done = cli(name)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"`invoke {name}` needs an action: {actions}" in done.stderr
    assert "usage: invoke " + name in done.stderr and f"all options: invoke --help {name}" in done.stderr
    assert "did not receive required positional arguments" not in done.stderr


def test_server_help_lists_no_stray_flag():
    done = cli("--help", "server")
    section = done.stdout.split("\nOptions:\n", 1)[1]
    rows = [row for row in section.splitlines() if row.startswith("  -")]
    assert rows and all(FLAG.match(row) for row in rows), [row for row in rows if not FLAG.match(row)]
    assert "  --, " not in done.stdout
    assert {"restart", "logs"} <= set(re.findall(r"^  (\w+)", done.stdout, re.M))


def test_a_short_flag_means_the_same_option_in_every_command():
    meaning: dict[str, set[str]] = {}
    for name in COMMANDS:
        done = cli("--help", name)
        assert done.returncode == 0, (name, done.stderr)
        for long_name, short in options(done.stdout).items():
            if short:
                meaning.setdefault(short, set()).add(long_name)
    assert meaning.get("H") == {"host"} and meaning.get("j") == {"json"}
    assert meaning.get("n") == {"dry-run"}
    assert all(len(longs) == 1 for longs in meaning.values()), meaning


def test_dash_n_is_a_dry_run_in_server_and_sandbox(tmp_path):
    rendered = cli("server", "start", "baseline", "--host", "blackwell-01", "-n")
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout.startswith("#!/usr/bin/env bash") and "Nothing started" in rendered.stderr
    folder = tmp_path / "sandbox"
    planned = cli("sandbox", "up", "-n", "--port", "2299", TOOLKIT_SANDBOX_DIR=str(folder))
    assert planned.returncode == 0, planned.stderr
    assert "dry run, nothing done" in planned.stdout and "start sshd on 127.0.0.1:2299" in planned.stdout
    assert not folder.exists()

"""`invoke()`: the toolkit's command line in a subprocess, as the user types it, for every test."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from toolkit.core.paths import PROJECT_ROOT


def invoke(*args: str, env: dict | None = None, unset: tuple[str, ...] = (), columns: int | None = None,
           timeout: float = 600, background: bool = False, **popen_kwargs):
    """`python -m invoke ARGS` from the project root with text output captured.

    env adds to this process's environment, unset removes names from it, columns sets COLUMNS
    (the width tables are drawn for). background=True starts it and returns the Popen (stdout and
    stderr piped unless popen_kwargs say otherwise); else it waits and returns the CompletedProcess.
    """
    full_env = {k: v for k, v in os.environ.items() if k not in unset}
    if columns is not None:
        full_env["COLUMNS"] = str(columns)
    full_env.update(env or {})
    command = [sys.executable, "-m", "invoke", *args]
    if background:
        # a test may interrupt it: Ctrl-C must reach it even when the suite runs with SIGINT ignored
        # (a background job of a non-interactive shell inherits SIG_IGN, and so would the CLI)
        options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
                   "preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen_kwargs}
        return subprocess.Popen(command, cwd=PROJECT_ROOT, env=full_env, text=True, **options)
    return subprocess.run(command, cwd=PROJECT_ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout, **popen_kwargs)


def sglang_options(release: str) -> set[str]:
    """Every --option a release's server takes, read from its wheel: 0.5.11 spells them as
    add_argument("--x") strings in srt/server_args.py, 0.5.17 as annotated fields there, 0.5.23 as
    annotated fields of srt/arg_groups/fields/*.py (the flag is the field's name with dashes, plus
    each Arg's aliases)."""
    import re

    from toolkit.patch import wheels

    wheel = wheels.pristine("sglang", release)
    paths = ["sglang/srt/server_args.py"] + [p for p in wheel.package_files("sglang/srt/arg_groups/fields")
                                             if p.endswith(".py")]
    names = set()
    for path in paths:
        if not wheel.has(path):
            continue
        text = wheel.read(path).decode()
        names |= {"--" + m.replace("_", "-") for m in re.findall(r"^    (\w+): A\[", text, re.M)}
        names |= set(re.findall(r'"(--[a-z0-9][\w-]*)"', text))
    return names

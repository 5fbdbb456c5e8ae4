"""Shared fixtures: a real sshd on loopback (the sandbox host) for the whole test session.

Each test session gets its own sandbox folder and a free port, so tests never touch the
developer's own `.sandbox/` and can run while it is up.
"""
from __future__ import annotations

import os

import pytest

from toolkit.core import sandbox
from toolkit.core.inventory import resolve_hosts
from toolkit.core.transport import LOOPBACK_ONLY_ENV

# No test dials a host other than a loopback one, in this process or in the CLIs it starts.
os.environ[LOOPBACK_ONLY_ENV] = "1"


free_port = sandbox.free_loopback_port


@pytest.fixture(scope="session")
def sandbox_env(tmp_path_factory):
    """Start a private sandbox sshd; point the built-in `sandbox` host at it."""
    folder = tmp_path_factory.mktemp("sandbox")
    port = free_port()
    saved = {k: os.environ.get(k) for k in ("TOOLKIT_SANDBOX_DIR", "TOOLKIT_SANDBOX_PORT")}
    os.environ["TOOLKIT_SANDBOX_DIR"] = str(folder)
    os.environ["TOOLKIT_SANDBOX_PORT"] = str(port)
    state = sandbox.up(folder, port)
    yield state
    sandbox.down(folder)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def sandbox_host(sandbox_env):
    """The built-in `sandbox` Host (SSH to 127.0.0.1 on the session's port)."""
    return resolve_hosts("sandbox")[0]


CPU_REF_REQUIREMENTS = ["torch==2.13.0", "transformers[serving]==5.24.0"]


def _cached_venv(name: str, requirements: list[str]):
    """A venv under the cache folder, built once (file-locked) and reused by later sessions."""
    import fcntl
    import subprocess
    import sys

    from toolkit.core.paths import cache_dir

    root = cache_dir() / "test-venvs"
    root.mkdir(parents=True, exist_ok=True)
    venv = root / name
    marker = venv / ".requirements"
    wanted = "\n".join(requirements)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (marker.exists() and marker.read_text() == wanted):
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *requirements], check=True)
            marker.write_text(wanted)
    return venv


@pytest.fixture(scope="session")
def cpu_ref_venv():
    """A venv with the CPU reference server (`transformers serve`, CPU torch); ~80 s the first time."""
    return _cached_venv("cpu-ref", CPU_REF_REQUIREMENTS)

"""Shared fixtures: a real sshd on loopback (the sandbox host) for the whole test session.

Each test session gets its own sandbox folder and a free port, so tests never touch the
developer's own `.sandbox/` and can run while it is up.
"""
from __future__ import annotations

import os
import socket

import pytest

from toolkit import sandbox
from toolkit.inventory import resolve_hosts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

"""Fixtures for the rollout tests: hosts that are the session's sandbox sshd, each with a private copy
of the CPU reference venv (hard links, so the shared cached venv is never changed: the patch engine and
the guard only replace files by rename), its own state folder and port, and the test patchsets of
transformers serve (tests/rollout/data/patchsets) in TOOLKIT_PATCHSETS."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.helpers import invoke
from tests.server.conftest import ref_model, ssh_host  # noqa: F401 (fixtures)
from toolkit import rollout
from toolkit.server import server
from toolkit.patch import wheels
from toolkit.core.inventory import Host

DATA = Path(__file__).parent / "data" / "patchsets"
SERVE_FILE = "transformers/cli/serving/server.py"
TRANSFORMERS = ("transformers", "5.24.0")
SMOKE_TOKENS = 32    # the smoke's chat answers (200 by default): the checks are the same, the CPU server quicker
LEASE_S = "15"      # the guard's lease in these tests (the controller renews it every 2.5 s)


@pytest.fixture(autouse=True)
def rollout_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TOOLKIT_PATCHSETS", str(DATA))
    monkeypatch.setenv("TOOLKIT_ROLLOUT_LEASE_S", LEASE_S)
    monkeypatch.setenv("TOOLKIT_PATCH_LOCK_TIMEOUT", "60")
    monkeypatch.delenv("TOOLKIT_ROLLOUT_TEST_HOLD", raising=False)


def private_venv(source: Path, copy: Path) -> Path:
    """A venv at `copy` that runs `source`'s packages but has its own `transformers` (hard links: the
    patch engine and the guard replace files by rename, so the shared cached venv never changes).
    Every other site-packages entry is a symlink; the console scripts are rewritten to run the copy's
    python, so `transformers serve` imports the copy's files."""
    copy.mkdir()
    for entry in source.iterdir():
        if entry.is_symlink():      # lib64 -> lib
            (copy / entry.name).symlink_to(os.readlink(entry))
        elif entry.name not in ("bin", "lib"):
            (copy / entry.name).symlink_to(entry)
    (copy / "bin").mkdir()
    for script in (source / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            subprocess.run(["cp", "-a", str(script), str(copy / "bin")], check=True)
            continue
        data = script.read_bytes()
        mine = data.replace(b"#!" + str(source).encode(), b"#!" + str(copy).encode(), 1)
        (copy / "bin" / script.name).write_bytes(mine)
        (copy / "bin" / script.name).chmod(0o755)
    site = site_of(source)
    mine = copy / site.relative_to(source)
    mine.mkdir(parents=True)
    for entry in site.iterdir():
        if entry.name == "transformers":
            subprocess.run(["cp", "-al", str(entry), str(mine / entry.name)], check=True)
        else:
            (mine / entry.name).symlink_to(entry)
    return copy


def site_of(venv: Path) -> Path:
    return next(venv.glob("lib/python*/site-packages"))


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@pytest.fixture(scope="session")
def transformers_wheel() -> wheels.Wheel:
    return wheels.pristine(*TRANSFORMERS)


class HostMaker:
    """make(name, **server_settings) -> a Host on the sandbox sshd with its own venv copy, state and port."""

    def __init__(self, ssh_host, cpu_ref_venv, ref_model, folder: Path):  # noqa: F811 (the fixtures, passed on)
        self.base, self.venv, self.model, self.folder = ssh_host, Path(cpu_ref_venv), ref_model, folder
        self.made: list[Host] = []

    def __call__(self, name: str = "sandbox", **settings) -> Host:
        venv = private_venv(self.venv, self.folder / f"venv-{name}")
        server_settings = {"bind": "127.0.0.1", "port": free_port(), "memory_wait_s": 5, "model": self.model,
                           **settings}
        host = dataclasses.replace(self.base, name=name, venv=str(venv), state_dir=str(self.folder / f"state-{name}"),
                                   server=server_settings)
        self.made.append(host)
        return host

    def clean(self) -> None:
        for host in self.made:
            _stop_everything(host)
            shutil.rmtree(host.venv, ignore_errors=True)


@pytest.fixture
def make_cpu_host(ssh_host, cpu_ref_venv, ref_model, tmp_path):  # noqa: F811
    maker = HostMaker(ssh_host, cpu_ref_venv, ref_model, tmp_path)
    yield maker
    maker.clean()


@pytest.fixture(scope="module")
def cpu_host(ssh_host, cpu_ref_venv, ref_model, tmp_path_factory):  # noqa: F811
    """One host for a module's rollouts, its cpu-ref server started once; each test starts from
    whatever whole state the one before left (and checks that it is whole)."""
    maker = HostMaker(ssh_host, cpu_ref_venv, ref_model, tmp_path_factory.mktemp("rollout-host"))
    host = maker("cpu1")
    server.start(host, "cpu-ref", timeout=300)
    yield host
    maker.clean()


def _stop_everything(host: Host) -> None:
    """Leave nothing running: a guard still waiting is asked to finish, then the server stops."""
    try:
        answer = rollout.ctl(host, "status")
        journal = answer.get("journal")
        if journal and journal.get("phase") not in rollout.TERMINAL:
            rollout.converge(host, "test teardown", timeout=240)
    except Exception:
        pass
    try:
        server.stop(host, grace=5, memory_wait=0)
    except Exception:
        pass


def write_inventory(path: Path, hosts: list[Host]) -> Path:
    lines = []
    for h in hosts:
        lines += [f"[{h.name}]", f'address = "{h.address}"', f"port = {h.port}", f'user = "{h.user}"',
                  f'key = "{h.key}"', f'known_hosts = "{h.known_hosts}"', f'venv = "{h.venv}"',
                  f'state_dir = "{h.state_dir}"', f"[{h.name}.server]"]
        lines += [f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in h.server.items()]
        lines.append("")
    path.write_text("\n".join(lines).replace("'", '"'))
    return path


def invoke_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return invoke(*args, env=env, columns=250, timeout=timeout)


def wait_final(host: Host, seconds: float = 240) -> dict:
    """The host's rollout journal once it is kept or rolled back (the guard acting on its own)."""
    deadline = time.monotonic() + seconds
    while True:
        journal = rollout.ctl(host, "status").get("journal") or {}
        if journal.get("phase") in rollout.TERMINAL:
            return journal
        assert time.monotonic() < deadline, f"still {journal.get('phase')} after {seconds} s"
        time.sleep(1)


def guard_gone(host: Host, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not rollout.ctl(host, "status").get("guard_alive"):
            return True
        time.sleep(0.5)
    return False

"""Fixtures for the client, smoke and bench tests: a real `transformers serve` on the CPU with
the tiny reference model (started straight from the cached venv, no host layer), and the fake
OpenAI server for the behaviours a real server will not show on demand."""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import free_port
from toolkit.core.paths import PROJECT_ROOT, cache_dir

from .fake_openai import FakeOpenAI

READY_TIMEOUT = 240.0   # a loaded 2-core CI machine is slow to import torch


@pytest.fixture(scope="session")
def ref_model_dir(cpu_ref_venv) -> Path:
    """The tiny reference model (toolkit/server/refmodel.py), made once and cached across sessions."""
    out = cache_dir() / "test-models" / "tiny-llama"
    subprocess.run([str(cpu_ref_venv / "bin" / "python"), str(PROJECT_ROOT / "toolkit" / "server" / "refmodel.py"), str(out)],
                   check=True, capture_output=True, timeout=600)
    return out


class CpuServer:
    """`transformers serve` on 127.0.0.1, its own process group, its log in a file."""

    def __init__(self, venv: Path, model: Path, log_path: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [str(venv / "bin" / "transformers"), "serve", str(model), "--host", "127.0.0.1",
                 "--port", str(self.port), "--device", "cpu", "--continuous-batching",
                 "--cb-num-blocks", "256", "--cb-block-size", "32", "--cb-max-batch-tokens", "2048",
                 "--log-level", "info"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"transformers serve exited ({self.process.returncode}):\n{self.read_log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"transformers serve not ready in {READY_TIMEOUT:.0f} s:\n{self.read_log()[-3000:]}")

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="session")
def cpu_server(cpu_ref_venv, ref_model_dir, tmp_path_factory):
    """One real CPU server for the tests that only talk to it."""
    server = CpuServer(cpu_ref_venv, ref_model_dir, tmp_path_factory.mktemp("cpu-server") / "server.log")
    yield server
    server.stop()


@pytest.fixture
def fresh_cpu_server(cpu_ref_venv, ref_model_dir, tmp_path):
    """A CPU server of this test's own, for tests that kill it."""
    server = CpuServer(cpu_ref_venv, ref_model_dir, tmp_path / "server.log")
    yield server
    server.stop()


@pytest.fixture
def fake_server():
    servers = []

    def make(**kwargs) -> FakeOpenAI:
        server = FakeOpenAI(**kwargs).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@contextmanager
def cpu_ref_inventory_host(name: str, tmp_path, cpu_ref_venv, ref_model_dir, host_lines: str = "",
                           server_lines: str = ""):
    """An inventory host (TOOLKIT_INVENTORY) over the sandbox sshd whose venv runs transformers
    serve with the reference model; yields (host, env) and stops its server afterwards.
    `host_lines` / `server_lines` go into its table / its server table."""
    from toolkit.server import server
    from toolkit.core.inventory import resolve_hosts

    base = resolve_hosts("sandbox")[0]
    (tmp_path / "hosts.toml").write_text(
        f"[{name}]\naddress = \"127.0.0.1\"\nport = {base.port}\nuser = \"{base.user}\"\n"
        f"key = \"{base.key}\"\nknown_hosts = \"{base.known_hosts}\"\nvenv = \"{cpu_ref_venv}\"\n"
        f"{host_lines}state_dir = \"{tmp_path / 'state'}\"\n"
        f"[{name}.server]\nmodel = \"{ref_model_dir}\"\nbind = \"127.0.0.1\"\nport = {free_port()}\n"
        f"memory_wait_s = 5\n{server_lines}")
    env = {"TOOLKIT_INVENTORY": str(tmp_path / "hosts.toml")}
    saved = os.environ.get("TOOLKIT_INVENTORY")
    os.environ.update(env)
    try:
        yield resolve_hosts(name)[0], env
    finally:
        server.stop(resolve_hosts(name)[0], grace=10)
        if saved is None:
            os.environ.pop("TOOLKIT_INVENTORY", None)
        else:
            os.environ["TOOLKIT_INVENTORY"] = saved

"""Fixtures for the server tests: the sandbox sshd as the host, the CPU reference venv as its
venv, the tiny model made on it once, private state folders, test profiles, a fake nvidia-smi.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port
from toolkit.server import server
from toolkit.core.inventory import Host, resolve_hosts
from toolkit.core.paths import cache_dir

HERE = Path(__file__).resolve().parent
NVIDIA_SMI_DATA = HERE.parent / "data" / "nvidia-smi"
FAKE_SERVER = HERE / "fake_server.py"


@pytest.fixture(scope="session")
def ssh_host(sandbox_env) -> Host:
    """The built-in `sandbox` host (SSH to the session's sshd on 127.0.0.1)."""
    return resolve_hosts("sandbox")[0]


@pytest.fixture(scope="session")
def ref_model(ssh_host, cpu_ref_venv) -> str:
    """The tiny reference model, made on the host through the engine (cached across sessions)."""
    host = dataclasses.replace(ssh_host, venv=str(cpu_ref_venv))
    out = cache_dir() / "test-models" / "tiny-llama"
    answer = server.make_model(host, str(out))
    assert answer["model"] == str(out)
    return str(out)


def process_alive(host: Host, pid: int) -> bool:
    """Whether `pid` runs on the host (a zombie, dead but not yet reaped by init, does not count)."""
    with host.connect() as transport:
        done = transport.run(f"test -d /proc/{pid} && ! grep -q '^State:.*Z' /proc/{pid}/status")
    return done.ok


def make_host(base: Host, state_dir: Path, **server_settings) -> Host:
    settings = {"bind": "127.0.0.1", "port": free_port(), "memory_wait_s": 5, **server_settings}
    return dataclasses.replace(base, state_dir=str(state_dir), server=settings)


@pytest.fixture
def cpu_host(ssh_host, cpu_ref_venv, ref_model, tmp_path) -> Host:
    """An SSH host whose venv runs `transformers serve`, with its own state folder and port."""
    return make_host(dataclasses.replace(ssh_host, venv=str(cpu_ref_venv)), tmp_path / "state", model=ref_model)


@pytest.fixture(scope="module")
def running_cpu_ref(ssh_host, cpu_ref_venv, ref_model, tmp_path_factory):
    """One real cpu-ref server shared by the tests of a module that only look at it."""
    host = make_host(dataclasses.replace(ssh_host, venv=str(cpu_ref_venv)),
                     tmp_path_factory.mktemp("shared-state"), model=ref_model)
    state = server.start(host, "cpu-ref", timeout=180)
    yield host, state
    # Stopping it is checked here, once, rather than with a server of its own.
    result = server.stop(host, grace=10)
    assert result.stopped and result.was_running and result.signal == "TERM", result
    assert any("GPU memory check skipped" in note for note in result.notes)
    assert server.status(host) is None
    assert not process_alive(host, state.pid), "the server process is still there after stop"
    assert server.stop(host).was_running is False


@pytest.fixture(scope="session")
def test_profiles(tmp_path_factory):
    """Profiles of kind `command` that run tests/server/fake_server.py (written here: they hold this
    checkout's absolute path), in a folder named by TOOLKIT_PROFILES."""
    folder = tmp_path_factory.mktemp("profiles")
    base = f'kind = "command"\ncommand = [{str(sys.executable)!r}, "-u", {str(FAKE_SERVER)!r}, "{{bind}}", "{{port}}"]\n'
    variants = {
        "fake": ("", ""),
        "fake-stubborn": ('flags = ["--ignore-term", "--child"]\n', ""),
        "fake-dies": ('flags = ["--die-at-start"]\n', ""),
        "fake-unhealthy": ('flags = ["--no-health"]\n', ""),
        "fake-needs-dyn": ('requires_patchsets = ["dyn-disable"]\n', ""),
        "fake-tp": ('tp_size = 4\ndyn_threshold = 5\nflags = ["--tp", "{tp_size}", "--rank-line", '
                    '"Dynamic speculation disable enabled: threshold={dyn_threshold}"]\n',
                    'rank_log_lines = ["Dynamic speculation disable enabled: threshold={dyn_threshold}"]\n'),
        # Lines for the `[logs] print` prefix of tests/server/data/patchsets/print-lines: one that
        # both ranks print, one only rank 1 prints, one that does not match, one without a rank prefix
        "fake-print": ('tp_size = 2\nflags = ["--tp", "{tp_size}", "--rank-line", "print-lines fixture: on every rank", '
                       '"--rank-line", "Load weight end", "--line-of-rank", "1", "print-lines fixture: only rank 1"]\n',
                       'rank_log_lines = ["Load weight end"]\n'),
        # A feature that only some releases' diffs carry: the file print-lines writes, and one it does not
        "fake-needs-file": ('requires_patchsets = ["print-lines"]\n'
                            'requires_patched_files = ["sglang/srt/utils/auth.py"]\n', ""),
        "fake-needs-other-file": ('requires_patchsets = ["print-lines"]\n'
                                  'requires_patched_files = ["sglang/srt/speculative/dyn_disable_native.py"]\n', ""),
        # A server that turns the patch's feature down: the line the profile waits for never comes
        "fake-refused": ('tp_size = 2\nflags = ["--tp", "{tp_size}", "--rank-line", '
                         '"print-lines fixture: refused (a stand-in reason); the feature stays off"]\n',
                         'rank_log_lines = ["print-lines fixture: enabled"]\n'),
    }
    for name, (extra, ready) in variants.items():
        (folder / f"{name}.toml").write_text(
            f'summary = "test stand-in: {name}"\n' + base + extra + '[ready]\nendpoint = "/health"\n' + ready)
    saved = os.environ.get("TOOLKIT_PROFILES")
    os.environ["TOOLKIT_PROFILES"] = str(folder)
    yield folder
    if saved is None:
        os.environ.pop("TOOLKIT_PROFILES", None)
    else:
        os.environ["TOOLKIT_PROFILES"] = saved


@pytest.fixture
def fake_host(ssh_host, tmp_path, test_profiles) -> Host:
    """An SSH host for the stand-in server profiles, with its own state folder and port."""
    return make_host(dataclasses.replace(ssh_host, venv=None), tmp_path / "state",
                     nvidia_smi=str(tmp_path / "no-nvidia-smi-here"))


class FakeNvidiaSmi:
    """A stand-in `nvidia-smi` on the host that prints outputs stored in tests/data/nvidia-smi/.

    A mock: this machine has no GPU. The outputs are those of an 8x H200 host (see the README
    there); the real tool is exercised on the GPU machine.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "nvidia-smi"
        self.path.write_text(
            "#!/bin/sh\n"
            'here="$(dirname "$0")"\n'
            'case "$*" in\n'
            '  *--query-gpu=*) cat "$here/current.query-gpu.csv" ;;\n'
            '  *--query-compute-apps=*) cat "$here/current.compute-apps.csv" ;;\n'
            '  *) cat "$here/current.txt" ;;\n'
            "esac\n")
        self.path.chmod(0o755)
        self.show("h200-idle")

    def show(self, scenario: str) -> None:
        for suffix in ("query-gpu.csv", "compute-apps.csv", "txt"):
            shutil.copyfile(NVIDIA_SMI_DATA / f"{scenario}.{suffix}", self.folder / f"current.{suffix}")


@pytest.fixture
def nvidia_smi(tmp_path) -> FakeNvidiaSmi:
    return FakeNvidiaSmi(tmp_path / "fake-nvidia-smi")

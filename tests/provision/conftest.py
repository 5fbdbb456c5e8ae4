"""Fixtures for provisioning: sandbox hosts (real sshd on loopback) with venvs in temp folders,
one session-wide host provisioned with the real cpu-ref stack, the cpu-ref wheelhouse (cached
under the project cache), and fake GPU layouts for the `gpu` stack (no GPU here)."""
from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.core import paths, sandbox
from toolkit.provision import provision, stack, wheelhouse
from toolkit.core.inventory import Host, resolve_hosts


def pip_env() -> dict[str, str]:
    """Host-side pip (the sandbox is this machine) caches its downloads under the project cache."""
    return {"PIP_CACHE_DIR": str(paths.cache_dir() / "pip")}


closed_port = sandbox.free_loopback_port  # nothing listens there: pip's index "unreachable"


def sandbox_with_venv(venv: Path, name: str = "sandbox") -> Host:
    return dataclasses.replace(resolve_hosts("sandbox")[0], name=name, venv=str(venv), state_dir=None)


@pytest.fixture
def fresh_host(sandbox_env, tmp_path) -> Host:
    """The sandbox host with a venv path that does not exist yet."""
    return sandbox_with_venv(tmp_path / "host" / "venv")


@pytest.fixture(scope="session")
def cpu_ref() -> stack.Stack:
    return stack.load("cpu-ref")


@pytest.fixture(scope="session")
def provisioned(sandbox_env, tmp_path_factory, cpu_ref):
    """One sandbox venv provisioned for real with cpu-ref (index downloads); shared read-only."""
    host = sandbox_with_venv(tmp_path_factory.mktemp("provisioned") / "venv")
    first = provision.provision(host, cpu_ref, env=pip_env(), note=lambda text: print(text, file=sys.stderr))
    return host, first


@pytest.fixture(scope="session")
def cpu_ref_wheelhouse(cpu_ref) -> wheelhouse.Manifest:
    python, platform = wheelhouse.this_machine()
    return wheelhouse.build(cpu_ref, python=python, platform=platform)


NVIDIA_SMI = """#!/bin/sh
# A stand-in for nvidia-smi (no GPU on the test machine): answers the two queries facts makes.
case "$1" in
  --query-gpu=*)
    [ -n "$FAKE_SMI_FAIL" ] && { echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."; exit 9; }
    i=0
    while [ $i -lt ${FAKE_GPUS:-1} ]; do
      echo "$i, NVIDIA H200, 9.0, 4, 143771, ${FAKE_DRIVER:-580.95.05}"
      i=$((i+1))
    done ;;
  *)
    [ -n "$FAKE_SMI_FAIL" ] && exit 9
    echo "| NVIDIA-SMI ${FAKE_DRIVER:-580.95.05}   Driver Version: ${FAKE_DRIVER:-580.95.05}   CUDA Version: ${FAKE_CUDA:-13.0} |" ;;
esac
"""


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """Put a fake nvidia-smi first on PATH (for `local` hosts, which inherit this environment)."""
    folder = tmp_path / "fakebin"
    folder.mkdir()
    smi = folder / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")

    def configure(**settings):
        for key, value in settings.items():
            monkeypatch.setenv(f"FAKE_{key.upper()}", str(value))
    return configure


@pytest.fixture
def no_gpu(monkeypatch):
    """A PATH on which no nvidia-smi can be found."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")


def write_dist(site: Path, name: str, version: str) -> None:
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nbody\n")


@pytest.fixture
def staged_site(tmp_path) -> Host:
    """The GPU machine's layout, faked: a 'system' Python (a bare venv) with torch 2.11.0+cu130 in
    its site-packages, and a trimmed site dir on PYTHONPATH holding sglang and flashinfer-python."""
    system = tmp_path / "system-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(system)], check=True)
    system_site = next(system.glob("lib/python*/site-packages"))
    write_dist(system_site, "torch", "2.11.0+cu130")
    write_dist(system_site, "sglang", "0.5.9")          # shadowed by the trimmed site
    trimmed = tmp_path / "site"
    write_dist(trimmed, "sglang", "0.5.11")
    write_dist(trimmed, "flashinfer-python", "0.6.8.post1")
    return Host(name="staged", transport="local", python=str(system / "bin" / "python"), pythonpath=str(trimmed),
                stack="gpu")

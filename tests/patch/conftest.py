"""Fixtures for the patch engine: the real SGLang 0.5.11 wheel (and 0.5.17, the second release)
installed `--no-deps` in a venv (built once per session), a fresh copy of it per test, and the
synthetic patchsets."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.patch import wheels
from toolkit.core.inventory import resolve_hosts

DATA = Path(__file__).parent / "data" / "patchsets"
GOOD = ("one-file", "pair-base", "pair-top", "twenty", "clash", "three")
VERSION = "0.5.11"
NEXT = "0.5.17"   # the second release (docs/porting.md says why this one)
NEWEST = "0.5.23"  # the newest release (Python >= 3.11; its wheel is built per Python)


@pytest.fixture(scope="session")
def sglang_wheel() -> wheels.Wheel:
    return wheels.pristine("sglang", VERSION)


@pytest.fixture(scope="session")
def next_wheel() -> wheels.Wheel:
    return wheels.pristine("sglang", NEXT)


@pytest.fixture(scope="session")
def newest_wheel() -> wheels.Wheel:
    return wheels.pristine("sglang", NEWEST)


def _venv_with(folder: Path, wheel: wheels.Wheel) -> Path:
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                    "--prefix", str(venv), "--no-warn-script-location", str(wheel.path)],
                   check=True, env=dict(os.environ, PIP_NO_INPUT="1"))
    return venv


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory, sglang_wheel):
    """A venv with the real sglang wheel installed without dependencies (pip byte-compiles it)."""
    venv = _venv_with(tmp_path_factory.mktemp("hostvenv"), sglang_wheel)
    yield venv
    shutil.rmtree(venv, ignore_errors=True)  # ~5000 entries: do not leave them to pytest's cleanup


@pytest.fixture(scope="session")
def next_base_venv(tmp_path_factory, next_wheel):
    """The same with SGLang 0.5.17."""
    venv = _venv_with(tmp_path_factory.mktemp("hostvenv-next"), next_wheel)
    yield venv
    shutil.rmtree(venv, ignore_errors=True)


@pytest.fixture(scope="session")
def newest_base_venv(tmp_path_factory, newest_wheel):
    """The same with SGLang 0.5.23."""
    venv = _venv_with(tmp_path_factory.mktemp("hostvenv-newest"), newest_wheel)
    yield venv
    shutil.rmtree(venv, ignore_errors=True)


# Folders a test may change in place (hand edits, METADATA); they are copied per test.
PRIVATE = ("sglang/srt/utils", "sglang-*.dist-info")


def _private_copy(base_venv: Path, copy: Path) -> Path:
    subprocess.run(["cp", "-al", str(base_venv), str(copy)], check=True)
    base_site = next(base_venv.glob("lib/python*/site-packages"))
    site = copy / base_site.relative_to(base_venv)
    for pattern in PRIVATE:
        for original in base_site.glob(pattern):
            target = site / original.relative_to(base_site)
            shutil.rmtree(target)
            subprocess.run(["cp", "-a", str(original), str(target)], check=True)
    return copy


@pytest.fixture
def host_venv(base_venv, tmp_path):
    """A per-test venv: hard links to the base venv, except PRIVATE folders, which are real copies.

    The engine only ever replaces files by rename, which never alters a hard-linked original;
    a test that edits a file in place must keep to the PRIVATE folders."""
    copy = _private_copy(base_venv, tmp_path / "venv")
    yield copy
    shutil.rmtree(copy, ignore_errors=True)


@pytest.fixture
def next_host(sandbox_host, next_base_venv, tmp_path):
    """The sandbox (real sshd) with a per-test venv of SGLang 0.5.17."""
    copy = _private_copy(next_base_venv, tmp_path / "venv-next")
    yield dataclasses.replace(sandbox_host, name="sandbox", venv=str(copy), state_dir=None)
    shutil.rmtree(copy, ignore_errors=True)


@pytest.fixture
def newest_host(sandbox_host, newest_base_venv, tmp_path):
    """The sandbox (real sshd) with a per-test venv of SGLang 0.5.23."""
    copy = _private_copy(newest_base_venv, tmp_path / "venv-newest")
    yield dataclasses.replace(sandbox_host, name="sandbox", venv=str(copy), state_dir=None)
    shutil.rmtree(copy, ignore_errors=True)


@pytest.fixture
def release_cache(tmp_path, monkeypatch, sglang_wheel, next_wheel):
    """A private cache (edit trees, images) that reuses both downloaded wheels."""
    folder = tmp_path / "cache"
    (folder / "wheels").mkdir(parents=True)
    for wheel in (sglang_wheel, next_wheel):
        os.symlink(wheel.path, folder / "wheels" / wheel.path.name)
    monkeypatch.setenv("TOOLKIT_CACHE", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)  # edit trees hold whole releases


@pytest.fixture
def site(host_venv) -> Path:
    return next(host_venv.glob("lib/python*/site-packages"))


@pytest.fixture
def host(sandbox_host, host_venv):
    """The sandbox (real sshd on loopback) with its venv pointed at this test's copy."""
    return dataclasses.replace(sandbox_host, name="sandbox", venv=str(host_venv), state_dir=None)


@pytest.fixture
def patchsets_dir(tmp_path, monkeypatch) -> Path:
    """A private patchsets/ with the synthetic ones (not escape/binary: those break `check` of all)."""
    folder = tmp_path / "patchsets"
    folder.mkdir()
    for name in GOOD:
        shutil.copytree(DATA / name, folder / name)
    monkeypatch.setenv("TOOLKIT_PATCHSETS", str(folder))
    monkeypatch.setenv("TOOLKIT_PATCH_LOCK_TIMEOUT", "60")
    return folder


def add_patchset(folder: Path, name: str) -> None:
    shutil.copytree(DATA / name, folder / name)


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def snapshot(site: Path, wheel: wheels.Wheel, names) -> dict:
    return {p: sha256(site / p) for p in names}


@pytest.fixture
def inventory(tmp_path, sandbox_env, monkeypatch):
    """hosts for the CLI: `t1`, `t2` = the sandbox sshd, each with its own venv copy."""
    def make(*venvs: Path) -> list[str]:
        base = resolve_hosts("sandbox")[0]
        lines, names = [], []
        for i, venv in enumerate(venvs, 1):
            name = f"t{i}"
            names.append(name)
            lines += [f"[{name}]", 'address = "127.0.0.1"', f"port = {base.port}", f'user = "{base.user}"',
                      f'key = "{base.key}"', f'known_hosts = "{base.known_hosts}"', f'venv = "{venv}"', ""]
        path = tmp_path / "hosts.toml"
        path.write_text("\n".join(lines))
        monkeypatch.setenv("TOOLKIT_INVENTORY", str(path))
        return names
    return make

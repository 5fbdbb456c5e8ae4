"""Fixtures for the dyn-disable patchset tests: the pristine files it touches, read from the real
SGLang 0.5.11 wheel (hash-checked against RECORD), and the patched copy of them."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit import wheels

REPO = Path(__file__).resolve().parents[2]
PATCHSET = REPO / "patchsets" / "dyn-disable"
PATCH = PATCHSET / "0001-dyn-disable.patch"


def touched_paths(patch_text: str) -> list[tuple[str, bool]]:
    """(path, is_new) for each file of a git-style diff."""
    out = []
    for block in patch_text.split("diff --git ")[1:]:
        new = re.search(r"^\+\+\+ b/(\S+)", block, re.M).group(1)
        out.append((new, "--- /dev/null" in block))
    return out


@pytest.fixture(scope="session")
def patch_text() -> str:
    return PATCH.read_text()


@pytest.fixture(scope="session")
def pristine_tree(tmp_path_factory, patch_text) -> Path:
    """The pristine 0.5.11 versions of the files the patch modifies, in a fresh folder."""
    wheel = wheels.pristine("sglang", "0.5.11")
    root = tmp_path_factory.mktemp("pristine")
    for path, is_new in touched_paths(patch_text):
        if not is_new:
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(path))
    return root


@pytest.fixture(scope="session")
def patched_tree(tmp_path_factory, pristine_tree) -> Path:
    root = tmp_path_factory.mktemp("patched")
    shutil.copytree(pristine_tree, root, dirs_exist_ok=True)
    subprocess.run(["git", "apply", "--unsafe-paths", f"--directory={root.relative_to(root.anchor)}",
                    "-p1", str(PATCH)], check=True, cwd=root.anchor)
    return root


@pytest.fixture(scope="session")
def dyn(patched_tree):
    """The patch's policy module, loaded by path (it must not need torch or the rest of sglang)."""
    path = patched_tree / "sglang/srt/speculative/dyn_disable.py"
    spec = importlib.util.spec_from_file_location("dyn_disable_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

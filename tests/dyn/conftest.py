"""Fixtures for the dyn-disable patchset tests: the pristine files it touches, read from the real
SGLang wheels (hash-checked against RECORD), and the patched copy of them.

`patched_tree` is SGLang 0.5.11 with its diff (the v1 worker and the 0.5.11-only hunks are tested
on it alone); `release_tree` is parametrized over every release patchsets/dyn-disable/ has a diff
for (0.5.11 and 0.5.17, each from its own wheel with its own diff), for the tests of what both
releases share: the policy module, the v2 plain step, the refusals."""
from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest

from toolkit.patch import wheels

REPO = Path(__file__).resolve().parents[2]
PATCHSET = REPO / "patchsets" / "dyn-disable"
RELEASES = ("0.5.11", "0.5.17", "0.5.23")   # every release patchsets/dyn-disable/ has a diff for
V2_RELEASES = ("0.5.17", "0.5.23")   # the releases with only the v2 worker (the ScheduleBatch path)


def patch_for(release: str) -> Path:
    return PATCHSET / release / "0001-dyn-disable.patch"


PATCH = patch_for("0.5.11")


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


def git_apply(patch: Path, root: Path) -> list[str]:
    return ["git", "apply", "-p1", str(patch)]


def tree_with(root: Path, patches: list[Path], release: str = "0.5.11", applier=git_apply) -> Path:
    """The pristine files of SGLang `release` the patches touch, under root, with the patches
    applied in order by the command `applier(patch, root)` (`git apply` unless told)."""
    wheel = wheels.pristine("sglang", release)
    for patch in patches:
        for path, is_new in touched_paths(patch.read_text()):
            target = root / path
            if not is_new and wheel.has(path) and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(wheel.read(path))
    for patch in patches:
        done = subprocess.run(applier(patch, root), cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, f"{patch.name}: {done.stdout}{done.stderr}"
    return root


def load_by_path(name: str, path: Path):
    """A module of the patched tree, imported from its file (not from an installed sglang)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def public_attrs(module) -> dict:
    """A module's names without the dunders, for stub_modules (a real module stood in whole)."""
    return {k: v for k, v in vars(module).items() if not k.startswith("__")}


def method_source(path: Path, class_name: str, func_name: str) -> str:
    """The source of one method of a class in a (patched) file, for exec or inspection."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == func_name:
                    return ast.unparse(item)
    raise AssertionError(f"{class_name}.{func_name} not found in {path}")


@contextmanager
def stub_modules(modules: dict[str, dict]):
    """sys.modules entries {dotted name: attributes} (parent packages made empty) for the length of
    the block, so a patched module that imports GPU-only parts of sglang loads on the CPU."""
    saved = dict(sys.modules)
    stubs = {}
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        stubs[name] = module
        parts = name.split(".")
        for i in range(1, len(parts)):
            stubs.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in list(sys.modules):
            if name not in saved:
                del sys.modules[name]
        sys.modules.update(saved)


def function_source(path: Path, func_name: str) -> str:
    """The source of one module-level function of a (patched) file, for exec."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == func_name:
            return ast.unparse(node)
    raise AssertionError(f"{func_name} not found in {path}")


def assert_imports_without_torch(path: Path, check: str) -> None:
    """Import the module at `path` in a fresh interpreter, run `check` (an assert on `m`), and
    fail if that pulled in torch."""
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('d', {str(path)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            f"{check}\n"
            "assert 'torch' not in sys.modules, 'policy module pulled in torch'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


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
def patched_tree(tmp_path_factory) -> Path:
    return tree_with(tmp_path_factory.mktemp("patched"), [PATCH])


@pytest.fixture(scope="session", params=RELEASES)
def release(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def release_tree(tmp_path_factory, release) -> Path:
    """The files of SGLang `release` that its dyn-disable diff touches, patched."""
    return tree_with(tmp_path_factory.mktemp(f"dyn-patched-{release}"), [patch_for(release)], release)


@pytest.fixture(scope="session")
def dyn(release_tree, release):
    """The patch's policy module of each release, loaded by path (it must not need torch or the
    rest of sglang)."""
    return load_by_path(f"dyn_disable_under_test_{release.replace('.', '_')}",
                        release_tree / "sglang/srt/speculative/dyn_disable.py")

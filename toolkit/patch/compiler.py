"""Compile a stack of patchsets into file images, offline, on the control machine.

The pristine files come from the pinned wheel (each checked against RECORD). They are
laid out in a scratch git repository and every patch of the stack is applied in order
with `git apply --check` then `git apply` (GitPython). The result, per touched file:
the pristine sha256, the patched bytes and their sha256, and the patchset that touched
it last. Hosts then receive byte-identical files, and a conflict between patchsets
shows here, before any host is touched. Images are cached by (version, wheel, stack,
patch file hashes).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import git

from toolkit.core import paths
from toolkit.patch import wheels
from toolkit.patch.patchsets import Patchset, PatchsetError, check_path

CACHE_FORMAT = 1


class CompileError(RuntimeError):
    """The stack does not apply to the pristine release (a conflict or a bad patch)."""


@dataclass
class FileImage:
    path: str
    pristine_sha256: str | None      # None: the stack creates the file
    sha256: str | None               # None: the stack deletes the file
    content: bytes | None
    by: str                          # the patchset that touched it last


@dataclass
class Image:
    package: str
    version: str
    stack: list[str]
    files: dict[str, FileImage] = field(default_factory=dict)

    def sha_of(self, path: str) -> str | None:
        return self.files[path].sha256


def cache_key(stack: list[Patchset], version: str, wheel_sha: str) -> str:
    material = json.dumps([CACHE_FORMAT, version, wheel_sha, [[p.name, p.fingerprint(version)] for p in stack]])
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def _cache_path(key: str) -> Path:
    return paths.cache_dir() / "images" / f"{key}.json"


def _save(image: Image, key: str) -> None:
    target = _cache_path(key)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = {"package": image.package, "version": image.version, "stack": image.stack, "files": {
        p: {"pristine": f.pristine_sha256, "sha256": f.sha256, "by": f.by,
            "content": None if f.content is None else base64.b64encode(f.content).decode()}
        for p, f in image.files.items()}}
    tmp = target.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")  # hosts compile in parallel threads
    tmp.write_text(json.dumps(data))
    os.replace(tmp, target)


def _load(key: str) -> Image | None:
    try:
        data = json.loads(_cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    image = Image(data["package"], data["version"], data["stack"])
    for path, f in data["files"].items():
        content = None if f["content"] is None else base64.b64decode(f["content"])
        if content is not None and hashlib.sha256(content).hexdigest() != f["sha256"]:
            return None  # a damaged cache entry is recompiled, never trusted
        image.files[path] = FileImage(path, f["pristine"], f["sha256"], content, f["by"])
    return image


def _git_paths(repo: git.Repo, patch_path: Path, package: str, where: str) -> list[str]:
    """The paths as git itself reads them (not only as unidiff does), checked again."""
    listed = []
    for row in repo.git.apply("--numstat", str(patch_path)).splitlines():
        added, removed, name = row.split("\t", 2)
        if added == "-" or removed == "-":
            raise PatchsetError(f"{where}: binary hunks are not allowed ({name})")
        listed.append(check_path(name, package, where))
    return listed


def compile_stack(stack: list[Patchset], version: str, note=lambda text: None, use_cache: bool = True) -> Image:
    """Apply `stack` (bottom first) to the pristine files of PACKAGE==VERSION."""
    if not stack:
        return Image("sglang", version, [])
    package = stack[0].package
    for ps in stack:
        if ps.package != package:
            raise PatchsetError(f"{ps.name} patches {ps.package}, the stack below it patches {package}")
        if version not in ps.versions:
            raise PatchsetError(ps.no_release(version))
    wheel = wheels.pristine(package, version, note)
    key = cache_key(stack, version, wheel.sha256)
    if use_cache:
        cached = _load(key)
        if cached is not None:
            return cached
    note(f"compiling {' + '.join(p.name for p in stack)} against {package} {version}")
    touched = sorted({f.path for ps in stack for p in ps.patches(version) for f in p.files})
    with tempfile.TemporaryDirectory(prefix="toolkit-compile-") as tmp:
        root = Path(tmp)
        repo = git.Repo.init(root)
        for path in touched:
            if wheel.has(path):
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                (root / path).write_bytes(wheel.read(path))
        last_touch: dict[str, str] = {}
        below = ["pristine"]
        for ps in stack:
            for patch in ps.patches(version):
                where = f"{ps.name}/{version}/{patch.name}"
                git_paths = _git_paths(repo, patch.path, package, where)
                if sorted(set(git_paths)) != sorted({f.path for f in patch.files}):
                    raise PatchsetError(f"{where}: git and unidiff disagree on the files it touches")
                try:
                    repo.git.apply("--check", str(patch.path))
                    repo.git.apply(str(patch.path))
                except git.GitCommandError as exc:
                    raise CompileError(f"{where} does not apply on top of {' + '.join(below)} ({package} {version}):\n"
                                       f"{(exc.stderr or '').strip()}") from exc
                for f in patch.files:
                    last_touch[f.path] = ps.name
            below.append(ps.name)
        image = Image(package, version, [p.name for p in stack])
        for path in touched:
            content = (root / path).read_bytes() if (root / path).exists() else None
            image.files[path] = FileImage(
                path, wheel.record.get(path) if wheel.has(path) else None,
                None if content is None else wheels.sha256_hex(content), content, last_touch[path])
    _save(image, key)
    return image

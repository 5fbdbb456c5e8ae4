"""Patchsets as data: `patchsets/NAME/patchset.toml` plus git-style diffs per release, read and validated.

A patchset holds one folder per release of its package, `patchsets/NAME/<release>/`, with
the diffs for that release (`*.patch`, applied in file-name order); the releases it supports
are those folders. `unidiff` reads the diffs for metadata (files, hunks, added/removed
lines) and for the rules every patch must keep: paths relative to site-packages inside the
target package, no `..`, no absolute paths, no binary hunks. Stacking: a fixed `order`
(lower applies first) and `requires` (must already be applied below).
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
import sys
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path

from unidiff import PatchSet as UniPatchSet
from unidiff.errors import UnidiffParseError

from toolkit.core import paths

REQUIRED_KEYS = ("name", "summary", "package", "order")
OLD_LAYOUT_KEYS = ("versions", "patches")   # the one-release layout: diffs beside patchset.toml
RELEASE_NAME = re.compile(r"[0-9]+(\.[0-9]+)*(\.post[0-9]+)?")


class PatchsetError(ValueError):
    """A patchset is malformed, unknown, or breaks a rule; the message says which and how."""


def patchsets_dir() -> Path:
    return Path(os.environ.get("TOOLKIT_PATCHSETS", paths.PATCHSETS_DIR)).resolve()


def release_key(version: str) -> tuple:
    """Sort key of a release name: 0.5.9 < 0.5.11 < 0.5.15 < 0.5.15.post1."""
    if not RELEASE_NAME.fullmatch(version):
        return ((), -1, version)
    main, _, post = version.partition(".post")
    return tuple(int(p) for p in main.split(".")), int(post or -1), ""


@dataclass
class PatchFileStat:
    path: str
    hunks: int
    added: int
    removed: int
    created: bool = False
    deleted: bool = False


@dataclass
class PatchFile:
    name: str
    path: Path
    sha256: str
    text: str
    files: list[PatchFileStat]


@dataclass
class Patchset:
    name: str
    folder: Path
    summary: str
    description: str
    package: str
    order: int
    requires: list[str]
    releases: dict[str, list[str]]     # release -> its patch file names, in the order they apply
    env: dict = field(default_factory=dict)
    logs: dict = field(default_factory=dict)
    verified: list = field(default_factory=list)
    hooks: dict = field(default_factory=dict)   # [hooks] file = "hooks.py": toolkit-side code beside patchset.toml

    @property
    def print_prefixes(self) -> list[str]:
        """`[logs] print`: prefixes of log lines `invoke server start` shows once the server is ready."""
        return list(self.logs.get("print", []))

    @property
    def refuse_prefixes(self) -> list[str]:
        """`[logs] refuse`: prefixes of log lines saying the patched server turned the patch's
        feature down at start; `invoke server start` stops waiting for the feature's lines and
        fails with that line."""
        return list(self.logs.get("refuse", []))

    @property
    def versions(self) -> list[str]:
        """The releases this patchset has diffs for, oldest first."""
        return sorted(self.releases, key=release_key)

    def release_folder(self, version: str) -> Path:
        return self.folder / version

    def no_release(self, version: str) -> str:
        """Why this patchset cannot go onto VERSION, with the command that fixes it."""
        return (f"{self.name} has no diff for {self.package} {version} (it has: {', '.join(self.versions) or 'none yet'});"
                f" port it with `invoke patch port {self.name} --to {version}`")

    def patches(self, version: str, allow_missing: bool = False) -> list[PatchFile]:
        if version not in self.releases:
            raise PatchsetError(self.no_release(version))
        found = []
        for name in self.releases[version]:
            path = self.release_folder(version) / name
            if not path.exists():
                if allow_missing:
                    continue
                raise PatchsetError(f"{self.name}/{version}/{name} is gone since the patchsets were read;"
                                    f" run the command again")
            found.append(read_patch(path, self.package, owner=f"{self.name}/{version}"))
        return found

    def touched(self, version: str | None = None) -> list[str]:
        """The files the diffs of VERSION touch (of every release when None)."""
        versions = self.versions if version is None else [version]
        return sorted({f.path for v in versions for p in self.patches(v, allow_missing=True) for f in p.files})

    def fingerprint(self, version: str) -> list[str]:
        return [f"{p.name}:{p.sha256}" for p in self.patches(version)]


def _strip(name: str, prefix: str) -> str | None:
    if name in ("/dev/null", None):
        return None
    return name[len(prefix):] if name.startswith(prefix) else name


def check_path(path: str, package: str, where: str) -> str:
    """A patch path must name a file inside the package directory, relative to site-packages."""
    top = package.replace("-", "_").lower()
    normal = posixpath.normpath(path)
    if (path.startswith("/") or "\\" in path or ".." in path.split("/") or normal != path
            or not normal.startswith(top + "/")):
        raise PatchsetError(f"{where}: path {path!r} leaves the package; every path must be"
                            f" relative to site-packages and inside {top}/ (e.g. a/{top}/srt/x.py)")
    return normal


def _crlf_header(text: str) -> str | None:
    """The first file header that ends in CR: the whole patch file was saved with CRLF endings.
    Content lines may end in CR legitimately (a patch of a CRLF file); headers never do."""
    lines = text.split("\n")
    headers = [line for line in lines if line.startswith("diff --git ")]
    if not headers:  # a plain unified diff: its first old-file header
        headers = [line for line in lines if line.startswith("--- ")][:1]
    return next((line for line in headers if line.endswith("\r")), None)


def read_patch(path: Path, package: str, owner: str = "") -> PatchFile:
    where = f"{owner + ': ' if owner else ''}{path.name}"
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PatchsetError(f"{where}: not UTF-8 text ({exc})") from exc
    crlf_header = _crlf_header(text)
    if crlf_header is not None:
        raise PatchsetError(f"{where}: the patch file has CRLF (Windows) line endings ({crlf_header[:-1]!r} ends"
                            f" in \\r); git-style diffs need LF: convert it with `sed -i 's/\\r$//' {path}`"
                            f" (or `dos2unix {path}`) and check it again")
    if "GIT binary patch" in text:
        raise PatchsetError(f"{where}: binary hunks are not allowed (GIT binary patch)")
    try:
        parsed = UniPatchSet(text)
    except UnidiffParseError as exc:
        raise PatchsetError(f"{where}: not a unified diff: {exc}") from exc
    if not parsed and text.strip():
        raise PatchsetError(f"{where}: no file changes found; is it a git-style unified diff?")
    stats = []
    for pf in parsed:
        if pf.is_binary_file:
            raise PatchsetError(f"{where}: binary hunks are not allowed ({pf.path})")
        source, target = _strip(pf.source_file, "a/"), _strip(pf.target_file, "b/")
        for name in filter(None, (source, target)):
            check_path(name, package, where)
        if source and target and source != target:
            raise PatchsetError(f"{where}: renames are not supported ({source} -> {target})")
        stats.append(PatchFileStat(path=target or source, hunks=len(pf), added=pf.added,
                                   removed=pf.removed, created=source is None, deleted=target is None))
    return PatchFile(path.name, path, hashlib.sha256(raw).hexdigest(), text, stats)


def _releases(folder: Path) -> dict[str, list[str]]:
    """The release folders of a patchset and the diffs in each (file-name order)."""
    stray = sorted(p.name for p in folder.glob("*.patch"))
    if stray:
        raise PatchsetError(f"{folder.name}: patch files belong in a folder named after the release they are for;"
                            f" move them, e.g. `git mv {folder}/*.patch {folder}/0.5.11/`")
    releases = {}
    for sub in sorted(folder.iterdir()):
        if not sub.is_dir() or sub.name.startswith((".", "_")):
            continue
        if not RELEASE_NAME.fullmatch(sub.name):
            raise PatchsetError(f"{folder.name}/{sub.name}: a release folder is named after the release,"
                                f" e.g. 0.5.11 or 0.5.15.post1")
        names = sorted(p.name for p in sub.glob("*.patch"))
        if not names:
            raise PatchsetError(f"{folder.name}/{sub.name}/ holds no .patch file; remove the empty folder"
                                f" (`rmdir {sub}`); diffs for {sub.name} come from `invoke patch port"
                                f" {folder.name} --to {sub.name}` (from another release), or, while"
                                f" {folder.name} has none yet, `invoke patch edit {folder.name} --release"
                                f" {sub.name}` then `invoke patch refresh {folder.name}`")
        releases[sub.name] = names
    return releases


def _load_one(folder: Path) -> Patchset:
    toml_path = folder / "patchset.toml"
    try:
        data = tomllib.loads(toml_path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PatchsetError(f"cannot read {folder.name}/patchset.toml: {exc}") from exc
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise PatchsetError(f"{folder.name}/patchset.toml lacks: {', '.join(missing)}")
    if data["name"] != folder.name:
        raise PatchsetError(f"{folder.name}/patchset.toml: name {data['name']!r} must equal the folder name")
    old_keys = [key for key in OLD_LAYOUT_KEYS if key in data]
    if old_keys:
        release = (data.get("versions") or ["0.5.11"])[0]
        raise PatchsetError(f"{folder.name}/patchset.toml: {' and '.join(old_keys)} belong to the old one-release"
                            f" layout; the releases are now the folders {folder.name}/<release>/: run"
                            f" `mkdir {folder}/{release} && git mv {folder}/*.patch {folder}/{release}/`"
                            f" and remove {' and '.join(old_keys)} from patchset.toml")
    releases = _releases(folder)
    logs = data.get("logs", {})
    for key in ("startup", "print", "refuse"):
        lines = logs.get(key, [])
        if not isinstance(lines, list) or not all(isinstance(x, str) and x.strip() for x in lines):
            raise PatchsetError(f"{folder.name}/patchset.toml: [logs] {key} must be a list of non-empty strings"
                                f" (log line prefixes), not {lines!r}")
    hooks = data.get("hooks", {})
    if not isinstance(hooks, dict) or set(hooks) - {"file"}:
        raise PatchsetError(f"{folder.name}/patchset.toml: [hooks] takes one key, file (a .py file beside"
                            f" patchset.toml), not {hooks!r}")
    if "file" in hooks:
        name = hooks["file"]
        if (not isinstance(name, str) or posixpath.normpath(name) != name or "/" in name
                or not name.endswith(".py") or not (folder / name).is_file()):
            raise PatchsetError(f"{folder.name}/patchset.toml: [hooks] file = {name!r} must name a .py file"
                                f" in {folder.name}/ itself")
    return Patchset(
        name=data["name"], folder=folder, summary=data["summary"], description=data.get("description", ""),
        package=data["package"], order=int(data["order"]), requires=list(data.get("requires", [])),
        releases=releases,
        env=dict(data.get("env", {})), logs=dict(data.get("logs", {})), verified=list(data.get("verified", [])),
        hooks=dict(hooks))


def load_all(folder: Path | None = None) -> dict[str, Patchset]:
    """Every patchset under `folder` (default `patchsets/`, or TOOLKIT_PATCHSETS), by name."""
    folder = (folder or patchsets_dir()).resolve()
    found = {}
    if folder.is_dir():
        for sub in sorted(folder.iterdir()):
            if (sub / "patchset.toml").is_file():
                found[sub.name] = _load_one(sub)
    for ps in found.values():
        for req in ps.requires:
            if req not in found:
                raise PatchsetError(f"{ps.name} requires {req!r}, which is not a known patchset")
    return found


def get(name: str, known: dict[str, Patchset]) -> Patchset:
    if name not in known:
        names = ", ".join(sorted(known)) or "none"
        raise PatchsetError(f"unknown patchset {name!r}; known: {names} (see `invoke patch list`)")
    return known[name]


def sort_stack(names, known: dict[str, Patchset]) -> list[str]:
    """The fixed stacking order: by `order`, then name; a requirement must sit below."""
    stack = sorted(set(names), key=lambda n: (known[n].order, n))
    for position, name in enumerate(stack):
        for req in known[name].requires:
            if req in stack and stack.index(req) > position:
                raise PatchsetError(f"{name} requires {req} but {req} has a higher order;"
                                    f" fix `order` in their patchset.toml files")
    return stack


def requirement_closure(name: str, known: dict[str, Patchset]) -> list[str]:
    """NAME and everything it requires, transitively, in stacking order."""
    seen: list[str] = []

    def visit(n: str, path: tuple):
        if n in path:
            raise PatchsetError(f"requirement cycle: {' -> '.join(path + (n,))}")
        for req in get(n, known).requires:
            visit(req, path + (n,))
        if n not in seen:
            seen.append(n)

    visit(name, ())
    return sort_stack(seen, known)


_ADDED_MODULES: dict[str, types.ModuleType] = {}


def added_file_text(name: str, path: str, known: dict[str, Patchset] | None = None,
                    version: str | None = None) -> str:
    """The text of a file that patchset `name` adds to the package (`path` relative to
    site-packages), read out of its diff for `version` (default: its newest release): code the
    toolkit shares with the patched server."""
    known = known if known is not None else load_all()
    patchset = get(name, known)
    if version is None:
        if not patchset.versions:
            raise PatchsetError(f"patchset {name} has no release folder yet")
        version = patchset.versions[-1]
    for patch in patchset.patches(version):
        for patched in UniPatchSet(patch.text):
            if patched.target_file == f"b/{path}" and patched.is_added_file:
                return "".join(line.value for hunk in patched for line in hunk if line.is_added)
    raise PatchsetError(f"patchset {name} does not add {path}")


def added_module(name: str, path: str, known: dict[str, Patchset] | None = None,
                 version: str | None = None) -> types.ModuleType:
    """That file loaded as a module (standard library only; cached per content)."""
    text = added_file_text(name, path, known, version)
    key = hashlib.sha256(text.encode()).hexdigest()
    if key not in _ADDED_MODULES:
        stem = posixpath.splitext(posixpath.basename(path))[0]
        module = types.ModuleType(f"toolkit_patchset_{stem}_{key[:12]}")
        module.__file__ = f"<{name} patchset: {path}>"
        sys.modules[module.__name__] = module  # dataclasses look their module up there
        exec(compile(text, module.__file__, "exec"), module.__dict__)
        _ADDED_MODULES[key] = module
    return _ADDED_MODULES[key]

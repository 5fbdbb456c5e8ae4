"""Writing patchsets: quilt's push/refresh, done with git.

`edit(NAME)` lays out the pristine files of the pinned release (the whole package, from
the wheel, checked against RECORD) as a git work tree in `cache_dir()/edit/NAME/`, with
every patchset NAME requires applied as commits, then NAME's own patches as commits. The
tag `toolkit-base` marks the commit before NAME's last patch. Edit files there (commit
or not, add new files); `refresh(NAME)` exports everything since `toolkit-base` as NAME's
last patch file (`0001-NAME.patch` for a new patchset, whose patchset.toml it writes).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git

from . import patchsets, paths, wheels
from .patchsets import PatchsetError

DEFAULT_VERSION = "0.5.11"
BASE_TAG = "toolkit-base"
META_FILE = "toolkit-edit.json"


class AuthoringError(RuntimeError):
    pass


@dataclass
class EditResult:
    name: str
    tree: Path
    version: str
    below: list[str]
    own_patches: list[str]
    files: int
    new_patchset: bool


@dataclass
class RefreshResult:
    name: str
    patch: Path
    files: int
    hunks: int
    added: int
    removed: int
    wrote_toml: bool


def edit_dir(name: str) -> Path:
    return paths.cache_dir() / "edit" / name


def _commit(repo: git.Repo, message: str) -> None:
    repo.git.add("-A")
    repo.git.commit("-q", "--allow-empty", "-m", message)


def edit(name: str, requires: list[str] | None = None, version: str | None = None, fresh: bool = False,
         note=lambda text: None) -> EditResult:
    known = patchsets.load_all()
    tree = edit_dir(name)
    if tree.exists():
        if not fresh:
            raise AuthoringError(f"{tree} already exists: edit there and run `invoke patch refresh {name}`,"
                                 f" or start over with `invoke patch edit {name} --fresh` (drops edits not refreshed)")
        shutil.rmtree(tree)
    existing = known.get(name)
    if existing:
        if requires:
            raise AuthoringError(f"{name} exists; change `requires` in its patchset.toml instead of --requires")
        below = patchsets.requirement_closure(name, known)[:-1]
        version = version or existing.versions[0]
        package = existing.package
        own = existing.patches(allow_missing=True)
    else:
        below = []
        for req in requires or []:
            below += patchsets.requirement_closure(req, known)
        below = patchsets.sort_stack(below, known)
        package = "sglang"
        version = version or (known[below[-1]].versions[0] if below else DEFAULT_VERSION)
        own = []
    wheel = wheels.pristine(package, version, note)
    files = wheel.package_files()
    note(f"laying out {len(files)} pristine files of {package} {version} in {tree}")
    tree.mkdir(parents=True)
    repo = git.Repo.init(tree)
    with repo.config_writer() as cfg:
        cfg.set_value("user", "name", "toolkit patch edit")
        cfg.set_value("user", "email", "toolkit@localhost")
    (tree / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    for rel in files:
        target = tree / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(wheel.read(rel))
    _commit(repo, f"pristine {package} {version}")
    for ps_name in below:
        for patch in known[ps_name].patches():
            _apply(repo, patch.path, f"{ps_name}/{patch.name}")
            _commit(repo, f"{ps_name}: {patch.name}")
    for patch in own[:-1]:
        _apply(repo, patch.path, f"{name}/{patch.name}")
        _commit(repo, f"{name}: {patch.name}")
    repo.create_tag(BASE_TAG)
    if own:
        _apply(repo, own[-1].path, f"{name}/{own[-1].name}")
        _commit(repo, f"{name}: {own[-1].name} (edit on top; refresh exports everything since {BASE_TAG})")
    meta = {"name": name, "package": package, "version": version, "below": below,
            "requires": requires or (existing.requires if existing else []),
            "patch": own[-1].name if own else (existing.patch_names[-1] if existing and existing.patch_names
                                               else f"0001-{name}.patch")}
    (Path(repo.git_dir) / META_FILE).write_text(json.dumps(meta, indent=1))
    return EditResult(name, tree, version, below, [p.name for p in own], len(files), existing is None)


def _apply(repo: git.Repo, patch: Path, where: str) -> None:
    try:
        repo.git.apply(str(patch))
    except git.GitCommandError as exc:
        raise AuthoringError(f"{where} does not apply in the edit tree: {(exc.stderr or '').strip()}") from exc


def export_diff(tree: Path) -> str:
    """Everything since toolkit-base (commits, uncommitted and new files), via a scratch index."""
    repo = git.Repo(tree)
    with tempfile.TemporaryDirectory() as tmp:
        with repo.git.custom_environment(GIT_INDEX_FILE=str(Path(tmp) / "index")):
            repo.git.read_tree("HEAD")
            repo.git.add("-A")
            return repo.git.diff("--cached", "--no-color", "--no-ext-diff", "--no-renames", BASE_TAG,
                                 "--", ".", ":(exclude).gitignore", strip_newline_in_stdout=False)


def refresh(name: str, note=lambda text: None) -> RefreshResult:
    tree = edit_dir(name)
    meta_path = tree / ".git" / META_FILE
    if not meta_path.exists():
        raise AuthoringError(f"no edit tree for {name}: run `invoke patch edit {name}` first")
    meta = json.loads(meta_path.read_text())
    diff = export_diff(tree)
    if not diff.strip():
        raise AuthoringError(f"no changes in {tree} since {BASE_TAG}: nothing to refresh")
    folder = patchsets.patchsets_dir() / name
    toml_path = folder / "patchset.toml"
    wrote_toml = not toml_path.exists()
    folder.mkdir(parents=True, exist_ok=True)
    patch_path = folder / meta["patch"]
    candidate = folder / f".{meta['patch']}.new"
    candidate.write_text(diff)
    try:
        parsed = patchsets.read_patch(candidate, meta["package"], owner=name)
    except PatchsetError:
        candidate.unlink()
        raise
    candidate.replace(patch_path)
    if wrote_toml:
        known = patchsets.load_all()
        order = max((p.order for p in known.values()), default=0) + 10
        toml_path.write_text(_skeleton(name, meta, order))
    note(f"wrote {patch_path}")
    return RefreshResult(name, patch_path, len(parsed.files), sum(f.hunks for f in parsed.files),
                         sum(f.added for f in parsed.files), sum(f.removed for f in parsed.files), wrote_toml)


def _skeleton(name: str, meta: dict, order: int) -> str:
    requires = ", ".join(f'"{r}"' for r in meta["requires"])
    return (f'name = "{name}"\n'
            f'summary = "TODO: one line for `invoke patch list`"\n'
            f'description = """TODO: what it changes and why"""\n'
            f'package = "{meta["package"]}"\n'
            f'versions = ["{meta["version"]}"]\n'
            f'order = {order}\n'
            f'requires = [{requires}]\n'
            f'patches = ["{meta["patch"]}"]\n'
            f'\n[env]\n\n[logs]\nstartup = []\n')

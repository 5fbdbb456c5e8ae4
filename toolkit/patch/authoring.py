"""Writing patchsets: quilt's push/refresh, done with git.

`edit(NAME)` lays out the pristine files of a release (NAME's newest unless `version` says
which; the whole package, from the wheel, checked against RECORD) as a git work tree in
`cache_dir()/edit/NAME/`, with every patchset NAME requires applied as commits, then NAME's
own patches for that release as commits. The tag `toolkit-base` marks the commit before
NAME's last patch. Edit files there (commit or not, add new files); `refresh(NAME)` exports
everything since `toolkit-base` as NAME's last patch file of that release
(`patchsets/NAME/<release>/0001-NAME.patch` for a new one; a new patchset also gets its
patchset.toml). `toolkit.patch.porting` lays out the same kind of tree for a rebase onto another
release.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git

from toolkit.patch import patchsets, wheels
from toolkit.core import paths
from toolkit.patch.patchsets import PatchsetError

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
    version: str = ""
    toml: Path | None = None


def edit_dir(name: str) -> Path:
    return paths.cache_dir() / "edit" / name


def commit(repo: git.Repo, message: str) -> None:
    repo.git.add("-A")
    repo.git.commit("-q", "--allow-empty", "-m", message)


def new_tree(name: str, fresh: bool) -> Path:
    """The (empty) edit tree folder of NAME; an existing one is only thrown away with `fresh`."""
    tree = edit_dir(name)
    if tree.exists():
        if not fresh:
            raise AuthoringError(f"{tree} already exists: edit there and run `invoke patch refresh {name}`,"
                                 f" or start over with `--fresh` (drops edits not refreshed)")
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    return tree


def init_repo(tree: Path) -> git.Repo:
    repo = git.Repo.init(tree)
    with repo.config_writer() as cfg:
        cfg.set_value("user", "name", "toolkit patch edit")
        cfg.set_value("user", "email", "toolkit@localhost")
        cfg.set_value("merge", "conflictStyle", "diff3")   # conflict markers show the old release's lines too
    (tree / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    return repo


def lay_out_release(repo: git.Repo, package: str, version: str, note=lambda text: None) -> int:
    """Make the work tree hold exactly the package files of PACKAGE==VERSION, committed."""
    tree = Path(repo.working_tree_dir)
    wheel = wheels.pristine(package, version, note)
    files = wheel.package_files()
    top = tree / files[0].split("/", 1)[0] if files else None
    if top is not None and top.exists():
        shutil.rmtree(top)  # another release was here: its files go, git records the difference
    note(f"laying out {len(files)} pristine files of {package} {version} in {tree}")
    for rel in files:
        target = tree / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(wheel.read(rel))
    commit(repo, f"pristine {package} {version}")
    return len(files)


def apply_stack(repo: git.Repo, known: dict, names: list[str], version: str) -> None:
    """Each patch of each patchset in NAMES for VERSION, as one commit each."""
    for ps_name in names:
        for patch in known[ps_name].patches(version):
            apply_patch_file(repo, patch.path, f"{ps_name}/{version}/{patch.name}")
            commit(repo, f"{ps_name}: {patch.name}")


def write_meta(repo: git.Repo, meta: dict) -> None:
    (Path(repo.git_dir) / META_FILE).write_text(json.dumps(meta, indent=1))


def _release_below(known: dict, below: list[str], version: str) -> None:
    for req in below:
        if version not in known[req].versions:
            raise AuthoringError(known[req].no_release(version))


def edit(name: str, requires: list[str] | None = None, version: str | None = None, fresh: bool = False,
         note=lambda text: None) -> EditResult:
    known = patchsets.load_all()
    existing = known.get(name)
    if existing:
        if requires:
            raise AuthoringError(f"{name} exists; change `requires` in its patchset.toml instead of --requires")
        below = patchsets.requirement_closure(name, known)[:-1]
        version = version or (existing.versions[-1] if existing.versions else DEFAULT_VERSION)
        if existing.versions and version not in existing.versions:
            raise AuthoringError(existing.no_release(version))
        package = existing.package
        own = existing.patches(version, allow_missing=True) if version in existing.versions else []
        listed = existing.releases.get(version, [])
    else:
        below = []
        for req in requires or []:
            below += patchsets.requirement_closure(req, known)
        below = patchsets.sort_stack(below, known)
        package = "sglang"
        version = version or (known[below[-1]].versions[-1] if below and known[below[-1]].versions
                              else DEFAULT_VERSION)
        own, listed = [], []
    _release_below(known, below, version)
    tree = new_tree(name, fresh)
    repo = init_repo(tree)
    files = lay_out_release(repo, package, version, note)
    apply_stack(repo, known, below, version)
    for patch in own[:-1]:
        apply_patch_file(repo, patch.path, f"{name}/{version}/{patch.name}")
        commit(repo, f"{name}: {patch.name}")
    repo.create_tag(BASE_TAG)
    if own:
        apply_patch_file(repo, own[-1].path, f"{name}/{version}/{own[-1].name}")
        commit(repo, f"{name}: {own[-1].name} (edit on top; refresh exports everything since {BASE_TAG})")
    write_meta(repo, {"name": name, "package": package, "version": version, "below": below,
                      "requires": requires or (existing.requires if existing else []),
                      "patch": own[-1].name if own else (listed[-1] if listed else f"0001-{name}.patch")})
    return EditResult(name, tree, version, below, [p.name for p in own], files, existing is None)


def apply_patch_file(repo: git.Repo, patch: Path, where: str) -> None:
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


CONFLICT_MARKERS = ("+<<<<<<< ", "+>>>>>>> ", "+||||||| ")


def conflicted_files(diff: str) -> list[str]:
    """Files whose exported diff still adds git conflict markers."""
    found, current = [], None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            current = line[len("+++ b/"):] if line.startswith("+++ b/") else line[4:]
        elif current and (line.startswith(CONFLICT_MARKERS) or line == "+======="):
            if current not in found:
                found.append(current)
    return found


def write_patch(name: str, version: str, patch_name: str, diff: str, package: str) -> tuple[Path, patchsets.PatchFile]:
    """Validate DIFF and write it as patchsets/NAME/VERSION/PATCH_NAME (atomically)."""
    folder = patchsets.patchsets_dir() / name / version
    folder.mkdir(parents=True, exist_ok=True)
    patch_path = folder / patch_name
    candidate = folder / f".{patch_name}.new"
    candidate.write_text(diff)
    try:
        parsed = patchsets.read_patch(candidate, package, owner=name)
    except PatchsetError:
        candidate.unlink()
        raise
    candidate.replace(patch_path)
    return patch_path, parsed


def refresh(name: str, note=lambda text: None) -> RefreshResult:
    tree = edit_dir(name)
    meta_path = tree / ".git" / META_FILE
    if not meta_path.exists():
        raise AuthoringError(f"no edit tree for {name}: run `invoke patch edit {name}` first")
    meta = json.loads(meta_path.read_text())
    diff = export_diff(tree)
    if not diff.strip():
        raise AuthoringError(f"no changes in {tree} since {BASE_TAG}: nothing to refresh")
    conflicted = conflicted_files(diff)
    if conflicted:
        raise AuthoringError(f"conflict markers (<<<<<<< ||||||| ======= >>>>>>>) are left in {', '.join(conflicted)}"
                             f" under {tree}: resolve them, then run `invoke patch refresh {name}` again;"
                             f" nothing written")
    folder = patchsets.patchsets_dir() / name
    toml_path = folder / "patchset.toml"
    wrote_toml = not toml_path.exists()
    patch_path, parsed = write_patch(name, meta["version"], meta["patch"], diff, meta["package"])
    if wrote_toml:
        known = patchsets.load_all()
        order = max((p.order for p in known.values()), default=0) + 10
        toml_path.write_text(_skeleton(name, meta, order))
    note(f"wrote {patch_path}")
    return RefreshResult(name, patch_path, len(parsed.files), sum(f.hunks for f in parsed.files),
                         sum(f.added for f in parsed.files), sum(f.removed for f in parsed.files), wrote_toml,
                         meta["version"], toml_path)


def _skeleton(name: str, meta: dict, order: int) -> str:
    requires = ", ".join(f'"{r}"' for r in meta["requires"])
    return (f'name = "{name}"\n'
            f'summary = "TODO: one line for `invoke patch list`"\n'
            f'description = """TODO: what it changes and why"""\n'
            f'package = "{meta["package"]}"\n'
            f'order = {order}\n'
            f'requires = [{requires}]\n'
            f'\n[env]\n\n[logs]\nstartup = []\n')

"""Carry a patchset onto another release of its package: a three-way rebase done with git.

`port(NAME, to=NEW)` lays out NAME's edit tree (`cache_dir()/edit/NAME/`, the tree
`invoke patch edit` uses) with this history:

    pristine OLD  --  requirements (OLD diffs)  --  NAME (OLD diffs)      tag toolkit-port-old
         \\
          pristine NEW  --  requirements (NEW diffs)                      tag toolkit-base

then replays NAME's change onto `toolkit-base` with `git cherry-pick --no-commit`: git's
three-way merge of base OLD+requirements, ours NEW+requirements, theirs OLD+requirements+NAME.

Before that, every hunk of NAME's change is tried alone on the NEW tree with `git apply
--check` (exact context, never fuzz), placed at its old-side line: "as is" (same line),
"moved" (same lines found at an offset), or "conflicted" (its lines are not in NEW as they
were). A port that fails while laying out the tree removes it. Only when every hunk is as
is or moved and the merge is clean are NEW's diffs written (`patchsets/NAME/NEW/`) and
checked. Otherwise nothing is written: the merge is left in the work tree (conflict markers
in diff3 style where git could not merge; a hunk git merged although its lines changed is
listed for review) and the result says the next steps, ending with `invoke patch refresh NAME`.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import git
from unidiff import PatchSet as UniPatchSet

from toolkit.patch import authoring, patching, patchsets, wheels
from toolkit.patch.authoring import BASE_TAG, AuthoringError
from toolkit.patch.patchsets import PatchsetError

OLD_TAG = "toolkit-port-old"
OLD_BASE_TAG = "toolkit-port-old-base"
_OFFSET = re.compile(r"Hunk #1 succeeded at (\d+) \(offset (-?\d+) lines?\)")


class PortError(AuthoringError):
    """The port cannot start (unknown release, requirement not ported, tree in the way)."""


@dataclass
class HunkReport:
    path: str
    number: int            # 1-based, within the file
    header: str            # "@@ -120,7 +120,9 @@ def foo"
    status: str            # as is | moved | conflicted
    offset: int = 0        # moved: lines, + further down in NEW
    detail: str = ""       # conflicted: what happened to it in the work tree


@dataclass
class PortResult:
    name: str
    source: str            # the release the diffs came from
    target: str            # the release they go to
    tree: Path
    below: list[str]
    hunks: list[HunkReport] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    markers: list[str] = field(default_factory=list)    # files left with conflict markers
    review: list[str] = field(default_factory=list)     # files git merged although a hunk's lines changed
    gone: list[str] = field(default_factory=list)       # files NAME changes that NEW no longer has
    check: patching.CompileReport | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return bool(self.written)

    def count(self, status: str) -> int:
        return sum(h.status == status for h in self.hunks)

    def next_steps(self) -> list[str]:
        if self.clean:
            return [f"invoke patch apply {self.name} --host H   # on a host with {self.target}"]
        steps = [f"cd {self.tree}", "git status   # conflicted files show as 'both modified' or 'deleted by us'"]
        for path in self.markers:
            steps.append(f"$EDITOR {path}   # resolve the <<<<<<< ||||||| ======= >>>>>>> blocks")
        for path in self.review:
            steps.append(f"$EDITOR {path}   # git merged it although the lines around the change moved: check it")
        for path in self.gone:
            steps.append(f"# {path} is gone in {self.target}: move the change to where that code went, then"
                         f" `git rm {path}`")
        steps.append(f"invoke patch refresh {self.name}   # writes patchsets/{self.name}/{self.target}/ and checks it")
        return steps


def _alone(pf, hunk) -> str:
    """The hunk with its new-side start set to its old-side start.

    In NAME's patch a hunk's new-side start counts the lines that the hunks above it added or
    removed, and `git apply` looks for a hunk at its new-side start (it expects the hunks
    above to be applied already). Tried alone, nothing above it is applied, so it belongs
    where its old lines were: the offset git reports is then how far upstream moved them."""
    if pf.is_added_file:
        return str(hunk)
    start = hunk.source_start if hunk.source_length else hunk.source_start + 1
    head = f"@@ -{hunk.source_start},{hunk.source_length} +{start},{hunk.target_length} @@"
    if hunk.section_header:
        head += f" {hunk.section_header}"
    return head + "\n" + str(hunk).split("\n", 1)[1]


def _hunk_patch(pf, hunk) -> str:
    """One hunk as a git patch of its own, placed where its old lines were."""
    path = pf.path
    head = f"diff --git a/{path} b/{path}\n"
    if pf.is_added_file:
        head += "new file mode 100644\n"
    elif pf.is_removed_file:
        head += "deleted file mode 100644\n"
    source = "/dev/null" if pf.is_added_file else f"a/{path}"
    target = "/dev/null" if pf.is_removed_file else f"b/{path}"
    return f"{head}--- {source}\n+++ {target}\n{_alone(pf, hunk)}"


def _try_hunk(repo: git.Repo, text: str) -> tuple[str, int]:
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False) as f:
        f.write(text if text.endswith("\n") else text + "\n")
    try:
        with repo.git.custom_environment(LC_ALL="C", LANG="C"):
            status, _, err = repo.git.apply("--check", "-v", f.name, with_extended_output=True,
                                            with_exceptions=False)
    finally:
        os.unlink(f.name)
    if status != 0:
        return "conflicted", 0
    moved = _OFFSET.search(err or "")
    if moved and int(moved.group(2)) != 0:
        return "moved", int(moved.group(2))
    return "as is", 0


def classify(repo: git.Repo, change: str) -> list[HunkReport]:
    """Every hunk of CHANGE tried alone on the work tree as it is now (exact context only)."""
    found = []
    for pf in UniPatchSet(change):
        for number, hunk in enumerate(pf, 1):
            status, offset = _try_hunk(repo, _hunk_patch(pf, hunk))
            header = str(hunk).split("\n", 1)[0]
            found.append(HunkReport(pf.path, number, header, status, offset))
    return found


def _diff(repo: git.Repo, a: str, b: str) -> str:
    return repo.git.diff("--no-color", "--no-ext-diff", "--no-renames", a, b, "--", ".", ":(exclude).gitignore",
                         strip_newline_in_stdout=False)


def _has_markers(path: Path) -> bool:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return False
    return any(line.startswith(("<<<<<<< ", ">>>>>>> ")) for line in text.splitlines())


def _pick_releases(ps: patchsets.Patchset, to: str, source: str | None) -> str:
    if not patchsets.RELEASE_NAME.fullmatch(to):
        raise PortError(f"--to {to!r} is not a release name like 0.5.17")
    if to in ps.versions:
        raise PortError(f"{ps.name} already has diffs for {to} ({ps.release_folder(to)}); change them with"
                        f" `invoke patch edit {ps.name} --release {to}` then `invoke patch refresh {ps.name}`")
    if source is None:
        if not ps.versions:
            raise PortError(f"{ps.name} has no diffs to port yet")
        return ps.versions[-1]
    if source not in ps.versions:
        raise PortError(f"{ps.name} has no diffs for {source} (it has: {', '.join(ps.versions)})")
    return source


def _lay_out(tree: Path, name: str, ps, known: dict, below: list[str], source: str, to: str, note):
    """The edit tree's history (module docstring) and the report of every hunk tried alone."""
    repo = authoring.init_repo(tree)
    result = PortResult(name, source, to, tree, below)
    authoring.lay_out_release(repo, ps.package, source, note)
    pristine_old = repo.head.commit.hexsha
    authoring.apply_stack(repo, known, below, source)
    repo.create_tag(OLD_BASE_TAG)
    own = ps.patches(source)
    for patch in own:
        authoring.apply_patch_file(repo, patch.path, f"{name}/{source}/{patch.name}")
    authoring.commit(repo, f"{name} on {ps.package} {source}")
    repo.create_tag(OLD_TAG)
    change = _diff(repo, OLD_BASE_TAG, OLD_TAG)

    repo.git.checkout("-q", "-b", f"release-{to}", pristine_old)
    authoring.lay_out_release(repo, ps.package, to, note)
    authoring.apply_stack(repo, known, below, to)
    repo.create_tag(BASE_TAG)
    note(f"trying each hunk of {name} ({source}) on {ps.package} {to}")
    result.hunks = classify(repo, change)
    return repo, result


def port(name: str, to: str, source: str | None = None, fresh: bool = False, note=lambda text: None) -> PortResult:
    known = patchsets.load_all()
    ps = patchsets.get(name, known)
    source = _pick_releases(ps, to, source)
    below = patchsets.requirement_closure(name, known)[:-1]
    for req in below:
        if source not in known[req].versions:
            raise PortError(f"{name} requires {req}, which has no diffs for {source} to port from")
        if to not in known[req].versions:
            raise PortError(f"{name} requires {req}, which has no diffs for {to}: port it first:"
                            f" `invoke patch port {req} --to {to}`")
    if authoring.edit_dir(name).exists() and not fresh:
        authoring.new_tree(name, fresh)  # refuses, naming the tree and --fresh
    for version in (source, to):
        wheels.pristine(ps.package, version, note)  # both wheels first: a release that does not exist writes nothing
    tree = authoring.new_tree(name, fresh)
    try:
        repo, result = _lay_out(tree, name, ps, known, below, source, to, note)
    except BaseException:
        shutil.rmtree(tree, ignore_errors=True)  # a half-built tree would only be in the next port's way
        raise
    own = ps.patches(source)

    note(f"three-way merge of {name} onto {ps.package} {to}")
    status, _, _ = repo.git.cherry_pick("--no-commit", OLD_TAG, with_extended_output=True, with_exceptions=False)
    patch_name = own[0].name if len(own) == 1 else f"0001-{name}.patch"
    if len(own) > 1:
        result.notes.append(f"{len(own)} patch files on {source} become one, {patch_name}, on {to}")
    authoring.write_meta(repo, {"name": name, "package": ps.package, "version": to, "below": below,
                                "requires": ps.requires, "patch": patch_name, "ported_from": source})
    unmerged = set(repo.git.diff("--name-only", "--diff-filter=U").split())
    deleted_upstream = unmerged - _paths_at(repo, BASE_TAG)
    for hunk in result.hunks:
        if hunk.status != "conflicted":
            continue
        if hunk.path in deleted_upstream:
            hunk.detail = f"the file is gone in {to}"
        elif _has_markers(tree / hunk.path):
            hunk.detail = "conflict markers in the file"
        else:
            hunk.detail = "merged by git's three-way merge although its lines changed: review"
    result.gone = sorted(deleted_upstream)
    result.markers = sorted(p for p in unmerged - deleted_upstream if _has_markers(tree / p))
    result.review = sorted({h.path for h in result.hunks if h.detail.startswith("merged")} - set(result.markers))
    if status != 0 or result.count("conflicted"):
        if status == 0 and not result.count("conflicted"):
            result.notes.append("git's merge stopped although every hunk applies alone: see `git status`")
        return result

    # committed on top of toolkit-base: the tree stays an edit tree for TO, and later edits
    # there go out with `invoke patch refresh NAME` as usual
    authoring.commit(repo, f"{name} on {ps.package} {to} (ported from {source})")
    new_change = _diff(repo, BASE_TAG, "HEAD")
    try:
        written, _ = authoring.write_patch(name, to, patch_name, new_change, ps.package)
    except PatchsetError as exc:
        raise PortError(f"the ported diff of {name} for {to} is not a valid patch: {exc}") from exc
    result.written.append(written)
    result.check = patching.check(name, note=note, version=to)
    return result


def _paths_at(repo: git.Repo, ref: str) -> set[str]:
    return set(repo.git.ls_tree("-r", "--name-only", ref).split())

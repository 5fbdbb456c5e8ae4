"""The patch engine's public face: check, apply, verify and revert patchsets on a host.

Every patched file is an image compiled offline (`compiler.compile_stack`); a host
only ever receives whole files and a plan. Costs in SSH round trips, whatever the
number of files: apply 2 (probe + one host-side run; +1 to fetch a diff on refusal),
verify 1, revert 2. A run that was cut is finished by the probe of the next command.
"""
from __future__ import annotations

import base64
import difflib
from dataclasses import asdict, dataclass, field

from toolkit.patch import compiler, patchhost, patchplan, patchsets, wheels
from toolkit.core.inventory import Host
from toolkit.patch.patchhost import PatchFailed, PatchRefused  # noqa: F401 (part of this module's API)
from toolkit.patch.patchplan import STATE_FORMAT, FileChange  # noqa: F401 (part of this module's API)
from toolkit.patch.patchsets import Patchset, PatchsetError


@dataclass
class PatchsetReport:
    name: str
    summary: str
    patches: list[dict]   # {release, name, files, hunks, added, removed}

    def totals(self, release: str | None = None) -> dict:
        rows = [p for p in self.patches if release is None or p["release"] == release]
        return {k: sum(p[k] for p in rows) for k in ("files", "hunks", "added", "removed")}


@dataclass
class CompileReport:
    stack: list[str]
    versions: list[str]                       # the releases compiled: every one the whole stack has diffs for
    patchsets: list[PatchsetReport]
    files: dict[str, list[FileChange]]        # release -> the files of its image
    ok: bool = True
    error: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass
class _WriteResult:
    """What apply and revert report: the stack before/after and one row per file."""
    host: str
    stack_before: list[str]
    stack_after: list[str]
    files: list[FileChange]
    dry_run: bool
    round_trips: int
    notes: list[str] = field(default_factory=list)
    recovered: dict | None = None

    @property
    def changed(self) -> int:
        """Files written (or, in a dry run, that would be)."""
        return sum(f.status in ("changed", "would change") for f in self.files)

    def to_json(self) -> dict:
        return {**asdict(self), "changed": self.changed}


@dataclass
class ApplyResult(_WriteResult):
    patchset: str = ""
    pycache_removed: list[str] = field(default_factory=list)


@dataclass
class RevertResult(_WriteResult):
    record_ok: bool = True
    popped: list[str] = field(default_factory=list)   # the patchsets taken off, top first


@dataclass
class VerifyResult:
    host: str
    package: str
    version: str | None
    stack: list[str]
    files: list[FileChange]
    ok: bool
    round_trips: int
    all_files_checked: int = 0
    notes: list[str] = field(default_factory=list)
    recovered: dict | None = None
    next_step: str = ""        # when not ok: the command that puts the files back

    def to_json(self) -> dict:
        return asdict(self)


def _quiet(text: str) -> None:
    pass


def load_patchsets() -> dict[str, Patchset]:
    return patchsets.load_all()


# -- check ------------------------------------------------------------------------------

def check(name: str | None = None, note=_quiet, version: str | None = None) -> CompileReport:
    """Compile NAME's stack (its requirements + NAME; all patchsets when None) offline, for every
    release the whole stack has diffs for (or for VERSION only)."""
    known = load_patchsets()
    if name:
        stack_names = patchsets.requirement_closure(name, known)
    else:
        stack_names = patchsets.sort_stack(known, known)
    stack = [known[n] for n in stack_names]
    wanted = [version] if version else sorted({v for ps in stack for v in ps.versions}, key=patchsets.release_key)
    result = CompileReport(stack_names, [], [], {})
    try:
        for v in wanted:
            lacking = [ps for ps in stack if v not in ps.versions]
            if lacking:
                if version:
                    raise PatchsetError(lacking[0].no_release(v))
                result.notes.append(f"{v}: not compiled: {lacking[0].no_release(v)}")
                continue
            result.versions.append(v)
        if stack and not result.versions:
            top = stack[-1]
            raise PatchsetError(f"{top.name} has no diffs yet: write them with `invoke patch edit {top.name}` then"
                                f" `invoke patch refresh {top.name}`" if not top.versions else
                                f"no release has diffs in every patchset of {' + '.join(stack_names)}; "
                                + "; ".join(result.notes))
        for ps in stack:
            rows = [{"release": v, "name": p.name, "files": len(p.files), "hunks": sum(f.hunks for f in p.files),
                     "added": sum(f.added for f in p.files), "removed": sum(f.removed for f in p.files)}
                    for v in result.versions for p in ps.patches(v)]
            result.patchsets.append(PatchsetReport(ps.name, ps.summary, rows))
        for v in result.versions:
            image = compiler.compile_stack(stack, v, note)
            result.files[v] = [
                FileChange(p, "patched", f.by, f"{_short(f.pristine_sha256, 'new')} -> {_short(f.sha256, 'deleted')}")
                for p, f in sorted(image.files.items())]
    except (compiler.CompileError, PatchsetError, wheels.WheelError) as exc:
        result.ok, result.error = False, str(exc)
    return result


# -- shared helpers ---------------------------------------------------------------------

def _short(sha: str | None, absent: str) -> str:
    return sha[:12] if sha else absent


_stack_of = patchplan.stack_of


def _probe_notes(answer: dict) -> list[str]:
    """What a probe or host run tidied up on its way (temporaries of dead runs)."""
    cleaned = answer.get("cleaned") or []
    if not cleaned:
        return []
    names = ", ".join(sorted(name.rsplit("/", 1)[-1] for name in cleaned))
    return [f"removed {len(cleaned)} temporary file(s) that interrupted runs had left: {names}"]


def _unified(expected: bytes | None, found: bytes | None, path: str, label: str) -> str:
    a = (expected or b"").decode(errors="replace").splitlines(keepends=True)
    b = (found or b"").decode(errors="replace").splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, f"{path} ({label})", f"{path} (found on host)", n=2))


def _drift_diff(transport, host, package, drifted: dict[str, tuple[bytes | None, str]]) -> str:
    """One more round trip, only on refusal: fetch the drifted files and diff them."""
    answer = patchhost.probe(transport, host, package, fetch=drifted, recover=False)
    parts = []
    for path, (expected, label) in sorted(drifted.items()):
        found = answer.get("contents", {}).get(path)
        parts.append(_unified(expected, None if found is None else base64.b64decode(found), path, label))
    return "".join(parts)


def drift_advice(host: str, package: str, version: str | None, state: dict | None, paths: list[str]) -> str:
    """What to run about files that hold neither the recorded image nor pristine bytes: a file the
    recorded stack wrote comes back with `revert --force` (the whole stack comes off, the edited bytes
    are kept in the backups); a file no patchset wrote only with a reinstall of the package."""
    recorded = (state or {}).get("files", {})
    ours = [p for p in paths if p in recorded]
    others = [p for p in paths if p not in recorded]
    parts = []
    if ours:
        parts.append(f"`invoke patch revert --force --host {host}` puts back the pristine files and takes the"
                     f" stack off (the hand-edited bytes are kept in the host's backups); then apply again")
    if others:
        parts.append(f"{', '.join(others)} {'are' if len(others) > 1 else 'is'} in no patchset's recorded state:"
                     f" reinstall {package} {version or ''} on {host} to get the installed bytes back")
    return "; ".join(parts)


def _image_bytes(path: str, state: dict | None, known, version, wheel) -> tuple[bytes | None, str]:
    """What the host should hold for `path` according to its recorded stack (for diffs)."""
    stack = _stack_of(state)
    if path in (state or {}).get("files", {}) and all(n in known for n in stack):
        image = compiler.compile_stack([known[n] for n in stack], version)
        if path in image.files:
            return image.files[path].content, f"image of {' + '.join(stack)}"
    return (wheel.read(path) if wheel.has(path) else None), "pristine"


# -- apply ------------------------------------------------------------------------------

def apply(host: Host, name: str, dry_run: bool = False, note=_quiet) -> ApplyResult:
    """Probe, decide (`patchplan.plan_apply`), then one host-side run that writes the plan."""
    known = load_patchsets()
    ps = patchsets.get(name, known)
    closure = patchsets.requirement_closure(name, known)
    with host.connect() as transport:
        note(f"{host.name}: probing {ps.package} files")
        probe = patchhost.probe(transport, host, ps.package, {p for n in closure for p in known[n].touched()})
        version, current, desired = patchplan.apply_stack(name, known, probe, host.name)
        image = compiler.compile_stack([known[n] for n in desired], version, note)
        wheel = wheels.pristine(ps.package, version, note)
        plan = patchplan.plan_apply(name, known, probe, image, wheel, host.name, dry_run)
        if plan.drifted:
            state = probe["state"]
            diff = _drift_diff(transport, host, ps.package,
                               {p: _image_bytes(p, state, known, version, wheel) for p in plan.drifted})
            raise PatchRefused(f"{', '.join(plan.drifted)} changed by hand (neither pristine nor"
                               f" the image of {' + '.join(current) or 'nothing'}); nothing written;"
                               f" {drift_advice(host.name, ps.package, version, state, plan.drifted)}", diff)
        result = ApplyResult(host.name, current, desired, plan.rows, dry_run, 0, patchset=name,
                             recovered=probe["recovered"], notes=_probe_notes(probe))
        if not plan.nothing_to_do and not dry_run:
            note(f"{host.name}: writing {len(plan.writes)} file(s)")
            answer = _execute(transport, host, ps.package, probe, plan)
            bad = [w["path"] for w in plan.writes if answer["hashes"].get(w["path"]) != w["sha256"]]
            if bad:
                raise RuntimeError(f"after the run {', '.join(bad)} do not hash to their images")
            result.notes += _probe_notes(answer)
            result.pycache_removed = answer.get("pycache_removed", [])
        result.round_trips = transport.round_trips
        return result


def _execute(transport, host: Host, package: str, probe: dict, plan: patchplan.WritePlan) -> dict:
    return patchhost.execute(transport, host, {
        "package": package, "version": plan.version, "expect": plan.expect(probe),
        "expect_state_sha": probe["state_sha"], "writes": plan.writes, "state": plan.new_state,
        "state_changed": True})


# -- verify -----------------------------------------------------------------------------

def verify(host: Host, all_files: bool = False, package: str = "sglang", note=_quiet) -> VerifyResult:
    known = load_patchsets()
    touched, unreadable = set(), []
    for ps in known.values():
        try:
            touched.update(ps.touched() if ps.package == package else [])
        except PatchsetError as exc:
            unreadable.append(f"patchset skipped: {exc}")
    with host.connect() as transport:
        note(f"{host.name}: probing {len(touched)} patchable file(s){' and every RECORD file' if all_files else ''}")
        probe = patchhost.probe(transport, host, package, touched, all_files=all_files)
        state = probe["state"] or {}
        result = VerifyResult(host.name, package, probe["version"], _stack_of(state), [], True, 0,
                              notes=unreadable + _probe_notes(probe), recovered=probe["recovered"])
        if not probe["version"]:
            result.ok = False
            result.notes.append(f"{package} is not installed in {probe['site']}")
        if result.stack and state.get("version") != probe["version"]:
            result.ok = False
            result.notes.append(f"state records {package} {state.get('version')}, installed is {probe['version']}")
        recorded = state.get("files", {})
        damaged = set(state.get("damaged", []))
        damaged_detail = state.get("damaged_detail", {})
        for p in sorted(probe["files"]):
            found, pristine = probe["files"][p], probe["record"].get(p)
            entry = recorded.get(p)
            expected = entry["expected"] if entry else pristine
            if p in damaged:
                row = FileChange(p, "drifted", entry and entry["by"],
                                 f"a cut run could not restore it: {damaged_detail.get(p, 'backup missing')}")
            elif found == expected:
                patched = entry is not None and expected != pristine
                row = FileChange(p, "patched" if patched else "pristine", entry["by"] if patched else None)
            elif found is None:
                row = FileChange(p, "missing", entry and entry["by"])
            elif found == pristine:
                row = FileChange(p, "drifted", entry["by"], f"pristine, but the state says patched by {entry['by']}")
            else:
                row = FileChange(p, "drifted", entry and entry["by"],
                                 f"expected {'image of ' + entry['by'] if entry else 'RECORD'} {_short(expected, '')}")
            result.files.append(row)
        if all_files and "all_files" in probe:
            result.all_files_checked = probe["all_files"]["checked"]
            for p, found in sorted(probe["all_files"]["mismatch"].items()):
                if p in probe["files"]:
                    continue  # judged above against the recorded state
                status = "missing" if found is None else "drifted"
                result.files.append(FileChange(p, status, None, "differs from the installed RECORD"))
        if any(f.status in ("drifted", "missing") for f in result.files):
            result.ok = False
            differ = [f.path for f in result.files if f.status in ("drifted", "missing") and f.path not in damaged]
            if differ:
                result.next_step = drift_advice(host.name, package, probe["version"], state, differ)
        if damaged:
            result.notes.append(f"once the cause is gone, `invoke patch revert --all --force --host {host.name}`"
                                f" restores {', '.join(sorted(damaged))} (from the backups, else from the wheel)")
        for p, why in sorted((probe.get("blocked") or {}).items()):
            result.notes.append(f"{p} cannot be replaced, so apply/revert will refuse to touch it: {why}")
        if probe.get("state_blocked"):
            result.notes.append(f"apply/revert will refuse: {probe['state_blocked']}")
        result.round_trips = transport.round_trips
        return result


# -- revert -----------------------------------------------------------------------------

def revert(host: Host, name: str | None = None, force: bool = False, dry_run: bool = False,
           package: str = "sglang", note=_quiet) -> RevertResult:
    """Probe, decide (`patchplan.revert_target`, `plan_revert`), then one host-side run."""
    known = load_patchsets()
    touched = set(known[name].touched()) if name and name in known else set()
    with host.connect() as transport:
        note(f"{host.name}: probing patch state")
        probe = patchhost.probe(transport, host, package, touched)
        current = _stack_of(probe["state"])
        result = RevertResult(host.name, current, current, [], dry_run, 0, recovered=probe["recovered"],
                              notes=_probe_notes(probe))
        target = patchplan.revert_target(name, known, probe, host.name, force, package)
        if target.kind == "not applied":
            return _not_applied(transport, host, name, probe, result)
        if target.kind == "nothing":
            result.notes.append("no patchset applied; nothing to revert")
        elif target.kind == "stale state":
            _clear_stale_state(transport, host, package, target.version, probe, result, dry_run)
        else:
            _pop(transport, host, name, known, probe, target, result, force, dry_run, package, note)
        result.round_trips = transport.round_trips
        return result


def _pop(transport, host, name, known, probe, target, result, force, dry_run, package, note) -> None:
    image = compiler.compile_stack([known[n] for n in target.keep], target.version, note)
    wheel = wheels.pristine(package, target.version, note)
    plan = patchplan.plan_revert(target, known, probe, image, wheel, host.name, force, dry_run, package)
    if plan.drifted:
        _refuse_drifted_revert(transport, host, package, probe["state"], known, target.version, wheel, plan.drifted,
                               set(probe["state"].get("damaged", [])), name)
    result.files, result.stack_after = plan.rows, target.keep
    result.popped = target.current[len(target.keep):][::-1]
    result.notes += plan.notes
    if dry_run:
        for p in plan.overwritten:
            result.notes.append(f"{p}: the hand-edited bytes would be kept in {probe['backup_dir']}/"
                                f"<their sha256> on {host.name}")
        return
    note(f"{host.name}: restoring {len(plan.writes)} file(s)")
    answer = _execute(transport, host, package, probe, plan)
    result.notes += _probe_notes(answer)
    for p in plan.overwritten:
        kept = answer.get("kept", {}).get(p)
        if kept:
            result.notes.append(f"{p}: the hand-edited bytes are kept in {kept} on {host.name}")
    for w in plan.writes:
        got = answer["hashes"].get(w["path"])
        if got != w["sha256"] or (w["path"] not in image.files and got != probe["record"].get(w["path"])):
            result.record_ok = False
            result.notes.append(f"{w['path']} hashes to {got} after the restore, not to RECORD")


def _not_applied(transport, host, name, probe, result) -> RevertResult:
    """`revert NAME` whose goal already holds: NAME is not applied and its files hold what the
    state says (pristine, or another patchset's image). A file that does not is refused."""
    differ = patchplan.not_applied_differ(probe)
    if differ:
        raise PatchRefused(f"{name} is not applied on {host.name}, but {', '.join(differ)}"
                           f" {'hold' if len(differ) > 1 else 'holds'} neither the pristine bytes nor"
                           f" the image of what is applied (`invoke patch verify --host {host.name}` shows them);"
                           f" nothing written")
    result.notes.append(f"{name} is not applied: nothing to do")
    result.round_trips = transport.round_trips
    return result


def _refuse_drifted_revert(transport, host, package, state, known, version, wheel, drifted, damaged,
                           name) -> None:
    """Refuse with the diff of every hand edit (one more round trip), as apply does."""
    edited = [p for p in drifted if p not in damaged]
    left = [p for p in drifted if p in damaged]
    parts = []
    if edited:
        parts.append(f"{', '.join(edited)} changed by hand since the patch was applied")
    if left:
        parts.append(f"{', '.join(left)} left damaged by a cut run (`invoke patch verify --host {host.name}` says what each holds)")
    diff = _drift_diff(transport, host, package,
                       {p: _image_bytes(p, state, known, version, wheel) for p in edited}) if edited else ""
    raise PatchRefused(f"{'; '.join(parts)}; `invoke patch revert {name + ' ' if name else ''}--force"
                       f" --host {host.name}` overwrites"
                       f" {'them' if len(drifted) > 1 else 'it'} (hand-edited bytes are kept in the host's backups);"
                       f" nothing written", diff)


def _clear_stale_state(transport, host, package, version, probe, result, dry_run):
    result.notes.append(f"state was for another {package} version; cleared it (files left as installed)")
    result.stack_after, result.popped = [], result.stack_before[::-1]
    if not dry_run:
        (patchhost.execute(transport, host, {
            "package": package, "version": version, "expect": {}, "expect_state_sha": probe["state_sha"],
            "writes": [], "state": patchplan.empty_state(package, version, probe["site"]), "state_changed": True}))
    return result

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

from toolkit.patch import compiler, patchhost, patchsets, wheels
from toolkit.hostside import patch_hostlib
from toolkit.core.inventory import Host
from toolkit.patch.patchhost import PatchFailed, PatchRefused  # noqa: F401 (part of this module's API)
from toolkit.patch.patchsets import Patchset, PatchsetError

STATE_FORMAT = 1


@dataclass
class FileChange:
    path: str
    status: str          # changed | unchanged | would change | pristine | patched | drifted | missing
    by: str | None = None
    detail: str = ""


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


def _stack_of(state: dict | None) -> list[str]:
    return [entry["name"] for entry in (state or {}).get("stack", [])]


def _new_state(image: compiler.Image, known: dict[str, Patchset], site: str) -> dict:
    return {"format": STATE_FORMAT, "package": image.package, "version": image.version, "site": site,
            "stack": [{"name": n, "patches": known[n].fingerprint(image.version)} for n in image.stack],
            "files": {p: {"pristine": f.pristine_sha256, "expected": f.sha256, "by": f.by}
                      for p, f in sorted(image.files.items())}}


def _same_state(a: dict | None, b: dict | None) -> bool:
    strip = lambda s: {k: v for k, v in (s or {}).items() if k not in ("site", "damaged")}  # noqa: E731
    return strip(a) == strip(b) and not (a or {}).get("damaged")


def _probe_notes(answer: dict) -> list[str]:
    """What a probe or host run tidied up on its way (temporaries of dead runs)."""
    cleaned = answer.get("cleaned") or []
    if not cleaned:
        return []
    names = ", ".join(sorted(name.rsplit("/", 1)[-1] for name in cleaned))
    return [f"removed {len(cleaned)} temporary file(s) that interrupted runs had left: {names}"]


def _refuse_unreplaceable(probe: dict, writes: list[dict], host: Host) -> None:
    """Before anything is written: every file the run would replace must be replaceable."""
    blocked = probe.get("blocked") or {}
    reasons = [f"{w['path']}: {blocked[w['path']]}" for w in writes if w["path"] in blocked]
    if reasons:
        raise PatchRefused(f"cannot replace {len(reasons)} file(s) on {host.name}; nothing written:\n  "
                           + "\n  ".join(reasons))


def _refuse_unwritable(probe: dict, host: Host, writes: list[dict], sizes: list[int], state: dict) -> None:
    """Before anything is written (a dry run too): the run can take the lock and write its state,
    journal and backups, and every file system it writes on has room for what it writes."""
    if probe.get("state_blocked"):
        raise PatchRefused(f"{host.name}: {probe['state_blocked']}; nothing written")
    space = probe.get("space")
    if not space:
        return
    backups = [probe["sizes"].get(w["path"]) or 0 for w in writes
               if probe["files"].get(w["path"]) and probe["backups"].get(probe["files"][w["path"]]) != "ok"]
    short = patch_hostlib.space_shortfalls(space["site"], space["state"], sizes, backups,
                                           patch_hostlib.meta_estimate(state, probe["state"], writes))
    if short:
        raise PatchRefused(f"not enough free space on {host.name}; nothing written: " + "; ".join(
            f"{folder} has {free} bytes free, the run needs {need} there" for folder, need, free in short))


def _require_installed(probe: dict, host: Host, package: str) -> str:
    if not probe["version"]:
        raise PatchRefused(f"{package} is not installed in {probe['site']} on {host.name}; nothing written")
    return probe["version"]


def _check_record_matches_wheel(probe: dict, wheel: wheels.Wheel, paths) -> None:
    for p in paths:
        installed = probe["record"].get(p)
        if wheel.has(p) and installed is not None and installed != wheel.record[p]:
            raise PatchRefused(f"the installed RECORD hash of {p} differs from the {wheel.path.name} wheel's:"
                               f" this is not the release the patchsets were compiled for; nothing written")


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
    known = load_patchsets()
    ps = patchsets.get(name, known)
    closure = patchsets.requirement_closure(name, known)
    with host.connect() as transport:
        note(f"{host.name}: probing {ps.package} files")
        touched = {p for n in closure for p in known[n].touched()}
        probe = patchhost.probe(transport, host, ps.package, touched)
        version = _require_installed(probe, host, ps.package)
        if version not in ps.versions:
            raise PatchRefused(f"{host.name} has {ps.package} {version}: {ps.no_release(version)}; nothing written")
        state = probe["state"]
        current = _stack_of(state)
        if current and state.get("version") != version:
            raise PatchRefused(f"{host.name}'s patch state records {ps.package} {state.get('version')} but"
                               f" {version} is installed (reinstalled?); run `invoke patch revert --all --force"
                               f" --host {host.name}` to clear it; nothing written")
        missing = [req for req in ps.requires if req not in current]
        if missing:
            raise PatchRefused(f"{name} requires {', '.join(missing)}, not applied on {host.name};"
                               f" run `invoke patch apply {missing[0]} --host {host.name}` first; nothing written")
        unknown = [n for n in current if n not in known]
        if unknown:
            raise PatchRefused(f"{host.name} has {', '.join(unknown)} applied, which is not in patchsets/;"
                               f" nothing written")
        if (state or {}).get("damaged"):
            raise PatchRefused(f"a cut run left {', '.join(state['damaged'])} damaged on {host.name}"
                               f" (`invoke patch verify` says what each holds and why); once the cause is gone,"
                               f" run `invoke patch revert --all --force --host {host.name}`; nothing written")
        desired = patchsets.sort_stack(current + [name], known)
        image = compiler.compile_stack([known[n] for n in desired], version, note)
        wheel = wheels.pristine(ps.package, version, note)
        paths = sorted(set(image.files) | set((state or {}).get("files", {})))
        _check_record_matches_wheel(probe, wheel, paths)
        recorded = (state or {}).get("files", {})
        writes, rows, drifted, sizes = [], [], {}, []
        for p in paths:
            found, pristine = probe["files"].get(p), wheel.record.get(p)
            if p in image.files:
                target = image.files[p]
            else:
                target = compiler.FileImage(p, pristine, pristine, None, "pristine")
            allowed = {pristine}
            if p in recorded:
                allowed.add(recorded[p]["expected"])
            if found not in allowed:
                drifted[p] = _image_bytes(p, state, known, version, wheel)
                continue
            if found == target.sha256:
                rows.append(FileChange(p, "unchanged", target.by))
                continue
            content = target.content if target.content is not None or target.sha256 is None else wheel.read(p)
            writes.append({"path": p, "sha256": target.sha256,
                           "content": None if content is None else base64.b64encode(content).decode()})
            sizes.append(0 if content is None else len(content))
            rows.append(FileChange(p, "would change" if dry_run else "changed", target.by))
        if drifted:
            diff = _drift_diff(transport, host, ps.package, drifted)
            raise PatchRefused(f"{', '.join(sorted(drifted))} changed by hand (neither pristine nor"
                               f" the image of {' + '.join(current) or 'nothing'}); nothing written", diff)
        _refuse_unreplaceable(probe, writes, host)
        new_state = _new_state(image, known, probe["site"])
        result = ApplyResult(host.name, current, desired, rows, dry_run, 0, patchset=name,
                             recovered=probe["recovered"], notes=_probe_notes(probe))
        if not writes and _same_state(state, new_state):
            result.round_trips = transport.round_trips
            return result
        _refuse_unwritable(probe, host, writes, sizes, new_state)
        if dry_run:
            result.round_trips = transport.round_trips
            return result
        note(f"{host.name}: writing {len(writes)} file(s)")
        answer = (patchhost.execute(transport, host, {
            "package": ps.package, "version": version, "expect": {p: probe["files"].get(p) for p in paths},
            "expect_state_sha": probe["state_sha"], "writes": writes, "state": new_state,
            "state_changed": True}))
        bad = [w["path"] for w in writes if answer["hashes"].get(w["path"]) != w["sha256"]]
        if bad:
            raise RuntimeError(f"after the run {', '.join(bad)} do not hash to their images")
        result.notes += _probe_notes(answer)
        result.pycache_removed = answer.get("pycache_removed", [])
        result.round_trips = transport.round_trips
        return result


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
    known = load_patchsets()
    touched = set()
    if name and name in known:
        touched = set(known[name].touched())
    with host.connect() as transport:
        note(f"{host.name}: probing patch state")
        probe = patchhost.probe(transport, host, package, touched)
        state = probe["state"]
        current = _stack_of(state)
        result = RevertResult(host.name, current, current, [], dry_run, 0, recovered=probe["recovered"],
                              notes=_probe_notes(probe))
        if name and name not in known and name not in current:
            patchsets.get(name, known)  # raises, naming the known patchsets
        if name and name not in current and not (state or {}).get("damaged"):
            return _not_applied(transport, host, name, probe, result)
        if not current and not (state or {}).get("files") and not (state or {}).get("damaged"):
            result.notes.append("no patchset applied; nothing to revert")
            result.round_trips = transport.round_trips
            return result
        if name and name not in current:
            raise PatchRefused(f"{name} is not applied on {host.name} (applied: {', '.join(current) or 'none'});"
                               f" nothing written")
        version = _require_installed(probe, host, package)
        if state.get("version") != version:
            if not force:
                raise PatchRefused(f"state records {package} {state.get('version')}, installed is {version};"
                                   f" run `invoke patch revert --all --force --host {host.name}` to clear the"
                                   f" stale state (files are left as installed); nothing written")
            return _clear_stale_state(transport, host, package, version, probe, result, dry_run)
        keep = current[:current.index(name)] if name else []
        missing = [n for n in keep if n not in known]
        if missing:
            raise PatchRefused(f"cannot rebuild {', '.join(missing)} (not in patchsets/); revert --all instead")
        image = compiler.compile_stack([known[n] for n in keep], version, note)
        wheel = wheels.pristine(package, version, note)
        recorded = state.get("files", {})
        damaged = set(state.get("damaged", []))
        paths = sorted(set(recorded) | set(image.files) | damaged)
        _check_record_matches_wheel(probe, wheel, paths)
        writes, drifted, overwritten, sizes = [], [], [], []
        for p in paths:
            found, pristine = probe["files"].get(p), wheel.record.get(p)
            target = image.files[p] if p in image.files else compiler.FileImage(p, pristine, pristine, None, "pristine")
            expected = recorded[p]["expected"] if p in recorded else pristine
            if found == target.sha256 and p not in damaged:
                result.files.append(FileChange(p, "unchanged", target.by if p in image.files else None))
                continue
            if (found != expected or p in damaged) and not force:
                drifted.append(p)
                continue
            write = {"path": p, "sha256": target.sha256, "content": None}
            sizes.append(0 if target.sha256 is None else
                         len(target.content if p in image.files else wheel.read(p)))
            if target.sha256 is not None:
                if probe["backups"].get(target.sha256) == "ok":
                    write["from_backup"] = target.sha256
                else:
                    content = target.content if p in image.files else wheel.read(p)
                    write["content"] = base64.b64encode(content).decode()
                    if target.sha256 == pristine:
                        why = "corrupt" if probe["backups"].get(target.sha256) == "corrupt" else "missing"
                        result.notes.append(f"backup of {p} is {why}: using the pristine file from the wheel")
            writes.append(write)
            if found != expected and found is not None:
                overwritten.append(p)
            result.files.append(FileChange(p, "would change" if dry_run else "changed",
                                           target.by if p in image.files else None,
                                           "overwriting a hand edit (--force)" if found != expected else ""))
        if drifted:
            _refuse_drifted_revert(transport, host, package, state, known, version, wheel, drifted, damaged, name)
        _refuse_unreplaceable(probe, writes, host)
        result.stack_after = keep
        result.popped = current[len(keep):][::-1]
        new_state = _new_state(image, known, probe["site"]) if keep else {
            "format": STATE_FORMAT, "package": package, "version": version, "site": probe["site"],
            "stack": [], "files": {}}
        _refuse_unwritable(probe, host, writes, sizes, new_state)
        if dry_run:
            for p in overwritten:
                result.notes.append(f"{p}: the hand-edited bytes would be kept in {probe['backup_dir']}/"
                                    f"<their sha256> on {host.name}")
            result.round_trips = transport.round_trips
            return result
        note(f"{host.name}: restoring {len(writes)} file(s)")
        answer = (patchhost.execute(transport, host, {
            "package": package, "version": version, "expect": {p: probe["files"].get(p) for p in paths},
            "expect_state_sha": probe["state_sha"], "writes": writes, "state": new_state, "state_changed": True}))
        result.notes += _probe_notes(answer)
        for p in overwritten:
            kept = answer.get("kept", {}).get(p)
            if kept:
                result.notes.append(f"{p}: the hand-edited bytes are kept in {kept} on {host.name}")
        for w in writes:
            got = answer["hashes"].get(w["path"])
            if got != w["sha256"] or (w["path"] not in image.files and got != probe["record"].get(w["path"])):
                result.record_ok = False
                result.notes.append(f"{w['path']} hashes to {got} after the restore, not to RECORD")
        result.round_trips = transport.round_trips
        return result


def _not_applied(transport, host, name, probe, result) -> RevertResult:
    """`revert NAME` whose goal already holds: NAME is not applied and its files hold what the
    state says (pristine, or another patchset's image). A file that does not is refused."""
    recorded = (probe["state"] or {}).get("files", {})
    differ = [p for p, found in sorted(probe["files"].items())
              if found != (recorded[p]["expected"] if p in recorded else probe["record"].get(p))]
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
        parts.append(f"{', '.join(left)} left damaged by a cut run (`invoke patch verify` says what each holds)")
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
            "writes": [], "state": {"format": STATE_FORMAT, "package": package, "version": version,
                                    "site": probe["site"], "stack": [], "files": {}}, "state_changed": True}))
    result.round_trips = transport.round_trips
    return result

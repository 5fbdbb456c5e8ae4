"""What `patch apply` and `patch revert` decide, as pure functions over what was probed.

The inputs are plain data: the patchsets (`patchsets.load_all`), the host's probe answer
(`patchhost.probe`: installed version, file hashes, RECORD, patch state, backups, free space),
the compiled image of the target stack (`compiler.Image`) and the pristine wheel (its RECORD and
bytes). The output is a plan (the files to write, the rows to show, the new patch state) or a
`PatchRefused` saying why nothing may be written. `patching.apply` / `revert` do the I/O around
them: probe, compile, fetch a diff on refusal, run the plan on the host.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field

from toolkit.patch import compiler, patchsets
from toolkit.hostside import patch_hostlib
from toolkit.patch.patchhost import PatchRefused

STATE_FORMAT = 1


@dataclass
class FileChange:
    path: str
    status: str          # changed | unchanged | would change | pristine | patched | drifted | missing
    by: str | None = None
    detail: str = ""


@dataclass
class WritePlan:
    """Files to write and how the run reports them; `drifted` non-empty means refused (the caller
    fetches their diff first)."""
    version: str
    stack_before: list[str]
    stack_after: list[str]
    paths: list[str]                                  # every file the host run checks before writing
    rows: list[FileChange] = field(default_factory=list)
    writes: list[dict] = field(default_factory=list)  # {path, sha256, content (base64) | from_backup}
    sizes: list[int] = field(default_factory=list)
    drifted: list[str] = field(default_factory=list)
    overwritten: list[str] = field(default_factory=list)   # revert --force: hand edits it replaces
    new_state: dict = field(default_factory=dict)
    nothing_to_do: bool = False
    notes: list[str] = field(default_factory=list)

    def expect(self, probe: dict) -> dict:
        return {p: probe["files"].get(p) for p in self.paths}


def stack_of(state: dict | None) -> list[str]:
    return [entry["name"] for entry in (state or {}).get("stack", [])]


def new_state(image: compiler.Image, known: dict, site: str) -> dict:
    return {"format": STATE_FORMAT, "package": image.package, "version": image.version, "site": site,
            "stack": [{"name": n, "patches": known[n].fingerprint(image.version)} for n in image.stack],
            "files": {p: {"pristine": f.pristine_sha256, "expected": f.sha256, "by": f.by}
                      for p, f in sorted(image.files.items())}}


def empty_state(package: str, version: str, site: str) -> dict:
    return {"format": STATE_FORMAT, "package": package, "version": version, "site": site, "stack": [], "files": {}}


def same_state(a: dict | None, b: dict | None) -> bool:
    strip = lambda s: {k: v for k, v in (s or {}).items() if k not in ("site", "damaged")}  # noqa: E731
    return strip(a) == strip(b) and not (a or {}).get("damaged")


def require_installed(probe: dict, host: str, package: str) -> str:
    if not probe["version"]:
        raise PatchRefused(f"{package} is not installed in {probe['site']} on {host}; nothing written")
    return probe["version"]


def check_record_matches_wheel(probe: dict, wheel, paths) -> None:
    for p in paths:
        installed = probe["record"].get(p)
        if wheel.has(p) and installed is not None and installed != wheel.record[p]:
            raise PatchRefused(f"the installed RECORD hash of {p} differs from the {wheel.path.name} wheel's:"
                               f" this is not the release the patchsets were compiled for; nothing written")


def refuse_unreplaceable(probe: dict, writes: list[dict], host: str) -> None:
    """Before anything is written: every file the run would replace must be replaceable."""
    blocked = probe.get("blocked") or {}
    reasons = [f"{w['path']}: {blocked[w['path']]}" for w in writes if w["path"] in blocked]
    if reasons:
        raise PatchRefused(f"cannot replace {len(reasons)} file(s) on {host}; nothing written:\n  "
                           + "\n  ".join(reasons))


def refuse_unwritable(probe: dict, host: str, writes: list[dict], sizes: list[int], state: dict) -> None:
    """Before anything is written (a dry run too): the run can take the lock and write its state,
    journal and backups, and every file system it writes on has room for what it writes."""
    if probe.get("state_blocked"):
        raise PatchRefused(f"{host}: {probe['state_blocked']}; nothing written")
    space = probe.get("space")
    if not space:
        return
    backups = [probe["sizes"].get(w["path"]) or 0 for w in writes
               if probe["files"].get(w["path"]) and probe["backups"].get(probe["files"][w["path"]]) != "ok"]
    short = patch_hostlib.space_shortfalls(space["site"], space["state"], sizes, backups,
                                           patch_hostlib.meta_estimate(state, probe["state"], writes))
    if short:
        raise PatchRefused(f"not enough free space on {host}; nothing written: " + "; ".join(
            f"{folder} has {free} bytes free, the run needs {need} there" for folder, need, free in short))


def _pristine_image(path: str, wheel) -> compiler.FileImage:
    pristine = wheel.record.get(path)
    return compiler.FileImage(path, pristine, pristine, None, "pristine")


# -- apply ------------------------------------------------------------------------------

def apply_stack(name: str, known: dict, probe: dict, host: str) -> tuple[str, list[str], list[str]]:
    """The refusals that need only the probe; (installed version, stack now, stack after)."""
    ps = patchsets.get(name, known)
    version = require_installed(probe, host, ps.package)
    if version not in ps.versions:
        raise PatchRefused(f"{host} has {ps.package} {version}: {ps.no_release(version)}; nothing written")
    state = probe["state"]
    current = stack_of(state)
    if current and state.get("version") != version:
        raise PatchRefused(f"{host}'s patch state records {ps.package} {state.get('version')} but"
                           f" {version} is installed (reinstalled?); run `invoke patch revert --all --force"
                           f" --host {host}` to clear it; nothing written")
    missing = [req for req in ps.requires if req not in current]
    if missing:
        raise PatchRefused(f"{name} requires {', '.join(missing)}, not applied on {host};"
                           f" run `invoke patch apply {missing[0]} --host {host}` first; nothing written")
    unknown = [n for n in current if n not in known]
    if unknown:
        raise PatchRefused(f"{host} has {', '.join(unknown)} applied, which is not in patchsets/;"
                           f" nothing written")
    if (state or {}).get("damaged"):
        raise PatchRefused(f"a cut run left {', '.join(state['damaged'])} damaged on {host}"
                           f" (`invoke patch verify --host {host}` says what each holds and why); once the cause is gone,"
                           f" run `invoke patch revert --all --force --host {host}`; nothing written")
    return version, current, patchsets.sort_stack(current + [name], known)


def plan_apply(name: str, known: dict, probe: dict, image: compiler.Image, wheel, host: str,
               dry_run: bool = False) -> WritePlan:
    """The files that make the host hold `image` (the stack `apply_stack` chose)."""
    version, current, desired = apply_stack(name, known, probe, host)
    state = probe["state"]
    recorded = (state or {}).get("files", {})
    plan = WritePlan(version, current, desired, sorted(set(image.files) | set(recorded)))
    check_record_matches_wheel(probe, wheel, plan.paths)
    for p in plan.paths:
        found, pristine = probe["files"].get(p), wheel.record.get(p)
        target = image.files[p] if p in image.files else _pristine_image(p, wheel)
        allowed = {pristine} | ({recorded[p]["expected"]} if p in recorded else set())
        if found not in allowed:
            plan.drifted.append(p)
            continue
        if found == target.sha256:
            plan.rows.append(FileChange(p, "unchanged", target.by))
            continue
        content = target.content if target.content is not None or target.sha256 is None else wheel.read(p)
        plan.writes.append({"path": p, "sha256": target.sha256,
                            "content": None if content is None else base64.b64encode(content).decode()})
        plan.sizes.append(0 if content is None else len(content))
        plan.rows.append(FileChange(p, "would change" if dry_run else "changed", target.by))
    if plan.drifted:
        return plan
    refuse_unreplaceable(probe, plan.writes, host)
    plan.new_state = new_state(image, known, probe["site"])
    if not plan.writes and same_state(state, plan.new_state):
        plan.nothing_to_do = True
        return plan
    refuse_unwritable(probe, host, plan.writes, plan.sizes, plan.new_state)
    return plan


# -- revert -----------------------------------------------------------------------------

@dataclass
class RevertTarget:
    """What `revert` must do before any file is looked at: `kind` is "not applied" (NAME is not in
    the stack: check its files), "nothing" (nothing applied), "stale state" (the state is for
    another installed release: clear it) or "pop" (rebuild `keep`)."""
    kind: str
    current: list[str]
    version: str | None = None
    keep: list[str] = field(default_factory=list)


def revert_target(name: str | None, known: dict, probe: dict, host: str, force: bool = False,
                  package: str = "sglang") -> RevertTarget:
    state = probe["state"]
    current = stack_of(state)
    damaged = (state or {}).get("damaged")
    if name and name not in known and name not in current:
        patchsets.get(name, known)  # raises, naming the known patchsets
    if name and name not in current and not damaged:
        return RevertTarget("not applied", current)
    if not current and not (state or {}).get("files") and not damaged:
        return RevertTarget("nothing", current)
    if name and name not in current:
        raise PatchRefused(f"{name} is not applied on {host} (applied: {', '.join(current) or 'none'});"
                           f" nothing written")
    version = require_installed(probe, host, package)
    if state.get("version") != version:
        if not force:
            raise PatchRefused(f"state records {package} {state.get('version')}, installed is {version};"
                               f" run `invoke patch revert --all --force --host {host}` to clear the"
                               f" stale state (files are left as installed); nothing written")
        return RevertTarget("stale state", current, version)
    keep = current[:current.index(name)] if name else []
    missing = [n for n in keep if n not in known]
    if missing:
        raise PatchRefused(f"cannot rebuild {', '.join(missing)} (not in patchsets/); revert --all instead")
    return RevertTarget("pop", current, version, keep)


def not_applied_differ(probe: dict) -> list[str]:
    """`revert NAME` when NAME is not applied: the files that hold neither their pristine bytes nor
    the image of what is applied."""
    recorded = (probe["state"] or {}).get("files", {})
    return [p for p, found in sorted(probe["files"].items())
            if found != (recorded[p]["expected"] if p in recorded else probe["record"].get(p))]


def plan_revert(target: RevertTarget, known: dict, probe: dict, image: compiler.Image, wheel, host: str,
                force: bool = False, dry_run: bool = False, package: str = "sglang") -> WritePlan:
    """The files that bring the host back to `target.keep` (`image` is its compiled image)."""
    state = probe["state"]
    recorded = state.get("files", {})
    damaged = set(state.get("damaged", []))
    plan = WritePlan(target.version, target.current, target.keep, sorted(set(recorded) | set(image.files) | damaged))
    check_record_matches_wheel(probe, wheel, plan.paths)
    for p in plan.paths:
        found, pristine = probe["files"].get(p), wheel.record.get(p)
        own = p in image.files
        target_file = image.files[p] if own else _pristine_image(p, wheel)
        expected = recorded[p]["expected"] if p in recorded else pristine
        if found == target_file.sha256 and p not in damaged:
            plan.rows.append(FileChange(p, "unchanged", target_file.by if own else None))
            continue
        if (found != expected or p in damaged) and not force:
            plan.drifted.append(p)
            continue
        write = {"path": p, "sha256": target_file.sha256, "content": None}
        plan.sizes.append(0 if target_file.sha256 is None else
                          len(target_file.content if own else wheel.read(p)))
        if target_file.sha256 is not None:
            if probe["backups"].get(target_file.sha256) == "ok":
                write["from_backup"] = target_file.sha256
            else:
                content = target_file.content if own else wheel.read(p)
                write["content"] = base64.b64encode(content).decode()
                if target_file.sha256 == pristine:
                    why = "corrupt" if probe["backups"].get(target_file.sha256) == "corrupt" else "missing"
                    plan.notes.append(f"backup of {p} is {why}: using the pristine file from the wheel")
        plan.writes.append(write)
        if found != expected and found is not None:
            plan.overwritten.append(p)
        plan.rows.append(FileChange(p, "would change" if dry_run else "changed", target_file.by if own else None,
                                    "overwriting a hand edit (--force)" if found != expected else ""))
    if plan.drifted:
        return plan
    refuse_unreplaceable(probe, plan.writes, host)
    plan.new_state = (new_state(image, known, probe["site"]) if target.keep
                      else empty_state(package, target.version, probe["site"]))
    refuse_unwritable(probe, host, plan.writes, plan.sizes, plan.new_state)
    return plan

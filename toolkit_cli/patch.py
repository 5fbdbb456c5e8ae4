"""`invoke patch list|check|apply|verify|revert|edit|refresh [NAME]`: patchsets on installed SGLang."""
from __future__ import annotations

import json

from invoke.exceptions import Exit
from rich.markup import escape
from rich.table import Table

from toolkit import authoring, compiler, patching, report, wheels
from toolkit.patchsets import PatchsetError

from .common import HOST_HELP, fail, finish, help_or_bad_action, run_on_hosts
from .parsing import command

ACTIONS = ("list", "check", "apply", "verify", "revert", "edit", "refresh")
USAGE = """usage: invoke patch ACTION [NAME] [options]
  list                      the patchsets in patchsets/ with their stacking order
  check [NAME]              compile NAME's stack (all patchsets without NAME) against the pinned wheel; no host
  apply NAME [--dry-run]    apply NAME (and keep what is applied below/above it) on --host
  verify [--all-files] [--json]   per file: pristine / patched by X / drifted / missing; exit 1 unless as recorded
  revert [NAME|--all] [--force] [--dry-run]   pop the stack down to and including NAME (default: all)
  edit NAME [--requires a,b] [--fresh]   lay out a git work tree of the pristine release + stack to edit in
  refresh NAME              export the edits in that work tree as NAME's patch file
every host action takes --host NAME[,NAME...] (default: sandbox)"""

ENGINE_ERRORS = (patching.PatchRefused, PatchsetError, compiler.CompileError, wheels.WheelError,
                 authoring.AuthoringError)


@command(positional=["action", "name"], optional=["name"], help={
    "action": "list | check | apply | verify | revert | edit | refresh",
    "name": "patchset name (a folder in patchsets/); apply/edit/refresh need it, check/revert take it optionally",
    "host": HOST_HELP,
    "dry_run": "apply/revert: print the plan (which files would change), write nothing",
    "all_files": "verify: also check every file of the package against the installed RECORD",
    "json_": "verify: print one JSON object per host (one per line) instead of tables",
    "force": "revert: overwrite files changed by hand; restore files a cut run could not",
    "all_": "revert: pop every patchset (the default when no NAME is given)",
    "requires": "edit: for a new patchset, the patchsets (comma-separated) to lay out below it",
    "fresh": "edit: throw away an existing edit tree and lay it out again",
})
def patch(c, action, name=None, host=None, dry_run=False, all_files=False, json_=False, force=False,
          all_=False, requires=None, fresh=False):
    """Patchsets on the installed SGLang: list, check offline, apply, verify, revert, edit, refresh."""
    if help_or_bad_action(USAGE, action, ACTIONS, name):
        return
    name = name or None
    if action in ("apply", "edit", "refresh") and not name:
        fail(f"`invoke patch {action}` needs a patchset name; see `invoke patch list`", code=2)
    if action == "revert" and name and all_:
        fail("give either a patchset NAME or --all, not both", code=2)
    try:
        if action == "list":
            return _list()
        if action == "check":
            return _check(name)
        if action == "edit":
            return _edit(name, requires, fresh)
        if action == "refresh":
            return _refresh(name)
    except ENGINE_ERRORS as exc:
        fail(str(exc))
    if action == "apply":
        outcomes = run_on_hosts(host, lambda h: patching.apply(h, name, dry_run=dry_run, note=report.note))
        finish(outcomes, show=_print_apply)
    elif action == "revert":
        outcomes = run_on_hosts(host, lambda h: patching.revert(h, name, force=force, dry_run=dry_run,
                                                                note=report.note))
        finish(outcomes, failed=lambda r: not r.record_ok, show=_print_revert)
    else:
        outcomes = run_on_hosts(host, lambda h: patching.verify(h, all_files=all_files,
                                                                note=(lambda t: None) if json_ else report.note))
        if json_:
            for o in outcomes:
                data = o.value.to_json() if o.ok else {"host": o.host.name, "ok": False, "error": str(o.error)}
                print(json.dumps(data, sort_keys=True))
            if any(not o.ok or not o.value.ok for o in outcomes):
                raise Exit(code=1)
            return
        finish(outcomes, failed=lambda r: not r.ok, show=_print_verify)


def _trips(count: int) -> str:
    return f"{count} round trip{'' if count == 1 else 's'}"


def _file_table(title, files, by_header="patchset") -> None:
    """Files with their status; long paths fold instead of being cut, empty detail is left out."""
    table = Table(title=title, title_justify="left")
    table.add_column("file", overflow="fold", min_width=44)
    table.add_column("status")
    table.add_column(by_header)
    detail = any(f.detail for f in files)
    if detail:
        table.add_column("", overflow="fold")
    for f in files:
        cells = [escape(f.path), report.styled(f.status), escape(f.by or "")]
        table.add_row(*(cells + [escape(f.detail)] if detail else cells))
    report.console.print(table)


def _print_apply(r: patching.ApplyResult) -> None:
    if r.recovered:
        report.note(f"{r.host}: finished an interrupted run first: {r.recovered['outcome']}")
    for text in r.notes:
        report.note(f"{r.host}: {text}")
    shown = [f for f in r.files if f.status != "unchanged"] if len(r.files) > 30 else r.files
    if shown:
        _file_table(f"{r.host}: apply {r.patchset}", shown)
    verb = "would change" if r.dry_run else "changed"
    report.line(f"{r.host}: {r.changed} {verb}; stack {' + '.join(r.stack_after)}"
                f" ({_trips(r.round_trips)}{', dry run: nothing written' if r.dry_run else ''})")


def _print_revert(r: patching.RevertResult) -> None:
    if r.recovered:
        report.note(f"{r.host}: finished an interrupted run first: {r.recovered['outcome']}")
    for text in r.notes:
        report.note(f"{r.host}: {text}")
    changed = [f for f in r.files if f.status != "unchanged"]
    if changed:
        _file_table(f"{r.host}: revert", changed, "patchset now")
    stack = " + ".join(r.stack_after) or "nothing (pristine)"
    popped = ""
    if r.popped:
        above = r.popped[:-1]
        popped = (f"; {'would pop' if r.dry_run else 'popped'} {', '.join(r.popped)}"
                  + (f" ({', '.join(above)} stacked above {r.popped[-1]})" if above else ""))
    if r.dry_run:
        report.line(f"{r.host}: {r.changed} would change{popped}; stack would be {stack}"
                    f" ({_trips(r.round_trips)}, dry run: nothing written)")
        return
    report.line(f"{r.host}: {r.changed} changed{popped}; stack now {stack}; restored files"
                f" {'match RECORD' if r.record_ok else 'DO NOT match RECORD'} ({_trips(r.round_trips)})")


def _print_verify(r: patching.VerifyResult) -> None:
    if r.recovered:
        report.note(f"{r.host}: finished an interrupted run first: {r.recovered['outcome']}")
    for text in r.notes:
        report.note(f"{r.host}: {text}")
    _file_table(f"{r.host}: {r.package} {r.version or '(not installed)'}", r.files)
    extra = f"; {r.all_files_checked} RECORD files checked" if r.all_files_checked else ""
    state = "matches its recorded state" if r.ok else "DOES NOT match its recorded state"
    report.line(f"{r.host}: {state}; stack {' + '.join(r.stack) or 'none'}{extra} ({_trips(r.round_trips)})")


def _list() -> None:
    known = patching.load_patchsets()
    if not known:
        report.line("no patchsets in patchsets/")
        return
    rows = []
    for ps in sorted(known.values(), key=lambda p: (p.order, p.name)):
        rows.append((ps.order, ps.name, ", ".join(ps.versions), ", ".join(ps.requires), ps.summary))
    report.table("patchsets (applied in this order)", ["order", "name", "versions", "requires", "summary"], rows)


def _check(name) -> None:
    result = patching.check(name, note=report.note)
    rows = [(ps.name, p["name"], p["files"], p["hunks"], f"+{p['added']}", f"-{p['removed']}")
            for ps in result.patchsets for p in ps.patches]
    if rows:
        report.table(f"stack: {' + '.join(result.stack)}", ["patchset", "patch", "files", "hunks", "+", "-"], rows)
    if result.files:
        table = Table(title=f"files of the compiled image ({result.version})", title_justify="left")
        table.add_column("file", overflow="fold", min_width=44)
        table.add_column("last touched by")
        table.add_column("sha256 pristine -> patched", overflow="fold")
        for f in result.files:
            table.add_row(escape(f.path), escape(f.by or ""), f.detail)
        report.console.print(table)
    if not result.ok:
        fail(result.error)
    totals = {k: sum(ps.totals[k] for ps in result.patchsets) for k in ("hunks", "added", "removed")}
    report.line(f"ok: {' + '.join(result.stack) or 'nothing'} compiles against {result.version or 'the pinned wheel'}:"
                f" {len(result.files)} files, {totals['hunks']} hunks, +{totals['added']} -{totals['removed']} lines")


def _edit(name, requires, fresh) -> None:
    reqs = [r.strip() for r in (requires or "").split(",") if r.strip()]
    result = authoring.edit(name, requires=reqs, fresh=fresh, note=report.note)
    below = " + ".join(result.below) or "nothing"
    report.line(f"edit tree for {name}: {result.tree}")
    report.line(f"  {result.files} pristine files of {result.version}, committed; below: {below};"
                f" {name}'s patches: {', '.join(result.own_patches) or 'none yet (new)'}")
    report.line(f"  edit files there (commit or not, new files too), then run: invoke patch refresh {name}")


def _refresh(name) -> None:
    result = authoring.refresh(name, note=report.note)
    report.line(f"wrote {result.patch}: {result.files} files, {result.hunks} hunks, +{result.added} -{result.removed}")
    if result.wrote_toml:
        report.line(f"new patchset: fill in summary/description in {result.patch.parent / 'patchset.toml'}")
    _check(name)

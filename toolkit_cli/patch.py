"""`invoke patch list|check|apply|verify|revert|edit|refresh|port [NAME]`: patchsets on installed SGLang."""
from __future__ import annotations

import json

from invoke.exceptions import Exit
from rich.markup import escape
from rich.table import Table

from toolkit.patch import authoring, compiler, patching, patchsets, porting, wheels
from toolkit.core import report
from toolkit.server import server
from toolkit.core.inventory import InventoryError
from toolkit.patch.patchsets import PatchsetError
from toolkit.core.transport import TransportError

from toolkit_cli import predictions
from toolkit_cli.common import HOST_HELP, fail, finish, help_or_bad_action, run_on_hosts
from toolkit_cli.parsing import command

ACTIONS = ("list", "check", "apply", "verify", "revert", "edit", "refresh", "port")
USAGE = """usage: invoke patch ACTION [NAME] [options]
  list                      the patchsets in patchsets/ with their stacking order and the releases they have diffs for
  check [NAME] [--release R]   compile NAME's stack (all patchsets without NAME) against each release's wheel; no host
  apply NAME [--dry-run]    apply NAME (and keep what is applied below/above it) on --host
  verify [--all-files] [--json]   per file: pristine / patched by X / drifted / missing; exit 1 unless as recorded
  revert [NAME|--all] [--force] [--dry-run]   pop the stack down to and including NAME (default: all)
  edit NAME [--release R] [--requires a,b] [--fresh]   a git work tree of the pristine release + stack to edit in
  refresh NAME              export the edits in that work tree as NAME's patch file for that release
  port NAME --to R [--from R0] [--fresh]   three-way rebase of NAME's diffs onto release R (per-hunk report)
every host action takes --host NAME[,NAME...] (default: sandbox)"""

ENGINE_ERRORS = (patching.PatchRefused, PatchsetError, compiler.CompileError, wheels.WheelError,
                 authoring.AuthoringError)


@command(positional=["action", "name"], optional=["name"], checked=["action"], usage=USAGE, help={
    "action": " | ".join(ACTIONS),
    "name": "patchset name (a folder in patchsets/); apply/edit/refresh need it, check/revert take it optionally",
    "host": HOST_HELP,
    "dry_run": "apply/revert: print the plan (which files would change), write nothing",
    "all_files": "verify: also check every file of the package against the installed RECORD",
    "json_": "apply, revert, verify: print one JSON object per host (one per line) instead of tables",
    "force": "revert: overwrite files changed by hand; restore files a cut run could not",
    "all_": "revert: pop every patchset (the default when no NAME is given)",
    "requires": "edit: for a new patchset, the patchsets (comma-separated) to lay out below it",
    "fresh": "edit/port: throw away an existing edit tree and lay it out again",
    "release": "edit/check: the SGLang release (default: edit the newest NAME has; check every one)",
    "to": "port: the release to carry NAME's diffs to, e.g. 0.5.17",
    "from_": "port: the release whose diffs are carried (default: the newest NAME has)",
})
def patch(c, action=None, name=None, host=None, dry_run=False, all_files=False, json_=False, force=False,
          all_=False, requires=None, fresh=False, release=None, to=None, from_=None):
    """Patchsets on the installed SGLang: list, check offline, apply, verify, revert, edit, refresh."""
    if help_or_bad_action(patch, action, ACTIONS, name):
        return
    name = name or None
    if action in ("apply", "edit", "refresh", "port") and not name:
        fail(f"`invoke patch {action}` needs a patchset name; see `invoke patch list`", code=2)
    if action in ("list", "verify") and name:
        fail(f"`invoke patch {action}` takes no patchset name (got {name!r}): it covers every patchset on the host",
             code=2)
    if action == "revert" and name and all_:
        fail("give either a patchset NAME or --all, not both", code=2)
    if action == "port" and not to:
        fail(f"`invoke patch port {name}` needs --to RELEASE (e.g. --to 0.5.17)", code=2)
    for option, value in (("--to", to), ("--from", from_), ("--release", release)):
        if value and not patchsets.RELEASE_NAME.fullmatch(value):
            fail(f"{option} {value!r} is not a release name like 0.5.17", code=2)
    if action in ("apply", "check", "port") and name:
        _known_or_exit(name)
    try:
        if action == "list":
            return _list()
        if action == "check":
            return _check(name, release)
        if action == "edit":
            return _edit(name, requires, fresh, release)
        if action == "port":
            return _port(name, to, from_, fresh)
        if action == "refresh":
            return _refresh(name)
    except ENGINE_ERRORS as exc:
        fail(str(exc))
    quiet = (lambda text: None) if json_ else report.note   # --json: stdout holds the JSON lines only
    if action == "apply":
        stale: dict = {}

        def apply_one(h):
            result = _with_server_check(h, patching.apply(h, name, dry_run=dry_run, note=quiet), stale)
            # what the stack's patchsets with a `predict` hook say this host's server will decide (one facts trip)
            return result, None if json_ else predictions.after_apply(h, result)

        outcomes = run_on_hosts(host, apply_one)
        if json_:
            return _print_json(outcomes, lambda pair: pair[0].to_json(), lambda pair: True,
                               lambda pair: {"server_loaded_before": _stale_json(stale.get(pair[0].host))})
        finish(outcomes, show=lambda pair: (_print_apply(pair[0]), _print_stale(pair[0], stale.get(pair[0].host), "apply"),
                                            predictions.show(pair[1])))
    elif action == "revert":
        stale = {}
        outcomes = run_on_hosts(host, lambda h: _with_server_check(
            h, patching.revert(h, name, force=force, dry_run=dry_run, note=quiet), stale))
        if json_:
            return _print_json(outcomes, lambda r: r.to_json(), lambda r: r.record_ok,
                               lambda r: {"server_loaded_before": _stale_json(stale.get(r.host))})
        finish(outcomes, failed=lambda r: not r.record_ok,
               show=lambda r: (_print_revert(r), _print_stale(r, stale.get(r.host), "revert")))
    else:
        outcomes = run_on_hosts(host, lambda h: patching.verify(h, all_files=all_files, note=quiet))
        if json_:
            return _print_json(outcomes, lambda r: r.to_json(), lambda r: r.ok)
        finish(outcomes, failed=lambda r: not r.ok, show=_print_verify)


def _print_json(outcomes, data_of, ok_of, extra_of=lambda value: {}) -> None:
    """One JSON object per host and line; exit 1 when any host failed."""
    for o in outcomes:
        data = ({**data_of(o.value), **extra_of(o.value)} if o.ok else
                {"host": o.host.name, "ok": False, "error": str(o.error)})
        print(json.dumps(data, sort_keys=True))
    if any(not o.ok or not ok_of(o.value) for o in outcomes):
        raise Exit(code=1)


def _stale_json(running) -> dict | str | None:
    """A server still running the files from before the change, as JSON (or why it was not checked)."""
    if running is None:
        return None
    if isinstance(running, Exception):
        return f"not checked: {running}"
    return {"profile": running.profile, "pid": running.pid, "patch_stack": running.patch_stack}


def _known_or_exit(name: str) -> None:
    """An unknown patchset is bad input (exit 2), as an unknown host or profile is. Patchsets that
    cannot be read are left to the command, which names the broken one (exit 1)."""
    try:
        known = patching.load_patchsets()
    except PatchsetError:
        return
    try:
        patchsets.get(name, known)
    except PatchsetError as exc:
        fail(str(exc), code=2)


def _with_server_check(host, result, stale: dict):
    """After files changed: is a server running that loaded the files from before? (one round trip)"""
    if not result.dry_run and result.changed:
        try:
            running = server.running_server(host)
        except (server.ServerError, TransportError, InventoryError) as exc:
            running = exc
        if running is not None:
            stale[result.host] = running
    return result


def _print_stale(result, running, verb: str) -> None:
    if running is None:
        return
    if isinstance(running, Exception):
        report.note(f"{result.host}: could not check for a running server ({running}); a server started before "
                    f"this {verb} still runs the old code until: invoke server restart --host {result.host}")
        return
    if running.patch_stack == list(result.stack_after):
        return   # the files are again what it loaded at its start
    started = running.started_at_iso.replace("T", " ")
    report.line(f"{result.host}: the {running.profile} server (pid {running.pid}, started {started}) still runs the "
                f"code from before this {verb}; to load the {'patched' if verb == 'apply' else 'restored'} files, "
                f"restart it: invoke server restart --host {result.host}")


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
    if r.next_step:
        report.line(f"{r.host}: to put the files back: {r.next_step}")


def _list() -> None:
    known = patching.load_patchsets()
    if not known:
        report.line("no patchsets in patchsets/")
        return
    rows = []
    for ps in sorted(known.values(), key=lambda p: (p.order, p.name)):
        rows.append((ps.order, ps.name, ", ".join(ps.versions) or "none yet", ", ".join(ps.requires), ps.summary))
    report.table("patchsets (applied in this order)", ["order", "name", "releases", "requires", "summary"], rows)


def _check(name, release=None) -> None:
    result = patching.check(name, note=report.note, version=release)
    for text in result.notes:
        report.note(text)
    rows = [(ps.name, p["release"], p["name"], p["files"], p["hunks"], f"+{p['added']}", f"-{p['removed']}")
            for ps in result.patchsets for p in ps.patches]
    if rows:
        report.table(f"stack: {' + '.join(result.stack)}", ["patchset", "release", "patch", "files", "hunks", "+", "-"],
                     rows)
    for version, files in result.files.items():
        table = Table(title=f"files of the compiled image ({version})", title_justify="left")
        table.add_column("file", overflow="fold", min_width=44)
        table.add_column("last touched by")
        table.add_column("sha256 pristine -> patched", overflow="fold")
        for f in files:
            table.add_row(escape(f.path), escape(f.by or ""), f.detail)
        report.console.print(table)
    if not result.ok:
        fail(result.error)
    for version in result.versions or [None]:
        totals = {k: sum(ps.totals(version)[k] for ps in result.patchsets) for k in ("hunks", "added", "removed")}
        report.line(f"ok: {' + '.join(result.stack) or 'nothing'} compiles against {version or 'the pinned wheel'}:"
                    f" {len(result.files.get(version, []))} files, {totals['hunks']} hunks,"
                    f" +{totals['added']} -{totals['removed']} lines")


def _edit(name, requires, fresh, release=None) -> None:
    reqs = [r.strip() for r in (requires or "").split(",") if r.strip()]
    result = authoring.edit(name, requires=reqs, version=release, fresh=fresh, note=report.note)
    below = " + ".join(result.below) or "nothing"
    report.line(f"edit tree for {name}: {result.tree}")
    report.line(f"  {result.files} pristine files of {result.version}, committed; below: {below};"
                f" {name}'s patches: {', '.join(result.own_patches) or 'none yet (new)'}")
    report.line(f"  edit files there (commit or not, new files too), then run: invoke patch refresh {name}")


def _refresh(name) -> None:
    result = authoring.refresh(name, note=report.note)
    report.line(f"wrote {result.patch}: {result.files} files, {result.hunks} hunks, +{result.added} -{result.removed}")
    if result.wrote_toml:
        report.line(f"new patchset: fill in summary/description in {result.toml}")
    _check(name, result.version)


def _port(name, to, source, fresh) -> None:
    result = porting.port(name, to, source=source, fresh=fresh, note=report.note)
    table = Table(title=f"{name}: {result.source} -> {result.target}, per hunk", title_justify="left")
    for column in ("file", "hunk", "status", ""):
        table.add_column(column, overflow="fold")
    for h in result.hunks:
        moved = f"{h.offset:+d} lines" if h.status == "moved" else ""
        table.add_row(escape(h.path), escape(f"#{h.number} {h.header}"), report.styled(h.status),
                      escape(h.detail or moved))
    report.console.print(table)
    for text in result.notes:
        report.note(text)
    counts = ", ".join(f"{result.count(s)} {s}" for s in ("as is", "moved", "conflicted"))
    if result.clean:
        report.line(f"{name} ported to {to} ({counts}): wrote {', '.join(str(p) for p in result.written)}")
        _check(name, to)
        report.line(f"next: {result.next_steps()[0]}")
        return
    report.line(f"{name} NOT ported to {to} ({counts}): nothing written to patchsets/; the merge is in {result.tree}")
    report.line("next steps:")
    for step in result.next_steps():
        report.line(f"  {step}")
    raise Exit(code=1)

"""`invoke facts`, `invoke provision`, `invoke wheelhouse build`: bring hosts to a stack."""
from __future__ import annotations

from pathlib import Path

from invoke.exceptions import Exit
from rich.markup import escape

from toolkit.provision import facts as facts_engine, provision as engine, stack as stacks, wheelhouse as wheels
from toolkit.core import report
from toolkit.core.hostrun import HostScriptError
from toolkit.core.inventory import Host
from toolkit.core.parallel import for_each_host
from toolkit.core.transport import TransportError

from toolkit_cli.common import HOST_HELP, fail, finish, help_or_bad_action, hosts_or_exit
from toolkit_cli.parsing import command

STACK_HELP = "stack name (a file in stacks/: gpu, cpu-ref) or a path to a stack .toml; default: the host's `stack`"


def _stack_for(host: Host, name: str | None) -> stacks.Stack:
    chosen = name or host.stack
    if not chosen:
        raise stacks.StackError(f"host {host.name} names no stack in the inventory; pass --stack"
                                f" ({', '.join(stacks.available())})")
    return stacks.load(chosen)


def _load_or_exit(name: str) -> stacks.Stack:
    try:
        return stacks.load(name)
    except stacks.StackError as exc:
        fail(str(exc), code=2)


@command(positional=[], help={
    "host": HOST_HELP,
    "stack": STACK_HELP + " (which pins to compare against)",
    "json_": "print the raw facts as JSON (one object, keyed by host) instead of tables",
})
def facts(c, host=None, stack=None, json_=False):
    """Facts in one round trip: OS, Python, disk, venv, stack package versions, GPUs, driver, CUDA, nvcc."""
    hosts = hosts_or_exit(host)
    if stack:
        _load_or_exit(stack)

    def one(h: Host):
        chosen = _stack_for(h, stack)
        return chosen, facts_engine.gather(h, chosen)

    outcomes = for_each_host(hosts, one)
    if json_:
        report.emit_json({o.host.name: (o.value[1].raw if o.ok else {"error": str(o.error)}) for o in outcomes})
        if any(not o.ok for o in outcomes):
            raise Exit(code=1)
        return
    for outcome in outcomes:
        if not outcome.ok:
            continue
        chosen, found = outcome.value
        report.table(f"{outcome.host.describe()}: facts ({found.round_trips} round trip)", ["fact", "value"],
                     [(k, escape(v)) for k, v in found.summary_rows()])
        report.table(f"{outcome.host.name}: packages of stack {chosen.name}",
                     ["package", "installed", "pinned", "status", "location"],
                     [(name, have, want,
                       "ok" if stacks.version_matches(have, want, found.cuda_build(name)) else "would change", where)
                      for name, have, want, where in found.package_rows(chosen)], status_column=3)
    finish(outcomes)


@command(positional=[], help={
    "host": HOST_HELP,
    "stack": STACK_HELP,
    "dry_run": "check and print what would change; change nothing on the host",
    "wheelhouse": "air-gapped install: a folder made by `invoke wheelhouse build`; the host gets only the wheels"
                  " it lacks (by sha256) and pip installs with --no-index from them",
    "json_": "print each host's report as JSON instead of tables",
})
def provision(c, host=None, stack=None, dry_run=False, wheelhouse=None, json_=False):
    """Bring hosts to the stack: venv, system packages, CUDA 13 compiler, torch, FlashInfer, sglang-kernel, SGLang."""
    hosts = hosts_or_exit(host)
    if stack:
        _load_or_exit(stack)
    if wheelhouse:
        try:
            wheels.load(wheelhouse)
        except wheels.WheelhouseError as exc:
            fail(str(exc), code=2)
    verb = "checking (dry run)" if dry_run else "provisioning"

    def one(h: Host):
        chosen = _stack_for(h, stack)
        report.note(f"{h.name}: {verb} stack {chosen.name} ({chosen.source})")
        return engine.provision(h, chosen, dry_run=dry_run, wheelhouse=wheelhouse, note=report.note)

    outcomes = for_each_host(hosts, one)
    if json_:
        report.emit_json({o.host.name: (o.value.to_json() if o.ok else {"error": str(o.error)}) for o in outcomes})
    else:
        for outcome in outcomes:
            if outcome.ok:
                _print_report(outcome.host, outcome.value)
    finish(outcomes, failed=lambda r: r.failed)


def _print_report(host: Host, result: engine.ProvisionReport) -> None:
    mode = " (dry run: nothing changed)" if result.dry_run else ""
    report.table(f"{host.describe()}: stack {result.stack}{mode}", ["step", "status", "detail", "seconds"],
                 [(s.name, s.status, escape(s.detail), f"{s.seconds:.1f}" if s.seconds else "")
                  for s in result.steps], status_column=1)
    for step in result.steps:
        if step.status == "failed" and step.tail:
            report.line(f"--- {step.name}: last lines of its output ---\n{step.tail}")
    verb = "would change" if result.dry_run else "changed"
    report.line(f"{host.name}: {result.changed} {verb}, {'FAILED' if result.failed else 'ok'};"
                f" {result.round_trips} round trip(s), {result.seconds:.1f}s")
    if result.wheels_sent or result.wheels_present:
        sent = "would send" if result.dry_run else "sent"
        report.line(f"{host.name}: wheelhouse: {sent} {len(result.wheels_sent)} wheel(s),"
                    f" {result.wheels_present} already on the host")
    if result.log:
        report.line(f"{host.name}: full output in {result.log} (on the host)")
    for text in result.notes:
        report.line(f"{host.name}: {text}")


WHEELHOUSE_USAGE = """usage: invoke wheelhouse build --stack STACK [--python 3.12] [--platform TAG] [--out DIR] [--host NAME] [--refresh]
  fills DIR with every wheel STACK needs for that Python and platform, plus manifest.json (sha256);
  --python/--platform default to --host's (one facts round trip) or else to this machine's"""


WHEELHOUSE_HELP = {
    "action": "build",
    "stack": "stack to download (gpu, cpu-ref or a .toml path); default: cpu-ref",
    "python": "target Python, e.g. 3.12 (default: the --host's, else this machine's)",
    "platform": "target platform tag, e.g. manylinux_2_35_x86_64 (default: the --host's, else this machine's)",
    "out": "folder to fill (default: .cache/wheelhouse/STACK-pyX.Y-PLATFORM)",
    "host": "take --python/--platform from this host's facts (one round trip); default: this machine",
    "refresh": "download again even when the folder's manifest already matches the stack",
    "json_": "print the manifest as JSON",
}

@command(positional=["action"], checked=["action"], usage=WHEELHOUSE_USAGE, help=WHEELHOUSE_HELP)
def wheelhouse(c, action=None, stack=None, python=None, platform=None, out=None, host=None, refresh=False,
               json_=False):
    """Download a stack's wheels for an air-gapped host (then: invoke provision --wheelhouse DIR)."""
    if help_or_bad_action(wheelhouse, action, ("build",)):
        return
    chosen = _load_or_exit(stack or "cpu-ref")
    if host and not (python and platform):
        target = hosts_or_exit(host)
        if len(target) != 1:
            fail("--host must name one host for a wheelhouse", code=2)
        try:
            found = facts_engine.gather(target[0], chosen)
        except (TransportError, HostScriptError) as exc:
            fail(str(exc))
        python = python or found.python_tag()
        platform = platform or found.platform_tag()
    here_python, here_platform = wheels.this_machine()
    python, platform = python or here_python, platform or here_platform
    report.note(f"wheelhouse for stack {chosen.name}, Python {python}, {platform}")
    try:
        manifest = wheels.build(chosen, python=python, platform=platform, out=Path(out) if out else None,
                                refresh=refresh, note=report.note)
    except wheels.WheelhouseError as exc:
        fail(str(exc))
    if json_:
        report.emit_json(manifest.to_json())
        return
    total = sum(w.size for w in manifest.wheels)
    report.line(f"{len(manifest.wheels)} wheels, {total / 1e6:.0f} MB, in {manifest.folder}"
                f" ({manifest.seconds:.0f}s); manifest: {Path(manifest.folder) / wheels.MANIFEST}")
    report.line(f"install with: invoke provision --stack {chosen.name} --wheelhouse {manifest.folder} --host NAME")

"""Bring a host to a stack: check first (one facts round trip), then act step by step.

Steps, in order: `venv`, `system` (the commands the stack needs, from apt), then the
stack's pip steps (CUDA 13 compiler, torch, FlashInfer, sglang-kernel, SGLang, ...).
Each step is ok / changed / failed (or `would change` in a dry run); the first failure
stops the host and brings back its output tail, the full output stays in a log file on
the host. A host whose pins all match costs exactly one round trip and no pip call.

Each step that acts is one round trip running `hostside/provision_step.py` under a lock
on the host, which checks again before it acts, so a second provision running at the
same time waits and then finds nothing to do.
"""
from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.core import hostrun
from toolkit.provision import wheelhouse as wheelhouse_mod
from toolkit.provision.facts import Facts, gather, host_venv, state_dir
from toolkit.core.hostrun import HostScriptError
from toolkit.core.inventory import Host
from toolkit.provision.stack import Stack, Step
from toolkit.core.transport import Transport

STEP_TIMEOUT = 3600.0


class ProvisionError(RuntimeError):
    """The host cannot take this stack; nothing was changed (the message says what to do)."""


@dataclass
class StepResult:
    name: str
    status: str               # ok | changed | failed | would change | skipped
    detail: str = ""
    seconds: float = 0.0
    tail: str = ""


@dataclass
class PlannedStep:
    name: str
    kind: str                 # venv | system | pip
    needed: bool
    detail: str
    step: Step | None = None
    apt: list[str] = field(default_factory=list)


@dataclass
class ProvisionReport:
    host: str
    stack: str
    dry_run: bool
    steps: list[StepResult]
    round_trips: int = 0
    seconds: float = 0.0
    log: str | None = None
    wheels_sent: list[str] = field(default_factory=list)
    wheels_present: int = 0
    notes: list[str] = field(default_factory=list)
    reapply: str | None = None       # the command that re-applies patches a reinstall replaced
    facts: dict | None = None

    @property
    def changed(self) -> int:
        return sum(1 for s in self.steps if s.status in ("changed", "would change"))

    @property
    def failed(self) -> bool:
        return any(s.status == "failed" for s in self.steps)

    def to_json(self) -> dict:
        return {"host": self.host, "stack": self.stack, "dry_run": self.dry_run, "changed": self.changed,
                "failed": self.failed, "round_trips": self.round_trips, "seconds": self.seconds,
                "log": self.log, "wheels_sent": self.wheels_sent, "wheels_present": self.wheels_present,
                "notes": self.notes, "reapply": self.reapply,
                "steps": [s.__dict__ for s in self.steps]}


# -- checks -------------------------------------------------------------------------------

def preflight(stack: Stack, facts: Facts, host: Host) -> None:
    """Refuse, before anything is installed, a host that cannot run the stack."""
    if stack.gpu:
        if not facts.gpus:
            why = facts.raw.get("error") or "nvidia-smi lists no GPU"
            raise ProvisionError(f"stack {stack.name} needs an NVIDIA GPU, and this host shows none"
                                 f" ({why}); nothing was installed. For a host without a GPU use --stack cpu-ref.")
        major = facts.driver_major
        if major is None or major < stack.min_driver:
            needs = f"CUDA {stack.cuda}" if stack.cuda else f"stack {stack.name}"
            raise ProvisionError(
                f"NVIDIA driver {facts.driver or 'unknown'} is older than {stack.min_driver}, which {needs}"
                f" needs; upgrade the driver to {stack.min_driver} or newer and run provision again."
                f" Nothing was installed.")
    target = facts.raw.get("python", {})
    venv = host_venv(host, stack)
    unreadable = facts.raw.get("venv", {}).get("unreadable")
    if venv and unreadable:
        raise ProvisionError(f"the venv at {venv} is there but cannot be used: {unreadable}. Nothing was installed.")
    if venv and facts.venv_exists:
        if not target.get("runs"):
            raise ProvisionError(f"the venv at {venv} is broken ({target.get('error')});"
                                 f" move it away and provision again")
        if not stack.python_ok(target["version"]):
            raise ProvisionError(f"the venv at {venv} has Python {target['version']}; stack"
                                 f" {stack.name} needs >= {stack.python}. Remove the venv (or name another one"
                                 f" in the inventory) so provision can make a new one.")
    elif venv:
        if not stack.python_ok(facts.creator_version):
            raise ProvisionError(f"python3 on the host is {facts.creator_version}; stack {stack.name}"
                                 f" needs Python >= {stack.python}. Install a newer Python (e.g. apt-get install"
                                 f" python3.{stack.python.split('.')[1]}) and set `python` for the host.")
    else:
        if not target.get("runs"):
            raise ProvisionError(f"cannot run {target.get('interpreter')}: {target.get('error')}")
        if not stack.python_ok(target["version"]):
            raise ProvisionError(f"{target['interpreter']} is Python {target['version']}; stack"
                                 f" {stack.name} needs >= {stack.python}")


def disk_shortfall(stack: Stack, facts: Facts, planned: list[PlannedStep]) -> str | None:
    """Why a fresh install would not fit, or None. Only a fresh venv is judged: an update of
    a few pins in an existing one needs far less, and pip's own error names a full disk."""
    disk = facts.raw.get("disk", {})
    free = disk.get("free_bytes")
    fresh = any(p.needed and p.kind == "venv" for p in planned)
    if free is None or not stack.min_free_gb or not fresh or free >= stack.min_free_gb * 2**30:
        return None
    return (f"only {free / 2**30:.1f} GiB free at {disk.get('path')}; stack {stack.name} needs about"
            f" {stack.min_free_gb:g} GiB for a fresh install")


def plan(stack: Stack, facts: Facts, host: Host) -> list[PlannedStep]:
    steps: list[PlannedStep] = []
    venv = host_venv(host, stack)
    if venv:
        if facts.venv_exists:
            steps.append(PlannedStep("venv", "venv", False, f"{venv} (Python {facts.python_version})"))
        else:
            steps.append(PlannedStep("venv", "venv", True, f"create {venv} with python3 {facts.creator_version}"))
    else:
        steps.append(PlannedStep("venv", "venv", False,
                                 f"no venv: {host.python or 'python3'} with PYTHONPATH={host.pythonpath}"
                                 " (missing pins go into that folder: pip --target --no-deps)"))
    commands = facts.raw.get("commands", {})
    apt = [pkg for command, pkg in sorted(stack.system.items()) if not commands.get(command)]
    if venv and not facts.venv_exists and not facts.raw["creator"]["ensurepip"]:
        apt.append("python3-venv")
    if apt:
        steps.append(PlannedStep("system", "system", True, f"apt-get install {' '.join(apt)}", apt=apt))
    else:
        present = ", ".join(sorted(stack.system)) or "nothing needed"
        steps.append(PlannedStep("system", "system", False, present))
    for step in stack.steps:
        wrong = []
        for pin in step.pins:
            if not facts.pin_matches(pin):
                wrong.append(f"{facts.describe(pin.name)} -> {pin.version}")
        if wrong:
            steps.append(PlannedStep(step.name, "pip", True, "; ".join(wrong), step=step))
        else:
            steps.append(PlannedStep(step.name, "pip", False,
                                     ", ".join(facts.describe(p.name) for p in step.pins), step=step))
    return steps


# -- acting ---------------------------------------------------------------------------------

def _step_args(host: Host, stack: Stack, planned: PlannedStep, log: str, host_wheels: str | None,
               lock_timeout: float) -> dict:
    args = {"kind": planned.kind, "venv": host_venv(host, stack), "python": host.python,
            "pythonpath": host.pythonpath, "state_dir": state_dir(host, stack), "log": log,
            "lock_timeout": lock_timeout}
    if planned.kind == "system":
        args.update(commands=dict(stack.system), apt=[p for p in planned.apt if p not in stack.system.values()])
    if planned.kind == "pip":
        step = planned.step
        args.update(pins=[{"name": p.name, "spec": p.spec, "version": p.version} for p in step.pins],
                    no_deps=step.no_deps, index_url=step.index_url, constraints=stack.constraints(),
                    wheelhouse=host_wheels)
    return args


@contextmanager
def _ticker(tell, every: float = 15.0):
    """Progress for a long step: the host answers only at the end, so say it is still going."""
    done = threading.Event()
    started = time.monotonic()

    def loop():
        while not done.wait(every):
            tell(time.monotonic() - started)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def run_step(transport: Transport, args: dict, env: dict | None = None) -> dict:
    """provision_step.py on the host (it imports facts.py's probes; hostrun ships both in its zip)."""
    result = transport.run("python3 -", stdin=hostrun.build_payload("provision_step", args), timeout=STEP_TIMEOUT,
                           env=env)
    return hostrun.parse_result(result, f"provision step {args['kind']}")


def _send_wheels(transport: Transport, host: Host, stack: Stack, manifest, dry_run: bool,
                 report: ProvisionReport, note, incoming: list | None = None) -> str:
    """List the host's wheelhouse (one round trip) and send what it lacks as .part files; the
    next step run checks their sha256 and renames them into place under the host lock."""
    folder = f"{state_dir(host, stack)}/wheelhouse"
    listing = hostrun.run_script(transport, "provision_wheels", {"dir": folder, "create": not dry_run}, timeout=600)
    have = listing["wheels"]
    missing = [w for w in manifest.wheels if have.get(w.file) != w.sha256]
    report.wheels_present = len(manifest.wheels) - len(missing)
    if dry_run:
        report.wheels_sent = [w.file for w in missing]
        if missing:
            report.notes.append(f"would send {len(missing)} wheel(s), {sum(w.size for w in missing) / 1e6:.0f} MB,"
                                f" to {folder} ({report.wheels_present} already there)")
        return folder
    total = sum(w.size for w in missing)
    sent = 0
    token = uuid.uuid4().hex[:12]
    for number, wheel in enumerate(missing, 1):
        note(f"{host.name}: sending wheel {number}/{len(missing)} {wheel.file} ({wheel.size / 1e6:.1f} MB;"
             f" {sent / 1e6:.0f}/{total / 1e6:.0f} MB done)")
        part = f"{folder}/.incoming-{token}-{wheel.file}.part"
        transport.put(Path(manifest.folder) / wheel.file, part)
        incoming.append({"part": part, "final": f"{folder}/{wheel.file}", "sha256": wheel.sha256})
        sent += wheel.size
        report.wheels_sent.append(wheel.file)
    return folder


def _check_patches(host: Host, facts: Facts, report: ProvisionReport, note) -> None:
    """A reinstall may have replaced patched files: say so, and how to re-apply."""
    state = facts.raw.get("patch_state")
    if not state or not state.get("stack"):
        return
    package = state.get("package") or "sglang"
    try:
        from toolkit.patch import patching
    except ImportError:
        report.notes.append(f"patches {', '.join(state['stack'])} were applied to {package}; check them with"
                            f" `invoke patch verify --host {host.name}`")
        return
    note(f"{host.name}: checking the applied patches ({', '.join(state['stack'])}) after the reinstall")
    try:
        verified = patching.verify(host, package=package)
    except Exception as exc:  # the patch engine's own refusal is worth showing, not fatal here
        report.notes.append(f"could not verify the patches on {package}: {exc}")
        return
    report.round_trips += verified.round_trips
    bad = [f for f in verified.files if f.status in ("drifted", "missing")]
    if verified.ok and not bad:
        report.notes.append(f"patches intact after provisioning: {', '.join(verified.stack)}")
        return
    top = verified.stack[-1] if verified.stack else state["stack"][-1]
    stale = state.get("version") and verified.version and state.get("version") != verified.version
    command = (f"invoke patch revert --all --force --host {host.name} && " if stale else "") + \
        f"invoke patch apply {top} --host {host.name}"
    report.reapply = command
    report.notes.append(
        f"provisioning replaced {len(bad)} patched file(s) of {package} ({', '.join(f.path for f in bad[:5])}"
        f"{'...' if len(bad) > 5 else ''}); re-apply the patches with: {command}"
        + (f" ({'; '.join(verified.notes)})" if verified.notes else ""))


def provision(host: Host, stack: Stack, *, dry_run: bool = False, wheelhouse: str | Path | None = None,
              env: dict[str, str] | None = None, note=lambda text: None,
              lock_timeout: float = 1800.0) -> ProvisionReport:
    """Check the host against the stack and change what differs (nothing in a dry run).

    `env` is exported for the host-side commands (pip reads PIP_* from it).
    Raises ProvisionError before any change when the host cannot take the stack.
    """
    started = time.monotonic()
    manifest = None
    if wheelhouse:
        manifest = wheelhouse_mod.load(wheelhouse)
        if manifest.stack != stack.name:
            raise ProvisionError(f"wheelhouse {wheelhouse} was built for stack {manifest.stack}, not {stack.name}")
    with host.connect() as transport:
        facts = gather(host, stack, transport)
        report = ProvisionReport(host.name, stack.name, dry_run, [], facts=facts.raw)
        preflight(stack, facts, host)
        planned = plan(stack, facts, host)
        shortfall = disk_shortfall(stack, facts, planned)
        if shortfall and not dry_run:
            raise ProvisionError(f"{shortfall}. Free some space and provision again; nothing was installed.")
        if shortfall:
            report.notes.append(f"a real run would stop here: {shortfall}")
        if manifest and any(p.needed and p.kind == "pip" for p in planned):
            host_tag = facts.python_tag()
            if host_tag != manifest.python:
                raise ProvisionError(f"wheelhouse {wheelhouse} holds wheels for Python {manifest.python}; {host.name}"
                                     f" runs {host_tag}: build one with `invoke wheelhouse build --stack"
                                     f" {stack.name} --python {host_tag} --host {host.name}`")
            wheelhouse_mod.check_files(manifest)
        if dry_run or not any(p.needed for p in planned):
            if manifest and dry_run and any(p.needed and p.kind == "pip" for p in planned):
                _send_wheels(transport, host, stack, manifest, True, report, note)
            report.steps = [StepResult(p.name, "would change" if p.needed else "ok", p.detail) for p in planned]
            report.round_trips = transport.round_trips
            report.seconds = round(time.monotonic() - started, 2)
            return report
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        report.log = f"{state_dir(host, stack)}/logs/provision-{stamp}.log"
        host_wheels = None
        incoming: list[dict] = []
        failed = False
        for item in planned:
            if failed:
                report.steps.append(StepResult(item.name, "skipped", "an earlier step failed"))
                continue
            if not item.needed:
                report.steps.append(StepResult(item.name, "ok", item.detail))
                continue
            if item.kind == "pip" and manifest and host_wheels is None:
                host_wheels = _send_wheels(transport, host, stack, manifest, False, report, note, incoming)
            note(f"{host.name}: {item.name}: {item.detail} ... (full output: {report.log})")
            args = _step_args(host, stack, item, report.log, host_wheels, lock_timeout)
            args["incoming"], incoming = incoming, []
            try:
                with _ticker(lambda elapsed: note(f"{host.name}: {item.name}: still running ({elapsed:.0f}s)")):
                    answer = run_step(transport, args, env)
            except HostScriptError as exc:
                answer = {"status": "failed", "detail": str(exc).splitlines()[0],
                          "tail": exc.result.tail() if exc.result else ""}
            result = StepResult(item.name, answer["status"], answer.get("detail", ""),
                                answer.get("seconds", 0.0), answer.get("tail", ""))
            if answer.get("waited_s", 0) > 1:
                result.detail += f" (waited {answer['waited_s']:.0f}s for another provision)"
            note(f"{host.name}: {item.name}: {result.status} in {result.seconds:.1f}s")
            report.steps.append(result)
            failed = result.status == "failed"
        if any(s.status == "changed" for s in report.steps if s.name not in ("venv", "system")):
            after = gather(host, stack, transport)
            report.facts = after.raw
            _check_patches(host, after, report, note)
        report.round_trips += transport.round_trips
    report.seconds = round(time.monotonic() - started, 2)
    return report


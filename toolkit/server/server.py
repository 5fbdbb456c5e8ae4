"""Start, stop and inspect the model server on a host, from a profile (profiles/*.toml).

    state = start(host, "cpu-ref")          # render launch.sh, start detached, wait until ready
    with endpoint(host, state) as url:      # base URL reachable from this machine
        ...                                  # (SSH: a tunnel from 127.0.0.1 here to the host's port)
    stop(host)                               # TERM the group, KILL after grace, GPU memory back to idle

Ready means: the profile's health endpoint answers 2xx AND every expected log line has been
printed (lines in `ready.rank_log_lines` by each TP rank TP0..TP{n-1}). Start refuses while a
server is recorded as running, while a process holds GPU memory, or while the port is taken;
a server that dies or is not ready in time is stopped again and its log tail is reported.

Every start keeps its own log (`<server dir>/logs/PROFILE-<UTC time>.log`, `server.log` points at
the newest); after ready, the lines that the host's applied patchsets list under `[logs] print`
come back in `ServerState.print_lines`, one per distinct text with the TP ranks that printed it.

Host-side work is `toolkit/hostside/server_ctl.py`: start is one round trip for a fast server
(it waits on the host), plus one per `wait_chunk` seconds of a slow start (progress lines).
"""
from __future__ import annotations

import contextlib
import logging
import posixpath
import select
import shlex
import socket
import threading
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterator

import jinja2

from toolkit.core import paths
from toolkit.server import profiles
from toolkit.core.hostrun import HostScriptError, run_script
from toolkit.core.inventory import Host
from toolkit.core.transport import SSHTransport, Transport, TransportError

DEFAULT_TIMEOUT = 900.0     # SGLang with a large model and CUDA graphs takes minutes
DEFAULT_KEEP_LOGS = 20      # per profile; older logs are removed at the next start (server.keep_logs)
DEFAULT_GRACE = 30.0
DEFAULT_MEMORY_WAIT = 60.0
WAIT_CHUNK = 15.0           # seconds the host waits per round trip before reporting progress


class ServerError(RuntimeError):
    """Start, stop or a query failed; the message says what to do. `log_tail` holds the server's last lines."""

    def __init__(self, message: str, log_tail: str = "", details: dict | None = None):
        super().__init__(message)
        self.log_tail = log_tail
        self.details = details or {}


class ServerRefused(ServerError):
    """Start was refused before anything was launched (already running, port taken, GPU held)."""


@dataclass
class ServerState:
    host: str
    profile: str
    pid: int
    port: int
    bind: str
    base_url_on_host: str
    log_path: str
    script_path: str
    started_at: float
    tp_size: int
    dyn_threshold: int | str | None   # "auto" with --threshold auto
    expected_log_lines: list[str]
    health_endpoint: str = "/health"
    model: str | None = None
    draft_model: str | None = None
    kind: str = ""
    status: str = "ready"           # starting | ready | dead (recorded but no process left)
    healthy: bool | None = None
    uptime_s: float | None = None
    ready_after_s: float | None = None
    idle_gpu_memory: list[dict] | None = None
    round_trips: int | None = None   # SSH round trips the start took (patch check excluded)
    notes: list[str] = field(default_factory=list)
    overrides: dict = field(default_factory=dict)       # the command-line options it was started with
    timeout_s: float | None = None
    check_patches: bool = True
    patch_stack: list[str] = field(default_factory=list)  # patchsets applied on the host when it started
    print_lines: list[str] = field(default_factory=list)  # `[logs] print` lines, "[TP0,TP1] text"
    ranks: dict | None = None        # status: {"0": pid, ...} of SGLang's live scheduler processes

    @property
    def started_at_iso(self) -> str:
        return datetime.fromtimestamp(self.started_at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    def to_json(self) -> dict:
        data = asdict(self)
        data["started_at_iso"] = self.started_at_iso
        return data


@dataclass
class StopResult:
    host: str
    stopped: bool                    # True: nothing of the server is left (and GPU memory is idle)
    was_running: bool
    profile: str | None = None
    pid: int | None = None
    signal: str | None = None        # TERM (exited in grace), KILL (needed), None (nothing to signal)
    stop_s: float | None = None
    gpu_memory: list[dict] | None = None
    holders: list[dict] = field(default_factory=list)
    reason: str = ""
    round_trips: int | None = None
    notes: list[str] = field(default_factory=list)
    gpu_check_error: str = ""        # nvidia-smi failed or hung after the stop: memory not checked

    def to_json(self) -> dict:
        return asdict(self)


# -- rendering ----------------------------------------------------------------------------

def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(paths.TEMPLATES_DIR)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def command_lines(argv: list[str]) -> list[str]:
    """The argv, shell-quoted, one `--flag value...` per line (for a script a person reads)."""
    lines: list[list[str]] = [[]]
    for arg in argv:
        if arg.startswith("-") and lines[-1] and len(lines) + len(lines[-1]) > 1:
            lines.append([])
        lines[-1].append(shlex.quote(arg))
    return [" ".join(words) for words in lines]


def render_launch_script(plan: profiles.LaunchPlan) -> str:
    script_path = posixpath.join(plan.server_dir, "launch.sh")
    return _environment().get_template("launch.sh.j2").render(
        plan=plan, script_path=script_path, command_lines=command_lines(plan.argv))


def render_unit(plan: profiles.LaunchPlan, grace: float = DEFAULT_GRACE) -> str:
    # Under systemd the toolkit does not start the server: its output gets a log of its own.
    return _environment().get_template("sglang.service.j2").render(
        plan=plan, script_path=posixpath.join(plan.server_dir, "launch.sh"),
        unit_path=posixpath.join(plan.server_dir, "toolkit-server.service"),
        log_path=posixpath.join(plan.server_dir, "logs", f"{plan.profile}-systemd.log"), grace=grace)


def plan(host: Host, profile_name: str, overrides: dict | None = None) -> profiles.LaunchPlan:
    return profiles.resolve(host, profile_name, overrides)


# -- host calls ---------------------------------------------------------------------------

def _root(host: Host) -> str:
    return posixpath.join(host.toolkit_state_dir, "server")


def _ctl(transport: Transport, host: Host, action: str, timeout: float, **args) -> dict:
    try:
        return run_script(transport, "server_ctl", {"action": action, "root": _root(host), **args}, timeout=timeout)
    except HostScriptError as exc:
        raise ServerError(f"{host.name}: server {action} failed on the host: {exc}") from exc


def _host_setting(host: Host, key: str, default):
    return (host.server or {}).get(key, default)


def default_model_dir(host: Host) -> str:
    """Where `invoke server model` makes the reference model: server.model, else <venv>/../models/tiny-llama."""
    return (host.server or {}).get("model") or posixpath.normpath(
        posixpath.join(host.venv or "", "..", "models", "tiny-llama"))


def required_paths(host: Host, launch: profiles.LaunchPlan, overrides: dict | None = None) -> list[dict]:
    """What start checks on the host before launching (the server program, model folders), each with
    the command that makes it right (`overrides`: the options the paths came from, if any).

    Only absolute paths: SGLang also takes a model hub id (`org/name`), which is not a path."""
    needs = []
    if launch.kind == "command":
        return needs
    if launch.argv and launch.argv[0].startswith("/"):
        needs.append({"what": "server program", "path": launch.argv[0],
                      "advice": f"install the stack first: invoke provision --host {host.name}"})
    for what, path, option in (("model", launch.model, "--model"), ("draft model", launch.draft_model, "--draft-model")):
        if not path or not path.startswith("/"):
            continue
        key = "model" if what == "model" else "draft_model"
        given = key in (overrides or {})
        if launch.kind == "transformers-serve" and what == "model":
            out = "" if path == posixpath.normpath(default_model_dir(host)) else f" --out {shlex.quote(path)}"
            advice = (f"{'check the path given with --model, or ' if given else ''}make the reference model "
                      f"there first: invoke server model --host {host.name}{out}")
        elif given:
            advice = f"check the path given with {option}"
        else:
            advice = (f"copy the {what} there, or name where it is with {option} PATH or `{key} = \"PATH\"` "
                      f"in the [{host.name}.server] table of its hosts/*.toml file")
        needs.append({"what": f"{what} folder", "path": path, "advice": advice})
    return needs


def missing_paths(host: Host, launches: list[profiles.LaunchPlan], overrides: dict | None = None,
                  transport: Transport | None = None) -> list[tuple[profiles.LaunchPlan, dict]]:
    """(launch, need) for each required path of these launch plans that does not exist on the host:
    one round trip, made before a server is stopped or a bench touches one."""
    needs = [(launch, need) for launch in launches for need in required_paths(host, launch, overrides)]
    if not needs:
        return []
    paths = sorted({need["path"] for _, need in needs})
    script = " ; ".join(f"test -e {shlex.quote(path)} || echo {shlex.quote(path)}" for path in paths)
    if transport is None:
        with host.connect() as own:
            found = own.run(script, timeout=60)
    else:
        found = transport.run(script, timeout=60)
    missing = set(found.stdout.splitlines())
    return [(launch, need) for launch, need in needs if need["path"] in missing]


def log_prefixes() -> dict[str, dict[str, list[str]]]:
    """{"print_prefixes": {patchset: [prefix, ...]}, "refuse_prefixes": {...}} from the `[logs]
    print` and `refuse` lists of the patchsets in patchsets/ (the host keeps those of its stack)."""
    from toolkit.patch.patchsets import PatchsetError, load_all

    try:
        known = load_all()
    except PatchsetError:
        known = {}   # a broken patchset folder is the patch commands' error to report, not start's
    return {"print_prefixes": {name: ps.print_prefixes for name, ps in known.items() if ps.print_prefixes},
            "refuse_prefixes": {name: ps.refuse_prefixes for name, ps in known.items() if ps.refuse_prefixes}}


def collapse_rank_lines(rows: list) -> list[str]:
    """[[rank or None, text], ...] in log order -> one line per distinct text, naming the ranks that
    printed it: "[TP0,TP1] text" (runs of 3 or more as "TP0-TP7"); a line without a rank stays bare."""
    order: list[str] = []
    ranks: dict[str, set] = {}
    for rank, text in rows:
        if text not in ranks:
            order.append(text)
            ranks[text] = set()
        if rank is not None:
            ranks[text].add(int(rank))
    lines = []
    for text in order:
        names, run = [], []
        for rank in sorted(ranks[text]) + [None]:
            if run and (rank is None or rank != run[-1] + 1):
                names += [f"TP{run[0]}-TP{run[-1]}"] if len(run) >= 3 else [f"TP{r}" for r in run]
                run = []
            if rank is not None:
                run.append(rank)
        lines.append(f"[{','.join(names)}] {text}" if names else text)
    return lines


def _state_from_record(host: Host, record: dict, **live) -> ServerState:
    started = record["started_at"]
    ready_at = record.get("ready_at")
    return ServerState(
        host=host.name, profile=record["profile"], pid=record["pid"], port=record["port"], bind=record["bind"],
        base_url_on_host=record["base_url_on_host"], log_path=record["log_path"],
        script_path=record["script_path"], started_at=started, tp_size=record["tp_size"],
        dyn_threshold=record.get("dyn_threshold"), expected_log_lines=record.get("expected_log_lines", []),
        health_endpoint=record.get("health_endpoint", "/health"), model=record.get("model"),
        draft_model=record.get("draft_model"), kind=record.get("kind", ""),
        ready_after_s=round(ready_at - started, 1) if ready_at else None,
        idle_gpu_memory=record.get("idle_gpu_memory"), overrides=record.get("overrides") or {},
        timeout_s=record.get("timeout_s"), check_patches=record.get("check_patches", True),
        patch_stack=record.get("patch_stack") or [], **live)


def _check_patchsets(host: Host, launch: profiles.LaunchPlan, note: Callable[[str], None]) -> list[str]:
    if not launch.requires_patchsets:
        return []
    try:
        from toolkit.patch import patching
    except ImportError:
        return [f"patch engine not available: requirement {', '.join(launch.requires_patchsets)} not checked"]
    try:
        result = patching.verify(host)
    except Exception as exc:  # the patch engine's own errors: any of them means "cannot tell"
        raise ServerRefused(f"{host.name}: cannot check that patchset(s) {', '.join(launch.requires_patchsets)} "
                            f"required by {launch.profile} are applied: {exc}; fix that, or pass "
                            f"--skip-patch-check to start anyway") from exc
    missing = [name for name in launch.requires_patchsets if name not in result.stack]
    if missing:
        raise ServerRefused(
            f"{host.name}: profile {launch.profile} requires patchset(s) {', '.join(missing)}, which "
            f"{'are' if len(missing) > 1 else 'is'} not applied (applied: {', '.join(result.stack) or 'none'}); "
            f"apply with: invoke patch apply {missing[0]} --host {host.name}")
    if not result.ok:
        raise ServerRefused(f"{host.name}: the installed package has drifted from its patch state; "
                            f"see: invoke patch verify --host {host.name}")
    patched = {row.path for row in result.files if row.status == "patched"}
    absent = [path for path in launch.requires_patched_files if path not in patched]
    if absent:
        # a feature that only some releases' diffs carry (e.g. dyn-disable's native plain path, 0.5.11)
        raise ServerRefused(
            f"{host.name}: profile {launch.profile} needs {', '.join(absent)}, which the patchset(s) applied for "
            f"{result.package} {result.version} ({', '.join(result.stack)}) do not write; `invoke patch list` shows "
            f"each release's diffs; pick a profile without it (invoke server profiles)")
    note(f"{host.name}: patchset(s) {', '.join(launch.requires_patchsets)} applied and verified")
    return []


def start_args(host: Host, launch: profiles.LaunchPlan, *, overrides: dict | None = None,
               timeout: float = DEFAULT_TIMEOUT, check_patches: bool = True, wait_chunk: float = WAIT_CHUNK) -> dict:
    """The arguments of `server_ctl start` for this launch plan (also what a rollout's host guard
    runs to bring the recorded server back without the control machine)."""
    meta = {"kind": launch.kind, "port": launch.port, "bind": launch.bind,
            "base_url_on_host": launch.base_url_on_host, "health_endpoint": launch.health_endpoint,
            "model": launch.model, "draft_model": launch.draft_model, "dyn_threshold": launch.dyn_threshold,
            "dyn_hysteresis": launch.dyn_hysteresis, "expected_log_lines": launch.expected_log_lines(),
            "host": host.name, "launch_id": uuid.uuid4().hex,
            "overrides": {k: v for k, v in (overrides or {}).items() if v is not None},
            "check_patches": check_patches, **log_prefixes()}
    args = {"plan": launch.to_json(), "script": render_launch_script(launch), "unit": render_unit(launch),
            "meta": meta, "timeout_s": timeout, "wait_s": min(wait_chunk, timeout),
            "nvidia_smi": launch.nvidia_smi, "shared_gpu": launch.shared_gpu,
            "required_paths": required_paths(host, launch, overrides), "keep_logs": keep_logs(host),
            "patch_state": posixpath.join(host.toolkit_state_dir, "patch", "state.json")}
    return args


def start(host: Host, profile_name: str, *, timeout: float = DEFAULT_TIMEOUT, overrides: dict | None = None,
          check_patches: bool = True, wait_chunk: float = WAIT_CHUNK,
          progress: Callable[[str], None] = lambda text: None) -> ServerState:
    """Start `profile_name` on `host` and wait until it is ready; raise ServerError otherwise."""
    launch = plan(host, profile_name, overrides)
    notes = list(launch.notes)
    notes += _check_patchsets(host, launch, progress) if check_patches else (
        [f"patchset requirement {', '.join(launch.requires_patchsets)} not checked (asked not to)"]
        if launch.requires_patchsets else [])
    args = start_args(host, launch, overrides=overrides, timeout=timeout, check_patches=check_patches,
                      wait_chunk=wait_chunk)
    meta = args["meta"]
    try:
        answer = _start_and_wait(host, launch, args, timeout, wait_chunk, progress)
    except (KeyboardInterrupt, TransportError, ServerError) as exc:
        # The launch may have happened before the interruption or the host-side error: take it down again.
        what = ("was interrupted" if isinstance(exc, (KeyboardInterrupt, TransportError))
                else f"failed on the host ({exc})")
        try:
            with host.connect() as transport:
                recorded = _ctl(transport, host, "status", 60).get("record") or {}
            if recorded.get("launch_id") == meta["launch_id"]:
                progress(f"{host.name}: start of {profile_name} {what}; stopping what it launched")
                stop(host, grace=10, memory_wait=0)
        except Exception as cleanup:  # report both: the server may be left running
            failed = (f"{host.name}: start of {profile_name} {what} and the cleanup failed "
                      f"({cleanup}); check with: invoke server status --host {host.name}")
            if isinstance(exc, KeyboardInterrupt):   # Ctrl-C still stops the caller (a rollout's gate too)
                progress(failed)
                raise exc from cleanup
            raise ServerError(failed) from exc
        raise
    notes += answer.get("notes", [])
    if answer["status"] == "refused":
        raise ServerRefused(f"{host.name}: not starting {profile_name}: {answer['reason']}", details=answer)
    if answer["status"] == "failed":
        survivors = answer.get("survivors") or []
        left = (f"; WARNING: processes {survivors} survived SIGKILL" if survivors
                else "; nothing of it is left running")
        raise ServerError(f"{host.name}: {profile_name} did not start: {answer['reason']}{left}",
                          log_tail=answer.get("log_tail", ""), details=answer)
    state = _state_from_record(host, answer["record"], status="ready", healthy=True, uptime_s=0.0,
                               round_trips=answer["round_trips"])
    state.notes = notes
    state.print_lines = collapse_rank_lines(answer.get("print_lines") or [])
    return state


def keep_logs(host: Host) -> int:
    value = (host.server or {}).get("keep_logs", DEFAULT_KEEP_LOGS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise profiles.ProfileError(f"host {host.name}: [server] keep_logs must be an integer >= 1, not {value!r}")
    return value


@dataclass
class RestartPlan:
    """What `restart` will do: stop `running` (None: nothing recorded) and start `profile` with `overrides`."""
    profile: str
    overrides: dict
    timeout: float
    check_patches: bool
    running: ServerState | None
    reused_from: str | None      # the recorded start whose options are reused, or None
    notes: list[str] = field(default_factory=list)


def restart_plan(host: Host, profile_name: str | None = None, overrides: dict | None = None,
                 timeout: float | None = None, check_patches: bool | None = None) -> RestartPlan:
    """One status round trip: what a restart would stop and start.

    No PROFILE: the recorded server's profile (or the last one started when none is recorded) with
    the options it was started with; options given now replace those. A different PROFILE starts
    with the options given now only."""
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    with host.connect() as transport:
        answer = _ctl(transport, host, "status", 60)
    record = answer.get("record")
    running = None
    notes = []
    if record is not None:
        running = _state_from_record(host, record, status="ready" if answer.get("running") else "dead",
                                     healthy=answer.get("healthy"), uptime_s=answer.get("uptime_s"))
    previous = record or answer.get("last")
    if profile_name is None:
        if previous is None:
            raise ServerRefused(f"{host.name}: no server has been started here, so there is nothing to restart; "
                                f"start one with: invoke server start PROFILE --host {host.name}")
        profile_name = previous["profile"]
        if record is None:
            notes.append(f"nothing is running; starting {profile_name}, the last profile started on {host.name}")
    same = previous is not None and previous.get("profile") == profile_name
    earlier = previous if same else {}
    reused = dict(earlier.get("overrides") or {})
    started = earlier.get("started_at")
    return RestartPlan(
        profile=profile_name, overrides={**reused, **given},
        timeout=float(timeout if timeout is not None else earlier.get("timeout_s") or DEFAULT_TIMEOUT),
        check_patches=check_patches if check_patches is not None else earlier.get("check_patches", True),
        running=running, notes=notes,
        reused_from=(datetime.fromtimestamp(started, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                     if started else None) if same else None)


@dataclass
class RestartResult:
    plan: RestartPlan
    stopped: StopResult | None
    started: ServerState


def restart(host: Host, profile_name: str | None = None, *, overrides: dict | None = None,
            timeout: float | None = None, check_patches: bool | None = None, grace: float = DEFAULT_GRACE,
            memory_wait: float | None = None,
            progress: Callable[[str], None] = lambda text: None) -> RestartResult:
    """Stop the recorded server (if any) and start `profile_name` (default: the same one) again.

    The new launch plan is resolved before anything is stopped, so bad options stop nothing."""
    todo = restart_plan(host, profile_name, overrides, timeout, check_patches)
    launch = plan(host, todo.profile, todo.overrides)
    for _, need in missing_paths(host, [launch], todo.overrides)[:1]:   # what start would refuse for
        raise ServerRefused(f"{host.name}: not restarting {todo.profile}: {need['what']} {need['path']} does "
                            f"not exist on the host; {need['advice']}; nothing was stopped")
    stopped = None
    if todo.running is not None:
        progress(f"{host.name}: stopping {todo.running.profile} (pid {todo.running.pid})")
        stopped = stop(host, grace=grace, memory_wait=memory_wait)
        if not stopped.stopped:
            raise ServerError(f"{host.name}: {todo.running.profile} did not stop ({stopped.reason}); "
                              f"nothing was started")
    started = start(host, todo.profile, timeout=todo.timeout, overrides=todo.overrides,
                    check_patches=todo.check_patches, progress=progress)
    started.notes = todo.notes + started.notes
    return RestartResult(todo, stopped, started)


def running_server(host: Host) -> ServerState | None:
    """The recorded server when its process still runs, else None (one round trip)."""
    state = status(host)
    return state if state is not None and state.status != "dead" else None


def _start_and_wait(host, launch, args, timeout, wait_chunk, progress) -> dict:
    round_trip_limit = wait_chunk + 120
    with host.connect() as transport:
        progress(f"{host.name}: starting {launch.profile} on {launch.bind}:{launch.port} "
                 f"(ready = {launch.health_endpoint} answers + {len(launch.expected_log_lines())} log line(s); "
                 f"timeout {timeout:.0f}s)")
        answer = _ctl(transport, host, "start", round_trip_limit, **args)
        while answer["status"] == "waiting":
            pending = []
            if not answer.get("healthy"):
                pending.append(f"{launch.health_endpoint} not answering")
            if answer.get("missing"):
                pending.append(f"{len(answer['missing'])} log line(s) missing, e.g. {answer['missing'][0]!r}")
            progress(f"{host.name}: waiting for {launch.profile}: {answer['waited_s']:.0f}s/{timeout:.0f}s, "
                     + ", ".join(pending))
            answer = _ctl(transport, host, "wait", round_trip_limit, wait_s=wait_chunk)
        answer["round_trips"] = transport.round_trips
    return answer


def stop_args(host: Host, *, grace: float, memory_wait: float, shared_gpu: bool) -> dict:
    """The arguments of `server_ctl stop` (without the action and root)."""
    return {"grace": grace, "memory_wait_s": memory_wait,
            "nvidia_smi": str(_host_setting(host, "nvidia_smi", "nvidia-smi")),
            "slack_mib": int(_host_setting(host, "idle_memory_slack_mib", 512)), "shared_gpu": shared_gpu}


def ctl_args(host: Host, action: str, **args) -> dict:
    """What `_ctl` sends to the host-side server_ctl (for payloads run on the host later)."""
    return {"action": action, "root": _root(host), **args}


def _memory_wait(host: Host, memory_wait: float | None) -> float:
    return float(_host_setting(host, "memory_wait_s", DEFAULT_MEMORY_WAIT) if memory_wait is None else memory_wait)


@dataclass
class StopPlan:
    """What `stop` would do: TERM `running`'s group (None: nothing recorded), KILL after `grace`,
    then wait up to `memory_wait` s for idle GPU memory (not with `shared_gpu`)."""
    host: str
    running: ServerState | None
    grace: float
    memory_wait: float
    shared_gpu: bool

    def to_json(self) -> dict:
        return asdict(self)


def stop_plan(host: Host, *, grace: float = DEFAULT_GRACE, memory_wait: float | None = None) -> StopPlan:
    """One status round trip: what `stop` with these options would stop; nothing is signalled."""
    shared_gpu = profiles.shared_gpu(host)
    return StopPlan(host.name, status(host), grace, _memory_wait(host, memory_wait), shared_gpu)


def stop(host: Host, *, grace: float = DEFAULT_GRACE, memory_wait: float | None = None) -> StopResult:
    """TERM the server's process group, KILL after `grace` s, wait for GPU memory to be idle again."""
    memory_wait = _memory_wait(host, memory_wait)
    shared_gpu = profiles.shared_gpu(host)   # a bad value is refused before connecting
    with host.connect() as transport:
        answer = _ctl(transport, host, "stop", grace + memory_wait + 120,
                      **stop_args(host, grace=grace, memory_wait=memory_wait, shared_gpu=shared_gpu))
        answer["round_trips"] = transport.round_trips
    if "profile" not in answer:  # nothing recorded
        return StopResult(host.name, stopped=True, was_running=False, reason=answer.get("reason", ""),
                          round_trips=answer["round_trips"])
    return StopResult(host.name, stopped=answer["stopped"], was_running=answer["was_running"],
                      profile=answer["profile"], pid=answer["pid"], signal=answer["signal"],
                      stop_s=answer["stop_s"], gpu_memory=answer.get("gpu_memory"),
                      holders=answer.get("holders", []), reason=answer.get("reason", ""),
                      round_trips=answer["round_trips"], notes=answer.get("notes", []),
                      gpu_check_error=answer.get("gpu_check_error", ""))


def status(host: Host, transport: Transport | None = None) -> ServerState | None:
    """The recorded server (status ready/starting/dead, health, uptime, live scheduler ranks), or
    None when none is recorded. `transport`: an open connection to reuse (`server watch`)."""
    with contextlib.nullcontext(transport) if transport is not None else host.connect() as link:
        answer = _ctl(link, host, "status", 60)
    record = answer.get("record")
    if record is None:
        return None
    status_word = "dead" if not answer["running"] else record.get("status", "ready")
    return _state_from_record(host, record, status=status_word, healthy=answer.get("healthy"),
                              uptime_s=answer.get("uptime_s"), ranks=answer.get("ranks"))


def read_log(host: Host, *, rank: int | None = None, lines: int | None = None, since_start: bool = True,
             profile: str | None = None, run: int = 0) -> str:
    """The server log of the current (or last) run; `rank` keeps TP{rank}'s lines; `lines` the last N.

    since_start=False puts the previous run's log in front; `run` N reads the Nth run before it.
    The host reads a log's last 4 MiB; of one run's whole log longer than that (no `rank` or
    `lines`), the host scans the earlier lines for the smoke's problem lines and sends their blocks
    too, with the log's line numbers (`smoke.excerpted_log`), so the smoke's log check sees them.
    ServerError when there is no such log (nothing started here, `profile` never started, `run`
    past the kept logs)."""
    from toolkit.check import smoke   # the problem lines it looks for

    whole = rank is None and not lines and since_start
    with host.connect() as transport:
        answer = _ctl(transport, host, "logs", 300 if whole else 60, rank=rank, lines=lines, profile=profile,
                      run=run, runs=1 if since_start else 2, problems=smoke.PROBLEM_LINE.pattern if whole else None)
    if answer.get("reason") and answer.get("log_path") is None:
        raise ServerError(f"{host.name}: {answer['reason']}")
    if answer.get("scan"):
        return smoke.excerpted_log(answer["scan"], answer["text"])
    return answer["text"]


def list_logs(host: Host, profile: str | None = None) -> dict:
    """{"profile": NAME, "logs": [{path, size, modified, current}, ...]} oldest first."""
    with host.connect() as transport:
        answer = _ctl(transport, host, "logs", 60, profile=profile, list=True)
    return {"profile": answer.get("profile"), "logs": answer.get("logs", []), "reason": answer.get("reason")}


def follow_log(host: Host, *, rank: int | None = None, lines: int = 20, duration: float = 60.0,
               interval: float = 1.0, emit: Callable[[str], None] = print,
               should_stop: Callable[[], bool] = lambda: False) -> int:
    """Print the last `lines`, then new lines as they come, for at most `duration` s; returns round trips."""
    deadline = time.monotonic() + duration
    with host.connect() as transport:
        answer = _ctl(transport, host, "logs", 60, rank=rank, lines=lines)
        if answer.get("text"):
            emit(answer["text"])
        offset, profile, following = answer.get("offset", 0), answer.get("profile"), answer.get("log_path")
        while time.monotonic() < deadline and not should_stop():
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            answer = _ctl(transport, host, "logs", 60, rank=rank, offset=offset, profile=profile,
                          log_path=following)
            if answer.get("text"):
                emit(answer["text"].rstrip("\n"))
            offset = answer.get("offset", offset)
            if not answer.get("text") and answer.get("latest") and answer["latest"] != following:
                following, offset = answer["latest"], 0   # the profile was started again: its new log
                emit(f"--- a new run of {profile}: {following} ---")
        return transport.round_trips


def model_target(host: Host, out_dir: str | None = None) -> str:
    """Where `make_model` would make the reference model (no host contact)."""
    if not host.venv and not host.python:
        raise ServerError(f"host {host.name} has no venv: the model is made with the venv's torch/transformers")
    return out_dir or default_model_dir(host)


def make_model(host: Host, out_dir: str | None = None, *, seed: int = 0, timeout: float = 600) -> dict:
    """Make the tiny reference model on the host inside its venv (refmodel.make from hostrun's zip)."""
    target = model_target(host, out_dir)
    with host.connect() as transport:
        try:
            return run_script(transport, "refmodel", {"out_dir": target, "seed": int(seed)},
                              python=shlex.quote(host.venv_python), timeout=timeout,
                              env={"HF_HUB_OFFLINE": "1"}, function="make")
        except HostScriptError as exc:
            raise ServerError(f"{host.name}: making the reference model in {target} failed: {exc}") from exc


# -- reaching the server from this machine ---------------------------------------------------

class _RefusedChannels(logging.Filter):
    """While a forward is open: drops paramiko's "Secsh channel N open FAILED" lines and counts them.

    Once the server is gone, every request through the forward fails to open its channel, and
    paramiko logs each one (through logging's last resort, on stderr): the forward drops that
    client, and the request fails and is reported by whoever sent it."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger, self.count = logger, 0
        logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if "open FAILED" in record.getMessage():
            self.count += 1
            return False
        return True

    def close(self) -> None:
        self.logger.removeFilter(self)


class _Forwarder:
    """127.0.0.1:<free port> here -> (host's address, port) over the SSH connection (direct-tcpip)."""

    def __init__(self, ssh: SSHTransport, remote: tuple[str, int]):
        self.ssh, self.remote = ssh, remote
        self.refused = _RefusedChannels(ssh.connection.client.get_transport().logger)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.closing = threading.Event()
        self.threads: list[threading.Thread] = []
        self.acceptor = threading.Thread(target=self._accept, name="toolkit-forward", daemon=True)
        self.acceptor.start()

    def _accept(self):
        paramiko_transport = self.ssh.connection.client.get_transport()
        while not self.closing.is_set():
            try:
                client, origin = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                channel = paramiko_transport.open_channel("direct-tcpip", self.remote, origin, timeout=30)
            except Exception:  # the host refused (server gone): drop this client, keep serving
                client.close()
                continue
            pump = threading.Thread(target=self._pump, args=(client, channel), daemon=True)
            pump.start()
            self.threads.append(pump)

    def _pump(self, client: socket.socket, channel):
        try:
            while not self.closing.is_set():
                ready, _, _ = select.select([client, channel], [], [], 0.5)
                if client in ready:
                    data = client.recv(65536)
                    if not data:
                        break
                    channel.sendall(data)
                if channel in ready:
                    data = channel.recv(65536)
                    if not data:
                        break
                    client.sendall(data)
        except OSError:
            pass
        finally:
            channel.close()
            client.close()

    def close(self):
        self.closing.set()
        self.listener.close()
        self.acceptor.join(timeout=2)
        for pump in self.threads:
            pump.join(timeout=2)
        self.refused.close()


@contextlib.contextmanager
def endpoint(host: Host, state: ServerState) -> Iterator[str]:
    """A base URL (no trailing slash) that reaches the server from this machine, for the block's duration.

    Local transport: the server's own URL. SSH: a forward from a free 127.0.0.1 port on this
    machine to the host's bind address and port through the SSH connection; nothing listens
    beyond loopback here, and the server keeps its own bind on the host.
    """
    if host.transport == "local":
        yield state.base_url_on_host
        return
    transport = host.connect()
    if not isinstance(transport, SSHTransport):
        transport.close()
        yield state.base_url_on_host
        return
    remote_address = urllib.parse.urlsplit(state.base_url_on_host).hostname   # an IPv6 address without brackets
    try:
        transport.connection  # connect now, so a failure shows here and not in the first request
        forwarder = _Forwarder(transport, (remote_address, state.port))
        try:
            yield f"http://127.0.0.1:{forwarder.port}"
        finally:
            forwarder.close()
    finally:
        transport.close()

"""`invoke rollout`: change a running host and prove it, or put it back by itself.

Per host: record the patch stack and the running server (profile, options) -> apply the patchset
(or revert it) -> restart with the profile asked for -> smoke (burst included) -> optionally a
short bench against the host's last recorded bench of that profile -> keep, or roll back to the
recorded stack and server and smoke that. Across hosts: canary hosts first, then waves, stopping
once more hosts failed than allowed.

Never half done: before anything changes, the host gets a journal and a guard
(`hostside/rollout_hostlib.py`): a detached process that rolls the host back by itself when the
controller asks, or when the controller stops renewing its lease (killed, SSH cut). Every rollback,
asked for or not, is the guard's, so one code path restores files from the content-addressed
backups and restarts the recorded server. The next `invoke rollout` on a host whose journal is
still in flight asks its guard to finish the rollback first, then goes on.

Planning (`plan_host`, `waves`, `fleet_stop`, `compare_bench`, `describe_state`) is pure; the
functions that act on hosts are thin around the patch and server engines.
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Callable

from toolkit.core import hostrun, paths
from toolkit.patch import patching, patchsets
from toolkit.server import profiles, server
from toolkit.check import smoke as smoke_engine
from toolkit.core.hostrun import HostScriptError
from toolkit.core.inventory import Host
from toolkit.core.parallel import for_each_host
from toolkit.core.transport import TransportError

DEFAULT_LEASE_S = 60.0          # a guard rolls back when the controller is silent this long
DEFAULT_TOLERANCE = 0.05        # --gate-bench: throughput may fall this much below the record
DEFAULT_BENCH_LEVELS = (1, 8)
BENCH_REQUESTS_PER_SLOT = 3     # requests per concurrency slot in the gate's short bench
BENCH_MAX_TOKENS = 32
WAIT_CHUNK = 15.0
TERMINAL = ("kept", "rolled-back", "rollback-failed")


class RolloutError(RuntimeError):
    """The rollout cannot go on; the message says what to do."""


class RolloutInputError(RolloutError):
    """Bad input (unknown patchset or profile, options the profile refuses): refused before any host
    changes, in a dry run too (the command exits 2)."""


class Interrupted(Exception):
    """Ctrl-C came while this host ran in a worker thread: stop at the next step, the guard rolls back."""


def _quiet(text: str) -> None:
    pass


def lease_seconds() -> float:
    return float(os.environ.get("TOOLKIT_ROLLOUT_LEASE_S", DEFAULT_LEASE_S))


# -- what is probed and planned ------------------------------------------------------------

@dataclass
class Change:
    patchset: str
    revert: bool = False

    @property
    def label(self) -> str:
        return f"{'revert' if self.revert else 'apply'} {self.patchset}"


@dataclass
class Probe:
    """What one host has now: the patch stack, the recorded server, the last rollout's journal."""
    host: str
    package: str
    version: str | None
    stack: list[str]
    files_ok: bool
    file_problems: list[str] = field(default_factory=list)
    server: dict | None = None        # profile, overrides, timeout_s, status, started_at, pid, tp_size, ...
    last_profile: str | None = None   # the last profile started when none is recorded now
    journal: dict | None = None
    guard_alive: bool = False
    lease_age_s: float | None = None


@dataclass
class HostPlan:
    host: str
    change: str
    action: str                      # roll out | unchanged | refused
    reason: str = ""
    stack_before: list[str] = field(default_factory=list)
    stack_after: list[str] = field(default_factory=list)
    server_before: dict | None = None   # {profile, overrides, timeout_s} or None: nothing ran
    server_after: dict | None = None
    gates: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    converge_first: str = ""         # an in-flight rollout the guard rolls back before this one
    server_started_at: float | None = None   # which start of the old server runs (the guard keeps it if untouched)


def server_text(s: dict | None) -> str:
    if not s:
        return "no server"
    options = " ".join(f"{k}={v}" for k, v in sorted((s.get("overrides") or {}).items()))
    return s["profile"] + (f" ({options})" if options else "")


def stack_text(stack: list[str]) -> str:
    return " + ".join(stack) or "(nothing applied)"


def _options_args(overrides: dict) -> str:
    flag = {"dyn_threshold": "--threshold", "dyn_hysteresis": "--hysteresis", "tp_size": "--tp",
            "draft_model": "--draft-model"}
    return "".join(f" {flag.get(k, '--' + k.replace('_', '-'))} {v}" for k, v in sorted(overrides.items()))


def plan_host(probe: Probe, change: Change, known: dict, *, profile: str | None = None,
              overrides: dict | None = None, gate_bench: bool = False,
              bench_levels=DEFAULT_BENCH_LEVELS, tolerance: float = DEFAULT_TOLERANCE,
              launch: Callable[[str, dict], object] | None = None) -> HostPlan:
    """What the rollout will do on this host, from what was probed; no host contact.

    `launch(profile, overrides)` resolves the server to start (`server.plan` for the host, as
    `server restart` does before it stops anything); a ProfileError there is bad input and raises
    RolloutInputError, so bad options stop nothing."""
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    before = None
    if probe.server and probe.server.get("status") != "dead":
        before = {"profile": probe.server["profile"], "overrides": dict(probe.server.get("overrides") or {}),
                  "timeout_s": probe.server.get("timeout_s")}
    plan = HostPlan(probe.host, change.label, "roll out", stack_before=list(probe.stack),
                    stack_after=list(probe.stack), server_before=before,
                    server_started_at=probe.server.get("started_at") if before else None)
    if probe.journal and probe.journal.get("phase") not in TERMINAL:
        label = (probe.journal.get("change") or {}).get("label", "?")
        plan.converge_first = (f"rollout {probe.journal.get('id')} ({label})"
                               f" is in flight at phase {probe.journal.get('phase')}: its guard rolls it back first")
        before_then = (probe.journal.get("before") or {})
        plan.stack_before = list(before_then.get("stack", probe.stack))
        recorded = before_then.get("server")
        plan.server_before = ({"profile": recorded["profile"], "overrides": recorded.get("overrides") or {},
                               "timeout_s": recorded.get("timeout_s")} if recorded else None)
        before = plan.server_before

    def refuse(reason: str) -> HostPlan:
        plan.action, plan.reason = "refused", reason
        plan.stack_after = list(plan.stack_before)
        plan.server_after = before
        return plan

    if change.patchset not in known:
        return refuse(f"unknown patchset {change.patchset!r} (known: {', '.join(sorted(known)) or 'none'})")
    ps = known[change.patchset]
    if not probe.version:
        return refuse(f"{ps.package} is not installed on {probe.host}")
    if not probe.files_ok and not plan.converge_first:
        return refuse("files differ from the patch state (" + "; ".join(probe.file_problems[:3])
                      + f"); see: invoke patch verify --host {probe.host}")
    unknown = [n for n in plan.stack_before if n not in known]
    if unknown:
        return refuse(f"{', '.join(unknown)} is applied but not in patchsets/")
    stack = list(plan.stack_before)
    if change.revert:
        after = stack[:stack.index(change.patchset)] if change.patchset in stack else stack
    else:
        if probe.version not in ps.versions:
            return refuse(ps.no_release(probe.version))
        missing = [r for r in ps.requires if r not in stack]
        if missing:
            return refuse(f"{change.patchset} requires {', '.join(missing)}: roll that out first")
        after = stack if change.patchset in stack else patchsets.sort_stack(stack + [change.patchset], known)
    plan.stack_after = after

    target = profile or (before or {}).get("profile")
    if target is None:   # a rollout never starts a server that nobody was running
        last = probe.last_profile or (probe.server or {}).get("profile")
        return refuse(f"no server runs on {probe.host} and no --profile was given: say which to start"
                      + (f" (the last one started there: --profile {last})" if last else ""))
    if before and target == before["profile"]:
        after_overrides = {**before["overrides"], **given}
        timeout = before.get("timeout_s")
    else:
        after_overrides, timeout = given, None
    if launch is not None:
        try:
            launch(target, after_overrides)
        except profiles.ProfileError as exc:
            raise RolloutInputError(f"{probe.host}: {exc}") from None
    plan.server_after = {"profile": target, "overrides": after_overrides, "timeout_s": timeout}
    plan.gates = ["smoke (models, chat, determinism, stream, burst, health, log)"]
    if gate_bench:
        levels = ",".join(str(c) for c in bench_levels)
        plan.gates.append(f"bench at c={levels}: output tok/s >= {1 - tolerance:.0%} of the last kept bench "
                          f"of {target} on this host (none yet: recorded, not compared)")
    if after == stack and before is not None and before == {**plan.server_after, "timeout_s": before.get("timeout_s")} \
            and not plan.converge_first:
        plan.action, plan.reason = "unchanged", f"{stack_text(after)} and {server_text(before)} already"
        plan.gates = []
        return plan
    host = probe.host
    if after != stack:
        verb = f"invoke patch revert {change.patchset}" if change.revert else f"invoke patch apply {change.patchset}"
        plan.steps.append(f"{verb} --host {host}   # {stack_text(stack)} -> {stack_text(after)}")
    if before:
        plan.steps.append(f"invoke server stop --host {host}   # {server_text(before)}")
    plan.steps.append(f"invoke server start {target}{_options_args(after_overrides)} --host {host}")
    plan.steps.append(f"invoke smoke --host {host}")
    if gate_bench:
        plan.steps.append(f"bench c={','.join(str(c) for c in bench_levels)} vs the last kept record of {target}")
    plan.steps.append("all pass: keep. Any fails: the host's guard restores "
                      f"{stack_text(stack)} from backups and " +
                      (f"starts {server_text(before)} again, then smoke" if before else "stops the server"))
    return plan


def waves(names: list[str], canary: int, parallel: int) -> list[list[str]]:
    """The canary hosts first (one wave), then the rest in waves of `parallel`."""
    canary = max(0, min(canary, len(names)))
    parallel = max(1, parallel)
    rest = names[canary:]
    out = [names[:canary]] if canary else []
    return out + [rest[i:i + parallel] for i in range(0, len(rest), parallel)]


def fleet_stop(wave_index: int, canary: int, canary_failed: int, failed_after: int, max_failures: int) -> str:
    """Why no more hosts start after this wave ('' to go on). The canary must pass whole; after
    it, `max_failures` failed hosts are tolerated and one more stops the rollout."""
    if canary and wave_index == 0 and canary_failed:
        return f"the canary failed ({canary_failed} of {canary} host(s))"
    if failed_after > max_failures:
        return f"{failed_after} host(s) failed after the canary, more than --max-failures {max_failures}"
    return ""


def compare_bench(now: dict, reference: dict | None, tolerance: float = DEFAULT_TOLERANCE) -> tuple[bool, str]:
    """Output tok/s per concurrency level against the reference; a level below (1 - tolerance)
    of it fails. No reference: passes, and says so."""
    if not reference:
        return True, "no earlier bench of this profile on this host: recorded as the reference"
    parts, ok = [], True
    for level in sorted(now, key=int):
        mine, theirs = now[level], reference.get(str(level), reference.get(level))
        if theirs in (None, 0) or mine is None:
            parts.append(f"c={level}: {mine if mine is None else f'{mine:.1f}'} tok/s, no reference")
            continue
        ratio = mine / theirs
        verdict = "ok" if ratio >= 1 - tolerance else "LOW"
        ok = ok and verdict == "ok"
        parts.append(f"c={level}: {mine:.1f} vs {theirs:.1f} tok/s ({ratio:.2f}x, {verdict})")
    return ok, "; ".join(parts) + f"; tolerance {tolerance:.0%}"


def describe_state(probe: Probe) -> tuple[str, str]:
    """(state, detail) of a host for `--status`: old / new / in flight / rollback failed / none."""
    journal = probe.journal
    current = f"{stack_text(probe.stack)}; {server_text(probe.server)}" + (
        f" [{probe.server.get('status')}]" if probe.server else "")
    if not journal:
        return "no rollout", current
    label = (journal.get("change") or {}).get("label", "?")
    when = _iso(journal["events"][-1]["at"]) if journal.get("events") else "?"
    phase = journal.get("phase")
    if phase == "kept":
        return "new", f"{label} kept at {when}; now {current}"
    if phase == "rolled-back":
        by = journal.get("rolled_back_by", "")
        return "old", f"{label} rolled back at {when} ({by}); now {current}"
    if phase == "rollback-failed":
        return "rollback failed", f"{label}: {journal['events'][-1].get('detail')}; now {current}"
    guard = "its guard runs" if probe.guard_alive else "its guard is gone"
    lease = "" if probe.lease_age_s is None else f", controller silent for {probe.lease_age_s:.0f} s of " \
                                                 f"{journal.get('lease_s', 0):.0f}"
    return "in flight", (f"{label} at phase {phase} since {when} ({guard}{lease}); the guard rolls it back when "
                         f"the lease runs out, or rerun the rollout to converge; now {current}")


def _iso(when: float) -> str:
    return datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- results -------------------------------------------------------------------------------

@dataclass
class Gate:
    name: str
    status: str            # pass | fail | skipped
    seconds: float = 0.0
    detail: str = ""


@dataclass
class HostResult:
    host: str
    outcome: str           # kept | rolled back | refused | unchanged | not started | rollback failed | lost contact
                           # | interrupted
    before: str = ""
    after: str = ""
    gates: list[Gate] = field(default_factory=list)
    failed_check: str = ""
    rank_errors: dict = field(default_factory=dict)     # "TP0" -> first problem lines
    log_paths: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rollout_id: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.outcome not in ("kept", "unchanged", "not started")

    def to_json(self) -> dict:
        data = asdict(self)
        data["failed"] = self.failed
        return data


@dataclass
class FleetResult:
    rollout_id: str
    change: str
    plans: list[HostPlan]
    results: list[HostResult]
    stopped: str = ""
    journal: str = ""

    @property
    def ok(self) -> bool:
        return not self.stopped and not any(r.failed for r in self.results)

    def to_json(self) -> dict:
        return {"rollout_id": self.rollout_id, "change": self.change, "ok": self.ok, "stopped": self.stopped,
                "journal": self.journal, "plans": [asdict(p) for p in self.plans],
                "hosts": [r.to_json() for r in self.results]}


# -- host calls ----------------------------------------------------------------------------

def _ctl(transport, host: Host, action: str, timeout: float = 120, **args) -> dict:
    try:
        return hostrun.run_script(transport, "rollout_ctl",
                                  {"action": action, "state_dir": host.toolkit_state_dir, **args}, timeout=timeout)
    except HostScriptError as exc:
        raise RolloutError(f"{host.name}: rollout {action} failed on the host: {exc}") from exc


def ctl(host: Host, action: str, timeout: float = 120, **args) -> dict:
    with host.connect() as transport:
        return _ctl(transport, host, action, timeout, **args)


def probe_host(host: Host, package: str) -> Probe:
    verified = patching.verify(host, package=package)
    problems = [f"{f.path}: {f.status}{' (' + f.detail + ')' if f.detail else ''}" for f in verified.files
                if f.status in ("drifted", "missing")]
    state = server.status(host)
    record = None
    last = None
    if state is not None:
        record = {"profile": state.profile, "overrides": state.overrides, "timeout_s": state.timeout_s,
                  "status": state.status, "started_at": state.started_at, "pid": state.pid,
                  "tp_size": state.tp_size, "log_path": state.log_path}
    else:
        try:
            last = server.restart_plan(host).profile
        except server.ServerRefused:
            last = None
    answer = ctl(host, "status")
    return Probe(host.name, package, verified.version, verified.stack, verified.ok, problems, record, last,
                 answer.get("journal"), bool(answer.get("guard_alive")), answer.get("lease_age_s"))


class _Heartbeat:
    """Renews the host's lease while the controller drives it (own connection, own thread).

    A renewal that fails is said at once (`note`) and counted (`missed`, `problem`): the guard
    rolls the host back once the lease is older than its lease_s, so the user must know why."""

    def __init__(self, host: Host, lease_path: str, every: float, note=_quiet):
        self.host, self.lease, self.every, self.note = host, lease_path, every, note
        self.missed, self.problem = 0, ""
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"rollout-lease-{host.name}", daemon=True)
        self.thread.start()

    def _run(self):
        transport = None
        while not self.done.wait(self.every):
            try:
                if transport is None:
                    transport = self.host.connect()
                done = transport.run(f"touch {shlex.quote(self.lease)}", timeout=max(5.0, self.every))
                why = "" if done.ok else (done.tail(3) or f"touch exited {done.exit_code}")
            except Exception as exc:   # the host is out of reach: try a new connection next time
                if transport is not None:
                    transport.close()
                transport = None
                why = f"{type(exc).__name__}: {exc}"
            if why and not self.missed:
                self.note(f"{self.host.name}: the rollout's lease {self.lease} could not be renewed ({why}); "
                          "the host's guard rolls it back if the lease runs out")
            self.missed = self.missed + 1 if why else 0
            self.problem = why or self.problem
        if transport is not None:
            transport.close()

    def stop(self) -> str:
        """Stop renewing; returns the last renewal problem ('' when every renewal worked)."""
        self.done.set()
        self.thread.join(timeout=self.every + 10)
        return self.problem


def _hold_for_test(phase: str) -> None:
    """Test hook: TOOLKIT_ROLLOUT_TEST_HOLD=PHASE:FILE makes the controller write FILE and wait
    (up to 10 minutes) once it reached PHASE, so a test can kill it there."""
    spec = os.environ.get("TOOLKIT_ROLLOUT_TEST_HOLD", "")
    if not spec or spec.split(":", 1)[0] != phase:
        return
    with open(spec.split(":", 1)[1], "w") as marker:
        marker.write(str(os.getpid()))
    time.sleep(600)


def _payloads(host: Host, plan: HostPlan) -> dict:
    stop = server.ctl_args(host, "stop", **server.stop_args(
        host, grace=server.DEFAULT_GRACE, memory_wait=float((host.server or {}).get("memory_wait_s", 60)),
        shared_gpu=bool((host.server or {}).get("shared_gpu", False))))
    out = {"stop": hostrun.build_payload("server_ctl", stop), "start": None,
           "wait": hostrun.build_payload("server_ctl", server.ctl_args(host, "wait", wait_s=WAIT_CHUNK))}
    before = plan.server_before
    if before:
        launch = server.plan(host, before["profile"], before["overrides"])
        args = server.start_args(host, launch, overrides=before["overrides"],
                                 timeout=float(before.get("timeout_s") or server.DEFAULT_TIMEOUT))
        out["start"] = hostrun.build_payload("server_ctl", server.ctl_args(host, "start", **args))
    return out


def _guard_source() -> str:
    """guard.py: `python3 guard.py FOLDER` runs rollout_hostlib.guard_main(FOLDER) from the host code zip."""
    return hostrun.build_payload("rollout_hostlib", None, "guard_main")


def _touched(known: dict, names: list[str]) -> list[str]:
    found = set()
    for name in names:
        if name in known:
            found.update(known[name].touched())
    return sorted(found)


def smoke_host(host: Host, max_tokens: int = smoke_engine.CHAT_MAX_TOKENS
               ) -> tuple[smoke_engine.SmokeResult | None, server.ServerState | None, str]:
    """The toolkit's smoke on the host's recorded server (burst sized from its threshold)."""
    state = server.status(host)
    if state is None or state.status == "dead":
        return None, state, "no server is running" if state is None else f"{state.profile} is recorded but dead"
    with server.endpoint(host, state) as url:
        result = smoke_engine.run_smoke(url, read_log=lambda: server.read_log(host, since_start=True),
                                        burst=smoke_engine.burst_size(state.dyn_threshold),
                                        chat_max_tokens=max_tokens)
    return result, state, ""


def rank_errors(host: Host, profile: str | None, tp_size: int) -> dict:
    """The first problem lines of each TP rank in the server's current (or last) log."""
    out = {}
    for rank in range(tp_size) if tp_size > 1 else [None]:
        try:
            text = server.read_log(host, rank=rank, profile=profile)
        except Exception as exc:   # a log that cannot be read is reported, it does not stop the rollback
            out[f"TP{rank or 0}"] = [f"log not readable: {exc}"]
            continue
        problems, _ = smoke_engine.scan_log(text)
        out[f"TP{rank or 0}"] = [p.summary() for p in problems[:3]] or ["(no error line)"]
    return out


def _bench_levels(url: str, levels, max_tokens: int = BENCH_MAX_TOKENS) -> dict:
    from toolkit.bench import metrics, runner
    from toolkit.bench.prompts import BenchRequest

    out = {}
    for level in levels:
        requests = [BenchRequest([{"role": "user", "content": f"{smoke_engine.FIBONACCI_PROMPT} ({i})"}],
                                 max_tokens, {"ignore_eos": True}) for i in range(level * BENCH_REQUESTS_PER_SLOT)]
        run = runner.run_level(url, requests, level, max_seconds=300, request_timeout=300)
        out[str(level)] = metrics.compute(run.records, run.duration_s).get("output_throughput")
    return out


def _bench_record_path(host: Host, profile: str) -> str:
    return f"{host.toolkit_state_dir}/rollout/bench/{profile}.json"


def read_bench_record(host: Host, profile: str) -> dict | None:
    with host.connect() as transport:
        done = transport.run(f"cat {shlex.quote(_bench_record_path(host, profile))} 2>/dev/null", timeout=60)
    try:
        return json.loads(done.stdout) if done.ok and done.stdout.strip() else None
    except ValueError:
        return None


def write_bench_record(host: Host, profile: str, record: dict) -> None:
    path = _bench_record_path(host, profile)
    folder, new, final = (shlex.quote(p) for p in (path.rsplit("/", 1)[0], path + ".new", path))
    with host.connect() as transport:
        done = transport.run(f"mkdir -p {folder} && cat > {new} && mv {new} {final}",
                             stdin=json.dumps(record, indent=1), timeout=60)
    if not done.ok:
        raise RolloutError(f"{host.name}: the bench record {path} was not written: "
                           f"{done.tail(3) or f'exit {done.exit_code}'}")


@dataclass
class Options:
    profile: str | None = None
    overrides: dict = field(default_factory=dict)
    gate_bench: bool = False
    bench_levels: tuple = DEFAULT_BENCH_LEVELS
    tolerance: float = DEFAULT_TOLERANCE
    canary: int = 1
    parallel: int = 1
    max_failures: int = 0
    timeout: float | None = None
    smoke_max_tokens: int = smoke_engine.CHAT_MAX_TOKENS


class _Run:
    """One host's rollout once it is armed: each step a gate row, the journal moved along."""

    def __init__(self, host: Host, plan: HostPlan, rollout_id: str, note, interrupted: threading.Event | None = None):
        self.host, self.plan, self.id, self.note = host, plan, rollout_id, note
        self.interrupted = interrupted
        self.result = HostResult(host.name, "rolled back", rollout_id=rollout_id,
                                 before=f"{stack_text(plan.stack_before)}; {server_text(plan.server_before)}",
                                 after=f"{stack_text(plan.stack_after)}; {server_text(plan.server_after)}")

    def check(self) -> None:
        """Raise Interrupted once Ctrl-C came (the fleet's main thread sets the event)."""
        if self.interrupted is not None and self.interrupted.is_set():
            raise Interrupted(f"{self.host.name}: interrupted (Ctrl-C)")

    def phase(self, name: str, allowed: tuple, detail: str = "") -> bool:
        self.check()
        answer = ctl(self.host, "phase", id=self.id, phase=name, detail=detail, **{"from": list(allowed)})
        if not answer["ok"]:
            journal = answer.get("journal") or {}
            self.result.notes.append(f"the host's guard took over at phase {journal.get('phase')}: "
                                     f"{journal.get('rolled_back_by', '')}")
        else:
            _hold_for_test(name)
        return answer["ok"]

    def gate(self, name: str, fn) -> Gate:
        self.check()
        started = time.monotonic()
        try:
            status, detail = fn()
        except TransportError:
            raise   # the host is out of reach: its guard decides (run_host says so)
        except (patching.PatchRefused, patching.PatchFailed, server.ServerError, RolloutError) as exc:
            status, detail = "fail", str(exc).splitlines()[0]
        except Exception as exc:   # any other failure of a step is a failed gate, and the host rolls back
            status, detail = "fail", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        gate = Gate(name, status, round(time.monotonic() - started, 2), detail)
        self.result.gates.append(gate)
        self.note(f"{self.host.name}: {name}: {status} ({gate.seconds:.1f} s) {detail}")
        return gate


def _change_files(host: Host, change: Change, package: str, note) -> tuple[str, str]:
    if change.revert:
        done = patching.revert(host, change.patchset, package=package, note=note)
        return "pass", f"popped {', '.join(done.popped) or 'nothing'}, {done.changed} file(s)"
    done = patching.apply(host, change.patchset, note=note)
    return "pass", f"{done.changed} file(s) written"


def _start_after(host: Host, plan: HostPlan, note) -> tuple[str, str]:
    if server.running_server(host) is not None:
        stopped = server.stop(host)
        if not stopped.stopped:
            return "fail", f"the old server did not stop: {stopped.reason}"
    after = plan.server_after
    state = server.start(host, after["profile"], overrides=after["overrides"],
                         timeout=float(after.get("timeout_s") or server.DEFAULT_TIMEOUT), progress=note)
    return "pass", f"{state.profile} ready after {state.ready_after_s} s (pid {state.pid})"


def _smoke_gate(host: Host, run: _Run, max_tokens: int) -> tuple[str, str]:
    result, state, why = smoke_host(host, max_tokens)
    if result is None:
        return "fail", why
    failed = [c for c in result.checks if c.status == "fail"]
    if failed:
        run.result.failed_check = f"smoke {failed[0].name}: {failed[0].detail}"
        return "fail", "; ".join(f"{c.name}: {c.detail}" for c in failed)
    return "pass", f"{len(result.checks)} checks passed"


def _bench_gate(host: Host, plan: HostPlan, options: Options, run: _Run) -> tuple[str, str]:
    state = server.status(host)
    profile = plan.server_after["profile"]
    reference = read_bench_record(host, profile)
    with server.endpoint(host, state) as url:
        now = _bench_levels(url, options.bench_levels)
    ok, detail = compare_bench(now, (reference or {}).get("output_throughput"), options.tolerance)
    run.bench = {"profile": profile, "output_throughput": now, "at": time.time(), "rollout": run.id,
                 "stack": plan.stack_after, "overrides": plan.server_after["overrides"]}
    if not ok:
        run.result.failed_check = f"bench: {detail}"
    return ("pass" if ok else "fail"), detail


def converge(host: Host, reason: str, note=_quiet, timeout: float = 3600) -> dict:
    """Ask the guard of an in-flight rollout to roll it back, and wait until it has."""
    ctl(host, "request", reason=reason)
    deadline = time.monotonic() + timeout
    while True:
        answer = ctl(host, "wait", timeout=WAIT_CHUNK + 60, wait_s=WAIT_CHUNK)
        journal = answer.get("journal") or {}
        if journal.get("phase") in TERMINAL or not journal:
            return journal
        note(f"{host.name}: waiting for the guard to roll back ({journal.get('phase')})")
        if time.monotonic() > deadline:
            raise RolloutError(f"{host.name}: the rollback did not finish in {timeout:.0f} s; "
                               f"see: invoke rollout --status --host {host.name}")


def _after_rollback(host: Host, plan: HostPlan, journal: dict, run: _Run, smoke_max_tokens: int) -> None:
    res = run.result
    if journal.get("phase") != "rolled-back":
        res.outcome = "rollback failed"
        res.notes.append((journal.get("events") or [{}])[-1].get("detail", ""))
        return
    res.outcome = "rolled back"
    ps_package = journal.get("package", "sglang")
    first = len(res.gates)

    def check_files():
        verified = patching.verify(host, package=ps_package)
        bad = [f.path for f in verified.files if f.status in ("drifted", "missing")]
        if bad or verified.stack != plan.stack_before:
            return "fail", f"stack {stack_text(verified.stack)}; differing: {', '.join(bad) or 'none'}"
        return "pass", f"{stack_text(verified.stack)}; {len(verified.files)} file(s) as recorded"
    run.gate("files restored", check_files)
    if plan.server_before:
        run.gate("smoke (restored server)",
                 lambda: _smoke_gate(host, _Run(host, plan, run.id, run.note), smoke_max_tokens))
    if any(g.status == "fail" for g in res.gates[first:]):
        res.outcome = "rollback failed"


def run_host(host: Host, plan: HostPlan, change: Change, options: Options, rollout_id: str,
             known: dict, note=_quiet, interrupted: threading.Event | None = None) -> HostResult:
    """Roll the change out on one host and prove it, or have its guard put it back.

    `interrupted`: set by the fleet's main thread on Ctrl-C while this runs in a worker thread (which
    never sees KeyboardInterrupt); the host then stops at its next step and its guard rolls it back."""
    started = time.monotonic()
    if interrupted is not None and interrupted.is_set():
        return HostResult(host.name, "not started", rollout_id=rollout_id, notes=["interrupted (Ctrl-C)"],
                          before=f"{stack_text(plan.stack_before)}; {server_text(plan.server_before)}")
    if plan.converge_first:
        note(f"{host.name}: {plan.converge_first}")
        converge(host, f"a new rollout ({change.label}) found it in flight", note)
        plan = plan_host(probe_host(host, known[change.patchset].package), change, known, profile=options.profile,
                         overrides=options.overrides, gate_bench=options.gate_bench,
                         bench_levels=options.bench_levels, tolerance=options.tolerance, launch=_launch_of(host))
    run = _Run(host, plan, rollout_id, note, interrupted)
    run.bench = None
    res = run.result
    if plan.action != "roll out":
        res.outcome = plan.action
        res.notes.append(plan.reason)
        res.after = res.before
        return res
    ps = known[change.patchset]
    lease = lease_seconds()
    journal = ctl(host, "arm", timeout=300, id=rollout_id, change={"label": change.label, **asdict(change)},
                  controller=f"{socket.gethostname()} pid {os.getpid()}", lease_s=lease,
                  package=ps.package, venv=host.venv, pythonpath=host.pythonpath,
                  paths=_touched(known, sorted(set(plan.stack_before) | set(plan.stack_after) | {change.patchset})),
                  stack=plan.stack_before,
                  server=(dict(plan.server_before, started_at=plan.server_started_at) if plan.server_before else None),
                  after={"stack": plan.stack_after, "server": plan.server_after},
                  payloads=_payloads(host, plan), guard_source=_guard_source())["journal"]
    _hold_for_test("armed")
    beat = _Heartbeat(host, journal["lease"], every=max(0.5, min(10.0, lease / 6)), note=note)
    try:
        ok = True
        for name, fn, phase, allowed in (
                (change.label, lambda: _change_files(host, change, ps.package, note), "applied", ("armed",)),
                (f"restart {plan.server_after['profile']}", lambda: _start_after(host, plan, note), "restarted",
                 ("applied",)),
                ("smoke", lambda: _smoke_gate(host, run, options.smoke_max_tokens), None, None),
                ("bench", lambda: _bench_gate(host, plan, options, run), None, None)):
            if name == "bench" and not options.gate_bench:
                continue
            gate = run.gate(name, fn)
            if gate.status != "pass":
                ok = False
                res.failed_check = res.failed_check or f"{name}: {gate.detail}"
                break
            if phase and not run.phase(phase, allowed):
                ok = None
                break
        if ok:
            if run.phase("kept", ("restarted",), "every gate passed"):
                res.outcome = "kept"
                if run.bench:
                    try:
                        write_bench_record(host, plan.server_after["profile"], run.bench)
                    except (RolloutError, TransportError) as exc:   # the host is kept all the same
                        res.notes.append(str(exc))
                        note(f"{host.name}: {exc}")
                res.seconds = round(time.monotonic() - started, 1)
                return res
        if ok is False:
            run.check()
            _failure_report(host, plan, res, note)
        _after_rollback(host, plan, converge(host, f"gate failed: {res.failed_check}" if ok is False
                                             else "the guard took over", note), run, options.smoke_max_tokens)
    except KeyboardInterrupt:
        note(f"{host.name}: interrupted; asking the host's guard to roll back")
        try:
            ctl(host, "request", reason="the controller was interrupted (Ctrl-C)")
        finally:
            beat.stop()
        raise
    except Interrupted:   # the fleet's main thread has asked the guard already; ask again in case it came first
        res.outcome = "interrupted"
        res.notes.append(f"Ctrl-C: the host's guard was asked to roll back; see: invoke rollout --status "
                         f"--host {host.name}")
        try:
            ctl(host, "request", reason="the controller was interrupted (Ctrl-C)")
        except Exception as exc:
            res.notes.append(f"asking the guard again failed ({exc}); it rolls back once the lease runs out")
    except TransportError as exc:
        res.outcome = "lost contact"
        res.notes.append(f"{exc}; the host's guard rolls back on its own once the controller has been silent "
                         f"for {lease:.0f} s; see: invoke rollout --status --host {host.name}")
    finally:
        problem = beat.stop()
        if problem:
            res.notes.append(f"the lease was not always renewed (last: {problem})")
    res.seconds = round(time.monotonic() - started, 1)
    return res


def _failure_report(host: Host, plan: HostPlan, res: HostResult, note) -> None:
    """Each TP rank's first error lines and the failed run's log path, before the rollback. Best
    effort: nothing here may stop the rollback request that follows."""
    profile, overrides = plan.server_after["profile"], plan.server_after["overrides"]
    try:
        state = server.status(host)
        # a failed start has no record any more: the size it was started with is the plan's
        tp = state.tp_size if state else int(overrides.get("tp_size") or server.plan(host, profile, overrides).tp_size)
        res.rank_errors = rank_errors(host, profile, tp)
        res.log_paths = [log["path"] for log in server.list_logs(host, profile).get("logs", [])[-1:]]
    except TransportError:
        raise   # the host is out of reach: its guard decides (run_host says so)
    except Exception as exc:
        res.notes.append(f"the failed server's logs could not be read: {type(exc).__name__}: {exc}")
        note(f"{host.name}: {res.notes[-1]}")


# -- the fleet -----------------------------------------------------------------------------

def journal_dir():
    return paths.cache_dir() / "rollouts"


def new_id(change: Change) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{change.patchset}-{'revert' if change.revert else 'apply'}-{uuid.uuid4().hex[:6]}"


class ControlJournal:
    """The rollout's own record on this machine: plans, then each host's result as it comes."""

    def __init__(self, rollout_id: str, change: Change, options: Options):
        journal_dir().mkdir(parents=True, exist_ok=True)
        self.path = journal_dir() / f"{rollout_id}.json"
        self.data = {"id": rollout_id, "change": change.label, "options": asdict(options),
                     "started_at": _iso(time.time()), "hosts": {}, "stopped": ""}
        self.lock = threading.Lock()

    def update(self, host: str, **values) -> None:
        with self.lock:
            self.data["hosts"].setdefault(host, {}).update(values)
            self._write()

    def finish(self, stopped: str) -> None:
        with self.lock:
            self.data.update(stopped=stopped, finished_at=_iso(time.time()))
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def _launch_of(host: Host) -> Callable[[str, dict], object]:
    return lambda profile, overrides: server.plan(host, profile, overrides)


def check_input(change: Change, options: Options) -> dict:
    """The known patchsets, once PATCHSET and --profile are known ones (else RolloutInputError)."""
    known = patchsets.load_all()
    try:
        patchsets.get(change.patchset, known)
    except patchsets.PatchsetError as exc:
        raise RolloutInputError(str(exc)) from None
    if options.profile:
        try:
            profiles.load_profile(options.profile)
        except profiles.ProfileError as exc:
            raise RolloutInputError(str(exc)) from None
    return known


def plan_fleet(hosts: list[Host], change: Change, options: Options, note=_quiet) -> tuple[list[HostPlan], dict]:
    """Every host's plan; RolloutInputError when the input is bad (on any host), before any change."""
    known = check_input(change, options)
    ps = known[change.patchset]
    probes = for_each_host(hosts, lambda h: probe_host(h, ps.package))
    plans, bad = [], []
    for outcome in probes:
        if outcome.error is not None:
            plans.append(HostPlan(outcome.host.name, change.label, "refused",
                                  reason=f"cannot probe: {str(outcome.error).splitlines()[0]}"))
            continue
        try:
            plans.append(plan_host(outcome.value, change, known, profile=options.profile,
                                   overrides=options.overrides, gate_bench=options.gate_bench,
                                   bench_levels=options.bench_levels, tolerance=options.tolerance,
                                   launch=_launch_of(outcome.host)))
        except RolloutInputError as exc:
            bad.append(str(exc))
    if bad:
        raise RolloutInputError("; ".join(bad) + "; nothing changed")
    return plans, known


def run_fleet(hosts: list[Host], change: Change, options: Options, note=_quiet,
              on_result: Callable[[HostResult], None] = lambda r: None) -> FleetResult:
    rollout_id = new_id(change)
    plans, known = plan_fleet(hosts, change, options, note)
    by_name = {h.name: h for h in hosts}
    plan_of = {p.host: p for p in plans}
    journal = ControlJournal(rollout_id, change, options)
    for p in plans:
        journal.update(p.host, plan=asdict(p), outcome="pending")
    fleet = FleetResult(rollout_id, change.label, plans, [], journal=str(journal.path))
    done: dict[str, HostResult] = {}
    canary_failed = failed_after = 0
    names = [h.name for h in hosts]
    interrupted = threading.Event()    # Ctrl-C: the wave's worker threads stop at their next step

    def one(host: Host) -> HostResult:
        journal.update(host.name, outcome="running")
        result = run_host(host, plan_of[host.name], change, options, rollout_id, known, note, interrupted)
        journal.update(host.name, outcome=result.outcome, result=result.to_json())
        on_result(result)
        return result

    def interrupt(wave_hosts: list[Host]) -> None:
        interrupted.set()
        note(f"interrupted: asking the guards of {', '.join(h.name for h in wave_hosts)} to roll back; "
             "waiting for each host to stop at its next step")
        for outcome in for_each_host(wave_hosts, lambda h: ctl(h, "request", reason="the controller was "
                                                                "interrupted (Ctrl-C)")):
            if outcome.error is not None:
                note(f"{outcome.host.name}: asking its guard to roll back failed ({outcome.error}); "
                     "it rolls back once the lease runs out")

    try:
        for index, wave in enumerate(waves(names, options.canary, options.parallel)):
            if fleet.stopped:
                break
            wave_hosts = [by_name[n] for n in wave]
            for outcome in for_each_host(wave_hosts, one, on_interrupt=lambda: interrupt(wave_hosts)):
                result = outcome.value if outcome.error is None else HostResult(
                    outcome.host.name, "failed", rollout_id=rollout_id,
                    notes=[f"{type(outcome.error).__name__}: {outcome.error}"])
                if outcome.error is not None:
                    journal.update(outcome.host.name, outcome=result.outcome, result=result.to_json())
                done[result.host] = result
                if result.failed:
                    if options.canary and index == 0:
                        canary_failed += 1
                    else:
                        failed_after += 1
            fleet.stopped = fleet_stop(index, options.canary, canary_failed, failed_after, options.max_failures)
    except KeyboardInterrupt:
        journal.finish("interrupted (Ctrl-C): the hosts that were running were asked to roll back")
        raise
    for name in names:
        if name not in done:
            p = plan_of[name]
            done[name] = HostResult(name, "not started", rollout_id=rollout_id,
                                    before=f"{stack_text(p.stack_before)}; {server_text(p.server_before)}",
                                    notes=[fleet.stopped])
            journal.update(name, outcome="not started")
    fleet.results = [done[n] for n in names]
    journal.finish(fleet.stopped)
    return fleet


def status(hosts: list[Host], package: str = "sglang") -> list[tuple[str, str, str]]:
    """(host, state, detail) for `invoke rollout --status`."""
    rows = []
    for outcome in for_each_host(hosts, lambda h: probe_host(h, _package_of_last(h, package))):
        if outcome.error is not None:
            rows.append((outcome.host.name, "unknown", str(outcome.error).splitlines()[0]))
            continue
        state, detail = describe_state(outcome.value)
        rows.append((outcome.host.name, state, detail))
    return rows


def _package_of_last(host: Host, default: str) -> str:
    journal = ctl(host, "status").get("journal") or {}
    return journal.get("package") or default

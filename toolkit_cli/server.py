"""`invoke server start PROFILE | stop | restart [PROFILE] | status | logs | model | profiles | render PROFILE`."""
from __future__ import annotations

import posixpath
import signal
from pathlib import Path
import threading
from datetime import datetime, timezone

from toolkit.server import profiles, server
from toolkit.core import report

from toolkit_cli import predictions
from toolkit_cli.common import (HOST_HELP, fail, finish, help_or_bad_action, hosts_or_exit, int_option, run_on_hosts,
                                seconds_option, threshold_option)
from toolkit_cli.parsing import command

ACTIONS = ("start", "stop", "restart", "status", "watch", "dashboard", "logs", "model", "profiles", "render")
USAGE = """usage: invoke server ACTION [PROFILE] [options]
  start PROFILE [--timeout S] [--port N] [--model P] [--draft-model P] [--tp N] [--threshold N|auto] [--hysteresis N]
                [--skip-patch-check] [--dry-run]
                           render launch.sh on the host, start detached, wait until ready; then show the
                           log lines the applied patchsets ask for ([logs] print)
  stop [--grace S] [--memory-wait S] [--dry-run]
                           TERM the server's process group, KILL after the grace, wait for GPU memory
  restart [PROFILE] [start and stop options] [--dry-run]
                           stop the running server and start it again with the options it was started
                           with (options given now replace those); PROFILE: start that one instead
  status [--json]          running?, profile, pid, port, uptime, health
  watch [--interval S] [--once] [--polls N] [--json] [--record FILE]
                           a live table, one row per host: profile, patches, running/queued requests,
                           drafting on/off and since when, switches, accept length, gen tok/s, KV use,
                           each TP rank's scheduler process; from SGLang's /metrics (or /server_info)
                           through the SSH tunnel; Ctrl-C leaves; --once --json for scripts
  dashboard --record FILE [--out PNG] [--host NAME]
                           draw dashboards/sglang-dyn-disable.json's panels from a recorded scrape
                           (watch --record, gpu/scrape_metrics.py) into a PNG (no host contact;
                           --host picks one host's lines of a file that holds several)
  logs [PROFILE] [-f] [--rank N] [--lines N] [--duration S] [--run N] [--list]
                           the log of the current/last run (every start keeps its own log); --run 1 is the
                           run before it; --list names the kept logs
  model [--out DIR] [--seed N] [--dry-run]
                           make the tiny reference model on the host (in its venv; for cpu-ref)
  profiles                 the profiles in profiles/ (no host)
  render PROFILE           print the launch script a start would write (no host contact)
every host action takes --host NAME[,NAME...] (default: sandbox)"""
TAKES_PROFILE = ("start", "render", "restart", "logs")
# -n is for the actions that start, stop or make something on a host; the others change nothing there
# and refuse it, so that nobody reads their output as a preview.
TAKES_DRY_RUN = ("start", "restart", "stop", "model")


def _overrides(port, model, draft_model, tp, threshold, hysteresis) -> dict:
    return {"port": int_option(port, "--port"), "model": model or None, "draft_model": draft_model or None,
            "tp_size": int_option(tp, "--tp", minimum=1), "dyn_threshold": threshold_option(threshold),
            "dyn_hysteresis": int_option(hysteresis, "--hysteresis")}


@command(positional=["action", "profile"], optional=["profile"], checked=["action"], usage=USAGE, help={
    "action": " | ".join(ACTIONS),
    "profile": "profile name (profiles/NAME.toml); start and render need it, restart and logs take it",
    "host": HOST_HELP,
    "timeout": f"start/restart: seconds to wait for readiness before stopping it again (default "
               f"{server.DEFAULT_TIMEOUT:.0f}; restart: the one it was started with)",
    "grace": f"stop/restart: seconds between SIGTERM and SIGKILL (default {server.DEFAULT_GRACE:.0f})",
    "memory_wait": f"stop/restart: seconds to wait for GPU memory back to idle (default {server.DEFAULT_MEMORY_WAIT:.0f})",
    "port": "start/render/restart: port instead of the profile's/host's",
    "model": "start/render/restart: model path on the host instead of the host's server.model",
    "draft_model": "start/render/restart: draft model path on the host instead of server.draft_model",
    "tp": "start/render/restart: tensor-parallel size instead of the profile's/host's",
    "threshold": "start/render/restart: dyn-disable threshold (running requests above which drafting stops), "
                 "or auto (the patch measures each batch size's plain and speculative steps and decides)",
    "hysteresis": "start/render/restart: drafting resumes at threshold - hysteresis (default with --threshold: "
                  "max(1, threshold // 4), as the patch's own default)",
    "skip_patch_check": "start/restart: do not check that the profile's required patchsets are applied",
    "dry_run": "start/restart: print the launch script it would write and the checks it would make; "
               "stop: what it would stop, the signal and the grace; model: where it would make the model; "
               "start, stop and make nothing (other actions change nothing and refuse it)",
    "follow": "logs: keep printing new lines (for --duration seconds or until Ctrl-C)",
    "rank": "logs: only the lines of tensor-parallel rank N ([... TPN] prefix)",
    "lines": "logs: the last N lines (default: 50; 0 for all)",
    "duration": "logs -f: stop following after S seconds (default 600)",
    "run": "logs: 0 = the current/last run (default), 1 = the run before it, ...",
    "list_": "logs: list the kept logs of the profile (path, size, time) instead of printing one",
    "out": "model: folder on the host (default: host's server.model, else <venv>/../models/tiny-llama); "
           "dashboard: the PNG to write (default: the record file with .png)",
    "seed": "model: seed of the random weights (default 0)",
    "json_": "status/start/stop/restart: print JSON instead of a table; watch: one JSON line per poll",
    "interval": "watch: seconds between polls (default 2)",
    "once": "watch: poll once, print, exit (non-zero when a host's server is not up)",
    "polls": "watch: stop after N polls (default: until Ctrl-C)",
    "record": "watch: append every /metrics reading to FILE (JSONL); dashboard: the file to draw",
}, name="server")
def server_task(c, action=None, profile=None, host=None, timeout=None, grace=None, memory_wait=None, port=None,
                model=None, draft_model=None, tp=None, threshold=None, hysteresis=None, skip_patch_check=False,
                dry_run=False, follow=False, rank=None, lines=None, duration=None, run=None, list_=False, out=None,
                seed=None, json_=False, interval=None, once=False, polls=None, record=None):
    """The model server on a host: start a profile, stop or restart it, status, logs; make the reference model."""
    if help_or_bad_action(server_task, action, ACTIONS, profile):
        return
    profile = profile or None
    if action in ("start", "render") and not profile:
        fail(f"`invoke server {action}` needs a profile; one of: {', '.join(_profile_names())}", code=2)
    if action not in TAKES_PROFILE and profile:
        fail(f"`invoke server {action}` takes no profile (got {profile!r})", code=2)
    if dry_run and action not in TAKES_DRY_RUN:
        fail(f"`invoke server {action}` changes nothing on a host and has no dry run; leave out -n/--dry-run "
             f"(it is taken by: {', '.join(TAKES_DRY_RUN)})", code=2)
    try:
        overrides = _overrides(port, model, draft_model, tp, threshold, hysteresis)
        timeout = seconds_option(timeout, "--timeout", positive=True)
        grace = seconds_option(grace, "--grace", server.DEFAULT_GRACE)
        memory_wait = seconds_option(memory_wait, "--memory-wait")
        if profile:
            # a bad name, or a threshold the profile has no use for, is bad input (exit 2), not a host failure
            loaded = profiles.load_profile(profile)
            if action in ("start", "render", "restart"):
                profiles.check_threshold_taken(profile, loaded, overrides)
        if action == "profiles":
            return _list_profiles()
        if action == "render" or (action == "start" and dry_run):
            return _render(host, profile, overrides, action == "start", not skip_patch_check)
        if action == "start":
            return _start(host, profile, overrides, timeout or server.DEFAULT_TIMEOUT, not skip_patch_check, json_)
        if action == "restart":
            return _restart(host, profile, overrides, timeout, False if skip_patch_check else None, grace,
                            memory_wait, dry_run, json_)
        if action == "stop":
            return _stop(host, grace, memory_wait, dry_run, json_)
        if action == "status":
            return _status(host, json_)
        if action == "dashboard":
            return _dashboard(record, out, host)
        if action == "watch":
            from toolkit_cli import watch as watch_cli

            return watch_cli.watch(host, seconds_option(interval, "--interval", 2.0, positive=True), once,
                                   int_option(polls, "--polls"), json_, record or None)
        if action == "logs":
            if list_:
                return _list_logs(host, profile)
            return _logs(host, profile, follow, int_option(rank, "--rank", minimum=0),
                         int_option(lines, "--lines", 50, minimum=0),
                         seconds_option(duration, "--duration", 600.0, positive=True),
                         int_option(run, "--run", 0, minimum=0))
        return _model(host, out, int_option(seed, "--seed", 0), dry_run)
    except (profiles.ProfileError, ValueError) as exc:
        fail(str(exc), code=2)


def _profile_names() -> list[str]:
    try:
        return sorted(profiles.load_profiles())
    except profiles.ProfileError:
        return []


def _list_profiles() -> None:
    rows = []
    for name, data in sorted(profiles.load_profiles().items()):
        rows.append([name, data.get("kind", "?"), data.get("tp_size", 1), data.get("port", ""),
                     ", ".join(data.get("requires_patchsets", [])) or "-",
                     data.get("dyn_threshold", "-"), data.get("summary", "")])
    report.table("server profiles", ["profile", "kind", "tp", "port", "requires", "dyn threshold", "summary"], rows)


def _render(host_spec, profile, overrides, for_start: bool, check_patches: bool = True) -> None:
    for host in hosts_or_exit(host_spec):
        launch = server.plan(host, profile, overrides)
        report.note(f"# {host.name}: {launch.server_dir}/launch.sh")
        report.line(server.render_launch_script(launch).rstrip("\n"))
        if for_start:
            checks = ["no toolkit server recorded as running", f"port {launch.port} free on {launch.bind}",
                      "GPU shared on purpose (server.shared_gpu): no GPU memory check" if launch.shared_gpu else
                      f"no process holds GPU memory ({launch.nvidia_smi}; skipped if absent)"]
            if launch.requires_patchsets and check_patches:
                checks.append(f"patchset(s) applied: {', '.join(launch.requires_patchsets)}")
                checks += [f"{path} written by them" for path in launch.requires_patched_files]
            checks += [f"{need['what']} {need['path']} exists" for need in server.required_paths(host, launch)]
            report.note(f"# dry run: would check {'; '.join(checks)}; then start and wait for "
                        f"{launch.health_endpoint} + {len(launch.expected_log_lines())} log line(s). Nothing started.")


def _start(host_spec, profile, overrides, timeout, check_patches, json_) -> None:
    def one(host):
        launch = server.plan(host, profile, overrides)
        if launch.kind == "sglang":  # what the applied patchsets' hooks say the server will decide at start
            predictions.note_before_start(predictions.predict_or_reason(host, None, launch.tp_size, launch.env))
        return server.start(host, profile, timeout=timeout, overrides=overrides, check_patches=check_patches,
                            progress=report.note)

    outcomes = run_on_hosts(host_spec, one)
    _print_started(outcomes, json_)
    finish(outcomes)


def _print_started(outcomes, json_, state_of=lambda value: value) -> None:
    for outcome in outcomes:
        if isinstance(outcome.error, server.ServerError) and outcome.error.log_tail:
            report.note(f"--- {outcome.host.name}: last lines of the server log ---\n{outcome.error.log_tail}\n---")
    started = [(o.host.name, state_of(o.value)) for o in outcomes if o.ok]
    if json_:
        report.emit_json([s.to_json() for _, s in started])
        return
    rows = [[s.host, s.profile, "ready", s.pid, f"{s.bind}:{s.port}", f"{s.ready_after_s}s", s.round_trips,
             s.log_path] for _, s in started]
    if rows:
        report.table(None, ["host", "profile", "status", "pid", "listening", "ready after", "round trips", "log"],
                     rows, status_column=2)
    for name, s in started:
        for note in s.notes:
            report.note(f"{name}: {note}")
    for name, s in started:
        if s.print_lines:
            report.line(f"{name}: log lines the applied patchsets ({', '.join(s.patch_stack)}) ask you to see:")
            for text in s.print_lines:
                report.line(f"  {text}")


def _restart(host_spec, profile, overrides, timeout, check_patches, grace, memory_wait, dry_run, json_) -> None:
    if dry_run:
        outcomes = run_on_hosts(host_spec, lambda h: server.restart_plan(h, profile, overrides, timeout, check_patches))
        for o in outcomes:
            if not o.ok:
                continue
            todo = o.value
            stop = (f"stop {todo.running.profile} (pid {todo.running.pid}, {todo.running.status})"
                    if todo.running else "stop nothing (no server recorded as running)")
            given = ", ".join(f"{k}={v}" for k, v in sorted(todo.overrides.items())) or "none"
            reused = f" (reused from its start at {todo.reused_from})" if todo.reused_from else ""
            for text in todo.notes:
                report.note(f"{o.host.name}: {text}")
            report.note(f"# dry run on {o.host.name}: would {stop}, then start {todo.profile} with options: "
                        f"{given}{reused}; timeout {todo.timeout:.0f}s"
                        f"{'' if todo.check_patches else '; patch check skipped'}. Nothing stopped or started.")
            try:
                launch = server.plan(o.host, todo.profile, todo.overrides)
            except profiles.ProfileError as exc:
                o.error = exc
                continue
            report.line(server.render_launch_script(launch).rstrip("\n"))
        finish(outcomes)
        return

    def one(host):
        return server.restart(host, profile, overrides=overrides, timeout=timeout, check_patches=check_patches,
                              grace=grace, memory_wait=memory_wait, progress=report.note)

    outcomes = run_on_hosts(host_spec, one)
    for o in outcomes:
        if o.ok and o.value.stopped is not None:
            r = o.value.stopped
            report.note(f"{o.host.name}: stopped {r.profile} (pid {r.pid}, "
                        f"{'SIGTERM' if r.signal == 'TERM' else 'SIGKILL after grace' if r.signal == 'KILL' else 'already gone'})")
    _print_started(outcomes, json_, state_of=lambda value: value.started)
    finish(outcomes)


def _stop_dry_run(host_spec, grace, memory_wait, json_) -> None:
    outcomes = run_on_hosts(host_spec, lambda h: server.stop_plan(h, grace=grace, memory_wait=memory_wait))
    if json_:
        report.emit_json([{**o.value.to_json(), "ok": True, "dry_run": True} if o.ok else
                          {"host": o.host.name, "ok": False, "dry_run": True, "error": str(o.error)} for o in outcomes])
    for o in outcomes:
        if not o.ok or json_:
            continue
        todo, running = o.value, o.value.running
        if running is None:
            report.note(f"# dry run on {o.host.name}: nothing to stop (no server recorded as running). Nothing stopped.")
            continue
        what = (f"would clear the record of {running.profile} (pid {running.pid}: no process of it is left)"
                if running.status == "dead" else
                f"would stop {running.profile} (pid {running.pid}, {running.status}, {running.bind}:{running.port}): "
                f"SIGTERM to its process group, SIGKILL after a grace of {todo.grace:g}s")
        memory = ("GPU shared on purpose (server.shared_gpu): no wait for GPU memory" if todo.shared_gpu else
                  f"then wait up to {todo.memory_wait:g}s for GPU memory back to idle")
        report.note(f"# dry run on {o.host.name}: {what}; {memory}. Nothing stopped.")
    finish(outcomes)


def _stop(host_spec, grace, memory_wait, dry_run, json_) -> None:
    if dry_run:
        return _stop_dry_run(host_spec, grace, memory_wait, json_)
    outcomes = run_on_hosts(host_spec, lambda h: server.stop(h, grace=grace, memory_wait=memory_wait))
    if json_:
        report.emit_json([o.value.to_json() if o.ok else {"host": o.host.name, "stopped": False, "error": str(o.error)}
                          for o in outcomes])
    else:
        rows = []
        for o in outcomes:
            if not o.ok:
                continue
            r = o.value
            if not r.was_running and r.stopped:
                state = "ok"
                detail = r.reason or "nothing was running"
            else:
                state = "ok" if r.stopped else "failed"
                gpu = ("GPU memory idle" if r.gpu_memory else "GPU check skipped") if r.stopped else r.reason
                detail = f"{r.profile} pid {r.pid}: {'SIGTERM' if r.signal == 'TERM' else 'SIGKILL after grace' if r.signal == 'KILL' else 'already gone'} ({r.stop_s}s); {gpu}"
            rows.append([o.host.name, state, detail])
            for note in r.notes:
                report.note(f"{o.host.name}: {note}")
        if rows:
            report.table(None, ["host", "stop", "detail"], rows, status_column=1)
    finish(outcomes, failed=lambda r: not r.stopped)


def _status(host_spec, json_) -> None:
    outcomes = run_on_hosts(host_spec, server.status)
    if json_:
        report.emit_json([{"host": o.host.name, "ok": True, "server": o.value.to_json() if o.value else None}
                          if o.ok else {"host": o.host.name, "ok": False, "error": str(o.error)}
                          for o in outcomes])
    else:
        rows = []
        for o in outcomes:
            if not o.ok:
                continue
            s = o.value
            if s is None:
                rows.append([o.host.name, "-", "not running", "", "", "", ""])
            else:
                health = "ok" if s.healthy else "failed"
                rows.append([o.host.name, s.profile, s.status, s.pid, f"{s.bind}:{s.port}",
                             _uptime(s.uptime_s), health if s.status != "dead" else "-"])
        if rows:
            report.table(None, ["host", "profile", "state", "pid", "listening", "uptime", "health"], rows)
    finish(outcomes, failed=lambda s: s is not None and s.status == "dead")


def _dashboard(record, out, host) -> None:
    from toolkit.server import dashboard, scrape

    if not record:
        fail("`invoke server dashboard` needs --record FILE (written by `invoke server watch --record FILE`)", code=2)
    path = Path(record)
    if not path.is_file():
        fail(f"--record {record}: no such file", code=2)
    try:
        written = dashboard.render(path, Path(out) if out else path.with_suffix(".png"), host=host or None)
    except (scrape.ScrapeError, dashboard.DashboardError) as exc:
        fail(str(exc))
    report.line(f"wrote {written}")


def _uptime(seconds) -> str:
    if seconds is None:
        return ""
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


def _logs(host_spec, profile, follow, rank, lines, duration, run) -> None:
    hosts = hosts_or_exit(host_spec)
    if follow:
        if len(hosts) != 1:
            fail("logs -f follows one host; name it with --host", code=2)
        if run:
            fail("logs -f follows the current run; leave out --run", code=2)
        interrupted = threading.Event()
        previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, lambda *_: interrupted.set())
        try:
            report.note(f"following the server log on {hosts[0].name} for up to {duration:.0f}s (Ctrl-C stops)")
            server.follow_log(hosts[0], rank=rank, lines=lines, duration=duration, emit=print,
                              should_stop=interrupted.is_set)
        except server.ServerError as exc:
            fail(str(exc))
        finally:
            signal.signal(signal.SIGINT, previous)
        return
    outcomes = run_on_hosts(host_spec, lambda h: server.read_log(h, rank=rank, lines=lines or None,
                                                                 profile=profile, run=run))
    for o in outcomes:
        if o.ok:
            if len(outcomes) > 1:
                report.note(f"--- {o.host.name} ---")
            if o.value:
                print(o.value)
            elif rank is not None:
                report.note(f"{o.host.name}: no TP{rank} lines in the server log (rank {rank} exists only at "
                            f"a TP size above {rank})")
            else:
                report.note(f"{o.host.name}: the server log is empty")
    finish(outcomes)


def _list_logs(host_spec, profile) -> None:
    outcomes = run_on_hosts(host_spec, lambda h: server.list_logs(h, profile))
    for o in outcomes:
        if not o.ok:
            continue
        found = o.value
        if not found["logs"]:
            report.line(f"{o.host.name}: {found.get('reason') or 'no logs kept for ' + str(found['profile'])}")
            continue
        rows = [[len(found["logs"]) - 1 - i, posixpath.basename(entry["path"]), f"{entry['size']:,}",
                 datetime.fromtimestamp(entry["modified"], timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
                 "current" if entry["current"] else ""] for i, entry in enumerate(found["logs"])]
        folder = posixpath.dirname(found["logs"][0]["path"])
        report.table(f"{o.host.name}: kept logs of {found['profile']} in {folder} (newest last; --run N shows one)",
                     ["run", "log", "bytes", "last written (UTC)", ""], rows)
    finish(outcomes)


def _model(host_spec, out, seed, dry_run) -> None:
    if dry_run:
        outcomes = run_on_hosts(host_spec, lambda h: server.model_target(h, out))
        for o in outcomes:
            if o.ok:
                report.note(f"# dry run on {o.host.name}: would make the reference model (seed {seed}) in {o.value} "
                            f"with the host's venv ({o.host.venv or o.host.python}), unless it is already current "
                            f"there. Nothing made.")
        return finish(outcomes)

    def one(host):
        report.note(f"{host.name}: making the reference model in the host's venv ({host.venv})")
        return server.make_model(host, out, seed=seed)

    outcomes = run_on_hosts(host_spec, one)
    for o in outcomes:
        if o.ok:
            report.line(f"{o.host.name}: {'made' if o.value['made'] else 'already current'}: {o.value['model']}")
    finish(outcomes)


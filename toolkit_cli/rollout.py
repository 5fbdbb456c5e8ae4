"""`invoke rollout PATCHSET --profile P [--host H,...|@label]`: apply, restart, prove and keep, or roll back."""
from __future__ import annotations

from dataclasses import asdict

from rich.markup import escape

from toolkit.core import report
from toolkit import rollout as engine
from toolkit.core.inventory import InventoryError

from toolkit_cli.common import HOST_HELP, fail, hosts_or_exit, int_option, threshold_option, wants_help
from toolkit_cli.parsing import command, render_help

USAGE = """\
usage: invoke rollout PATCHSET [--revert] [--profile P] [--threshold N|auto] [--host H,...|@label]
                      [--canary K] [--parallel J] [--max-failures F] [--gate-bench] [--dry-run] [--json]
       invoke rollout --status [--host H,...] [--json]

Per host: record the patch stack and the running server (profile + options); apply PATCHSET (or with
--revert take it off); restart with --profile (default: the profile that runs; a host with no server
running needs --profile); smoke, burst included; with --gate-bench a short bench at two levels against
the host's last kept bench of that profile. Bad input (unknown patchset or profile, options the profile
refuses) exits 2 before any host changes, in a dry run too.
Every gate passes: keep. Any fails: the host's guard restores the recorded stack from its backups,
starts the recorded server with its options again, and the rollout smokes it and reports "rolled back"
with the failing check, each TP rank's first error lines and the log path.
Fleet: the --canary hosts first (all must pass), then waves of --parallel; once more than
--max-failures hosts failed after the canary, no further host starts.
Interrupted (Ctrl-C, this process killed, SSH cut): each host's guard rolls it back by itself once
this machine stops renewing its lease (TOOLKIT_ROLLOUT_LEASE_S, default 60 s); `--status` says where
each host stands, and running the same rollout again finishes the rollback and goes on."""


def _overrides(threshold, hysteresis) -> dict:
    found = {"dyn_threshold": threshold_option(threshold),
             "dyn_hysteresis": int_option(hysteresis, "--hysteresis")}
    return {k: v for k, v in found.items() if v is not None}


def _gate_cell(result: engine.HostResult) -> str:
    return "; ".join(f"{g.name}: {g.status} {g.seconds:.1f}s" for g in result.gates) or "-"


def print_plans(plans: list[engine.HostPlan]) -> None:
    for plan in plans:
        report.line("")
        report.line(f"{plan.host}: {plan.change}: {plan.action}{' (' + plan.reason + ')' if plan.reason else ''}")
        report.line(f"  stack:  {engine.stack_text(plan.stack_before)} -> {engine.stack_text(plan.stack_after)}")
        report.line(f"  server: {engine.server_text(plan.server_before)} -> {engine.server_text(plan.server_after)}")
        if plan.converge_first:
            report.line(f"  first:  {plan.converge_first}")
        for gate in plan.gates:
            report.line(f"  gate:   {gate}")
        for step in plan.steps:
            report.line(f"  step:   {step}")


def print_fleet(fleet: engine.FleetResult) -> None:
    rows = [(r.host, r.outcome, escape(r.before), escape(r.after if r.outcome == "kept" else r.before),
             escape(_gate_cell(r)), f"{r.seconds:.0f}") for r in fleet.results]
    report.table(f"rollout {fleet.rollout_id}: {fleet.change}",
                 ["host", "result", "before", "now", "gates", "s"], rows)
    for r in fleet.results:
        if r.outcome in ("kept", "unchanged", "not started") and not r.failed_check:
            continue
        if r.failed_check:
            report.line(f"{r.host}: failed check: {r.failed_check}")
        for rank, lines in r.rank_errors.items():
            for text in lines:
                report.line(f"{r.host}: {rank}: {text}")
        for path in r.log_paths:
            report.line(f"{r.host}: log: {path}")
        for text in r.notes:
            if text:
                report.line(f"{r.host}: {text}")
    if fleet.stopped:
        report.line(f"stopped: {fleet.stopped}")
    report.note(f"journal: {fleet.journal}")


@command(positional=["patchset"], optional=["patchset"], usage=USAGE, help={
    "patchset": "the patchset to roll out (or, with --revert, to take off)",
    "revert": "take PATCHSET (and any applied above it) off instead of applying it",
    "profile": "server profile to restart with (default: the one running)",
    "threshold": "dyn-disable threshold for the restarted server, an integer or auto (as `server start --threshold`)",
    "hysteresis": "dyn-disable hysteresis for the restarted server",
    "host": HOST_HELP,
    "canary": "hosts rolled out first; all of them must pass before any other starts (default 1)",
    "parallel": "hosts per wave after the canary (default 1)",
    "max_failures": "failed hosts tolerated after the canary; one more stops starting new hosts (default 0)",
    "gate_bench": "also gate on a short bench at two levels vs the host's last kept bench of the profile",
    "bench_levels": f"the gate's concurrency levels (default {','.join(map(str, engine.DEFAULT_BENCH_LEVELS))})",
    "smoke_max_tokens": "max_tokens of the smoke's chat, determinism and stream checks (as `smoke --max-tokens`)",
    "tolerance": f"the gate's allowed throughput loss in percent (default {engine.DEFAULT_TOLERANCE:.0%})",
    "dry_run": "print the plan per host (stack before/after, restart command, gates); change nothing",
    "json_": "print JSON instead of tables",
    "status": "say per host whether it is on its old state, its new one, or a rollout is in flight",
})
def rollout(c, patchset=None, revert=False, profile=None, threshold=None, hysteresis=None, host=None, canary=None,
            parallel=None, max_failures=None, gate_bench=False, bench_levels=None, tolerance=None, dry_run=False,
            json_=False, status=False, smoke_max_tokens=None):
    """Roll a patchset out (or back) on running hosts: prove it with smoke (and a bench), or roll back by itself."""
    if wants_help(patchset):
        report.line(render_help(rollout, "rollout"))
        return
    if status:
        given = [text for text, value in (
            ("PATCHSET", patchset), ("--revert", revert), ("--profile", profile), ("--threshold", threshold),
            ("--hysteresis", hysteresis), ("--canary", canary), ("--parallel", parallel),
            ("--max-failures", max_failures), ("--gate-bench", gate_bench), ("--bench-levels", bench_levels),
            ("--tolerance", tolerance), ("--dry-run", dry_run), ("--smoke-max-tokens", smoke_max_tokens))
            if value not in (None, False, "")]
        if given:
            fail(f"`invoke rollout --status` takes only --host and --json, not {', '.join(given)}: it changes "
                 f"nothing (drop --status to roll out)", code=2)
    hosts = hosts_or_exit(host)
    if status:
        rows = engine.status(hosts)
        if json_:
            report.emit_json({name: {"state": state, "detail": detail} for name, state, detail in rows})
        else:
            report.table("rollout status", ["host", "state", "detail"], [(n, s, escape(d)) for n, s, d in rows])
        if any(state in ("in flight", "rollback failed", "unknown") for _, state, _ in rows):
            fail("a host is not in a whole state (see above)")
        return
    if not patchset:
        fail(f"`invoke rollout` needs a PATCHSET (or --status)\n{USAGE}", code=2)
    levels = engine.DEFAULT_BENCH_LEVELS
    if bench_levels:
        try:
            levels = tuple(int(x) for x in str(bench_levels).split(",") if x.strip())
        except ValueError:
            fail("--bench-levels takes integers, e.g. 1,8", code=2)
    try:
        tol = engine.DEFAULT_TOLERANCE if tolerance in (None, "") else float(tolerance) / 100
    except ValueError:
        fail("--tolerance takes a percentage, e.g. 5", code=2)
    options = engine.Options(profile=profile or None, overrides=_overrides(threshold, hysteresis),
                             gate_bench=bool(gate_bench), bench_levels=levels, tolerance=tol,
                             canary=int_option(canary, "--canary", 1), parallel=int_option(parallel, "--parallel", 1),
                             max_failures=int_option(max_failures, "--max-failures", 0),
                             smoke_max_tokens=int_option(smoke_max_tokens, "--smoke-max-tokens",
                                                         engine.smoke_engine.CHAT_MAX_TOKENS))
    if options.canary < 0 or options.parallel < 1 or options.max_failures < 0 or not levels or \
            options.smoke_max_tokens < 1 or \
            any(x < 1 for x in levels) or not 0 <= tol < 1:
        fail("--canary and --max-failures must be >= 0, --parallel, bench levels and --smoke-max-tokens >= 1,"
             " --tolerance 0-99", code=2)
    change = engine.Change(patchset, bool(revert))
    try:
        if dry_run:
            plans, _ = engine.plan_fleet(hosts, change, options, report.note)
            if json_:
                report.emit_json({"dry_run": True, "change": change.label, "waves": engine.waves(
                    [h.name for h in hosts], options.canary, options.parallel),
                    "plans": [asdict(p) for p in plans]})
            else:
                print_plans(plans)
                report.line("")
                report.line("waves: " + " | ".join(",".join(w) for w in engine.waves(
                    [h.name for h in hosts], options.canary, options.parallel)) + "   (dry run: nothing changed)")
            if any(p.action == "refused" for p in plans):
                fail("a host would refuse (see above)")
            return
        fleet = engine.run_fleet(hosts, change, options, report.note)
    except engine.RolloutInputError as exc:
        fail(str(exc), code=2)
    except (engine.RolloutError, engine.patchsets.PatchsetError, InventoryError) as exc:
        fail(str(exc))
    if json_:
        report.emit_json(fleet.to_json())
    else:
        print_fleet(fleet)
    if not fleet.ok:
        fail("rollout did not keep every host")

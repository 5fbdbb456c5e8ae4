"""`invoke bench [options]` (a concurrency sweep over profiles) and `invoke bench compare FILES`."""
from __future__ import annotations

import sys
from pathlib import Path

from invoke import Exit
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from toolkit.core import paths, report
from toolkit.server import server
from toolkit.bench import recommend as recommend_mod
from toolkit.bench import session
from toolkit.bench.compare import compare as compare_runs
from toolkit.bench.hosts import HostServers
from toolkit.bench.outputs import OutputError, RunWriter, median_by_level
from toolkit.bench.plot import plot_throughput
from toolkit.bench.prompts import PromptError, PromptSource
from toolkit.bench.runner import BenchError, BenchOptions, SweepListener, new_run_id

from toolkit_cli.common import HOST_HELP, fail, hosts_or_exit, int_list_option, int_option, seconds_option, wants_help
from toolkit_cli.parsing import command

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"
USAGE = """usage:
  invoke bench [--profiles a,b,c] [--concurrency 1,2,4,...] [--requests N]
               [--dataset builtin|synthetic|FILE.jsonl] [--input-len L] [--output-len M] [--seed S]
               [--repeat N] [--model PATH] [--draft-model PATH] [--no-restart] [--url URL] [--out DIR] [--host NAME]
  invoke bench compare RUN[,RUN...] [--plot FILE.png] [--json]   (RUN: a results.jsonl or a bench output folder)
default profiles: cpu-ref on a host without a GPU (the sandbox), else baseline,eagle3,eagle3-dyn
every option with its help: invoke --help bench"""


class ProgressListener(SweepListener):
    """A rich progress bar on stderr over every request of the sweep."""

    def __init__(self, progress: Progress, total: int):
        self.progress = progress
        self.task = progress.add_task("bench", total=total)
        self.failed = 0
        self.noted: list[str] = []

    def level_started(self, profile, concurrency, requests):
        self.progress.update(self.task, description=f"{profile} c={concurrency}")

    def request_done(self, record):
        self.failed += 0 if record.ok else 1
        self.progress.advance(self.task)

    def level_done(self, record):
        m = record["metrics"]
        self.progress.console.print(
            f"{record['profile']} c={record['concurrency']}: {m['completed']} ok, {m['failed']} failed, "
            f"{_fmt(m['output_throughput'])} output tok/s", markup=False)

    def note(self, text):
        self.noted.append(text)
        self.progress.console.print(text, markup=False)


def _fmt(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


def _throughput_cell(metrics: dict) -> str:
    spread = metrics.get("output_throughput_range")
    return _fmt(metrics["output_throughput"]) + (f" [{_fmt(spread[0])}-{_fmt(spread[1])}]" if spread else "")


def _accept_cell(server: dict) -> str:
    """'2.61 -> 2.58' (one request alone before the first level -> after this level), 'sim 2.6'
    appended where SGLANG_SIMULATE_ACC_LEN forced it; the server's cumulative average where no
    probe answered; '-' where the server reports none."""
    accept = server.get("accept_length") if isinstance(server.get("accept_length"), dict) else {}
    before, after = accept.get("before_first_level"), accept.get("after_level")
    if before is None and after is None:
        text = _fmt(server.get("avg_spec_accept_length"), 2)
    else:
        text = f"{_fmt(before, 2)} -> {_fmt(after, 2)}"
    simulated = accept.get("simulated")
    return text + (f" (sim {simulated})" if isinstance(simulated, str) else "")


def print_levels(records: list[dict]) -> None:
    """One row per profile and level: the median of the runs where a level was repeated."""
    throughput, latency, held = [], [], []
    for r in median_by_level(records):
        m = r["metrics"]
        level = (r["profile"], r["concurrency"])
        throughput.append((*level, f"{_fmt(m['completed'], 0)}/{_fmt(m['completed'] + m['failed'], 0)}",
                           _fmt(m.get("mean_input_tokens")), _fmt(m["request_throughput"], 2), _throughput_cell(m),
                           _fmt(m["mean_request_output_throughput_tok_s"]),
                           _accept_cell(r.get("server", {}))))
        latency.append((*level, _fmt(m["median_ttft_ms"]), _fmt(m["p99_ttft_ms"]), _fmt(m["median_tpot_ms"], 2),
                        _fmt(m["median_itl_ms"], 2), _fmt(m["median_e2el_ms"], 0),
                        _fmt(m.get("mean_arrivals_per_request")), _fmt(m.get("mean_tokens_per_arrival"), 2)))
        if m.get("held_back_streams"):
            share = m.get("held_back_replacement_share")
            why = ("" if share is None else
                   f"; {share:.0%} of their text is U+FFFD (invalid UTF-8 the server holds back)" if share
                   else "; their text is valid UTF-8, so not the server's hold-back of partial characters")
            held.append(f"{r['profile']} c={r['concurrency']}: {m['held_back_streams']}/{m['completed']} streams "
                        f"held back (most of the answer in one arrival); their ITL is the whole decode{why}")
    report.table("bench: throughput per level", ["profile", "conc", "ok", "in tok", "req/s", "out tok/s",
                                                 "per-req tok/s", "accept len before -> after"], throughput)
    report.table("bench: latency per level (ms)", ["profile", "conc", "TTFT p50", "TTFT p99", "TPOT p50",
                                                   "ITL p50", "E2E p50", "arrivals/req", "tok/arrival"], latency)
    for line in held:
        report.line(f"observation: {line}")


def print_recommendation(recs: list[recommend_mod.Recommendation]) -> None:
    for rec in recs:
        if any(level.eagle3_dyn is not None or level.eagle3 is not None for level in rec.levels):
            speculative = rec.speculative or "(spec not measured)"
            dynamic = rec.dynamic or "(dyn not measured)"
            rows = [(l.concurrency, _fmt(l.baseline), _fmt(l.eagle3), _fmt(l.eagle3_dyn),
                     _fmt(l.eagle3_over_baseline, 2), _fmt(l.dyn_over_best, 2)) for l in rec.levels]
            report.table("output tok/s by profile", ["conc", "baseline", speculative, dynamic,
                                                     "spec/baseline", "dyn/best"], rows)
        report.line(f"recommendation: {rec.text}")


def _options(concurrency, requests, input_len, output_len, dataset, seed, max_level_seconds, warmup,
             repeat) -> BenchOptions:
    try:
        prompts = PromptSource(dataset=dataset or "builtin", input_len=int_option(input_len, "--input-len", 256),
                               output_len=int_option(output_len, "--output-len", 256))
        return BenchOptions(concurrency=int_list_option(concurrency or DEFAULT_CONCURRENCY, "--concurrency"),
                            prompts=prompts, requests=int_option(requests, "--requests"),
                            seed=int_option(seed, "--seed", 0), warmup=int_option(warmup, "--warmup", 2),
                            max_level_seconds=seconds_option(max_level_seconds, "--max-level-seconds", 600.0, positive=True),
                            repeat=int_option(repeat, "--repeat", 1))
    except (PromptError, BenchError, ValueError) as exc:
        fail(str(exc), code=2)


def _plan(host, profiles, no_restart, url, timeout: float, model, draft_model) -> session.BenchPlan:
    names = [p.strip() for p in (profiles or "").split(",") if p.strip()]
    if url and no_restart:
        fail("--url already means 'use this running server'; leave out --no-restart", code=2)
    if url and (model or draft_model):
        fail("--url benches a running server as it is: leave out --model/--draft-model", code=2)
    try:
        if url:
            return session.plan_url(url, names)
        hosts = hosts_or_exit(host)
        if len(hosts) != 1:
            fail("bench runs on one host at a time (its servers are started and stopped in turn)", code=2)
        overrides = {k: v for k, v in (("model", model), ("draft_model", draft_model)) if v}
        return session.plan_host(hosts[0], names, no_restart=no_restart, overrides=overrides,
                                 timeout=timeout, note=report.note)
    except BenchError as exc:
        fail(str(exc), code=2)


def _print_dry_run(plan: session.BenchPlan, options: BenchOptions, out_dir: Path, json_: bool) -> None:
    steps = session.dry_run_steps(plan, options)
    if json_:
        report.emit_json({"dry_run": True, "target": plan.target, "profiles": plan.profiles,
                          "concurrency": options.concurrency, "out": str(out_dir), "steps": steps})
        return
    report.line(f"bench on {plan.target} (dry run: nothing started, stopped or written)")
    for number, step in enumerate(steps, 1):
        report.line(f"  {number}. {step}")
    report.line(f"  results would go to {out_dir}")


def _sweep(host, profiles, concurrency, requests, input_len, output_len, dataset, seed, no_restart,
           out, url, json_, max_level_seconds, warmup, timeout, repeat, model, draft_model, dry_run=False):
    options = _options(concurrency, requests, input_len, output_len, dataset, seed, max_level_seconds, warmup,
                       repeat)
    run_id = new_run_id()
    out_dir = Path(out) if out else paths.PROJECT_ROOT / "out" / "bench" / run_id
    try:
        RunWriter(out_dir).check_new()      # before anything is started: nothing lost, nothing mixed
    except OutputError as exc:
        fail(str(exc), code=2)
    plan = _plan(host, profiles, no_restart, url, seconds_option(timeout, "--timeout", server.DEFAULT_TIMEOUT, positive=True), model,
                 draft_model)
    for text in plan.notes:
        report.note(text)
    if dry_run:
        return _print_dry_run(plan, options, out_dir, json_)
    report.note(f"bench {run_id}: {plan.target}, profiles {','.join(plan.profiles)}, concurrency "
                f"{','.join(map(str, options.concurrency))}; results in {out_dir}")
    total = len(plan.profiles) * options.repeat * sum(options.requests_for(c) for c in options.concurrency)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=report.err_console, transient=False)
    with progress:
        listener = ProgressListener(progress, total)
        if isinstance(plan.control, HostServers):
            plan.control.note = listener.note
        try:
            outcome = session.run(plan, options, out_dir, run_id=run_id, listener=listener)
        except BenchError as exc:
            fail(str(exc), code=2)
    recs = outcome.recommendations
    if json_:
        report.emit_json({"run_id": run_id, "out": str(out_dir) if outcome.written else None,
                          "records": outcome.records,
                          "recommendation": recs[0].to_dict() if recs else None,
                          "recommendations": [r.to_dict() for r in recs], "errors": outcome.errors,
                          "interrupted": outcome.interrupted})
    else:
        if outcome.records:
            print_levels(outcome.records)
            print_recommendation(recs)
            report.line("written: " + ", ".join(str(p) for p in outcome.written))
        else:
            report.line("no level finished: nothing written")
    for error in outcome.errors:
        if f"profile {error}" not in listener.noted:  # a profile's failure was shown when it happened
            report.error(error)
    if outcome.interrupted:
        raise Exit("interrupted: the levels that finished are kept", code=130)
    if outcome.errors or not outcome.records:
        raise Exit(code=1)


def _compare(files, json_, plot):
    names = [f.strip() for f in (files or "").split(",") if f.strip()]
    if not names:
        fail("invoke bench compare needs runs: RUN[,RUN...] (results.jsonl files or bench output folders)", code=2)
    try:
        comparison = compare_runs([Path(n) for n in names])
    except OutputError as exc:
        fail(str(exc), code=2)
    if json_:
        report.emit_json(comparison.to_dict())
    else:
        for heading, rows in comparison.tables.items():
            report.table(escape(heading), ["conc", *[escape(c) for c in comparison.columns]],
                         [[row[0], *[_fmt(v) for v in row[1:]]] for row in rows])
    if plot:
        records = [{**r, "profile": r["_label"]} for r in comparison.records]
        plot_throughput(records, Path(plot), title="bench compare: " + ", ".join(names))
        report.note(f"plot written: {plot}")


@command(positional=["action", "files"], optional=["action", "files"], help={
    "action": "leave out to run a sweep; `compare` to put earlier runs side by side",
    "files": "compare: runs to compare, comma-separated (results.jsonl files or bench output folders)",
    "host": HOST_HELP,
    "profiles": "server profiles to sweep, comma-separated (default: cpu-ref on a host without a GPU, "
                "such as the sandbox; else baseline,eagle3,eagle3-dyn)",
    "concurrency": f"in-flight request counts, comma-separated (default {DEFAULT_CONCURRENCY})",
    "requests": "requests per level (default max(16, 4 x concurrency))",
    "dataset": "builtin (coding + agentic prompts, default) | synthetic (fixed lengths) | FILE.jsonl",
    "input_len": "synthetic: prompt tokens (default 256)",
    "output_len": "max tokens per answer; synthetic: exact where the server takes ignore_eos (default 256)",
    "seed": "seed for the prompt order and synthetic words (default 0)",
    "no_restart": "use the server already running on the host (its profile) instead of starting each",
    "url": "bench an OpenAI-compatible server at this base URL (no host, no start/stop)",
    "out": "output folder (default out/bench/RUN_ID)",
    "json_": "print the records and the recommendation as JSON",
    "max_level_seconds": "time bound per level: no new requests after it (default 600)",
    "warmup": "warm-up requests per profile before the first level (default 2)",
    "timeout": "seconds to wait for each profile's server to be ready (default 900)",
    "repeat": "passes over all levels per profile (default 1); tables, plot and recommendation use the median",
    "plot": "compare: also write a PNG with every run's curves to this path",
    "model": "model path on the host for every profile, instead of the host's server.model",
    "draft_model": "draft model path on the host for every profile, instead of the host's server.draft_model",
    "dry_run": "print what the sweep would start, stop and send (the running server included); change nothing",
})
def bench(c, action=None, files=None, host=None, profiles=None, concurrency=None, requests=None,
          dataset=None, input_len=None, output_len=None, seed=None, no_restart=False, url=None, out=None,
          json_=False, max_level_seconds=None, warmup=None, timeout=None, plot=None, repeat=None, model=None,
          draft_model=None, dry_run=False):
    """Sweep concurrency levels over server profiles; find where EAGLE-3 stops paying off."""
    if wants_help(action, files):
        report.line(USAGE)
        return
    if action == "compare":
        return _compare(files, json_, plot)
    if action:
        fail(f"unknown action {action!r} (files for compare go after `compare`)\n{USAGE}", code=2)
    try:
        _sweep(host, profiles, concurrency, requests, input_len, output_len, dataset, seed, no_restart,
               out, url, json_, max_level_seconds, warmup, timeout, repeat, model, draft_model, dry_run)
    except (server.ServerError, OutputError) as exc:
        fail(str(exc))
    sys.stdout.flush()

"""`invoke bench [options]` (a concurrency sweep over profiles) and `invoke bench compare FILES`."""
from __future__ import annotations

import sys
from pathlib import Path

from invoke import Exit
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from toolkit import paths, report, server
from toolkit.bench import recommend as recommend_mod
from toolkit.bench.compare import compare as compare_runs
from toolkit.bench.outputs import OutputError, RunWriter, median_by_level
from toolkit.bench.plot import plot_throughput
from toolkit.bench.prompts import PromptError, PromptSource
from toolkit.bench.hosts import HostServers, RunningOnHost, host_facts
from toolkit.bench.runner import BenchError, BenchOptions, RunningServer, SweepListener, new_run_id, run_sweep

from .common import HOST_HELP, fail, hosts_or_exit, int_option, wants_help
from .parsing import command

DEFAULT_PROFILES = "baseline,eagle3,eagle3-dyn"
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"
USAGE = """usage:
  invoke bench [--profiles baseline,eagle3,eagle3-dyn] [--concurrency 1,2,4,...] [--requests N]
               [--dataset builtin|synthetic|FILE.jsonl] [--input-len L] [--output-len M] [--seed S]
               [--repeat N] [--no-restart] [--url URL] [--out DIR] [--host NAME]
  invoke bench compare RUN[,RUN...] [--plot FILE.png] [--json]   (RUN: a results.jsonl or a bench output folder)
every option with its help: invoke --help bench"""


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        fail(f"{what} takes comma-separated integers, got {text!r}", code=2)
    if not values or any(v < 1 for v in values):
        fail(f"{what} needs integers >= 1, got {text!r}", code=2)
    return values


class ProgressListener(SweepListener):
    """A rich progress bar on stderr over every request of the sweep."""

    def __init__(self, progress: Progress, total: int):
        self.progress = progress
        self.task = progress.add_task("bench", total=total)
        self.failed = 0

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
        self.progress.console.print(text, markup=False)


def _fmt(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


def _throughput_cell(metrics: dict) -> str:
    spread = metrics.get("output_throughput_range")
    return _fmt(metrics["output_throughput"]) + (f" [{_fmt(spread[0])}-{_fmt(spread[1])}]" if spread else "")


def print_levels(records: list[dict]) -> None:
    """One row per profile and level: the median of the runs where a level was repeated."""
    throughput, latency = [], []
    for r in median_by_level(records):
        m = r["metrics"]
        level = (r["profile"], r["concurrency"])
        throughput.append((*level, f"{_fmt(m['completed'], 0)}/{_fmt(m['completed'] + m['failed'], 0)}",
                           _fmt(m["request_throughput"], 2), _throughput_cell(m),
                           _fmt(m["mean_request_output_throughput_tok_s"]),
                           _fmt(r.get("server", {}).get("avg_spec_accept_length"), 2)))
        latency.append((*level, _fmt(m["median_ttft_ms"]), _fmt(m["p99_ttft_ms"]), _fmt(m["median_tpot_ms"], 2),
                        _fmt(m["median_itl_ms"], 2), _fmt(m["median_e2el_ms"], 0)))
    report.table("bench: throughput per level", ["profile", "conc", "ok", "req/s", "out tok/s",
                                                 "per-req tok/s", "accept len"], throughput)
    report.table("bench: latency per level (ms)", ["profile", "conc", "TTFT p50", "TTFT p99", "TPOT p50",
                                                   "ITL p50", "E2E p50"], latency)


def print_recommendation(recs: list[recommend_mod.Recommendation]) -> None:
    for rec in recs:
        if any(level.eagle3_dyn is not None or level.eagle3 is not None for level in rec.levels):
            rows = [(l.concurrency, _fmt(l.baseline), _fmt(l.eagle3), _fmt(l.eagle3_dyn),
                     _fmt(l.eagle3_over_baseline, 2), _fmt(l.dyn_over_best, 2)) for l in rec.levels]
            report.table("output tok/s by profile", ["conc", "baseline", rec.speculative, rec.dynamic,
                                                     f"{rec.speculative}/baseline", "dyn/best"], rows)
        report.line(f"recommendation: {rec.text}")


def finalize(writer: RunWriter, records: list[dict], title: str) -> list[recommend_mod.Recommendation] | None:
    """CSV, plot and recommendation(s) from the levels that finished (also after Ctrl-C).

    recommendation.json holds the first pair's answer (eagle3 when measured); answers for
    further pairs (eagle3-v2) go under its "others" key."""
    if not records:
        return None
    writer.write_csv(records)
    recs = recommend_mod.recommend_all(records)
    data = recs[0].to_dict()
    if len(recs) > 1:
        data["others"] = [rec.to_dict() for rec in recs[1:]]
    writer.write_recommendation(data)
    plot_throughput(records, writer.plot, title=title, crossover=recs[0].crossover_concurrency)
    return recs


def _sweep(host, profiles, concurrency, requests, input_len, output_len, dataset, seed, no_restart,
           out, url, json_, max_level_seconds, warmup, timeout, repeat):
    if url and no_restart:
        fail("--url already means 'use this running server'; leave out --no-restart", code=2)
    try:
        prompts = PromptSource(dataset=dataset or "builtin", input_len=int_option(input_len, "--input-len", 256),
                               output_len=int_option(output_len, "--output-len", 256))
        options = BenchOptions(concurrency=_ints(concurrency or DEFAULT_CONCURRENCY, "--concurrency"),
                               prompts=prompts, requests=int_option(requests, "--requests"),
                               seed=int_option(seed, "--seed", 0), warmup=int_option(warmup, "--warmup", 2),
                               max_level_seconds=float(max_level_seconds or 600),
                               repeat=int_option(repeat, "--repeat", 1))
    except (PromptError, BenchError, ValueError) as exc:
        fail(str(exc), code=2)
    profile_names = [p.strip() for p in (profiles or "").split(",") if p.strip()]
    run_facts: dict = {}
    if url:
        control = RunningServer(url, {"kind": "external", "url": url})
        profile_names = profile_names or ["server"]
        if len(profile_names) > 1:
            fail("--url benches one running server: give at most one name in --profiles", code=2)
    else:
        hosts = hosts_or_exit(host)
        if len(hosts) != 1:
            fail("bench runs on one host at a time (its servers are started and stopped in turn)", code=2)
        target = hosts[0]
        if no_restart:
            state = server.status(target)
            if state is None or state.status == "dead":
                fail(f"--no-restart: no running server on {target.name}; start one with "
                     f"invoke server start PROFILE --host {target.name}")
            if profile_names and profile_names != [state.profile]:
                fail(f"--no-restart uses the running server ({state.profile}); --profiles "
                     f"{','.join(profile_names)} does not match it", code=2)
            profile_names = [state.profile]
            control = RunningOnHost(target, state)
        else:
            profile_names = profile_names or DEFAULT_PROFILES.split(",")
            control = HostServers(target, timeout=float(timeout or server.DEFAULT_TIMEOUT), note=report.note)
        run_facts = host_facts(target, note=report.note)
    run_id = new_run_id()
    out_dir = Path(out) if out else paths.PROJECT_ROOT / "out" / "bench" / run_id
    writer = RunWriter(out_dir)
    report.note(f"bench {run_id}: profiles {','.join(profile_names)}, concurrency "
                f"{','.join(map(str, options.concurrency))}; results in {out_dir}")
    total = len(profile_names) * options.repeat * sum(options.requests_for(c) for c in options.concurrency)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=report.err_console, transient=False)
    interrupted = False
    records: list[dict] = []
    errors: list[str] = []
    with progress:
        listener = ProgressListener(progress, total)
        if isinstance(control, HostServers):
            control.note = listener.note
        def keep(record: dict) -> None:
            writer.append(record)   # on disk first: a Ctrl-C after this keeps the level
            records.append(record)

        try:
            result = run_sweep(profile_names, options, control, on_level=keep, listener=listener,
                               run_facts=run_facts, run_id=run_id)
            errors = result.errors
        except KeyboardInterrupt:
            interrupted = True
    title = f"bench {run_id} ({options.prompts.dataset}, output {options.prompts.output_len} tokens)"
    recs = finalize(writer, records, title)
    if json_:
        report.emit_json({"run_id": run_id, "out": str(out_dir), "records": records,
                          "recommendation": recs[0].to_dict() if recs else None,
                          "recommendations": [r.to_dict() for r in recs or []], "errors": errors,
                          "interrupted": interrupted})
    else:
        if records:
            print_levels(records)
            print_recommendation(recs)
        report.line(f"written: {writer.jsonl}" + (f", {writer.csv}, {writer.plot}, {writer.recommendation}"
                                                    if records else " (no level finished)"))
    for error in errors:
        report.error(error)
    if interrupted:
        raise Exit("interrupted: the levels that finished are kept", code=130)
    if errors or not records:
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
    "profiles": f"server profiles to sweep, comma-separated (default {DEFAULT_PROFILES})",
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
})
def bench(c, action=None, files=None, host=None, profiles=None, concurrency=None, requests=None,
          dataset=None, input_len=None, output_len=None, seed=None, no_restart=False, url=None, out=None,
          json_=False, max_level_seconds=None, warmup=None, timeout=None, plot=None, repeat=None):
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
               out, url, json_, max_level_seconds, warmup, timeout, repeat)
    except (server.ServerError, OutputError) as exc:
        fail(str(exc))
    sys.stdout.flush()

"""One `invoke bench` run from start to files: what to bench (checked before anything changes),
the sweep, and the files that come of it.

    plan = plan_host(host, profiles, ...)  or  plan_url(url, profile)   # BenchError: nothing done
    outcome = run(plan, options, out_dir, listener)                      # Ctrl-C keeps finished levels

The command layer (`toolkit_cli/bench.py`) only parses options and prints.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from toolkit.server import profiles as profiles_mod
from toolkit.server import server
from toolkit.provision import stack
from toolkit.core.inventory import Host, InventoryError, load_inventory
from toolkit.check import client
from toolkit.bench import recommend as recommend_mod
from toolkit.bench.hosts import HostServers, RunningOnHost, host_facts
from toolkit.bench.outputs import OutputError, RunWriter, load_records
from toolkit.bench.plot import plot_throughput
from toolkit.bench.runner import (BenchError, BenchOptions, RunningServer, ServerControl, SweepListener, new_run_id,
                     run_sweep)

GPU_PROFILES = ("baseline", "eagle3", "eagle3-dyn")
CPU_PROFILES = ("cpu-ref",)


@dataclass
class BenchPlan:
    """What a run will bench; made by `plan_host` / `plan_url` after every check passed."""
    profiles: list[str]
    control: ServerControl
    target: str                                   # host name or URL
    run_facts: dict = field(default_factory=dict)  # host and versions for every record
    notes: list[str] = field(default_factory=list)


@dataclass
class BenchOutcome:
    run_id: str
    out_dir: Path
    records: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    interrupted: bool = False
    recommendations: list[recommend_mod.Recommendation] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)   # empty when no level finished: nothing on disk


def host_has_gpu(host: Host) -> bool | None:
    """What the host's stack says (None: no stack named, or it cannot be read)."""
    if not host.stack:
        return None
    try:
        return stack.load(host.stack).gpu
    except Exception:
        return None


def default_profiles(host: Host) -> list[str]:
    """cpu-ref on a host without a GPU (the sandbox), else baseline, eagle3, eagle3-dyn."""
    return list(CPU_PROFILES if host_has_gpu(host) is False else GPU_PROFILES)


def _gpu_hosts() -> list[str]:
    try:
        return sorted(name for name, h in load_inventory().items() if host_has_gpu(h))
    except InventoryError:
        return []


def check_profiles(host: Host, names: list[str], overrides: dict | None = None) -> list[profiles_mod.LaunchPlan]:
    """Every profile resolves for the host and can run there, and its model is on the host;
    BenchError with the command that helps otherwise. Runs before any server is touched."""
    known = sorted(profiles_mod.load_profiles())
    plans = []
    for name in names:
        if name not in known:
            raise BenchError(f"no profile {name!r}; profiles: {', '.join(known)} (see: invoke server profiles)")
        kind = profiles_mod.load_profile(name).get("kind")
        if kind == "sglang" and host_has_gpu(host) is False:
            gpu_hosts = _gpu_hosts()
            elsewhere = (f"invoke bench --host {gpu_hosts[0]} --profiles {','.join(names)}" if gpu_hosts
                         else "a GPU host added to hosts/*.toml (docs/provisioning.md)")
            raise BenchError(f"profile {name} runs SGLang on a GPU, and {host.name} has none (stack {host.stack}); "
                             f"bench the CPU reference server here: invoke bench --host {host.name} "
                             f"--profiles {','.join(CPU_PROFILES)}; or on a GPU host: {elsewhere}")
        try:
            plans.append(server.plan(host, name, overrides))
        except profiles_mod.ProfileError as exc:
            raise BenchError(str(exc)) from None
    _check_models(host, plans, overrides or {})
    return plans


def _check_models(host: Host, plans: list[profiles_mod.LaunchPlan], overrides: dict) -> None:
    try:
        missing = server.missing_paths(host, plans, overrides)
    except Exception as exc:
        raise BenchError(f"{host.name}: cannot check the models on the host: {exc}") from None
    if missing:
        raise BenchError("\n".join(f"profile {launch.profile}: {need['what']} {need['path']} does not exist on "
                                    f"{host.name}; {need['advice']}" for launch, need in missing))


def plan_url(url: str, profiles: list[str]) -> BenchPlan:
    if len(profiles) > 1:
        raise BenchError("--url benches one running server: give at most one name in --profiles")
    try:
        client.base_url_of(url)
    except ValueError as exc:
        raise BenchError(f"--url: {exc}") from None
    return BenchPlan(profiles or ["server"], RunningServer(url, {"kind": "external", "url": url}), url)


def plan_host(host: Host, profiles: list[str], *, no_restart: bool = False, timeout: float = server.DEFAULT_TIMEOUT,
              overrides: dict | None = None, note: Callable[[str], None] = lambda text: None) -> BenchPlan:
    notes = []
    if no_restart:
        if overrides:
            raise BenchError("--no-restart uses the running server as it was started: leave out --model/--draft-model")
        state = server.status(host)
        if state is None or state.status == "dead":
            raise BenchError(f"--no-restart: no running server on {host.name}; start one with "
                             f"invoke server start PROFILE --host {host.name}")
        if profiles and profiles != [state.profile]:
            raise BenchError(f"--no-restart uses the running server ({state.profile}); --profiles "
                             f"{','.join(profiles)} does not match it")
        names, control = [state.profile], RunningOnHost(host, state)
    else:
        names = profiles or default_profiles(host)
        if not profiles:
            notes.append(f"profiles: {','.join(names)} (the default for {host.name}; choose with --profiles)")
        check_profiles(host, names, overrides)
        control = HostServers(host, timeout=timeout, note=note, overrides=overrides)
    return BenchPlan(names, control, host.name, host_facts(host, note=note), notes)


def dry_run_steps(plan: BenchPlan, options: BenchOptions) -> list[str]:
    """What `run(plan, options, ...)` would do, in order, as sentences; reads the host's server
    state (read-only) for a plan that starts servers."""
    per_profile = [f"c={c}: {options.requests_for(c)} requests" for c in options.concurrency]
    sweep = f"{options.warmup} warm-up request(s), then " + ", ".join(per_profile)
    if options.repeat > 1:
        sweep += f"; {options.repeat} passes"
    if isinstance(plan.control, RunningOnHost):
        return [f"bench the running {plan.profiles[0]} server on {plan.target} as it is (nothing started or "
                f"stopped): {sweep}"]
    if not isinstance(plan.control, HostServers):
        return [f"bench the server at {plan.target} as it is: {sweep}"]
    host = plan.control.host
    steps = []
    running = server.status(host)
    if running is not None and running.status != "dead":
        steps.append(f"stop the running {running.profile} server (pid {running.pid}); the sweep does not start it "
                     f"again after (invoke server start {running.profile} --host {host.name})")
    for name in plan.profiles:
        steps.append(f"start {name} (wait up to {plan.control.timeout:.0f} s for it to be ready), {sweep}; stop it")
    return steps


def finalize(writer: RunWriter, records: list[dict], title: str) -> tuple[list[recommend_mod.Recommendation], list[Path]]:
    """CSV, plot and recommendation(s) from the levels that finished (also after Ctrl-C).

    recommendation.json holds the first pair's answer (eagle3 when measured); answers for
    further pairs (eagle3-v2) go under its "others" key."""
    if not records:
        return [], []
    csv_path = writer.write_csv(records)
    recs = recommend_mod.recommend_all(records)
    data = recs[0].to_dict()
    if len(recs) > 1:
        data["others"] = [rec.to_dict() for rec in recs[1:]]
    recommendation = writer.write_recommendation(data)
    plot = plot_throughput(records, writer.plot, title=title, crossover=recs[0].crossover_concurrency)
    return recs, [writer.jsonl, csv_path, plot, recommendation]


def run(plan: BenchPlan, options: BenchOptions, out_dir: Path, *, run_id: str | None = None,
        listener: SweepListener | None = None) -> BenchOutcome:
    """The sweep; every finished level is on disk (JSONL) before the next starts. Ctrl-C ends it
    with `interrupted` set and the files written from what finished."""
    writer = RunWriter(out_dir)
    try:
        writer.check_new()
    except OutputError as exc:
        raise BenchError(str(exc)) from None
    outcome = BenchOutcome(run_id or new_run_id(), Path(out_dir))

    def keep(record: dict) -> None:
        writer.append(record)   # on disk first: a Ctrl-C after this keeps the level
        outcome.records.append(record)

    try:
        result = run_sweep(plan.profiles, options, plan.control, on_level=keep, listener=listener,
                           run_facts=plan.run_facts, run_id=outcome.run_id)
        outcome.errors = result.errors
    except KeyboardInterrupt:
        outcome.interrupted = True
        if writer.jsonl.exists():
            # the file is what finished: an interrupt that lands between a level's line going to
            # disk and `keep` taking it in memory must not leave that level out of the CSV
            outcome.records = load_records(writer.jsonl)
    title = f"bench {outcome.run_id} ({options.prompts.dataset}, output {options.prompts.output_len} tokens)"
    outcome.recommendations, outcome.written = finalize(writer, outcome.records, title)
    return outcome

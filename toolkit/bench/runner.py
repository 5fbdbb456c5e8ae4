"""Run concurrency levels against a server, and a sweep over profiles.

A level keeps exactly `concurrency` requests in flight (a closed loop, like `--max-concurrency`
in sglang.bench_serving and `vllm bench serve` with an infinite request rate) until its request
count is done or its time bound is reached; requests in flight then finish (each bounded by the
request timeout). The sweep starts each profile's server through a `ServerControl`, warms it up,
runs the levels, and hands every finished level to `on_level` at once, so an interrupted sweep
keeps what it finished.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import platform
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, Protocol

import aiohttp

from toolkit.check.client import OpenAIClient, RequestRecord
from toolkit.bench import dynlevel
from toolkit.bench import metrics as metrics_mod
from toolkit.bench import serverconfig
from toolkit.bench.prompts import BenchRequest, PromptError, PromptSource, SyntheticCalibration, calibration_prompts

SCHEMA = 2          # 2: server config keys (serverconfig), stream-shape metrics, arrivals-based ITL
CALIBRATION_CONCURRENCY = 8
CALIBRATION_CHECKS = 4        # composed prompts whose length the warm-up checks against the server


class BenchError(RuntimeError):
    pass


def default_requests(concurrency: int) -> int:
    """Enough requests that the in-flight count stays at the level for most of the run."""
    return max(16, 4 * concurrency)


@dataclass
class BenchOptions:
    concurrency: list[int]
    prompts: PromptSource = field(default_factory=PromptSource)
    requests: int | None = None          # per level; None: default_requests(level)
    seed: int = 0
    temperature: float = 0.0
    warmup: int = 2
    max_level_seconds: float = 600.0
    request_timeout: float = 600.0
    model: str | None = None
    repeat: int = 1                      # passes over all levels (reports use the median per level)

    def __post_init__(self):
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise BenchError("concurrency levels must be integers >= 1")
        if self.requests is not None and self.requests < 1:
            raise BenchError("--requests must be >= 1")
        if self.repeat < 1:
            raise BenchError("--repeat must be >= 1")
        if self.warmup < 0:
            raise BenchError("--warmup must be >= 0")
        if not self.max_level_seconds > 0:
            raise BenchError("--max-level-seconds must be > 0")
        self.concurrency = sorted(set(self.concurrency))

    def requests_for(self, concurrency: int) -> int:
        return self.requests if self.requests is not None else default_requests(concurrency)

    def describe(self) -> dict:
        return {"concurrency": self.concurrency, "requests": self.requests, "seed": self.seed, "repeat": self.repeat,
                "temperature": self.temperature, "warmup": self.warmup,
                "max_level_seconds": self.max_level_seconds, "request_timeout": self.request_timeout,
                **self.prompts.describe()}


@dataclass
class LevelRun:
    concurrency: int
    records: list[RequestRecord]
    duration_s: float
    stopped_early: bool          # the time bound cut the request count short
    rejected_fields: list[str] = field(default_factory=list)


async def run_level_async(base_url: str, requests: list[BenchRequest], concurrency: int, *,
                          max_seconds: float = 600.0, request_timeout: float = 600.0,
                          temperature: float = 0.0, model: str | None = None,
                          on_request: Callable[[RequestRecord], None] | None = None,
                          client: OpenAIClient | None = None,
                          rejected_fields: set[str] | None = None) -> LevelRun:
    own_client = client is None
    if client is None:
        client = OpenAIClient(base_url, model=model, timeout=request_timeout,
                              max_connections=concurrency)
    client.rejected_fields |= set(rejected_fields or ())
    try:
        if client.model is None:
            await client.resolve_model()
        records: list[RequestRecord | None] = [None] * len(requests)
        next_index = 0
        started = time.perf_counter()
        deadline = started + max_seconds

        async def one(index: int) -> RequestRecord:
            request = requests[index]
            try:
                return await asyncio.wait_for(
                    client.chat(request.messages, max_tokens=request.max_tokens, temperature=temperature,
                                stream=True, extra=request.extra), request_timeout)
            except asyncio.TimeoutError:
                return RequestRecord(ok=False, error=f"timed out after {request_timeout:.0f} s")

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(requests) and time.perf_counter() < deadline:
                index = next_index
                next_index += 1
                record = await one(index)
                records[index] = record
                if on_request is not None:
                    on_request(record)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
        duration = time.perf_counter() - started
        done = [r for r in records if r is not None]
        return LevelRun(concurrency, done, duration, stopped_early=len(done) < len(requests),
                        rejected_fields=sorted(client.rejected_fields))
    finally:
        if own_client:
            await client.aclose()


def run_level(base_url: str, requests: list[BenchRequest], concurrency: int, **kwargs) -> LevelRun:
    return asyncio.run(run_level_async(base_url, requests, concurrency, **kwargs))


# --- servers ----------------------------------------------------------------------------------
@dataclass
class ServedProfile:
    profile: str
    base_url: str                    # reachable from this machine
    facts: dict = field(default_factory=dict)   # server kind, host, models ...
    config_fallback: dict = field(default_factory=dict)   # serverconfig keys the launch plan gives
    config_sources: dict = field(default_factory=dict)    # their sources where not "profile"


class ServerControl(Protocol):
    def serve(self, profile: str) -> ContextManager[ServedProfile]:
        """Start the profile's server (or use a running one) and stop it when done.

        A control that can see the server's process may also have `gone(served) -> str | None`:
        why the process is gone (None while it runs); the sweep asks it after a level that had
        failures."""


class RunningServer:
    """A server that is already up (`--no-restart`, `--url`): used as it is, never stopped."""

    def __init__(self, base_url: str, facts: dict | None = None):
        self.base_url = base_url
        self.facts = dict(facts or {})

    @contextlib.contextmanager
    def serve(self, profile: str) -> Iterator[ServedProfile]:
        yield ServedProfile(profile, self.base_url, dict(self.facts))


class SweepListener:
    """Progress hooks; the command layer draws a progress bar from them. All optional."""

    def profile_started(self, profile: str, total_requests: int) -> None: ...
    def level_started(self, profile: str, concurrency: int, requests: int) -> None: ...
    def request_done(self, record: RequestRecord) -> None: ...
    def level_done(self, record: dict) -> None: ...
    def note(self, text: str) -> None: ...


@dataclass
class SweepResult:
    run_id: str
    records: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def client_facts() -> dict:
    return {"control_host": socket.gethostname(), "python": platform.python_version(),
            "http": f"aiohttp {aiohttp.__version__}"}


ACCEPT_PROBE_PROMPT = "Write a Python function to compute fibonacci numbers. Be brief."


async def _server_state(base_url: str, *, probe: bool = True) -> dict:
    """What the server says about its state (`OpenAIClient.server_state`) and, with `probe`, the
    accept length of one request sent alone right now (`accept_probe`: value, why not)."""
    async with OpenAIClient(base_url, timeout=120.0, max_connections=2) as client:
        state = await client.server_state()
        if probe and "unreachable" not in state:
            state["accept_probe"] = await client.accept_length_probe(ACCEPT_PROBE_PROMPT)
        return state


def accept_record(before: tuple | None, after: tuple | None, simulated) -> dict:
    """A record's `server.accept_length`: one request's accept length alone on the server before
    the first level (after the warm-up) and right after this level (after the resume, where the
    level crossed the dyn-disable threshold), and SGLANG_SIMULATE_ACC_LEN (False: not set, None:
    unknown)."""
    why = [probe[1] for probe in (before, after) if probe and probe[0] is None and probe[1]]
    return {"before_first_level": before[0] if before else None, "after_level": after[0] if after else None,
            "why_not": why[0] if why else None, "simulated": simulated,
            "source": "SGLang /generate meta_info (one request alone)"
            if (before and before[0]) or (after and after[0]) else None}


async def _prompt_tokens(client: OpenAIClient, contents: list[str]) -> list[int]:
    """The server's prompt_tokens for each content as a one-message chat (max_tokens 1)."""
    gate = asyncio.Semaphore(CALIBRATION_CONCURRENCY)

    async def one(content: str) -> int:
        async with gate:
            record = await client.chat([{"role": "user", "content": content}], max_tokens=1,
                                       temperature=0.0, stream=False)
        if not record.ok or not record.prompt_tokens:
            raise BenchError(f"synthetic calibration request failed: {record.error or 'no usage.prompt_tokens'}")
        return record.prompt_tokens

    return list(await asyncio.gather(*(one(content) for content in contents)))


async def calibrate_synthetic(client: OpenAIClient, options: BenchOptions) -> dict:
    """Ask the server what the synthetic words cost (SyntheticCalibration), then check a few
    composed prompts against its count. Sets `options.prompts.calibration`."""
    prompts = calibration_prompts()
    counts = dict(zip(prompts, await _prompt_tokens(client, list(prompts.values()))))
    base = counts.pop("")
    try:
        calibration = SyntheticCalibration.fit(base, counts)
    except PromptError as exc:
        raise BenchError(str(exc)) from None
    wanted = options.prompts.input_len
    if wanted < base:
        raise BenchError(f"--input-len {wanted} is shorter than the chat template with one word on this "
                         f"server ({base} prompt tokens): ask for at least {base}")
    options.prompts.calibration = calibration
    sample = options.prompts.requests(CALIBRATION_CHECKS, options.seed)
    measured = await _prompt_tokens(client, [r.messages[0]["content"] for r in sample])
    return {**calibration.to_dict(), "check": {"requested": wanted, "measured": measured,
                                               "max_error_pct": round(max(abs(m - wanted) for m in measured)
                                                                      / wanted * 100, 2)}}


async def _warm_up(base_url: str, options: BenchOptions, calibrate: bool, served: "ServedProfile") -> dict:
    """A few sequential requests (first-request costs out of the measurement); the server's
    configuration (serverconfig); for the synthetic mode also the prompt calibration against
    the server's own usage counts."""
    facts: dict = {}
    async with OpenAIClient(base_url, model=options.model, timeout=options.request_timeout,
                            max_connections=CALIBRATION_CONCURRENCY) as client:
        facts["model"] = await client.resolve_model()
        for request in options.prompts.requests(options.warmup, options.seed + 1):
            record = await client.chat(request.messages, max_tokens=min(request.max_tokens, 32),
                                       temperature=options.temperature, stream=True, extra=request.extra)
            if not record.ok:
                raise BenchError(f"warm-up request failed: {record.error}")
        facts["rejected_fields"] = set(client.rejected_fields)
        facts["config"] = serverconfig.describe(await client.server_info(), await client.model_info(),
                                                served.config_fallback, served.config_sources)
        if calibrate:
            facts["calibration"] = await calibrate_synthetic(client, options)
    return facts


def new_run_id() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:6]


def run_sweep(profiles: list[str], options: BenchOptions, control: ServerControl, *,
              on_level: Callable[[dict], None], listener: SweepListener | None = None,
              run_facts: dict | None = None, run_id: str | None = None) -> SweepResult:
    """Every profile x level; `on_level(record)` gets each level's record as soon as it is done.

    A profile whose server fails to start or dies is reported in `errors` and the sweep moves on.
    """
    listener = listener or SweepListener()
    result = SweepResult(run_id=run_id or new_run_id())
    calibration: dict | None = None     # synthetic: calibrated once, so every profile gets the same prompts
    for profile in profiles:
        total = options.repeat * sum(options.requests_for(c) for c in options.concurrency)
        listener.profile_started(profile, total)
        try:
            with control.serve(profile) as served:
                warm = asyncio.run(_warm_up(served.base_url, options,
                                            options.prompts.is_synthetic and calibration is None, served))
                calibration = warm.get("calibration", calibration)
                accept_before = asyncio.run(_server_state(served.base_url)).get("accept_probe")
                if calibration is not None:
                    warm["calibration"] = calibration
                # whole passes over the levels, not each level N times in a row: slow drift on
                # the machine then spreads over every level instead of biasing some
                passes = [(r, c) for r in range(options.repeat) for c in options.concurrency]
                for repeat, concurrency in passes:
                    count = options.requests_for(concurrency)
                    listener.level_started(profile, concurrency, count)
                    requests = options.prompts.requests(count, options.seed)
                    dyn_before = asyncio.run(dynlevel.reading(served.base_url))
                    level = run_level(served.base_url, requests, concurrency,
                                      max_seconds=options.max_level_seconds,
                                      request_timeout=options.request_timeout,
                                      temperature=options.temperature, model=warm.get("model"),
                                      on_request=listener.request_done,
                                      rejected_fields=warm.get("rejected_fields"))
                    state = asyncio.run(_server_state(served.base_url))
                    state["accept_length"] = accept_record(accept_before, state.pop("accept_probe", None),
                                                           served.facts.get("simulated_accept_length"))
                    record = level_record(result.run_id, served, options, level, warm, state, run_facts)
                    dyn_level = dynlevel.level_entry(dyn_before, asyncio.run(dynlevel.reading(served.base_url)))
                    if dyn_level is not None:
                        record["dyn_disable_level"] = dyn_level
                    record["repeat"] = repeat
                    result.records.append(record)
                    on_level(record)
                    listener.level_done(record)
                    dead = _dead(control, served, state, record)
                    if dead:
                        left = passes[passes.index((repeat, concurrency)) + 1:]
                        raise BenchError(f"{dead[0]} after concurrency {concurrency}: {dead[1]}; the sweep of"
                                         f" {profile} stopped"
                                         f" there (levels not run: "
                                         f"{', '.join(f'c={c}' for _, c in left) or 'none'}),"
                                         f" the levels measured are kept")
        except KeyboardInterrupt:
            raise
        except Exception as exc:   # one profile's failure must not lose the others
            message = f"{profile}: {str(exc) or type(exc).__name__}"
            result.errors.append(message)
            listener.note(f"profile {message}")
    return result


def _dead(control, served: ServedProfile, state: dict, record: dict) -> tuple[str, str] | None:
    """(what, why) when the server is dead after a level, None while it serves: its health check
    fails, or, after a level with failures, the control finds its process gone."""
    gone = None
    if (record["metrics"]["failed"] or state.get("unreachable")) and hasattr(control, "gone"):
        gone = control.gone(served)
    if state.get("unreachable"):
        return "server unreachable", state["unreachable"] + (f"; {gone}" if gone else "")
    return ("server process gone", gone) if gone else None


def level_record(run_id: str, served: ServedProfile, options: BenchOptions, level: LevelRun,
                 warm: dict, state: dict, run_facts: dict | None) -> dict:
    server = {**served.facts, "model": warm.get("model"), **warm.get("config", {})}
    for key in ("version", "avg_spec_accept_length", "dyn_spec_disable", "accept_length"):
        if state.get(key) is not None:
            server[key] = state[key]
    return {
        "schema": SCHEMA,
        "run_id": run_id,
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "profile": served.profile,
        "concurrency": level.concurrency,
        "requests": options.requests_for(level.concurrency),
        "params": {**options.describe(), **({"calibration": warm["calibration"]} if "calibration" in warm else {})},
        "host": dict((run_facts or {}).get("host", {})),
        "versions": dict((run_facts or {}).get("versions", {})),
        "client": {**client_facts(), "rejected_fields": level.rejected_fields},
        "server": server,
        "stopped_early": level.stopped_early,
        "metrics": metrics_mod.compute(level.records, level.duration_s),
    }

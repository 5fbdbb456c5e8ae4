"""`invoke smoke`: does the running server really work? A fixed list of checks, each timed.

models       /v1/models lists a model
chat         the fibonacci prompt at temperature 0: non-empty answer, consistent usage
determinism  the same request twice more: those two answers must be identical; the first
             answer (computed before the prompt was in the server's prefix cache) may differ
             from them, which is reported, not failed (see _determinism_detail)
stream       a streamed request (at least STREAM_MIN_TOKENS tokens) arrives as a stream: not in
             one piece after the server worked long enough on it to have streamed it (a
             missing `data: [DONE]` is fine; an answer made too fast to tell is reported)
burst        more concurrent requests than the profile's dyn-disable threshold, all complete,
             and no stream stops for far longer than the server's median step (a stall);
             the server's accept length before the burst and after it (where it reports one)
health       the server still answers afterwards
log          the server log since start holds no traceback or error line (minus an allow-list)

Engine only: it takes a base URL and a log-reading callable, so it runs against any
OpenAI-compatible server; `toolkit_cli/smoke.py` finds both from the host's server state.
Every failure becomes a failed check with a message; nothing here raises for a broken server.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable

from toolkit.check.client import ClientError, OpenAIClient, RequestRecord

FIBONACCI_PROMPT = "Write a Python function to compute fibonacci numbers. Be brief."
CHAT_MAX_TOKENS = 200
DEFAULT_BURST = 8
BURST_MAX_TOKENS = 64
CHECK_NAMES = ("models", "chat", "determinism", "stream", "burst", "health", "log")
# The stream check asks for at least this many tokens (ignore_eos where the server takes it), so
# that a server that streams makes them over many reads of the client.
STREAM_MIN_TOKENS = 128
# A burst stream stalled when one gap between its arrivals exceeds
#   max(STALL_FACTOR x the burst's median gap, STALL_FLOOR_S)     (docs/smoke.md: why these)
STALL_FACTOR = 25
STALL_FLOOR_S = 2.0
STALL_MIN_GAPS = 10           # fewer gaps than this in the whole burst: no median to judge by
LOOP_TICK_S = 0.01

# Log lines that mean trouble. A Python traceback is taken as one block (through its final
# exception line), so an allow-list entry can excuse a whole known-harmless traceback.
PROBLEM_LINE = re.compile(
    r"Traceback \(most recent call last\)"
    r"|\bERROR\b|\bCRITICAL\b|\bFATAL\b"
    r"|^\s*(?:\[[^\]]*\]\s*)?[\w.]*(?:Error|Exception): "
    r"|CUDA error|NCCL error|out of memory|Segmentation fault|core dumped")

# Known-harmless problems: (pattern searched in the problem's text, why it is harmless).
DEFAULT_LOG_ALLOW = (
    (r"Can not initialize OpenAIServingResponses[\s\S]*No module named 'openai_harmony'",
     "SGLang without openai_harmony: only the /v1/responses endpoint is missing"),
)


@dataclass
class Check:
    name: str
    status: str = "fail"          # pass | fail | skipped
    seconds: float = 0.0
    detail: str = ""


@dataclass
class SmokeResult:
    base_url: str
    model: str | None = None
    checks: list[Check] = field(default_factory=list)
    rejected_fields: list[str] = field(default_factory=list)
    burst_gaps: dict = field(default_factory=dict)       # GapReport.to_dict() of the burst
    accept_length: dict = field(default_factory=dict)    # accept_phases(...)

    @property
    def ok(self) -> bool:
        return all(check.status != "fail" for check in self.checks)

    def to_dict(self) -> dict:
        return {"base_url": self.base_url, "model": self.model, "ok": self.ok,
                "rejected_fields": self.rejected_fields, "burst_gaps": self.burst_gaps,
                "accept_length": self.accept_length,
                "checks": [asdict(check) for check in self.checks]}


class CheckFailed(Exception):
    pass


def burst_size(dyn_threshold: int | str | None) -> int:
    """Enough concurrent requests to cross the dyn-disable threshold both ways."""
    return 2 * dyn_threshold + 2 if isinstance(dyn_threshold, int) and dyn_threshold else DEFAULT_BURST


# --- log scan ---------------------------------------------------------------------------------
@dataclass
class LogProblem:
    line_number: int      # 1-based, in the text scanned
    text: str             # the problem line, or a traceback block through its exception line

    def summary(self) -> str:
        lines = self.text.strip().splitlines()
        if len(lines) > 1:
            return f"line {self.line_number}: {lines[0].strip()[:120]} ... {lines[-1].strip()[:160]}"
        return f"line {self.line_number}: {lines[0].strip()[:200] if lines else ''}"


# A log too long to read whole (the host reads its last 4 MiB) comes as the problem blocks of its
# earlier lines, found on the host with PROBLEM_LINE, then its end; each part after a line
# "[toolkit] log lines A-B ..." that gives the log's own line numbers (excerpted_log).
EXCERPT_FIRST = "[toolkit] this log has "
EXCERPT_HEAD = re.compile(r"^\[toolkit\] log lines (\d+)-(\d+)\b")
EXCERPT_OMITTED = re.compile(r"^\[toolkit\] \d+ more problem block\(s\)")


def excerpted_log(scan: dict, tail: str) -> str:
    """The text of a log that the host scanned (server_ctl's `scan` answer) for scan_log and people."""
    rows = [f"{EXCERPT_FIRST}{scan['lines']} lines; of lines 1-{scan['tail_line'] - 1}, before its "
            f"last 4 MiB, only the blocks that the smoke's log check flags are shown"]
    for first, text in scan["blocks"]:
        last = first + len(text.splitlines()) - 1
        rows += [f"[toolkit] log lines {first}-{last}:", text]
    if scan.get("omitted"):
        rows.append(f"[toolkit] {scan['omitted']} more problem block(s) before line {scan['tail_line']} "
                    f"not shown (over 1 MiB of them)")
    rows.append(f"[toolkit] log lines {scan['tail_line']}-{scan['lines']} (the end of the log):")
    rows.append(tail)
    return "\n".join(rows)


def _line_numbers(lines: list[str]) -> list[int | None]:
    """Each line's number in the log (None for excerpted_log's own lines)."""
    if not lines or not lines[0].startswith(EXCERPT_FIRST):
        return list(range(1, len(lines) + 1))
    numbers: list[int | None] = []
    number = 0
    for line in lines:
        head = EXCERPT_HEAD.match(line)
        if head or line.startswith("[toolkit] "):
            number = int(head.group(1)) - 1 if head else number
            numbers.append(None)
        else:
            number += 1
            numbers.append(number)
    return numbers


def _traceback_end(lines: list[str], start: int) -> int:
    """Index of the last line of the traceback starting at `start` (its exception line)."""
    i = start + 1
    while i < len(lines):
        line = lines[i]
        if EXCERPT_HEAD.match(line):   # an excerpt cut short
            return i - 1
        if not line.strip() or line[:1].isspace():
            i += 1
            continue
        if line.startswith(("During handling of the above exception",
                            "The above exception was the direct cause")) or \
                "Traceback (most recent call last)" in line:
            i += 1
            continue
        return i
    return len(lines) - 1


def scan_log(text: str, allow=DEFAULT_LOG_ALLOW) -> tuple[list[LogProblem], list[str]]:
    """Problems in a server log and the reasons of the allowed ones that were skipped."""
    lines = text.splitlines()
    numbers = _line_numbers(lines)
    allow_patterns = [(re.compile(pattern), why) for pattern, why in allow]
    problems: list[LogProblem] = []
    excused: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if numbers[i] is None:   # excerpted_log's own line
            if EXCERPT_OMITTED.match(line):
                problems.append(LogProblem(max(filter(None, numbers[:i]), default=1), line))
            i += 1
            continue
        if not PROBLEM_LINE.search(line):
            i += 1
            continue
        end = _traceback_end(lines, i) if "Traceback (most recent call last)" in line else i
        # The line before a traceback often says what it was about ("... error: Traceback").
        context_start = i - 1 if end > i and i > 0 else i
        block = "\n".join(lines[context_start:end + 1])
        reason = next((why for pattern, why in allow_patterns if pattern.search(block)), None)
        if reason:
            excused.append(reason)
        else:
            problems.append(LogProblem(numbers[i], "\n".join(lines[i:end + 1])))
        i = end + 1
    return problems, excused


# --- time as the client saw it ---------------------------------------------------------------
class LoopWatch:
    """The longest time this event loop could not run while inside the block (a ticker's
    lateness): a gap in a stream no longer than that may be this machine's, not the server's."""

    def __init__(self, tick: float = LOOP_TICK_S):
        self.tick = tick
        self.longest = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.tick)
            self.longest = max(self.longest, loop.time() - before - self.tick)

    async def __aenter__(self) -> "LoopWatch":
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@dataclass
class GapReport:
    """The burst's streams' gaps between arrivals: the longest, where, and the median (the
    server's step as the streams show it: one arrival per step at steady state)."""
    gaps: int = 0
    longest_s: float | None = None
    median_s: float | None = None
    stream: int | None = None          # which request (0-based) had the longest gap
    arrival: int | None = None         # ... before its arrival number (1-based)
    arrivals: int | None = None        # ... of that many
    at_s: float | None = None          # ... ending this long after the burst started
    client_stall_s: float = 0.0        # the longest this machine kept the client from running

    @property
    def bound_s(self) -> float | None:
        return None if self.median_s is None else max(STALL_FACTOR * self.median_s, STALL_FLOOR_S)

    @property
    def judged(self) -> bool:
        """Enough gaps for a median, and the client ran often enough to see a stall as one."""
        return (self.gaps >= STALL_MIN_GAPS and self.longest_s is not None
                and self.client_stall_s < self.longest_s / 2)

    @property
    def stalled(self) -> bool:
        return self.judged and self.longest_s > self.bound_s

    def describe(self) -> str:
        if self.longest_s is None or self.median_s is None:
            return "no gaps between arrivals to judge a stall by"
        text = (f"longest gap {self.longest_s * 1000:.0f} ms (request {self.stream}, before arrival "
                f"{self.arrival} of {self.arrivals}, {self.at_s:.2f} s into the burst), median step "
                f"{self.median_s * 1000:.1f} ms over {self.gaps} gaps")
        bound = (f"bound max({STALL_FACTOR} x median, {STALL_FLOOR_S:.0f} s) = {self.bound_s:.2f} s")
        if self.gaps < STALL_MIN_GAPS:
            return f"{text}; too few gaps to judge a stall (fewer than {STALL_MIN_GAPS})"
        if not self.judged:
            return (f"{text}; not judged: this machine kept the client from running for "
                    f"{self.client_stall_s * 1000:.0f} ms during the burst")
        return f"{text}; {'over the' if self.stalled else 'within the'} {bound}"

    def to_dict(self) -> dict:
        return {**asdict(self), "bound_s": self.bound_s, "judged": self.judged, "stalled": self.stalled}


def burst_gaps(records: list[RequestRecord], started: float, client_stall_s: float = 0.0) -> GapReport:
    """The gaps of the burst's streams (`started`: time.perf_counter() when it was sent)."""
    report = GapReport(client_stall_s=client_stall_s)
    pooled = []
    for number, record in enumerate(records):
        for index, gap in enumerate(record.itl):
            pooled.append(gap)
            if report.longest_s is None or gap > report.longest_s:
                report.longest_s, report.stream = gap, number
                report.arrival, report.arrivals = index + 2, len(record.arrivals)
                report.at_s = record.start + record.arrivals[index + 1] - started
    report.gaps = len(pooled)
    report.median_s = statistics.median(pooled) if pooled else None
    return report


# --- accept length ----------------------------------------------------------------------------
def _dyn(state: dict) -> dict:
    dyn = state.get("dyn_spec_disable")
    return dyn if isinstance(dyn, dict) else {}


def accept_phases(before: tuple[float | None, str], after: tuple[float | None, str], state_before: dict,
                  state_after: dict, simulated: str | bool | None = None) -> dict:
    """The accept length before the burst and after its resume, with what the dyn-disable
    counters say about the crossings (SGLang /server_info: internal_states[0])."""
    dyn_before, dyn_after = _dyn(state_before), _dyn(state_after)
    off_before = dyn_before.get("switches_off")
    crossings = (dyn_after.get("switches_off", 0) - off_before
                 if isinstance(off_before, int) and isinstance(dyn_after.get("switches_off"), int) else None)
    resumes = (dyn_after.get("switches_on", 0) - dyn_before.get("switches_on", 0)
               if isinstance(dyn_before.get("switches_on"), int) and isinstance(dyn_after.get("switches_on"), int)
               else None)
    return {"before": before[0], "after_resume": after[0],
            "why_not": before[1] or after[1] or None,
            "source": "SGLang /generate meta_info (one request alone)" if before[0] or after[0] else None,
            "earlier_crossings": off_before, "burst_crossings": crossings, "burst_resumes": resumes,
            "server_cumulative": state_after.get("avg_spec_accept_length"),
            "simulated": simulated}


def describe_accept(phases: dict) -> str:
    """'accept length 2.61 before the first crossing, 2.58 after the burst's resume ...' or n/a."""
    def value(v):
        return "n/a" if v is None else f"{v:.2f}"

    if phases.get("before") is None and phases.get("after_resume") is None:
        return f"accept length n/a ({phases.get('why_not') or 'not reported'})"
    earlier = phases.get("earlier_crossings")
    when = ("before the first crossing" if earlier == 0 else
            f"before the burst (after {earlier} earlier crossing(s))" if earlier else "before the burst")
    text = f"accept length {value(phases.get('before'))} {when}, {value(phases.get('after_resume'))} after"
    crossings, resumes = phases.get("burst_crossings"), phases.get("burst_resumes")
    if crossings is None:
        text += " the burst"
    elif crossings == 0:
        text += " the burst (which did not cross the threshold)"
    else:
        text += f" the burst's resume (drafting stopped {crossings}x, resumed {resumes}x)"
    if isinstance(phases.get("simulated"), str):
        text += f"; simulated: SGLANG_SIMULATE_ACC_LEN={phases['simulated']}"
    return text


# --- the checks -------------------------------------------------------------------------------
def _usage_problem(record: RequestRecord, max_tokens: int) -> str:
    p, c, t = record.prompt_tokens, record.completion_tokens, record.total_tokens
    if p is None or c is None or t is None:
        return f"usage incomplete: prompt={p} completion={c} total={t}"
    if p <= 0 or c <= 0:
        return f"usage not positive: prompt={p} completion={c}"
    if p + c != t:
        return f"usage inconsistent: prompt {p} + completion {c} != total {t}"
    if c > max_tokens:
        return f"completion_tokens {c} > max_tokens {max_tokens}"
    return ""


def _answer_of(record: RequestRecord) -> str:
    return record.text or record.reasoning


async def _chat_check(client: OpenAIClient, *, stream: bool, max_tokens: int,
                      extra: dict | None = None) -> tuple[RequestRecord, str]:
    record = await client.chat([{"role": "user", "content": FIBONACCI_PROMPT}],
                               max_tokens=max_tokens, temperature=0.0, stream=stream, extra=extra)
    if not record.ok:
        raise CheckFailed(record.error or "request failed")
    if not _answer_of(record).strip():
        raise CheckFailed(f"empty answer (finish_reason={record.finish_reason})")
    problem = _usage_problem(record, max_tokens)
    if problem:
        raise CheckFailed(problem)
    kind = "content" if record.text.strip() else "reasoning only"
    detail = (f"{record.completion_tokens} tokens ({kind}), prompt {record.prompt_tokens}, "
              f"finish {record.finish_reason}")
    return record, detail


def _first_difference(a: str, b: str) -> int | None:
    """Index of the first character where a and b differ (the shorter length if one is a
    prefix of the other), or None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _determinism_detail(first: str, second: str, third: str) -> str:
    """The determinism verdict on three temperature-0 answers to one request, sent one after
    another: the chat check's (`first`) and two more.

    The second and third are computed alike: the prompt is in the server's prefix cache for
    both, nothing else runs. They must be identical; a server that changes outputs (a broken
    sampler, a patch that alters the arithmetic between steps) fails here. The first answer's
    prefill ran before the prompt was cached. For later requests SGLang recomputes only the last
    prompt token over the cached prefix, with another kernel and summation order, which with
    near-tied logits (random-weight test models, long answers) can part the first answer from the
    others at some token (inferred from the GPU runs in docs/evidence/dyn-disable-7: the repeats
    matched, the first parted; not isolated with the cache off): reported, not failed. SGLang
    documents --enable-deterministic-inference as making such answers identical (not tried here).
    """
    split = _first_difference(second, third)
    if split is not None:
        raise CheckFailed(
            f"the same request twice in a row (prompt cached both times) gave different text at "
            f"temperature 0, from character {split} on: {second[split:split + 40]!r} vs "
            f"{third[split:split + 40]!r}")
    cold = _first_difference(first, second)
    if cold is None:
        return f"same {len(first)} characters three times"
    return (f"same {len(second)} characters twice; the first answer, computed before the prompt "
            f"was in the prefix cache, parts from them at character {cold} "
            f"({first[cold:cold + 20]!r} vs {second[cold:cold + 20]!r}): the cached prefill's "
            f"arithmetic differs (not a failure; SGLang documents --enable-deterministic-inference "
            f"as making them match)")


# -- judging: pure functions of what a check saw (tests/client/test_smoke_judges.py) ---------

def judge_stream(record: RequestRecord, detail: str, loop_longest_s: float) -> str:
    """A streamed answer: content must arrive in pieces, unless this machine itself kept the
    client from reading for at least half of the hold (then it is not judged)."""
    ttft = "-" if record.ttft is None else f"{record.ttft * 1000:.0f}"
    shape = f"first content at {ttft} ms; {record.stream_shape()}"
    done = "[DONE] seen" if record.saw_done else "no [DONE] (tolerated)"
    if record.held_back:
        held_for = record.hold_evidence()[0]
        if loop_longest_s < held_for / 2:
            raise CheckFailed(f"not streamed: {shape}")
        return (f"{shape}; not judged: this machine kept the client from reading for "
                f"{loop_longest_s * 1000:.0f} ms of it, {done}; {detail}")
    return f"{shape}, {done}; {detail}"


def judge_burst_records(records: list[RequestRecord]) -> None:
    """Every burst request completed and reported its usage."""
    failed = [r for r in records if not r.ok]
    no_usage = [r for r in records if r.ok and r.completion_tokens is None]
    if failed:
        raise CheckFailed(f"{len(failed)}/{len(records)} failed; first: {failed[0].error}")
    if no_usage:
        raise CheckFailed(f"{len(no_usage)}/{len(records)} streams carried no usage")


def judge_burst(records: list[RequestRecord], elapsed: float, gaps: GapReport, accept: dict) -> str:
    tokens = sum(r.completion_tokens for r in records)
    text = (f"{len(records)} concurrent streams ok, {tokens} tokens in {elapsed:.2f} s; {gaps.describe()}; "
            f"{describe_accept(accept)}")
    if gaps.stalled:
        raise CheckFailed(f"stalled: {text}")
    return text


def judge_log(text: str, allow=DEFAULT_LOG_ALLOW) -> str:
    problems, excused = scan_log(text, allow)
    if problems:
        shown = "; ".join(p.summary() for p in problems[:3])
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckFailed(f"{len(problems)} problem(s): {shown}{more}")
    note = f", {len(excused)} known-harmless skipped" if excused else ""
    numbers = [n for n in _line_numbers(text.splitlines()) if n is not None]
    return f"{numbers[-1] if numbers else 0} lines clean{note}"


# -- doing: one method per check, each asks the server and hands what it saw to a judge ----

class _Checks:
    def __init__(self, client: OpenAIClient, result: SmokeResult, *, read_log, burst: int, burst_max_tokens: int,
                 chat_max_tokens: int, log_allow, simulated_accept_length):
        self.client, self.result, self.read_log = client, result, read_log
        self.burst, self.burst_max_tokens, self.chat_max_tokens = burst, burst_max_tokens, chat_max_tokens
        self.log_allow, self.simulated_accept_length = log_allow, simulated_accept_length
        self.first_answer: str | None = None      # the chat check's, for the determinism check

    async def models(self) -> str:
        names = await self.client.list_models()
        self.client.model = self.client.model or names[0]
        return f"{len(names)} model(s); using {self.client.model}"

    async def chat(self) -> str:
        record, detail = await _chat_check(self.client, stream=False, max_tokens=self.chat_max_tokens)
        self.first_answer = _answer_of(record)
        return f"{detail}, {record.latency:.2f} s"

    async def determinism(self) -> str:
        if self.first_answer is None:
            raise CheckFailed("the chat check gave no answer to compare with")
        again = []
        for _ in range(2):
            record, _ = await _chat_check(self.client, stream=False, max_tokens=self.chat_max_tokens)
            again.append(_answer_of(record))
        return _determinism_detail(self.first_answer, *again)

    async def stream(self) -> str:
        async with LoopWatch() as watch:
            record, detail = await _chat_check(self.client, stream=True,
                                               max_tokens=max(self.chat_max_tokens, STREAM_MIN_TOKENS),
                                               extra={"ignore_eos": True})
        return judge_stream(record, detail, watch.longest)

    async def burst_check(self) -> str:
        client = self.client
        before = await client.accept_length_probe(FIBONACCI_PROMPT)
        state_before = await client.server_state()
        messages = [[{"role": "user", "content": f"{FIBONACCI_PROMPT} (variant {i})"}] for i in range(self.burst)]
        async with LoopWatch() as watch:
            started = time.perf_counter()
            records = await asyncio.gather(*(
                client.chat(m, max_tokens=self.burst_max_tokens, temperature=0.0, stream=True,
                            extra={"ignore_eos": True}) for m in messages))
            elapsed = time.perf_counter() - started
        judge_burst_records(records)
        gaps = burst_gaps(records, started, watch.longest)
        self.result.burst_gaps = gaps.to_dict()
        state_after = await client.server_state()
        after = await client.accept_length_probe(FIBONACCI_PROMPT)
        self.result.accept_length = accept_phases(before, after, state_before, state_after,
                                                  self.simulated_accept_length)
        return judge_burst(records, elapsed, gaps, self.result.accept_length)

    async def health(self) -> str:
        problem = await self.client.healthy()
        if problem:
            raise CheckFailed(problem)
        return "answers"

    async def log(self) -> str:
        if self.read_log is None:
            raise _Skip("no log reader for this server")
        return judge_log(await asyncio.to_thread(self.read_log), self.log_allow)

    def step(self, name: str):
        return self.burst_check if name == "burst" else getattr(self, name)


async def run_smoke_async(base_url: str, *, read_log: Callable[[], str] | None = None,
                          burst: int = DEFAULT_BURST, burst_max_tokens: int = BURST_MAX_TOKENS,
                          chat_max_tokens: int = CHAT_MAX_TOKENS,
                          request_timeout: float = 300.0, log_allow=DEFAULT_LOG_ALLOW,
                          on_check: Callable[[str], None | Awaitable[None]] | None = None,
                          model: str | None = None,
                          simulated_accept_length: str | bool | None = None) -> SmokeResult:
    """`simulated_accept_length`: SGLANG_SIMULATE_ACC_LEN as the server runs with it (False: not
    set, None: unknown), reported beside the accept length."""
    result = SmokeResult(base_url=base_url)
    async with OpenAIClient(base_url, model=model, timeout=request_timeout,
                            max_connections=max(burst, 8)) as client:
        checks = _Checks(client, result, read_log=read_log, burst=burst, burst_max_tokens=burst_max_tokens,
                         chat_max_tokens=chat_max_tokens, log_allow=log_allow,
                         simulated_accept_length=simulated_accept_length)
        for name in CHECK_NAMES:
            if on_check is not None:
                maybe = on_check(name)
                if asyncio.iscoroutine(maybe):
                    await maybe
            result.checks.append(await _run_check(name, checks.step(name)))
        result.model = client.model
        result.rejected_fields = sorted(client.rejected_fields)
    return result


async def _run_check(name: str, step) -> Check:
    check = Check(name)
    started = time.perf_counter()
    try:
        check.detail = await step()
        check.status = "pass"
    except _Skip as exc:
        check.status, check.detail = "skipped", str(exc)
    except (CheckFailed, ClientError) as exc:
        check.detail = str(exc)
    except Exception as exc:   # a smoke test reports, it does not crash
        check.detail = f"{type(exc).__name__}: {exc}"
    check.seconds = time.perf_counter() - started
    return check


class _Skip(Exception):
    pass


def run_smoke(base_url: str, **kwargs) -> SmokeResult:
    return asyncio.run(run_smoke_async(base_url, **kwargs))

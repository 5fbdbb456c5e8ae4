"""An async OpenAI-compatible chat client (aiohttp) that times every piece of a stream as it arrives.

Smoke and bench share it. It measures what `sglang.bench_serving` and `vllm bench serve`
measure (time to first token, the gaps in the stream, end-to-end latency) and takes token
counts from the server's `usage`, never from a guess.

What a streaming user sees is what arrives from the network, so the clock is read once per
network read (`StreamReader.iter_any`), not once per parsed line: server-sent events that come
in one read (the server wrote them together, or they queued in the socket) are shown at the
same moment and count as one **arrival**. Each request keeps the arrival times of the reads
that brought content, the characters each brought, and the number of content events
(`chunks`; one event may carry several tokens, e.g. with speculative decoding). ITL is the gap
between consecutive arrivals; a stream whose content comes in one or two arrivals is visible
as such (`stream_shape`), and called "held back" only when the server demonstrably took long
enough over that content for it to have come in many arrivals (`held_back`).

Tolerant of the servers it meets:
- a stream that ends without `data: [DONE]` (transformers serve) is complete when the
  connection closes after a `finish_reason`;
- a server that rejects fields outside the OpenAI API (`ignore_eos`, `top_k`: HTTP 422) gets
  the request again without them, and the client remembers not to send them again;
- a keep-alive connection the server closed while idle: the request goes out again once on a
  new connection.
"""
from __future__ import annotations

import asyncio
import errno
import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

# Fields some servers (SGLang, vLLM) take but the OpenAI API does not define.
NON_OPENAI_FIELDS = ("ignore_eos", "top_k", "min_tokens", "repetition_penalty")
CONNECT_TIMEOUT = 10.0
ACCEPT_PROBE_TOKENS = 128      # the accept-length probe's answer (one request alone on the server)
# A stream whose largest single arrival carries at least this share of its text, for an answer
# of at least HELD_BACK_MIN_TOKENS tokens, reached the user in one piece, not as a stream.
HELD_BACK_SHARE = 0.9
HELD_BACK_MIN_TOKENS = 8
# ... and it was held back when the server worked at least this long on that piece before sending
# it. A server that streams writes within a few ms of making a token (transformers serve's loop
# takes the GIL back within Python's 5 ms switch interval), so a quarter second of silence followed
# by most of the answer is the server's doing; a fast server that makes a whole answer within one
# read of the client is not holding anything back, and is reported as too fast to tell.
HELD_BACK_MIN_SILENCE = 0.25


class ClientError(RuntimeError):
    """A request that could not be completed; the message says why (HTTP status, body, cause)."""


class TransportError(Exception):
    """The connection failed (refused, reset, closed mid-body); the message names the cause."""


@dataclass
class RequestRecord:
    """One request's outcome and timings (seconds; `start` is time.perf_counter())."""
    ok: bool = False
    error: str | None = None
    status_code: int | None = None
    start: float = 0.0
    ttft: float | None = None             # first arrival with content (or reasoning), since start
    first_event: float | None = None      # first event with `choices`, even a role-only one
    headers_at: float | None = None       # the response's headers arrived
    latency: float | None = None          # end-to-end: start to the end of the body
    arrivals: list[float] = field(default_factory=list)    # each network read that brought content
    arrival_chars: list[int] = field(default_factory=list)  # characters of content each brought
    # the server's own `created` stamps of the content events each arrival brought: (first, last)
    arrival_created: list[tuple[float, float] | None] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    finish_reason: str | None = None
    saw_done: bool = False
    chunks: int = 0                       # server-sent events that carried content
    dropped_fields: list[str] = field(default_factory=list)

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive arrivals of content (an arrival may hold several events,
        an event several tokens)."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    @property
    def span(self) -> float:
        """First to last arrival of content (0 for one arrival)."""
        return self.arrivals[-1] - self.arrivals[0] if self.arrivals else 0.0

    @property
    def largest_arrival_share(self) -> float | None:
        total = sum(self.arrival_chars)
        return max(self.arrival_chars) / total if total else None

    @property
    def one_piece(self) -> bool:
        """The answer (long enough to stream) reached the client in one piece, or the first
        token and then (almost) everything else at once."""
        share = self.largest_arrival_share
        return (self.ok and (self.completion_tokens or 0) >= HELD_BACK_MIN_TOKENS
                and share is not None and share >= HELD_BACK_SHARE)

    def _largest(self) -> int:
        return max(range(len(self.arrival_chars)), key=self.arrival_chars.__getitem__)

    @property
    def silence_before_largest(self) -> float | None:
        """Seconds between the last thing the client received before the largest arrival (the
        headers, an event without content, the arrival before) and that arrival: how long the
        server was silent while it made that content (a short prompt's prefill included)."""
        if not self.arrivals:
            return None
        index = self._largest()
        at = self.arrivals[index]
        before = [t for t in (self.headers_at, self.first_event) if t is not None and t < at]
        if index > 0:
            before.append(self.arrivals[index - 1])
        return at - max(before, default=0.0)

    @property
    def server_production(self) -> tuple[float, bool] | None:
        """What the server's own `created` stamps say about how long it worked on the largest
        arrival's content (counted from the stamp of the arrival before it, if any), and whether
        that is exact: it is where the stamps have sub-second parts; where they are whole seconds
        (OpenAI's format) a span of s seconds proves at least s - 1. None where they say nothing
        (no stamps, or one stamp for the whole request, as SGLang sends)."""
        if not self.arrivals or len(self.arrival_created) != len(self.arrivals):
            return None
        index = self._largest()
        stamps = self.arrival_created[index]
        if stamps is None:
            return None
        earlier = [pair[1] for pair in self.arrival_created[:index] if pair is not None]
        start = earlier[-1] if earlier else stamps[0]
        span = stamps[1] - start
        if span <= 0:
            return None
        if all(float(t).is_integer() for t in (start, *stamps)):
            return max(0.0, span - 1.0), False
        return span, True

    def hold_evidence(self) -> tuple[float, str] | None:
        """(seconds the server provably worked on the largest arrival's content, from what):
        its own event stamps where they are exact or prove more than the client saw, else the
        client's silence before that arrival."""
        silence = self.silence_before_largest
        server = self.server_production
        if server is not None and (server[1] or server[0] > (silence or 0.0)):
            return server[0], "per the server's event times"
        return (silence, "of silence before it") if silence is not None else None

    @property
    def held_back(self) -> bool:
        """In one piece although the server worked long enough on it to have streamed it."""
        if not self.one_piece:
            return False
        evidence = self.hold_evidence()
        return evidence is not None and evidence[0] >= HELD_BACK_MIN_SILENCE

    @property
    def replacement_chars(self) -> int:
        """U+FFFD in the answer: bytes the server could not decode as UTF-8. SGLang's
        detokenizer holds text back while it ends in one, so a held-back stream full of them
        was held back for that reason (random-weight models emit such byte tokens)."""
        return self.text.count("\ufffd")

    def stream_shape(self) -> str:
        """'T tokens in N content events, A arrivals over S ms' (+ what an answer in one piece
        means: held back, saying whether invalid UTF-8 can explain it, or too fast to tell)."""
        tokens = "?" if self.completion_tokens is None else str(self.completion_tokens)
        text = (f"{tokens} tokens in {self.chunks} content event(s), {len(self.arrivals)} arrival(s) "
                f"over {self.span * 1000:.1f} ms")
        if not self.one_piece:
            return text
        seconds, source = self.hold_evidence() or (0.0, "")
        share = f"{self.largest_arrival_share:.0%} of the text came in one arrival"
        if not self.held_back:
            return (f"{text}; {share}, made within {seconds * 1000:.0f} ms (under "
                    f"{HELD_BACK_MIN_SILENCE * 1000:.0f} ms: too fast to tell a stream from an answer "
                    f"sent whole; ask for a longer answer to tell)")
        text += (f"; {share} after {seconds * 1000:.0f} ms {source}: "
                 f"the stream was held back and reached the client in one piece")
        if self.replacement_chars:
            text += (f" ({self.replacement_chars} of {len(self.text)} characters are U+FFFD: "
                     f"output that is not valid UTF-8, which the server holds back)")
        else:
            text += " (the text is valid UTF-8, so not the server's hold-back of partial characters)"
        return text

    def to_dict(self) -> dict:
        data = asdict(self)
        data["itl"] = self.itl
        return data


def spec_accept_length(meta_info: dict | None) -> float | None:
    """One request's accept length (tokens per verify step, the bonus token included) from
    SGLang's native `meta_info`: `spec_accept_length`, else completion_tokens / spec_verify_ct;
    None where the request was not speculated (no verify steps, or a server without them)."""
    if not isinstance(meta_info, dict):
        return None
    value = meta_info.get("spec_accept_length")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    verify, tokens = meta_info.get("spec_verify_ct"), meta_info.get("completion_tokens")
    if isinstance(verify, int) and isinstance(tokens, int) and verify > 0:
        return tokens / verify
    return None


def _usage_into(record: RequestRecord, usage: dict | None) -> None:
    if not usage:
        return
    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
    record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
    record.total_tokens = usage.get("total_tokens", record.total_tokens)


def _rejected_fields(record: RequestRecord, sent: list[str]) -> list[str]:
    """The non-OpenAI fields a 400/422 answer rejects: those its body names; for a 422 that
    names none, all that were sent (a validation error caused by anything else would have
    happened without them too, so dropping them costs one retry at most)."""
    if not sent or record.status_code not in (400, 422):
        return []
    body = record.error or ""
    named = [name for name in sent if re.search(rf"\b{re.escape(name)}\b", body)]
    if named:
        return named
    return list(sent) if record.status_code == 422 else []


def _stale_connection(exc: BaseException) -> bool:
    """A send on a kept-alive connection the server had closed: its close, or the reset it
    answers our bytes with (a connect error is not this: nothing was ever kept alive there)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    if not isinstance(exc, aiohttp.ClientOSError) or isinstance(exc, aiohttp.ClientConnectorError):
        return False
    # aiohttp's "Can not write request body" onto a transport the server had just closed carries
    # no errno; its cause, a ConnectionResetError, says what happened (a CI run hit it once in ~30)
    return exc.errno in (errno.ECONNRESET, errno.EPIPE) or isinstance(
        exc.__cause__, (ConnectionResetError, BrokenPipeError))


def _describe(exc: BaseException) -> str:
    text = str(exc) or ("no connection in time" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__)
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


class _Events:
    """Server-sent events from the bytes of one body, fed one network read at a time."""

    def __init__(self):
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        """The `data:` payloads completed by `data` (comments, `event:` lines and blank
        separators are skipped)."""
        self._buffer += data
        lines = self._buffer.split(b"\n")
        self._buffer = lines.pop()
        return [payload for line in lines if (payload := _data_of(line)) is not None]

    def close(self) -> list[str]:
        """A last line without its newline (a server that ends the body right after it)."""
        rest, self._buffer = self._buffer, b""
        payload = _data_of(rest)
        return [] if payload is None else [payload]


def _data_of(line: bytes) -> str | None:
    line = line.rstrip(b"\r")
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip().decode("utf-8", "replace")


def base_url_of(url: str) -> str:
    """The server's base URL (`http://127.0.0.1:30000`) from what a user typed, `/v1` and a
    trailing slash taken off; ValueError when it is not an http(s) URL with a host."""
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not re.match(r"https?://[^/]+", base):
        raise ValueError(f"not an http(s) base URL: {url!r} (e.g. http://127.0.0.1:8000)")
    return base


class OpenAIClient:
    """Chat completions against one base URL (`http://127.0.0.1:30000`, without `/v1`).

    Use as an async context manager (the aiohttp session lives in the running event loop).
    `max_connections` bounds the connection pool; the bench sets it to the concurrency level
    so the client never queues requests itself.
    """

    def __init__(self, base_url: str, *, model: str | None = None, timeout: float = 600.0,
                 max_connections: int = 256, api_key: str | None = None):
        self.base_url = base_url_of(base_url)
        self.model = model
        self.timeout = timeout            # a whole request, first byte sent to last byte read
        self.max_connections = max_connections
        self.rejected_fields: set[str] = set()
        # identity: a compressed stream would reach the client in compressed blocks, not as it was sent
        self._headers = {"User-Agent": "toolkit-bench", "Accept-Encoding": "identity"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "OpenAIClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0,
                                             ttl_dns_cache=None)
            # No total timeout here: `chat` bounds the whole request itself.
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT))
        return self._session

    async def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        async def go():
            async with self._http().get(self.base_url + path) as response:
                return response.status, await response.read()
        try:
            return await asyncio.wait_for(go(), timeout)
        except asyncio.TimeoutError:
            raise TransportError(f"ReadTimeout: no answer in {timeout:.0f} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise TransportError(_describe(exc)) from None

    # --- plain endpoints -------------------------------------------------------------------
    async def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        try:
            status, body = await self._get(path, timeout or self.timeout)
        except TransportError as exc:
            raise ClientError(f"GET {path}: {exc}") from None
        text = body.decode("utf-8", "replace")
        if status != 200:
            raise ClientError(f"GET {path}: HTTP {status}: {text[:300]}")
        try:
            return json.loads(text)
        except ValueError:
            raise ClientError(f"GET {path}: not JSON: {text[:200]!r}") from None

    async def get_text(self, path: str, *, timeout: float | None = None) -> str | None:
        """The body of GET `path` as text; None on HTTP 404 (the server has no such endpoint)."""
        try:
            status, body = await self._get(path, timeout or self.timeout)
        except TransportError as exc:
            raise ClientError(f"GET {path}: {exc}") from None
        text = body.decode("utf-8", "replace")
        if status == 404:
            return None
        if status != 200:
            raise ClientError(f"GET {path}: HTTP {status}: {text[:300]}")
        return text

    async def list_models(self) -> list[str]:
        data = await self.get_json("/v1/models")
        models = [m.get("id") for m in (data.get("data") or []) if isinstance(m, dict) and m.get("id")]
        if not models:
            raise ClientError(f"/v1/models lists no model: {json.dumps(data)[:300]}")
        return models

    async def resolve_model(self) -> str:
        if not self.model:
            self.model = (await self.list_models())[0]
        return self.model

    async def healthy(self, *, timeout: float = 10.0) -> str:
        """'' when the server answers /health (or /v1/models where /health is missing), else why not."""
        for path in ("/health", "/v1/models"):
            try:
                status, _ = await self._get(path, timeout)
            except TransportError as exc:
                return f"GET {path}: {exc}"
            if status == 200:
                return ""
            if status != 404:
                return f"GET {path}: HTTP {status}"
        return "neither /health nor /v1/models answers"

    async def _first_json(self, paths: tuple[str, ...]) -> dict | None:
        for path in paths:
            try:
                info = await self.get_json(path, timeout=30.0)
            except ClientError:
                continue
            return info if isinstance(info, dict) else None
        return None

    async def server_info(self) -> dict | None:
        """SGLang's `/server_info` (server args, scheduler info, `internal_states`, version) as
        it answers; None where the server has none (transformers serve, vLLM)."""
        info = await self._first_json(("/server_info", "/get_server_info"))
        if info and isinstance(info.get("decode"), list) and info["decode"]:
            info = info["decode"][0]     # a PD-disaggregated router: the decode side runs the steps
        return info

    async def model_info(self) -> dict | None:
        """SGLang's `/model_info` (model_path, model_type, architectures); None where absent."""
        return await self._first_json(("/model_info", "/get_model_info"))

    async def server_state(self) -> dict:
        """What the server says about its running state, where it says it (SGLang's
        /server_info): version, avg_spec_accept_length (cumulative since start), the
        dyn_spec_disable counters. `unreachable` holds why when the server does not answer."""
        problem = await self.healthy()
        if problem:
            return {"unreachable": problem}
        info = await self.server_info()
        if not info:
            return {}
        state = {"version": info.get("version")}
        states = info.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], dict):
            state["avg_spec_accept_length"] = states[0].get("avg_spec_accept_length")
            state["dyn_spec_disable"] = states[0].get("dyn_spec_disable")
        return {k: v for k, v in state.items() if v is not None}

    async def native_generate(self, text: str, *, max_new_tokens: int, timeout: float | None = None) -> dict | None:
        """SGLang's native `POST /generate` at temperature 0 with `ignore_eos` (its answer: `text`,
        `meta_info`, which holds the per-request speculative counters); None where the server has
        no such endpoint (HTTP 404/405: transformers serve, vLLM). ClientError when it fails."""
        body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                             "ignore_eos": True}}).encode()

        async def go():
            async with self._http().post(self.base_url + "/generate", data=body,
                                         headers={"Content-Type": "application/json"}) as response:
                return response.status, await response.read()
        try:
            status, raw = await asyncio.wait_for(go(), timeout or self.timeout)
        except asyncio.TimeoutError:
            raise ClientError(f"POST /generate: no answer in {timeout or self.timeout:.0f} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ClientError(f"POST /generate: {_describe(exc)}") from None
        if status in (404, 405):
            return None
        text_body = raw.decode("utf-8", "replace")
        if status != 200:
            raise ClientError(f"POST /generate: HTTP {status}: {text_body[:300]}")
        try:
            data = json.loads(text_body)
        except ValueError:
            raise ClientError(f"POST /generate: not JSON: {text_body[:200]!r}") from None
        return data if isinstance(data, dict) else None

    async def accept_length_probe(self, text: str, max_new_tokens: int = ACCEPT_PROBE_TOKENS) -> tuple[float | None, str]:
        """The accept length of one request sent alone through SGLang's native /generate (its
        meta_info), or None and why not: no such endpoint, no speculation, or the error."""
        try:
            answer = await self.native_generate(text, max_new_tokens=max_new_tokens)
        except ClientError as exc:
            return None, str(exc)
        if answer is None:
            return None, "the server has no native /generate"
        value = spec_accept_length(answer.get("meta_info"))
        return value, "" if value is not None else "the server reports no speculative verify steps"

    # --- chat ------------------------------------------------------------------------------
    def _payload(self, messages: list[dict], *, max_tokens: int, temperature: float, stream: bool,
                 extra: dict | None) -> tuple[dict, list[str]]:
        payload: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                   "temperature": temperature, "stream": stream}
        if stream:
            payload["stream_options"] = {"include_usage": True}
        sent_extra = []
        for key, value in (extra or {}).items():
            if key in self.rejected_fields:
                continue
            payload[key] = value
            if key in NON_OPENAI_FIELDS:
                sent_extra.append(key)
        return payload, sent_extra

    async def chat(self, messages: list[dict], *, max_tokens: int = 200, temperature: float = 0.0,
                   stream: bool = True, extra: dict | None = None) -> RequestRecord:
        """Send one chat completion; never raises for request failures (see `record.ok/error`)."""
        if self.model is None:
            try:
                await self.resolve_model()
            except ClientError as exc:
                return RequestRecord(ok=False, error=str(exc), start=time.perf_counter())
        dropped: list[str] = []
        while True:
            payload, sent_extra = self._payload(messages, max_tokens=max_tokens, temperature=temperature,
                                                stream=stream, extra=extra)
            record = RequestRecord(start=time.perf_counter())
            record.dropped_fields = dropped
            body = json.dumps(payload).encode()
            try:
                await asyncio.wait_for(self._post(body, record, stream), self.timeout)
            except asyncio.TimeoutError:
                record.ok = False
                record.error = f"timed out after {self.timeout:.0f} s ({record.chunks} chunk(s) received)"
            rejected = _rejected_fields(record, sent_extra)
            if rejected:
                self.rejected_fields.update(rejected)
                dropped = dropped + rejected
                continue
            return record

    async def _post(self, body: bytes, record: RequestRecord, stream: bool) -> None:
        url = self.base_url + "/v1/chat/completions"
        for attempt in (1, 2):
            try:
                async with self._http().post(url, data=body,
                                             headers={"Content-Type": "application/json"}) as response:
                    record.status_code = response.status
                    record.headers_at = time.perf_counter() - record.start
                    if response.status != 200:
                        text = (await response.read()).decode("utf-8", "replace")
                        record.error = f"HTTP {response.status}: {text[:500]}"
                        return
                    await (self._read_stream(response, record) if stream else self._read_plain(response, record))
                    return
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                if record.status_code is None and attempt == 1 and _stale_connection(exc):
                    # The server closed a kept-alive connection as we sent on it (we see the
                    # close, or the reset it answers our bytes with): once more, fresh.
                    record.start = time.perf_counter()
                    continue
                record.error = self._broken(record, exc)
                return

    @staticmethod
    def _broken(record: RequestRecord, exc: BaseException) -> str:
        if record.status_code is None:
            return f"POST /v1/chat/completions: {_describe(exc)}"
        return f"stream broke after {record.chunks} chunk(s): {_describe(exc)}"

    async def _read_plain(self, response: aiohttp.ClientResponse, record: RequestRecord) -> None:
        text = (await response.read()).decode("utf-8", "replace")
        record.latency = time.perf_counter() - record.start
        try:
            data = json.loads(text)
            choice = data["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            record.error = f"unexpected response: {text[:300]!r}"
            return
        message = choice.get("message") or {}
        record.text = message.get("content") or ""
        record.reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        record.finish_reason = choice.get("finish_reason")
        record.ttft = record.latency
        record.arrivals = [record.latency]
        record.arrival_chars = [len(record.text) + len(record.reasoning)]
        record.chunks = 1
        _usage_into(record, data.get("usage"))
        record.ok = True

    async def _read_stream(self, response: aiohttp.ClientResponse, record: RequestRecord) -> None:
        text_parts: list[str] = []
        reasoning_parts: list[str] = []
        events = _Events()
        problem: list[str] = []

        def take(payloads: list[str], now: float) -> bool:
            """Handle the events of one read; False to stop reading (an error)."""
            chars = 0
            stamps: list[float] = []
            for data in payloads:
                if data == "[DONE]":
                    record.saw_done = True     # read on to the end, so the connection stays usable
                    continue
                if record.saw_done:
                    continue
                try:
                    chunk = json.loads(data)
                except ValueError:
                    problem.append(f"bad stream chunk: {data[:200]!r}")
                    return False
                if not isinstance(chunk, dict):
                    problem.append(f"bad stream chunk: {data[:200]!r}")
                    return False
                if chunk.get("error"):
                    problem.append(f"server error in stream: {json.dumps(chunk['error'])[:300]}")
                    return False
                _usage_into(record, chunk.get("usage"))
                if chunk.get("choices") and record.first_event is None:
                    record.first_event = now
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    content = delta.get("content") or ""
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    if content or reasoning:
                        created = chunk.get("created")
                        if isinstance(created, (int, float)) and not isinstance(created, bool):
                            stamps.append(float(created))
                        record.chunks += 1
                        chars += len(content) + len(reasoning)
                        text_parts.append(content)
                        reasoning_parts.append(reasoning)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
            if chars:
                if record.ttft is None:
                    record.ttft = now
                record.arrivals.append(now)
                record.arrival_chars.append(chars)
                record.arrival_created.append((min(stamps), max(stamps)) if stamps else None)
            return True

        try:
            async for data in response.content.iter_any():
                now = time.perf_counter() - record.start
                if not take(events.feed(data), now):
                    break
            else:
                take(events.close(), time.perf_counter() - record.start)
        finally:
            record.text = "".join(text_parts)
            record.reasoning = "".join(reasoning_parts)
        if problem:
            record.error = problem[0]
            return
        record.latency = time.perf_counter() - record.start
        if record.chunks == 0 and record.finish_reason is None:
            record.error = "stream ended without any content"
            return
        # (A finished stream without content is a complete, empty answer: e.g. EOS at once, or
        # tokens that decode to nothing. It counts its tokens but has no TTFT.)
        if record.finish_reason is None and not record.saw_done:
            # The body ended cleanly but nothing said the answer was complete.
            record.error = f"stream ended after {record.chunks} chunk(s) without finish_reason or [DONE]"
            return
        record.ok = True

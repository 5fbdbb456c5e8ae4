"""An async OpenAI-compatible chat client that times every streamed chunk.

Smoke and bench share it. It measures what `sglang.bench_serving` and `vllm bench serve`
measure (time to first token, the gap between content chunks, end-to-end latency) and takes
token counts from the server's `usage`, never from a guess.

Tolerant of the servers it meets:
- a stream that ends without `data: [DONE]` (transformers serve) is complete when the
  connection closes after at least one chunk;
- a server that rejects fields outside the OpenAI API (`ignore_eos`, `top_k`: HTTP 422) gets
  the request again without them, and the client remembers not to send them again.

HTTP is a small HTTP/1.1 keep-alive pool on asyncio streams (`_Pool`), not httpx: httpx's
connection pool costs milliseconds of CPU per request at 64 connections, which capped a
benchmark at ~200-350 requests/s on two cores where `vllm bench serve` (aiohttp) drives
~1200 (benchmarks/bench_client_vs_vllm.py). A benchmark client must never be the bottleneck.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

# Fields some servers (SGLang, vLLM) take but the OpenAI API does not define.
NON_OPENAI_FIELDS = ("ignore_eos", "top_k", "min_tokens", "repetition_penalty")


class ClientError(RuntimeError):
    """A request that could not be completed; the message says why (HTTP status, body, cause)."""


@dataclass
class RequestRecord:
    """One request's outcome and timings (seconds; `start` is time.perf_counter())."""
    ok: bool = False
    error: str | None = None
    status_code: int | None = None
    start: float = 0.0
    ttft: float | None = None             # first chunk with content (or reasoning) after start
    first_event: float | None = None      # first chunk with `choices`, even a role-only one
                                          # (what `vllm bench serve` 0.32 takes as TTFT)
    latency: float | None = None          # end-to-end: start to the last byte
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk, since start
    text: str = ""
    reasoning: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    finish_reason: str | None = None
    saw_done: bool = False
    chunks: int = 0                       # content chunks
    dropped_fields: list[str] = field(default_factory=list)

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive content chunks (a chunk may carry several tokens)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["itl"] = self.itl
        return data


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

class TransportError(Exception):
    """The connection failed (refused, reset, closed mid-body); the message names the cause."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.reused = False

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


class _Response:
    """Status and headers of one answer; the body is read through `chunks()` or `lines()`."""

    def __init__(self, pool: "_Pool", connection: _Connection, status: int, reason: str, headers: dict):
        self._pool, self._connection = pool, connection
        self.status, self.reason, self.headers = status, reason, headers
        self._complete = False

    async def chunks(self) -> AsyncIterator[bytes]:
        reader = self._connection.reader
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                while True:
                    size_line = await reader.readline()
                    if not size_line:
                        raise TransportError("server closed the connection mid-body")
                    size = int(size_line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                            pass   # trailers
                        break
                    data = await reader.readexactly(size)
                    await reader.readexactly(2)
                    yield data
            elif "content-length" in self.headers:
                remaining = int(self.headers["content-length"])
                while remaining > 0:
                    data = await reader.read(min(65536, remaining))
                    if not data:
                        raise TransportError("server closed the connection mid-body")
                    remaining -= len(data)
                    yield data
            else:   # framed by the end of the connection
                self.headers["connection"] = "close"
                while data := await reader.read(65536):
                    yield data
        except asyncio.IncompleteReadError:
            raise TransportError("server closed the connection mid-body") from None
        except (ConnectionError, OSError) as exc:
            raise TransportError(_describe(exc)) from None
        self._complete = True

    async def lines(self) -> AsyncIterator[str]:
        buffer = b""
        async for piece in self.chunks():
            buffer += piece
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if buffer:
            yield buffer.decode("utf-8", "replace")

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    def finish(self) -> None:
        keep = self._complete and self.headers.get("connection", "").lower() != "close"
        self._pool.release(self._connection, keep)


class _Pool:
    """HTTP/1.1 keep-alive connections to one origin, at most `limit` at a time."""

    def __init__(self, base_url: str, limit: int, headers: dict[str, str], connect_timeout: float = 10.0):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        host_header = self.host if parts.port is None else f"{self.host}:{self.port}"
        self.headers = {"Host": host_header, "User-Agent": "toolkit-bench", **headers}
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(limit)

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=2 ** 20), self.connect_timeout)
        except asyncio.TimeoutError:
            raise TransportError(f"ConnectTimeout: no connection to {self.host}:{self.port} "
                                 f"in {self.connect_timeout:.0f} s") from None
        except OSError as exc:
            raise TransportError(f"ConnectError: cannot connect to {self.host}:{self.port}: {exc}") from None
        return _Connection(reader, writer)

    def release(self, connection: _Connection, keep: bool) -> None:
        if keep:
            connection.reused = True
            self._idle.append(connection)
        else:
            connection.close()
        self._slots.release()

    async def _exchange(self, connection: _Connection, head: bytes, body: bytes) -> tuple[int, str, dict]:
        connection.writer.write(head + body)
        await connection.writer.drain()
        status_line = await connection.reader.readline()
        if not status_line:
            raise ConnectionResetError("connection closed before an answer")
        version, _, rest = status_line.decode("latin-1").strip().partition(" ")
        code, _, reason = rest.partition(" ")
        headers: dict[str, str] = {}
        while True:
            line = await connection.reader.readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise ConnectionResetError("connection closed in the headers")
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        if version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers["connection"] = "close"
        return int(code), reason, headers

    @contextlib.asynccontextmanager
    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str = "application/json") -> AsyncIterator[_Response]:
        head_lines = [f"{method} {self.prefix}{path} HTTP/1.1"]
        head_lines += [f"{k}: {v}" for k, v in self.headers.items()]
        if body or method == "POST":
            head_lines += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
        head = ("\r\n".join(head_lines) + "\r\n\r\n").encode("latin-1")
        await self._slots.acquire()
        response = None
        try:
            while True:
                connection = self._idle.pop() if self._idle else await self._connect()
                try:
                    status, reason, headers = await self._exchange(connection, head, body)
                    break
                except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
                    connection.close()
                    if connection.reused:
                        continue   # the server closed an idle keep-alive connection: take another
                    raise TransportError(_describe(exc)) from None
            response = _Response(self, connection, status, reason, headers)
        except BaseException:
            self._slots.release()
            raise
        try:
            yield response
        finally:
            response.finish()

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


class OpenAIClient:
    """Chat completions against one base URL (`http://127.0.0.1:30000`, without `/v1`).

    Use as an async context manager. `max_connections` bounds the connection pool; the bench
    sets it to the concurrency level so the client never queues requests itself.
    """

    def __init__(self, base_url: str, *, model: str | None = None, timeout: float = 600.0,
                 max_connections: int = 256, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.timeout = timeout            # a whole request, first byte sent to last byte read
        self.rejected_fields: set[str] = set()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._pool = _Pool(self.base_url, max_connections, headers)

    async def __aenter__(self) -> "OpenAIClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._pool.close()

    async def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        async def go():
            async with self._pool.request("GET", path) as response:
                return response.status, await response.read()
        try:
            return await asyncio.wait_for(go(), timeout)
        except asyncio.TimeoutError:
            raise TransportError(f"ReadTimeout: no answer in {timeout:.0f} s") from None

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

    async def server_state(self) -> dict:
        """What the server says about itself, where it says it (SGLang's /server_info):
        version, avg_spec_accept_length (cumulative since start), dyn_spec_disable counters.
        `unreachable` holds why when the server does not answer at all."""
        problem = await self.healthy()
        if problem:
            return {"unreachable": problem}
        for path in ("/server_info", "/get_server_info"):
            try:
                info = await self.get_json(path, timeout=30.0)
            except ClientError:
                continue
            if not isinstance(info, dict):
                return {}
            if info.get("decode"):
                info = info["decode"][0]
            state = {"version": info.get("version")}
            states = info.get("internal_states")
            if isinstance(states, list) and states and isinstance(states[0], dict):
                state["avg_spec_accept_length"] = states[0].get("avg_spec_accept_length")
                state["dyn_spec_disable"] = states[0].get("dyn_spec_disable")
            return {k: v for k, v in state.items() if v is not None}
        return {}

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
                await asyncio.wait_for(self._stream(body, record) if stream else self._plain(body, record),
                                       self.timeout)
            except asyncio.TimeoutError:
                record.ok = False
                record.error = f"timed out after {self.timeout:.0f} s ({record.chunks} chunk(s) received)"
            rejected = _rejected_fields(record, sent_extra)
            if rejected:
                self.rejected_fields.update(rejected)
                dropped = dropped + rejected
                continue
            return record

    async def _plain(self, body: bytes, record: RequestRecord) -> None:
        try:
            async with self._pool.request("POST", "/v1/chat/completions", body) as response:
                record.status_code = response.status
                text = (await response.read()).decode("utf-8", "replace")
        except TransportError as exc:
            record.error = f"POST /v1/chat/completions: {exc}"
            return
        record.latency = time.perf_counter() - record.start
        if record.status_code != 200:
            record.error = f"HTTP {record.status_code}: {text[:500]}"
            return
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
        record.chunk_times = [record.latency]
        record.chunks = 1
        _usage_into(record, data.get("usage"))
        record.ok = True

    async def _stream(self, body: bytes, record: RequestRecord) -> None:
        text_parts: list[str] = []
        reasoning_parts: list[str] = []
        try:
            async with self._pool.request("POST", "/v1/chat/completions", body) as response:
                record.status_code = response.status
                if response.status != 200:
                    text = (await response.read()).decode("utf-8", "replace")
                    record.error = f"HTTP {response.status}: {text[:500]}"
                    return
                async for line in response.lines():
                    if not line.startswith("data:"):
                        continue   # blank separators, comments (": keep-alive"), event: lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        # Read on to the end of the body, so the connection can be kept alive.
                        record.saw_done = True
                        continue
                    if record.saw_done:
                        continue
                    now = time.perf_counter() - record.start
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        record.error = f"bad stream chunk: {data[:200]!r}"
                        return
                    if isinstance(chunk, dict) and chunk.get("error"):
                        record.error = f"server error in stream: {json.dumps(chunk['error'])[:300]}"
                        return
                    _usage_into(record, chunk.get("usage"))
                    if chunk.get("choices") and record.first_event is None:
                        record.first_event = now
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        content = delta.get("content") or ""
                        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                        if content or reasoning:
                            if record.ttft is None:
                                record.ttft = now
                            record.chunk_times.append(now)
                            record.chunks += 1
                            text_parts.append(content)
                            reasoning_parts.append(reasoning)
                        if choice.get("finish_reason"):
                            record.finish_reason = choice["finish_reason"]
        except TransportError as exc:
            if record.status_code is None:
                record.error = f"POST /v1/chat/completions: {exc}"
            else:
                record.error = f"stream broke after {record.chunks} chunk(s): {exc}"
            return
        finally:
            record.text = "".join(text_parts)
            record.reasoning = "".join(reasoning_parts)
        record.latency = time.perf_counter() - record.start
        if record.chunks == 0 and record.finish_reason is None:
            record.error = "stream ended without any content"
            return
        # (A finished stream without content is a complete, empty answer: e.g. EOS at once, or
        # tokens that decode to nothing. It counts its tokens but has no TTFT.)
        if record.finish_reason is None and not record.saw_done:
            # The connection closed on its own but nothing said the answer was complete.
            record.error = f"stream ended after {record.chunks} chunk(s) without finish_reason or [DONE]"
            return
        record.ok = True


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text

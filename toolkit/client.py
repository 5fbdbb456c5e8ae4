"""An async OpenAI-compatible chat client that times every streamed chunk.

Smoke and bench share it. It measures what `sglang.bench_serving` and `vllm bench serve`
measure (time to first token, the gap between content chunks, end-to-end latency) and takes
token counts from the server's `usage`, never from a guess.

Tolerant of the servers it meets:
- a stream that ends without `data: [DONE]` (transformers serve) is complete when the
  connection closes after at least one chunk;
- a server that rejects fields outside the OpenAI API (`ignore_eos`, `top_k`: HTTP 422) gets
  the request again without them, and the client remembers not to send them again.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

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
        self.rejected_fields: set[str] = set()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=10.0),
                                       limits=limits, headers=headers)

    async def __aenter__(self) -> "OpenAIClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- plain endpoints -------------------------------------------------------------------
    async def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        try:
            response = await self._http.get(path, timeout=timeout) if timeout else await self._http.get(path)
        except httpx.HTTPError as exc:
            raise ClientError(f"GET {path}: {_describe(exc)}") from exc
        if response.status_code != 200:
            raise ClientError(f"GET {path}: HTTP {response.status_code}: {response.text[:300]}")
        try:
            return response.json()
        except ValueError as exc:
            raise ClientError(f"GET {path}: not JSON: {response.text[:200]!r}") from exc

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
                response = await self._http.get(path, timeout=timeout)
            except httpx.HTTPError as exc:
                return f"GET {path}: {_describe(exc)}"
            if response.status_code == 200:
                return ""
            if response.status_code != 404:
                return f"GET {path}: HTTP {response.status_code}"
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
            if stream:
                await self._stream(payload, record)
            else:
                await self._plain(payload, record)
            rejected = _rejected_fields(record, sent_extra)
            if rejected:
                self.rejected_fields.update(rejected)
                dropped = dropped + rejected
                continue
            return record

    async def _plain(self, payload: dict, record: RequestRecord) -> None:
        try:
            response = await self._http.post("/v1/chat/completions", json=payload)
        except httpx.HTTPError as exc:
            record.error = f"POST /v1/chat/completions: {_describe(exc)}"
            return
        record.latency = time.perf_counter() - record.start
        record.status_code = response.status_code
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {response.text[:500]}"
            return
        try:
            data = response.json()
            choice = data["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            record.error = f"unexpected response: {response.text[:300]!r}"
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

    async def _stream(self, payload: dict, record: RequestRecord) -> None:
        text_parts: list[str] = []
        reasoning_parts: list[str] = []
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=payload) as response:
                record.status_code = response.status_code
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")
                    record.error = f"HTTP {response.status_code}: {body[:500]}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue   # blank separators, comments (": keep-alive"), event: lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        record.saw_done = True
                        break
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
        except httpx.HTTPError as exc:
            record.error = f"stream broke after {record.chunks} chunk(s): {_describe(exc)}"
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

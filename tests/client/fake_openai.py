"""A small OpenAI-compatible chat server on loopback (asyncio, standard library only).

It stands in where the real CPU server cannot show a behaviour on demand: streams cut in the
middle, no usage, HTTP errors, a strict request schema, slow answers, streams written in groups
or held back until the end, SGLang's /server_info and /model_info; and it is fast enough to
measure how many requests per second a client can drive (benchmarks/bench_client_vs_vllm.py).

    server = FakeOpenAI(mode=...); server.start(); ... server.base_url ...; server.stop()
    python tests/client/fake_openai.py PORT [--chunks N] [--delay S] [--group N] [--mode M]
        [--tokens-per-chunk N]                          (standalone, its own process, for the benchmarks)

`metrics` / `server_info`: a callable giving the current /metrics text / /server_info answer
(a server_info dict is served as it is), for numbers that move as requests come in.

`answer`: a callable(n) giving the words of the n-th non-streamed answer (0, 1, ...), e.g. a
first answer that differs from the later ones, as SGLang's prefix cache can make it.

Stream timing: `delay` seconds before each write; `group` events per write (several events in
one write reach the client in one read, as transformers serve sends them under load);
`tokens_per_chunk` tokens in each event's content (as speculative decoding sends them). Every
event carries `created` as the time it was made: whole seconds as OpenAI, SGLang and
transformers serve send it, or with `stamps="float"` the exact time, `stamps=None` none.
`stall_s` / `stall_at`: once, when `stall_at` streams are in flight, every stream stops for
`stall_s` seconds before its next event (what the first crossing of the dyn-disable threshold
did on the GPU); later bursts do not stall.

`server_info` (a dict, or a callable giving one per request) answers SGLang's /server_info;
`native` (a callable(n) giving the n-th answer's extra `meta_info`, e.g. `spec_verify_ct` and
`spec_accept_length`) makes SGLang's native POST /generate answer; None: 404 like a server
without them.

Modes (per server, or per request with the user message "mode:NAME"):
  ok            `chunks` content chunks, a finish chunk with usage, then `data: [DONE]`
  no-done       like ok, without `data: [DONE]` (transformers serve does this)
  no-usage      like ok, without usage
  break         two chunks, then the connection is closed mid-stream
  truncated     the chunks, then a clean end of the body: no finish_reason, no usage, no [DONE]
  error500      HTTP 500
  strict        HTTP 422 when the request has fields outside the OpenAI API (like transformers serve)
  held          the first event, then the others made one every `delay` but all written in one
                piece at the end: a stream held back, as the speculative SGLang servers' arrived
  buffered      every event made one every `delay`, all written in one piece at the end
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

OPENAI_FIELDS = {"model", "messages", "max_tokens", "temperature", "stream", "stream_options", "top_p",
                 "n", "stop", "seed", "presence_penalty", "frequency_penalty", "user", "logprobs",
                 "max_completion_tokens"}


class FakeOpenAI:
    def __init__(self, *, mode: str = "ok", chunks: int = 8, delay: float = 0.0, host: str = "127.0.0.1",
                 port: int = 0, strict: bool = False, close_idle: bool = False, group: int = 1,
                 tokens_per_chunk: int = 1, server_info: dict | None = None, model_info: dict | None = None,
                 prompt_tokens=None, answer=None, stamps: str | None = "int", stall_s: float = 0.0,
                 stall_at: int = 2, native=None, metrics=None):
        self.mode, self.chunks, self.delay, self.strict = mode, chunks, delay, strict
        self.group, self.tokens_per_chunk = max(1, group), max(1, tokens_per_chunk)
        self.server_info, self.model_info = server_info, model_info   # None: 404 like a non-SGLang server
        self.metrics = metrics     # callable() -> Prometheus text (tests/client/sglang_metrics.py); None: 404
        self.prompt_tokens = prompt_tokens      # callable(text) -> count; default: words in the last message
        self.answer = answer                    # callable(n) -> the words of the n-th non-streamed answer
        self.answers_sent = 0
        self.stamps = stamps
        self.stall_s, self.stall_at = stall_s, stall_at
        self.stall_until: float | None = None
        self.native = native                    # callable(n) -> extra meta_info of the n-th /generate
        self.native_requests: list[dict] = []
        self.close_idle = close_idle          # close every connection after one answer, unannounced
        self.connections = 0
        self.host, self.port = host, port
        self.requests: list[dict] = []          # bodies of the chat requests received
        self.in_flight = 0
        self.max_in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._loop is not None

    # --- lifecycle (a thread with its own event loop) --------------------------------------------
    def start(self) -> "FakeOpenAI":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._loop is None:
            return

        async def close():
            self._server.close()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        loop, self._loop = self._loop, None
        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # --- HTTP ------------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                method, path, _ = request_line.decode().split(" ", 2)
                headers = {}
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b"\n", b""):
                        break
                    key, _, value = line.decode().partition(":")
                    headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0) or 0))
                keep = await self._route(method, path.split("?")[0], body, writer)
                if not keep or self.close_idle:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError, ValueError):
            return
        finally:
            try:
                writer.close()
            except Exception:
                pass

    @staticmethod
    def _send(writer, status: str, payload: dict) -> None:
        data = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
                     .encode() + data)

    async def _route(self, method: str, path: str, body: bytes, writer) -> bool:
        if method == "GET" and path == "/health":
            self._send(writer, "200 OK", {"status": "ok"})
        elif method == "GET" and path == "/v1/models":
            self._send(writer, "200 OK", {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        elif method == "GET" and path in ("/server_info", "/get_server_info") and self.server_info is not None:
            self._send(writer, "200 OK", self.server_info() if callable(self.server_info) else self.server_info)
        elif method == "GET" and path == "/metrics" and self.metrics is not None:
            data = self.metrics().encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
                         + f"content-length: {len(data)}\r\n\r\n".encode() + data)
        elif method == "GET" and path in ("/model_info", "/get_model_info") and self.model_info is not None:
            self._send(writer, "200 OK", self.model_info)
        elif method == "POST" and path == "/v1/chat/completions":
            return await self._chat(json.loads(body or b"{}"), writer)
        elif method == "POST" and path == "/generate" and self.native is not None:
            self._generate(json.loads(body or b"{}"), writer)
        else:
            self._send(writer, "404 Not Found", {"detail": "Not Found"})
        await writer.drain()
        return True

    def _generate(self, request: dict, writer) -> None:
        """SGLang's native /generate, non-streamed: text and meta_info."""
        self.native_requests.append(request)
        tokens = int((request.get("sampling_params") or {}).get("max_new_tokens") or 16)
        prompt = max(1, len(str(request.get("text", "")).split()))
        extra = self.native(len(self.native_requests) - 1) or {}
        self._send(writer, "200 OK", {"text": "tok " * tokens, "meta_info": {
            "id": "x", "finish_reason": {"type": "length", "length": tokens}, "prompt_tokens": prompt,
            "completion_tokens": tokens, "cached_tokens": 0, "e2e_latency": 0.1, **extra}})

    async def _stall(self) -> None:
        if self.stall_s and self.stall_until is None and self.in_flight >= self.stall_at:
            self.stall_until = time.monotonic() + self.stall_s
        if self.stall_until is not None and self.stall_until > time.monotonic():
            await asyncio.sleep(self.stall_until - time.monotonic())

    def _created(self):
        return {"int": int(time.time()), "float": time.time()}.get(self.stamps)

    async def _chat(self, request: dict, writer) -> bool:
        self.requests.append(request)
        mode = self.mode
        text = str(request.get("messages", [{}])[-1].get("content", ""))
        if text.startswith("mode:"):
            mode = text[5:].split()[0]
        unknown = set(request) - OPENAI_FIELDS
        if (self.strict or mode == "strict") and unknown:
            self._send(writer, "422 Unprocessable Entity", {"detail": f"Unexpected fields in the request: {unknown}"})
            await writer.drain()
            return True
        if mode == "error500":
            self._send(writer, "500 Internal Server Error", {"error": "boom"})
            await writer.drain()
            return True
        chunks = min(self.chunks, int(request.get("max_tokens") or self.chunks))
        tokens = chunks * self.tokens_per_chunk
        prompt_tokens = self.prompt_tokens(text) if self.prompt_tokens else max(1, len(text.split()))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if not request.get("stream"):
                if self.delay:
                    await asyncio.sleep(self.delay * chunks)
                content = "tok " * tokens
                if self.answer is not None:
                    content = " ".join(self.answer(self.answers_sent).split()[:tokens])
                    self.answers_sent += 1
                self._send(writer, "200 OK", {
                    "id": "x", "object": "chat.completion", "choices": [{
                        "index": 0, "message": {"role": "assistant", "content": content},
                        "finish_reason": "length"}],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                              "total_tokens": prompt_tokens + tokens}})
                await writer.drain()
                return True
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

            pending: list[bytes] = []      # events of the current write (one send for the group)

            def event(payload) -> None:
                data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
                pending.append(f"{len(data):x}\r\n".encode() + data + b"\r\n")

            async def flush() -> None:
                writer.write(b"".join(pending))
                pending.clear()
                await writer.drain()

            one_piece = mode in ("held", "buffered")
            for i in range(chunks):
                if i > 0:
                    await self._stall()
                # a write goes out before the first event and every `group` events; held and
                # buffered streams make every event `delay` apart but write them together
                if self.delay and (one_piece or i % self.group == 0):
                    await asyncio.sleep(self.delay)
                event({"id": "x", "object": "chat.completion.chunk", "created": self._created(),
                       "choices": [{"index": 0, "delta": {"content": "tok " * self.tokens_per_chunk}}]})
                if one_piece:
                    ends_write = i == chunks - 1 or (i == 0 and mode == "held")
                else:
                    ends_write = i == chunks - 1 or (i + 1) % self.group == 0
                if ends_write:
                    await flush()
                if mode == "break" and i == 1:
                    await flush()
                    writer.transport.abort()
                    return False
            if mode == "truncated":
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return True
            event({"id": "x", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            if mode != "no-usage":   # as OpenAI and SGLang send it: a last chunk with no choices
                event({"id": "x", "object": "chat.completion.chunk", "choices": [],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                                 "total_tokens": prompt_tokens + tokens}})
            if mode not in ("no-done",):
                event("[DONE]")
            pending.append(b"0\r\n\r\n")
            await flush()
            return True
        finally:
            self.in_flight -= 1


def main(argv: list[str]) -> int:
    def option(name, kind, default):
        return kind(argv[argv.index(name) + 1]) if name in argv else default

    port = int(argv[0]) if argv else 0
    server = FakeOpenAI(port=port, chunks=option("--chunks", int, 8), delay=option("--delay", float, 0.0),
                        group=option("--group", int, 1), mode=option("--mode", str, "ok"),
                        tokens_per_chunk=option("--tokens-per-chunk", int, 1)).start()
    print(f"fake OpenAI server on {server.base_url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

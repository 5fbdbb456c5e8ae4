"""`invoke server watch`: what each host's server is doing now, one `HostView` per poll.

A `HostWatch` keeps, per host, one SSH connection for the server's status (profile, patch stack,
whether its process and each TP rank's scheduler process live: one round trip per poll) and one
forward to the server (`server.endpoint`, the tunnel smoke and bench use), through which it reads
`/health`, SGLang's Prometheus `/metrics` (`toolkit.server.scrape`) and `/server_info` (the dyn-disable
switch where the server exports no metrics, and the mean acceptance length since start). A
failure at any point gives a view that says `down` or `unreachable` and why; the next poll
connects again. Nothing here prints.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field

from toolkit.server import scrape, server
from toolkit.check.client import ClientError, OpenAIClient
from toolkit.core.inventory import Host

HTTP_TIMEOUT = 5.0


@dataclass
class HostView:
    host: str
    t: float                                   # unix time of the poll
    state: str                                 # up | down | no server | unreachable
    problem: str = ""
    profile: str | None = None
    patch_stack: list[str] = field(default_factory=list)
    uptime_s: float | None = None
    running: float | None = None
    queued: float | None = None
    gen_throughput: float | None = None        # SGLang's own gauge (token/s over its log interval)
    token_usage: float | None = None           # KV cache in use (0..1)
    accept_length: float | None = None         # over SGLang's last log interval, else since start
    dyn: dict | None = None                    # scrape.dyn_state() shape, with "source"
    ranks: dict[str, str] | None = None        # "0": "ok" | "gone"; None where the server is not SGLang
    source: str | None = None                  # "metrics" | "server_info" | None: where the numbers came from
    snapshot: scrape.Snapshot | None = None    # the raw /metrics reading (for --record)

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("snapshot")
        return data


def rank_health(state: server.ServerState) -> dict[str, str] | None:
    """Each TP rank's scheduler process: ok or gone. None for a server that is not SGLang and
    shows no scheduler processes (transformers serve, stand-ins)."""
    ranks = state.ranks or {}
    if not ranks and state.kind != "sglang":
        return None
    expected = max(state.tp_size or 1, len(ranks))
    return {str(r): "ok" if str(r) in ranks else "gone" for r in range(expected)}


async def read_server(base_url: str) -> dict:
    """Health, /metrics and /server_info of one server; `problem` says why when it does not answer."""
    async with OpenAIClient(base_url, timeout=HTTP_TIMEOUT, max_connections=2) as client:
        problem = await client.healthy(timeout=HTTP_TIMEOUT)
        if problem:
            return {"problem": problem}
        out: dict = {}
        try:
            out["snapshot"] = await scrape.read(client)
        except (ClientError, scrape.ScrapeError) as exc:
            out["metrics_problem"] = str(exc)
        out["server_info"] = await client.server_info()
        return out


def view_from(host: str, state: server.ServerState, answer: dict, now: float) -> HostView:
    view = HostView(host, now, "up", profile=state.profile, patch_stack=list(state.patch_stack),
                    uptime_s=state.uptime_s, ranks=rank_health(state))
    snapshot: scrape.Snapshot | None = answer.get("snapshot")
    info = answer.get("server_info")
    if snapshot is not None and snapshot.running is not None:
        view.source, view.snapshot = "metrics", snapshot
        view.running, view.queued = snapshot.running, snapshot.queued
        view.gen_throughput, view.token_usage = snapshot.gen_throughput, snapshot.token_usage
        view.accept_length = snapshot.accept_length
        dyn = snapshot.dyn_state()
        if dyn is not None:
            view.dyn = {**dyn, "source": "metrics"}
    elif answer.get("metrics_problem"):
        view.problem = f"/metrics: {answer['metrics_problem']}"
    if view.dyn is None:
        dyn = scrape.dyn_from_server_info(info)
        if dyn is not None:
            view.dyn = {**dyn, "source": "server_info"}
            view.source = view.source or "server_info"
    if isinstance(info, dict):
        states = info.get("internal_states")
        first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
        if view.accept_length is None or view.accept_length == 0:
            view.accept_length = first.get("avg_spec_accept_length", view.accept_length)
        if view.gen_throughput is None:
            view.gen_throughput = first.get("last_gen_throughput")
            view.source = view.source or "server_info"
    if view.ranks and any(v != "ok" for v in view.ranks.values()):
        view.problem = "; ".join(filter(None, [view.problem, "rank(s) gone: " + ", ".join(
            f"TP{r}" for r, v in view.ranks.items() if v != "ok")]))
    return view


class HostWatch:
    """Poll one host's server; `close()` ends its connections."""

    def __init__(self, host: Host):
        self.host = host
        self._transport = None
        self._endpoint: contextlib.ExitStack | None = None
        self._url: str | None = None
        self._served_pid: int | None = None
        self._speculating: bool | None = None    # drafting state seen at the last poll
        self._since: float | None = None         # when this watch saw it change

    def _drop_endpoint(self) -> None:
        if self._endpoint is not None:
            stack, self._endpoint, self._url = self._endpoint, None, None
            with contextlib.suppress(Exception):
                stack.close()

    def _drop_transport(self) -> None:
        if self._transport is not None:
            transport, self._transport = self._transport, None
            with contextlib.suppress(Exception):
                transport.close()

    def close(self) -> None:
        self._drop_endpoint()
        self._drop_transport()

    def poll(self) -> HostView:
        now = time.time()
        try:
            if self._transport is None:
                self._transport = self.host.connect()
            state = server.status(self.host, self._transport)
        except Exception as exc:   # SSH down, host gone: a row that says so, never a traceback
            self.close()
            return HostView(self.host.name, now, "unreachable", problem=str(exc) or type(exc).__name__)
        if state is None:
            self._drop_endpoint()
            return HostView(self.host.name, now, "no server", problem="no server recorded as started")
        if state.status == "dead":
            self._drop_endpoint()
            return HostView(self.host.name, now, "down", problem=f"{state.profile}: the server's processes are gone",
                            profile=state.profile, patch_stack=list(state.patch_stack), ranks=rank_health(state))
        try:
            if self._url is None or self._served_pid != state.pid:
                self._drop_endpoint()
                stack = contextlib.ExitStack()
                self._url = stack.enter_context(server.endpoint(self.host, state))
                self._endpoint, self._served_pid = stack, state.pid
            answer = asyncio.run(read_server(self._url))
        except Exception as exc:
            self._drop_endpoint()
            answer = {"problem": str(exc) or type(exc).__name__}
        if answer.get("problem"):
            self._drop_endpoint()
            view = HostView(self.host.name, now, "down", problem=answer["problem"], profile=state.profile,
                            patch_stack=list(state.patch_stack), uptime_s=state.uptime_s, ranks=rank_health(state))
            return view
        view = view_from(self.host.name, state, answer, now)
        self._note_since(view)
        return view

    def _note_since(self, view: HostView) -> None:
        """Without the server's own time of the last switch (no metrics), the poll at which this
        watch saw drafting change; None until it has seen a change."""
        dyn = view.dyn
        if dyn is None:
            return
        if self._speculating is not None and dyn.get("speculating") != self._speculating:
            self._since = view.t
        self._speculating = dyn.get("speculating")
        if dyn.get("since") is None and self._since is not None:
            dyn["since"], dyn["since_source"] = self._since, "watch"


def poll_once(hosts: list[Host]) -> list[HostView]:
    """One poll of every host (for --once), connections closed after."""
    from toolkit.core.parallel import for_each_host

    def one(host: Host) -> HostView:
        watch = HostWatch(host)
        try:
            return watch.poll()
        finally:
            watch.close()

    return [o.value if o.ok else HostView(o.host.name, time.time(), "unreachable", problem=str(o.error))
            for o in for_each_host(hosts, one)]

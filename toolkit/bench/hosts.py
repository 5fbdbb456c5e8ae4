"""Servers for a sweep on an inventory host: started and stopped per profile, or the one running.

`HostServers` and `RunningOnHost` are the `ServerControl`s of `runner.run_sweep` for a host (the
`--url` case needs no host: `runner.RunningServer`). `host_facts` is what a bench record says
about the machine and its stack, from the provisioning facts (one round trip).
"""
from __future__ import annotations

import contextlib
import json
import posixpath
import shlex
from typing import Callable, Iterator

from toolkit.server import profiles, server
from toolkit.core.inventory import Host
from toolkit.bench import serverconfig
from toolkit.bench.runner import BenchError, ServedProfile

FACT_PACKAGES = ["sglang", "sglang-kernel", "torch", "flashinfer-python", "transformers", "vllm"]
SIMULATE_ACC_LEN = "SGLANG_SIMULATE_ACC_LEN"


def server_facts(host: Host, state: server.ServerState, overrides: dict | None = None) -> dict:
    return {"host": host.name, "kind": state.kind, "served_model": state.model,
            "draft_model": state.draft_model,
            "simulated_accept_length": simulated_accept_length(host, state, overrides or state.overrides or None)}


def model_config(host: Host, model: str | None) -> dict | None:
    """The model's config.json on the host (None when it cannot be read: a hub id, no file)."""
    if not model:
        return None
    try:
        with host.connect() as transport:
            result = transport.run(f"cat {shlex.quote(posixpath.join(model, 'config.json'))}", timeout=60)
        return json.loads(result.stdout) if result.ok else None
    except Exception:   # a fact for the record, never a reason to fail the bench
        return None


def simulated_accept_length(host: Host, state: server.ServerState, overrides: dict | None = None) -> str | bool | None:
    """SGLANG_SIMULATE_ACC_LEN as the server runs with it: its value, False where it is not set,
    None where nobody can say. The server process's own environment on the host comes first (an
    env_file counts; only that one variable leaves the host), then the launch plan."""
    name = SIMULATE_ACC_LEN
    command = (f"f=/proc/{int(state.pid)}/environ; test -r $f || exit 3; "
               f"tr '\\0' '\\n' < $f | sed -n 's/^{name}=//p' | head -n 1")
    try:
        with host.connect() as transport:
            result = transport.run(command, timeout=30)
        if result.ok:
            return result.stdout.strip() or False
    except Exception:   # a fact for the report, never a reason to fail
        pass
    try:
        return server.plan(host, state.profile, overrides).env.get(name) or False
    except Exception:
        return None


def config_fallback(host: Host, state: server.ServerState, overrides: dict | None = None) -> tuple[dict, dict]:
    """What the launch plan and the host say about the server's configuration, and the source
    of each value (see serverconfig): the profile's flags, the TP size and dyn-disable settings
    the server was started with, the architecture from the model's config.json."""
    try:
        launch = server.plan(host, state.profile, overrides)
        argv = launch.argv
        hysteresis = launch.dyn_hysteresis
        if state.dyn_threshold == profiles.AUTO_THRESHOLD:
            hysteresis = None
        elif state.dyn_threshold is not None and launch.dyn_threshold != state.dyn_threshold:
            hysteresis = profiles.default_hysteresis(state.dyn_threshold)   # started with an override
    except Exception:   # a profile changed or removed since the start: keep what the state says
        argv, hysteresis = [], None
    fallback = serverconfig.from_launch(argv, tp_size=state.tp_size, dyn_threshold=state.dyn_threshold,
                                        dyn_hysteresis=hysteresis)
    sources = {}
    architecture = serverconfig.architecture_of(model_config(host, state.model))
    if architecture:
        fallback["architecture"] = architecture
        sources["architecture"] = "model_config"
    return fallback, sources


def served(host: Host, profile: str, url: str, state: server.ServerState,
           overrides: dict | None = None) -> ServedProfile:
    fallback, sources = config_fallback(host, state, overrides)
    return ServedProfile(profile, url, server_facts(host, state, overrides), fallback, sources)


class HostServers:
    """Start each profile's server on the host, reach it through `server.endpoint`, stop it after."""

    def __init__(self, host: Host, *, timeout: float, note: Callable[[str], None], overrides: dict | None = None):
        self.host = host
        self.timeout = timeout
        self.note = note
        self.overrides = dict(overrides or {})   # --model / --draft-model for every profile

    def gone(self, served: ServedProfile) -> str | None:
        return process_gone(self.host)

    @contextlib.contextmanager
    def serve(self, profile: str) -> Iterator[ServedProfile]:
        running = server.status(self.host)
        if running is not None and running.status != "dead":
            self.note(f"{self.host.name}: stopping the running {running.profile} server first")
            stopped = server.stop(self.host)
            if not stopped.stopped:
                raise BenchError(f"could not stop the running {running.profile} server: {stopped.reason}")
        self.note(f"{self.host.name}: starting {profile}")
        state = server.start(self.host, profile, timeout=self.timeout, overrides=self.overrides or None,
                             progress=self.note)
        try:
            with server.endpoint(self.host, state) as url:
                yield served(self.host, profile, url, state, self.overrides)
        finally:
            result = server.stop(self.host)
            if not result.stopped:
                self.note(f"{self.host.name}: WARNING: {profile} server not fully stopped: {result.reason}")


def process_gone(host: Host) -> str | None:
    """Why the host's recorded server process is gone, or None while it runs (or when the host
    cannot be asked: the health check decides then)."""
    try:
        state = server.status(host)
    except Exception:
        return None
    if state is None:
        return f"no server is recorded as running on {host.name}"
    if state.status == "dead":
        return f"its process (pid {state.pid}) on {host.name} is gone"
    return None


class RunningOnHost:
    """--no-restart: the host's running server, reached through the endpoint; never stopped."""

    def __init__(self, host: Host, state: server.ServerState):
        self.host, self.state = host, state

    def gone(self, served: ServedProfile) -> str | None:
        return process_gone(self.host)

    @contextlib.contextmanager
    def serve(self, profile: str) -> Iterator[ServedProfile]:
        with server.endpoint(self.host, self.state) as url:
            yield served(self.host, profile, url, self.state)


def host_facts(host: Host, note: Callable[[str], None] = lambda text: None) -> dict:
    """The host and its stack's versions for the records; a bare entry (and a note) if unavailable."""
    try:
        from toolkit.provision import facts as facts_mod

        gathered = facts_mod.gather(host, extra_packages=FACT_PACKAGES)
    except Exception as exc:   # facts are a bonus in the record, never a reason to fail
        note(f"{host.name}: host facts unavailable ({exc})")
        return {"host": {"name": host.name}, "versions": {}}
    raw = gathered.raw
    gpus = raw.get("gpus") or []
    return {"host": {"name": host.name, "os": (raw.get("os") or {}).get("name"),
                     "gpus": [g.get("name") for g in gpus], "gpu_count": len(gpus),
                     "driver": raw.get("driver"), "cuda": raw.get("cuda")},
            "versions": {"python": gathered.python_version,
                         **{name: entry.get("version") for name, entry in gathered.packages.items()}}}

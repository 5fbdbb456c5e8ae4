"""Server profiles as data: `profiles/NAME.toml`, resolved against a host into a launch plan.

A profile names the server kind, its flags, environment, TP size, port, the readiness rule
(health endpoint + log lines, some from every TP rank) and the patchsets it requires.
`extends = "other"` starts from another profile: tables (`env`, `ready`) merge key by key,
everything else is replaced. The host's `[NAME.server]` table supplies what differs per host
(model and draft paths, bind address, port, TP size, env file with secrets, extra flags/env);
`overrides` (from the command line) win over both.

Strings may use placeholders: {model} {draft_model} {venv} {python} {bind} {port} {tp_size}
{dyn_threshold} {dyn_hysteresis}.

`TOOLKIT_PROFILES` names extra folders of profiles (os.pathsep-separated), read after
`profiles/`; a later file of the same name replaces an earlier one.
"""
from __future__ import annotations

import os
import posixpath
import re
import shlex
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from toolkit.core import paths
from toolkit.patch import patchhooks, patchsets
from toolkit.core.inventory import Host, shown_path

KINDS = ("sglang", "transformers-serve", "command")
TOP_LEVEL_KEYS = {
    "summary", "extends", "kind", "model", "draft_model", "draft_model_required", "tp_size", "port",
    "bind", "flags", "env", "ready", "requires_patchsets", "requires_patched_files", "dyn_threshold",
    "dyn_hysteresis", "command",
}
READY_KEYS = {"endpoint", "log_lines", "rank_log_lines"}
HOST_SERVER_KEYS = {"model", "draft_model", "bind", "port", "tp_size", "env_file", "flags", "env",
                    "nvidia_smi", "idle_memory_slack_mib", "memory_wait_s", "shared_gpu", "keep_logs"}
OVERRIDE_KEYS = {"model", "draft_model", "bind", "port", "tp_size", "dyn_threshold", "dyn_hysteresis",
                 "flags", "env"}
# Inline env values end up in the launch script and in reports: secrets belong in server.env_file.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|CREDENTIAL", re.IGNORECASE)
LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|localhost|::1)$")


class ProfileError(ValueError):
    """A profile is unknown, malformed, or cannot be resolved for a host."""


@dataclass
class LaunchPlan:
    """A profile resolved for one host: everything the host side needs to start and judge it."""
    profile: str
    host: str
    kind: str
    argv: list[str]
    env: dict[str, str]
    env_file: str | None
    model: str | None
    draft_model: str | None
    tp_size: int
    bind: str
    port: int
    health_endpoint: str
    log_lines: list[str]
    rank_log_lines: list[str]
    requires_patchsets: list[str]
    requires_patched_files: list[str]   # package files the applied patchsets must have written
    dyn_threshold: int | str | None   # "auto": the patch's controller finds it
    dyn_hysteresis: int | None
    venv: str | None
    server_dir: str
    summary: str = ""
    nvidia_smi: str = "nvidia-smi"
    idle_memory_slack_mib: int = 512
    shared_gpu: bool = False             # other servers use this host's GPUs on purpose
    notes: list[str] = field(default_factory=list)

    @property
    def probe_address(self) -> str:
        """Where a client on the host connects: the bind address, or loopback for a wildcard."""
        return "127.0.0.1" if self.bind in ("0.0.0.0", "", "::") else self.bind

    @property
    def base_url_on_host(self) -> str:
        address = self.probe_address
        return f"http://[{address}]:{self.port}" if ":" in address else f"http://{address}:{self.port}"

    def expected_log_lines(self) -> list[str]:
        """Every line the readiness rule waits for, rank-prefixed where it must come from each rank."""
        lines = list(self.log_lines)
        for text in self.rank_log_lines:
            if self.tp_size > 1:
                lines.extend(f"TP{rank}: {text}" for rank in range(self.tp_size))
            else:
                lines.append(text)
        return lines

    def to_json(self) -> dict:
        return asdict(self)


def profile_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("TOOLKIT_PROFILES", "").split(os.pathsep) if p]
    missing = [str(p) for p in extra if not p.is_dir()]
    if missing:
        raise ProfileError(f"TOOLKIT_PROFILES names {', '.join(missing)}, which is not a folder of profiles")
    return [paths.PROFILES_DIR, *extra]


def _read_raw() -> dict[str, dict]:
    raw: dict[str, dict] = {}
    for folder in profile_dirs():
        for path in sorted(folder.glob("*.toml")):
            try:
                data = tomllib.loads(path.read_text())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ProfileError(f"cannot read profile {shown_path(path, 'TOOLKIT_PROFILES')}: {exc}") from exc
            unknown = set(data) - TOP_LEVEL_KEYS
            if unknown:
                raise ProfileError(f"profile {path.stem} ({path.name}): unknown keys {', '.join(sorted(unknown))}")
            unknown_ready = set(data.get("ready", {})) - READY_KEYS
            if unknown_ready:
                raise ProfileError(f"profile {path.stem}: unknown keys in [ready]: {', '.join(sorted(unknown_ready))}")
            raw[path.stem] = data
    return raw


def _merge(base: dict, child: dict) -> dict:
    merged = dict(base)
    for key, value in child.items():
        if key in ("env", "ready") and isinstance(value, dict):
            merged[key] = {**base.get(key, {}), **value}
        else:
            merged[key] = value
    merged.pop("extends", None)
    return merged


def _flatten(name: str, raw: dict[str, dict], seen: tuple = ()) -> dict:
    if name in seen:
        raise ProfileError(f"profile {name}: `extends` makes a cycle ({' -> '.join(seen + (name,))})")
    if name not in raw:
        raise ProfileError(f"unknown profile {name!r}; known: {', '.join(sorted(raw)) or 'none'}")
    data = raw[name]
    parent = data.get("extends")
    if parent:
        if parent not in raw:
            raise ProfileError(f"profile {name} extends unknown profile {parent!r}")
        data = _merge(_flatten(parent, raw, seen + (name,)), data)
    return data


def load_profiles() -> dict[str, dict]:
    """All profiles, `extends` resolved: {name: table}."""
    raw = _read_raw()
    return {name: _flatten(name, raw) for name in raw}


def load_profile(name: str) -> dict:
    raw = _read_raw()
    profile = _flatten(name, raw)
    kind = profile.get("kind")
    if kind not in KINDS:
        raise ProfileError(f"profile {name}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "command" and not profile.get("command"):
        raise ProfileError(f"profile {name}: kind 'command' needs `command = [argv...]`")
    return profile


class _Placeholders(dict):
    def __init__(self, profile_name: str, values: dict):
        super().__init__(values)
        self.profile_name = profile_name

    def __missing__(self, key):
        if key == "venv":
            raise ProfileError(f"profile {self.profile_name} uses {{venv}}, but the host has no venv; "
                               f"set `venv = \"/path\"` in its inventory table")
        raise ProfileError(f"profile {self.profile_name}: unknown placeholder {{{key}}}; "
                           f"known: {', '.join('{' + k + '}' for k in sorted(self))}")


def _fill(text: str, values: _Placeholders, what: str) -> str:
    try:
        filled = str(text).format_map(values)
    except (ValueError, IndexError) as exc:
        raise ProfileError(f"profile {values.profile_name}: bad placeholder in {what}: {text!r} ({exc})") from exc
    if "\x00" in filled:
        raise ProfileError(f"profile {values.profile_name}: NUL byte in {what}")
    return filled


def _int(value, what: str, profile: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ProfileError(f"profile {profile}: {what} must be an integer, not {value!r}") from None


def shared_gpu(host: Host) -> bool:
    """The host's `[server] shared_gpu` switch: other servers use its GPUs on purpose."""
    value = (host.server or {}).get("shared_gpu", False)
    if not isinstance(value, bool):
        raise ProfileError(f"host {host.name}: [server] shared_gpu must be true or false, not {value!r}")
    return value


AUTO_THRESHOLD = "auto"


def patch_defaults(values: dict) -> dict:
    """The launch values the patchsets' `launch_values` hooks fill in (toolkit/patch/patchhooks.py)."""
    try:
        return patchhooks.launch_values(values)
    except (patchsets.PatchsetError, patchhooks.HookError) as exc:
        raise ProfileError(f"no patchset defaults for {values}: {exc}") from None


def default_hysteresis(threshold: int) -> int:
    """The hysteresis a server started with only `threshold` gets (a patchset hook's default)."""
    hysteresis = patch_defaults({"dyn_threshold": threshold, "dyn_hysteresis": None}).get("dyn_hysteresis")
    if hysteresis is None:
        raise ProfileError(f"no default hysteresis for threshold {threshold}: no patchset hook gives one")
    return hysteresis


def _checked_overrides(host: Host, overrides: dict | None) -> tuple[dict, dict]:
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = set(overrides) - OVERRIDE_KEYS
    if unknown:
        raise ProfileError(f"cannot override {', '.join(sorted(unknown))}; possible: {', '.join(sorted(OVERRIDE_KEYS))}")
    server = dict(host.server or {})
    unknown_host = set(server) - HOST_SERVER_KEYS
    if unknown_host:
        raise ProfileError(f"host {host.name}: unknown keys in [server]: {', '.join(sorted(unknown_host))}; "
                           f"possible: {', '.join(sorted(HOST_SERVER_KEYS))}")
    return overrides, server


def resolve(host: Host, name: str, overrides: dict | None = None, profile: dict | None = None) -> LaunchPlan:
    """The launch plan for profile `name` on `host` (overrides > host [server] > profile): reads the
    profile file and the patchsets' hooks, then `plan_launch` decides."""
    _checked_overrides(host, overrides)
    profile = profile if profile is not None else load_profile(name)
    check_threshold_taken(name, profile, overrides)
    return plan_launch(host, name, profile, overrides, defaults=patch_defaults)


THRESHOLD_OPTIONS = {"dyn_threshold": "--threshold", "dyn_hysteresis": "--hysteresis"}


def takes_threshold(profile: dict) -> bool:
    """Whether a dyn-disable threshold means anything to this profile. The rule: the profile sets
    `dyn_threshold` itself or through `extends` (its default, which its env and ready lines fill
    in), as the dyn-disable profiles do; the same rule as gpu/lab_launch.py's is_dyn. Requiring a
    particular patchset would make the engine test a patchset's name."""
    return "dyn_threshold" in profile


def check_threshold_taken(name: str, profile: dict, overrides: dict | None) -> None:
    """Refuse a threshold or hysteresis given for a profile that has none: it would change nothing."""
    given = [option for key, option in THRESHOLD_OPTIONS.items() if (overrides or {}).get(key) is not None]
    if given and not takes_threshold(profile):
        takers = sorted(other for other, data in load_profiles().items() if takes_threshold(data))
        raise ProfileError(f"profile {name} has no dyn-disable threshold (it sets no dyn_threshold), so "
                           f"{' and '.join(given)} would change nothing; use a profile that takes one: "
                           f"{', '.join(takers) or 'none is defined'}")


def plan_launch(host: Host, name: str, profile: dict, overrides: dict | None = None,
                defaults=lambda values: {}) -> LaunchPlan:
    """The launch plan from a loaded profile, without I/O. `defaults(values)` returns the launch
    values the patched server would fill in itself (`patch_defaults` in `resolve`)."""
    overrides, server = _checked_overrides(host, overrides)

    def pick(key, default=None):
        for source in (overrides, server, profile):
            if key in source:
                return source[key]
        return default

    venv = host.venv
    python = host.venv_python
    tp_size = _int(pick("tp_size", 1), "tp_size", name)
    if tp_size < 1:
        raise ProfileError(f"profile {name}: tp_size must be >= 1, got {tp_size}")
    port = _int(pick("port", 30000), "port", name)
    if not 0 < port < 65536:
        raise ProfileError(f"profile {name}: port {port} is out of range")
    bind = str(pick("bind", "127.0.0.1"))
    threshold = pick("dyn_threshold")
    hysteresis = pick("dyn_hysteresis")
    auto = threshold == AUTO_THRESHOLD   # the patch's 0003 diff finds the crossover itself
    if auto and "dyn_hysteresis" in overrides:
        raise ProfileError(f"profile {name}: dyn_threshold = auto takes no dyn_hysteresis (the controller's "
                           f"band is SGLANG_SPEC_DISABLE_AUTO_HYSTERESIS)")
    threshold = None if threshold is None or auto else _int(threshold, "dyn_threshold", name)
    hysteresis = None if hysteresis is None or auto else _int(hysteresis, "dyn_hysteresis", name)
    if threshold is not None and threshold < 1:
        raise ProfileError(f"profile {name}: dyn_threshold must be >= 1, got {threshold}")
    if threshold is not None and (hysteresis is None or
                                  ("dyn_threshold" in overrides and "dyn_hysteresis" not in overrides)):
        # none given, or one set for the profile's own threshold (which would flap at e.g. 18)
        hysteresis = defaults({"dyn_threshold": threshold, "dyn_hysteresis": None,
                               "tp_size": tp_size}).get("dyn_hysteresis")
        if hysteresis is None:
            raise ProfileError(f"profile {name}: dyn_threshold {threshold} but no dyn_hysteresis, and no patchset's"
                               f" hook gives a default one: set dyn_hysteresis")
    if threshold is not None and hysteresis is not None and not 0 <= hysteresis < threshold:
        raise ProfileError(f"profile {name}: dyn_hysteresis must satisfy 0 <= hysteresis < threshold ({threshold})")

    if auto:
        threshold = AUTO_THRESHOLD
    base = {"python": python, "bind": bind, "port": port, "tp_size": tp_size,
            "dyn_threshold": "" if threshold is None else threshold,
            "dyn_hysteresis": "" if hysteresis is None else hysteresis}
    if venv:
        base["venv"] = venv
    values = _Placeholders(name, {**base, "model": "", "draft_model": ""})
    model = pick("model")
    model = posixpath.normpath(_fill(model, values, "model")) if model else None
    draft = pick("draft_model")
    draft = posixpath.normpath(_fill(draft, values, "draft_model")) if draft else None
    kind = profile["kind"]
    if kind != "command" and not model:
        raise ProfileError(f"profile {name} needs a model on host {host.name}: set `model = \"/path\"` in its "
                           f"[{host.name}.server] table, or pass --model")
    if profile.get("draft_model_required") and not draft:
        raise ProfileError(f"profile {name} needs a draft model on host {host.name}: set `draft_model = \"/path\"` "
                           f"in its [{host.name}.server] table, or pass --draft-model")
    values = _Placeholders(name, {**base, "model": model or "", "draft_model": draft or ""})

    flags = [_fill(f, values, "flags") for f in profile.get("flags", [])]
    flags += [_fill(f, values, "host flags") for f in server.get("flags", [])]
    flags += [_fill(f, values, "override flags") for f in overrides.get("flags", [])]
    if kind == "sglang":
        argv = [python, "-m", "sglang.launch_server", "--model-path", model, "--tp-size", str(tp_size),
                "--host", bind, "--port", str(port), *flags]
    elif kind == "transformers-serve":
        serve = posixpath.join(venv, "bin", "transformers") if venv else "transformers"
        argv = [serve, "serve", model, "--host", bind, "--port", str(port), *flags]
    else:
        argv = [_fill(a, values, "command") for a in profile["command"]] + flags

    env: dict[str, str] = {}
    for source, label in ((profile.get("env", {}), "profile"), (server.get("env", {}), "host"),
                          (overrides.get("env", {}), "override")):
        for key, value in source.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ProfileError(f"profile {name}: {label} env name {key!r} is not a valid variable name")
            if SECRET_NAME.search(key):
                raise ProfileError(f"{label} env {key} looks like a secret: put it in a file on the host and name "
                                   f"that file as `env_file` in the host's [server] table (it is sourced, never copied)")
            env[key] = _fill(value, values, f"env {key}")

    if profile.get("requires_patched_files") and not profile.get("requires_patchsets"):
        raise ProfileError(f"profile {name}: requires_patched_files needs requires_patchsets (the patchsets "
                           f"that write them, whose verify checks them)")
    ready = profile.get("ready", {})
    notes = []
    if not LOOPBACK.match(bind):
        notes.append(f"server binds {bind}: reachable beyond this host (set by the host's server.bind)")
    return LaunchPlan(
        profile=name, host=host.name, kind=kind, argv=argv, env=env,
        env_file=server.get("env_file"), model=model, draft_model=draft, tp_size=tp_size, bind=bind,
        port=port, health_endpoint=ready.get("endpoint", "/health"),
        log_lines=[_fill(t, values, "ready.log_lines") for t in ready.get("log_lines", [])],
        rank_log_lines=[_fill(t, values, "ready.rank_log_lines") for t in ready.get("rank_log_lines", [])],
        requires_patchsets=list(profile.get("requires_patchsets", [])),
        requires_patched_files=list(profile.get("requires_patched_files", [])),
        dyn_threshold=threshold, dyn_hysteresis=hysteresis, venv=venv,
        server_dir=posixpath.join(host.toolkit_state_dir, "server", name),
        summary=profile.get("summary", ""), nvidia_smi=str(server.get("nvidia_smi", "nvidia-smi")),
        idle_memory_slack_mib=_int(server.get("idle_memory_slack_mib", 512), "idle_memory_slack_mib", name),
        shared_gpu=shared_gpu(host),
        notes=notes,
    )


def shell_command(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)

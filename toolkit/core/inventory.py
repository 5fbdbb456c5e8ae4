"""Hosts: the inventory in `hosts/*.toml` plus two built-ins, `sandbox` and `local`.

A host file holds one table per host:

    [blackwell-01]
    address = "blackwell-01.example"   # DNS name or IP; never dialled by tests
    port = 22
    user = "ml"
    key = "~/.ssh/id_ed25519"
    known_hosts = "~/.ssh/known_hosts"
    venv = "/opt/sglang/venv"          # the venv that runs SGLang
    gpus = 8                           # expected GPU count (facts check it)
    labels = ["blackwell", "prod"]
    [blackwell-01.server]              # free-form settings for server profiles
    model = "/models/Kimi-K2.5"

`TOOLKIT_INVENTORY` names extra files or folders (os.pathsep-separated), read after
`hosts/`; a later definition of a name replaces an earlier one.
"""
from __future__ import annotations

import getpass
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.core import paths
from toolkit.core.sandbox import sandbox_port, up_command
from toolkit.core.transport import LocalTransport, SSHTransport, Transport


class InventoryError(ValueError):
    pass


@dataclass
class Host:
    name: str
    transport: str = "ssh"              # "ssh" or "local"
    address: str = ""
    port: int = 22
    user: str | None = None
    key: str | None = None
    known_hosts: str | None = None
    venv: str | None = None             # venv that runs SGLang on the host
    python: str | None = None           # interpreter of that venv (default: <venv>/bin/python)
    pythonpath: str | None = None       # extra site dir (a trimmed site instead of a venv)
    state_dir: str | None = None        # toolkit state on the host (default: <venv>/.toolkit)
    gpus: int = 0
    stack: str | None = None            # default stack for provision
    labels: list[str] = field(default_factory=list)
    server: dict = field(default_factory=dict)
    # Built-in hosts only (not an inventory key): what to do when the host does not answer.
    unreachable_advice: str | None = None

    @property
    def venv_python(self) -> str:
        if self.python:
            return self.python
        return f"{self.venv}/bin/python" if self.venv else "python3"

    @property
    def toolkit_state_dir(self) -> str:
        if self.state_dir:
            return self.state_dir
        base = self.venv or self.pythonpath
        if not base:
            raise InventoryError(f"host {self.name!r} has neither venv nor pythonpath: nowhere to keep state")
        return f"{base}/.toolkit"

    def connect(self) -> Transport:
        if self.transport == "local":
            return LocalTransport()
        if self.transport != "ssh":
            raise InventoryError(f"host {self.name!r}: unknown transport {self.transport!r}")
        return SSHTransport(self.address, port=self.port, user=self.user,
                            key_filename=_expand(self.key), known_hosts=_expand(self.known_hosts),
                            advice=self.unreachable_advice)

    def describe(self) -> str:
        if self.transport == "local":
            return f"{self.name} (this machine)"
        return f"{self.name} ({self.user + '@' if self.user else ''}{self.address}:{self.port})"


def _expand(path: str | None) -> str | None:
    return os.path.expanduser(path) if path else None


_FIELDS = set(Host.__dataclass_fields__) - {"unreachable_advice"}


# What each key of a host table holds; checked at load, so a wrong value is named with its host
# and file before anything connects.
_TYPES = {"transport": str, "address": str, "port": int, "user": str, "key": str, "known_hosts": str,
          "venv": str, "python": str, "pythonpath": str, "state_dir": str, "gpus": int, "stack": str,
          "labels": list, "server": dict}
_WORDS = {str: "a string", int: "an integer", list: "a list of strings", dict: "a table"}


def _check_table(name: str, table: dict, where: str) -> None:
    for key, value in table.items():
        kind = _TYPES[key]
        wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool)) or \
            (kind is list and not all(isinstance(item, str) for item in value))
        if wrong:
            raise InventoryError(f"{where}: host {name!r}: {key} must be {_WORDS[kind]}, got {value!r}")
    port = table.get("port", 22)
    if not 1 <= port <= 65535:
        raise InventoryError(f"{where}: host {name!r}: port must be 1-65535, got {port}")
    if table.get("transport", "ssh") == "ssh" and not table.get("address", "").strip():
        raise InventoryError(f"{where}: host {name!r} has no address (the DNS name or IP to reach it by SSH);"
                             f" add `address = \"...\"` to its table")


def _host_from_table(name: str, table: dict, source: str) -> Host:
    unknown = set(table) - _FIELDS
    if unknown:
        raise InventoryError(f"{source}: host {name!r} has unknown keys: {', '.join(sorted(unknown))}")
    _check_table(name, table, source)
    return Host(name=name, **table)


def sandbox_host(folder: Path | None = None, port: int | None = None) -> Host:
    """The built-in `sandbox` host: SSH to 127.0.0.1 with the keys and venv of `folder` (.sandbox/)."""
    sandbox = folder or paths.sandbox_dir()
    port = port or sandbox_port(sandbox)
    return Host(
        name="sandbox", address="127.0.0.1", port=port, user=getpass.getuser(),
        key=str(sandbox / "client_key"), known_hosts=str(sandbox / "known_hosts"),
        venv=str(sandbox / "host" / "venv"), stack="cpu-ref", labels=["sandbox"],
        server={"bind": "127.0.0.1"},
        unreachable_advice=f"is the sandbox up? start it with: {up_command(port)}",
    )


def builtin_hosts() -> dict[str, Host]:
    sandbox = paths.sandbox_dir()
    return {
        "sandbox": sandbox_host(sandbox),
        "local": Host(
            name="local", transport="local",
            venv=os.environ.get("TOOLKIT_LOCAL_VENV", str(sandbox / "local" / "venv")),
            stack="cpu-ref", labels=["local"], server={"bind": "127.0.0.1"},
        ),
    }


def shown_path(path: Path, variable: str) -> str:
    """A config file as the user knows it: relative to the project for a shipped one, else as named
    through `variable`."""
    try:
        return str(path.resolve().relative_to(paths.PROJECT_ROOT))
    except ValueError:
        return f"{path} (from {variable})"


def _inventory_files() -> list[Path]:
    files = sorted(paths.HOSTS_DIR.glob("*.toml"))
    for entry in filter(None, os.environ.get("TOOLKIT_INVENTORY", "").split(os.pathsep)):
        p = Path(entry)
        files.extend(sorted(p.glob("*.toml")) if p.is_dir() else [p])
    return files


def load_inventory() -> dict[str, Host]:
    hosts = builtin_hosts()
    for path in _inventory_files():
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InventoryError(f"cannot read inventory {shown_path(path, 'TOOLKIT_INVENTORY')}: {exc}") from exc
        for name, table in data.items():
            if not isinstance(table, dict):
                raise InventoryError(f"{path.name}: {name!r} must be a table of host settings")
            hosts[name] = _host_from_table(name, table, path.name)
    return hosts


def resolve_hosts(spec: str | None) -> list[Host]:
    """`--host a,b` -> [Host(a), Host(b)]; default the sandbox; `@label` selects by label. A host
    named twice (or by name and by a label) is taken once, where it first comes."""
    inventory = load_inventory()
    names = [n.strip() for n in (spec or "sandbox").split(",") if n.strip()]
    chosen: list[Host] = []
    for name in names:
        if name.startswith("@"):
            matched = [h for h in inventory.values() if name[1:] in h.labels]
            if not matched:
                raise InventoryError(f"no host has label {name[1:]!r}")
            chosen.extend(matched)
        elif name in inventory:
            chosen.append(inventory[name])
        else:
            known = ", ".join(sorted(inventory))
            raise InventoryError(f"unknown host {name!r}; known hosts: {known}")
    return list({host.name: host for host in chosen}.values())   # a key keeps its first place

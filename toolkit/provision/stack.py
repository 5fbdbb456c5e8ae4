"""The software stack as data: `stacks/NAME.toml` (Python, venv, GPU needs and every pin).

A stack is a list of steps; each step pins packages (`"name[extras]" = "version"`) and
says how pip installs them (`no_deps`, an extra `index`). `invoke provision` checks every
pin against the host's installed metadata and runs only the steps whose pins differ.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.core import paths
from toolkit.hostside.facts import version_matches  # noqa: F401  (the one rule, shared with the host side)

_STACK_KEYS = {"name", "summary", "python", "venv", "gpu", "min_driver", "cuda", "min_free_gb", "system",
               "indexes", "steps"}
_STEP_KEYS = {"name", "summary", "pins", "no_deps", "index"}
_RESERVED_STEPS = {"venv", "system"}


class StackError(ValueError):
    """The stack file is missing or malformed (the message names the file and the key)."""


def normalize(name: str) -> str:
    """PEP 503 name: `Flashinfer_Python` -> `flashinfer-python`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def split_extras(requirement: str) -> tuple[str, str]:
    """`transformers[serving]` -> (`transformers`, `[serving]`)."""
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[A-Za-z0-9_,\s.-]*\])?\s*", requirement)
    if not match:
        raise StackError(f"not a package name: {requirement!r}")
    return match.group(1), (match.group(2) or "").replace(" ", "")


@dataclass(frozen=True)
class Pin:
    requirement: str      # as written: "transformers[serving]"
    version: str          # "5.24.0"

    @property
    def name(self) -> str:
        return normalize(split_extras(self.requirement)[0])

    @property
    def spec(self) -> str:
        """What pip installs: `transformers[serving]==5.24.0`."""
        return f"{self.requirement}=={self.version}"

    @property
    def constraint(self) -> str:
        """Constraints files take no extras: `transformers==5.24.0`."""
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Step:
    name: str
    summary: str
    pins: tuple[Pin, ...]
    no_deps: bool = False
    index_url: str | None = None


@dataclass(frozen=True)
class Stack:
    name: str
    summary: str
    python: str                       # minimum "3.10"
    venv: str
    steps: tuple[Step, ...]
    gpu: bool = False
    min_driver: int | None = None
    cuda: str | None = None
    min_free_gb: float = 0.0          # free disk a fresh install needs where the venv lives
    system: dict[str, str] = field(default_factory=dict)   # command -> Debian package
    source: str = ""

    @property
    def pins(self) -> list[Pin]:
        return [pin for step in self.steps for pin in step.pins]

    @property
    def package_names(self) -> list[str]:
        return [pin.name for pin in self.pins]

    def constraints(self) -> str:
        """Every pin as a pip constraints file: no step may move another step's package."""
        return "".join(pin.constraint + "\n" for pin in self.pins)

    def python_ok(self, version: str | None) -> bool:
        return bool(version) and _tuple(version)[:2] >= _tuple(self.python)[:2]

    def step(self, name: str) -> Step:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(name)


def _tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def stacks_dir() -> Path:
    return paths.STACKS_DIR


def available() -> list[str]:
    return sorted(p.stem for p in stacks_dir().glob("*.toml"))


def load(name_or_path: str, folder: Path | None = None) -> Stack:
    """`gpu` -> stacks/gpu.toml; a path ending in .toml is read as it is."""
    if name_or_path.endswith(".toml"):
        path = Path(name_or_path)
    else:
        path = (folder or stacks_dir()) / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(available()) or "none"
        raise StackError(f"no stack {name_or_path!r} (looked for {path}); known stacks: {known}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise StackError(f"{path.name}: not valid TOML: {exc}") from exc
    return parse(data, path.name)


def parse(data: dict, source: str = "<stack>") -> Stack:
    def bad(message: str):
        raise StackError(f"{source}: {message}")

    unknown = set(data) - _STACK_KEYS
    if unknown:
        bad(f"unknown keys: {', '.join(sorted(unknown))} (allowed: {', '.join(sorted(_STACK_KEYS))})")
    for key in ("name", "python", "venv", "steps"):
        if key not in data:
            bad(f"missing {key!r}")
    if not re.fullmatch(r"3\.\d+", str(data["python"])):
        bad(f"python must look like \"3.10\", got {data['python']!r}")
    gpu = bool(data.get("gpu", False))
    if gpu and not isinstance(data.get("min_driver"), int):
        bad("a gpu stack needs min_driver (an integer, e.g. 580)")
    indexes = data.get("indexes", {})
    steps, seen_steps, seen_pins = [], set(), set()
    for number, raw in enumerate(data["steps"], 1):
        where = f"step {number}"
        if not isinstance(raw, dict):
            bad(f"{where} must be a table")
        unknown = set(raw) - _STEP_KEYS
        if unknown:
            bad(f"{where}: unknown keys: {', '.join(sorted(unknown))}")
        name = raw.get("name") or bad(f"{where} has no name")
        if name in seen_steps or name in _RESERVED_STEPS:
            bad(f"{where}: step name {name!r} is used twice or reserved")
        seen_steps.add(name)
        pins_table = raw.get("pins") or bad(f"step {name!r} pins nothing")
        pins = []
        for requirement, version in pins_table.items():
            if not isinstance(version, str) or not re.fullmatch(r"[0-9][0-9A-Za-z.+!_-]*", version):
                bad(f"step {name!r}: {requirement} must be pinned to one exact version, got {version!r}")
            try:
                pin = Pin(requirement, version)
                pin_name = pin.name
            except StackError as exc:
                bad(f"step {name!r}: {exc}")
            if pin_name in seen_pins:
                bad(f"{pin_name} is pinned twice")
            seen_pins.add(pin_name)
            pins.append(pin)
        index_url = None
        if raw.get("index"):
            index_url = indexes.get(raw["index"]) or bad(f"step {name!r}: unknown index {raw['index']!r}")
        steps.append(Step(name, raw.get("summary", ""), tuple(pins), bool(raw.get("no_deps", False)), index_url))
    return Stack(name=data["name"], summary=data.get("summary", ""), python=str(data["python"]),
                 venv=data["venv"], steps=tuple(steps), gpu=gpu, min_driver=data.get("min_driver"),
                 cuda=data.get("cuda"), min_free_gb=float(data.get("min_free_gb", 0)), system=dict(data.get("system", {})), source=source)

"""Wheelhouses for air-gapped hosts: every wheel a stack needs, for one Python and platform.

`build(stack, python=, platform=, out=)` fills a folder on the control machine with
`pip download --only-binary=:all: --python-version --platform` (one call per stack step,
under the stack's constraints) and writes `manifest.json` with each wheel's sha256.
`invoke provision --wheelhouse DIR` then sends a host only the wheels it lacks and
installs with `pip --no-index --find-links`.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from toolkit.core import paths
from toolkit.hostside._lib import sha256_file
from toolkit.provision.stack import Stack

MANIFEST = "manifest.json"


class WheelhouseError(RuntimeError):
    pass


@dataclass
class WheelFile:
    file: str
    sha256: str
    size: int


@dataclass
class Manifest:
    stack: str
    python: str
    platform: str
    wheels: list[WheelFile]
    pins: list[str] = field(default_factory=list)
    created: str = ""
    folder: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("folder")
        data.pop("seconds")
        return data


def default_folder(stack: Stack, python: str, platform: str) -> Path:
    return paths.cache_dir() / "wheelhouse" / f"{stack.name}-py{python}-{platform}"


def this_machine() -> tuple[str, str]:
    """(python, platform tag) of the control machine, e.g. ("3.11", "manylinux_2_36_x86_64")."""
    import platform as _platform

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    libc, version = _platform.libc_ver()
    machine = _platform.machine()
    if libc == "glibc" and version:
        major, minor = version.split(".")[:2]
        return python, f"manylinux_{major}_{minor}_{machine}"
    return python, f"linux_{machine}"


def expand_platform(tag: str) -> list[str]:
    """A glibc platform accepts every older manylinux tag; pip 23 does not expand them itself."""
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
    if not match:
        return [tag]
    major, minor, machine = int(match.group(1)), int(match.group(2)), match.group(3)
    tags = [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 16, -1)] if major == 2 else [tag]
    if major == 2 and minor >= 17:
        tags.append(f"manylinux2014_{machine}")
    if major == 2 and minor >= 12 and machine in ("x86_64", "i686"):
        tags += [f"manylinux_2_12_{machine}", f"manylinux2010_{machine}", f"manylinux_2_5_{machine}",
                 f"manylinux1_{machine}"]
    return tags


_SAVED = re.compile(r"^(?:Saved|File was already downloaded)\s+(\S+\.whl)\s*$")


def _downloaded(output: str) -> list[str]:
    return sorted({Path(m.group(1)).name for line in output.splitlines() if (m := _SAVED.match(line.strip()))})


def up_to_date(folder: Path, stack: Stack, python: str, platform: str) -> Manifest | None:
    """The folder's manifest if it was built for exactly these pins, Python and platform and
    every wheel in it still hashes to its record (then nothing needs downloading)."""
    try:
        manifest = load(folder)
        if (manifest.stack, manifest.python, manifest.platform) != (stack.name, python, platform):
            return None
        if manifest.pins != [p.spec for p in stack.pins]:
            return None
        check_files(manifest)
        return manifest
    except WheelhouseError:
        return None


def build(stack: Stack, *, python: str, platform: str, out: Path | None = None, refresh: bool = False,
          note=lambda text: None, timeout: float = 3600) -> Manifest:
    if not re.fullmatch(r"3\.\d+", python):
        raise WheelhouseError(f"--python must look like 3.12, got {python!r}")
    if not stack.python_ok(python):
        raise WheelhouseError(f"stack {stack.name} needs Python >= {stack.python}; {python} is older")
    folder = Path(out) if out else default_folder(stack, python, platform)
    current = None if refresh else up_to_date(folder, stack, python, platform)
    if current:
        note(f"wheelhouse {folder} is up to date for stack {stack.name} (--refresh downloads again)")
        return current
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    files: set[str] = set()
    with tempfile.TemporaryDirectory() as scratch:
        constraints = Path(scratch) / "constraints.txt"
        constraints.write_text(stack.constraints())
        for step in stack.steps:
            argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
                    "--progress-bar", "off", "-d", str(folder), "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", "-c", str(constraints)]
            for tag in expand_platform(platform):
                argv += ["--platform", tag]
            if step.no_deps:
                argv.append("--no-deps")
            if step.index_url:
                argv += ["--extra-index-url", step.index_url]
            argv += [pin.spec for pin in step.pins]
            note(f"wheelhouse {stack.name}: step {step.name}: pip download {' '.join(p.spec for p in step.pins)}")
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                raise WheelhouseError(f"pip download for step {step.name} failed (exit {done.returncode}):\n"
                                      + "\n".join((done.stdout + done.stderr).splitlines()[-25:]))
            got = _downloaded(done.stdout)
            if not got:
                raise WheelhouseError(f"pip download for step {step.name} named no wheel; output:\n{done.stdout[-1500:]}")
            files.update(got)
    wheels = []
    for name in sorted(files):
        path = folder / name
        wheels.append(WheelFile(name, sha256_file(path), path.stat().st_size))
    manifest = Manifest(stack.name, python, platform, wheels, [p.spec for p in stack.pins],
                        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), str(folder),
                        round(time.monotonic() - started, 1))
    (folder / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    return manifest


def load(folder: str | Path) -> Manifest:
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
        wheels = [WheelFile(**w) for w in data["wheels"]]
        return Manifest(data["stack"], data["python"], data["platform"], wheels, data.get("pins", []),
                        data.get("created", ""), str(folder))
    except FileNotFoundError:
        raise WheelhouseError(f"{folder} has no {MANIFEST}: make it with"
                              f" `invoke wheelhouse build --stack STACK --out {folder}`") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise WheelhouseError(f"{path} is not a wheelhouse manifest: {exc}") from exc


def check_files(manifest: Manifest) -> None:
    """Every wheel the manifest names is in the folder with its recorded sha256."""
    for wheel in manifest.wheels:
        path = Path(manifest.folder) / wheel.file
        if not path.is_file():
            raise WheelhouseError(f"wheelhouse {manifest.folder} lacks {wheel.file}; rebuild it")
        if path.stat().st_size != wheel.size or sha256_file(path) != wheel.sha256:
            raise WheelhouseError(f"{path} does not match the manifest's sha256; rebuild the wheelhouse")

"""The pristine files of a pinned release, read from its wheel and checked against RECORD.

`pristine(package, version)` downloads the wheel once into `cache_dir()/wheels`
(`pip download --no-deps PACKAGE==VERSION`) and returns a `Wheel` whose `read(path)`
refuses any file whose bytes do not hash to the wheel's own RECORD entry.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import subprocess
import sys
import zipfile
from functools import lru_cache
from pathlib import Path

from toolkit.core import paths


class WheelError(RuntimeError):
    """The wheel could not be fetched, or a file in it does not match its RECORD."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record_hash_to_hex(value: str) -> str | None:
    """RECORD writes `sha256=<urlsafe base64, no padding>`; return plain hex (None if absent)."""
    if not value:
        return None
    algorithm, _, digest = value.partition("=")
    if algorithm != "sha256":
        return None
    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()


def parse_record(text: str) -> dict[str, str | None]:
    """RECORD text -> {path: sha256 hex or None}."""
    return {row[0]: record_hash_to_hex(row[1] if len(row) > 1 else "")
            for row in csv.reader(io.StringIO(text)) if row}


def wheel_dir() -> Path:
    return paths.cache_dir() / "wheels"


def _normal(package: str) -> str:
    return package.replace("-", "_").lower()


def find_cached(package: str, version: str) -> Path | None:
    found = sorted(wheel_dir().glob(f"{_normal(package)}-{version}-*.whl"))
    return found[0] if found else None


def fetch(package: str, version: str, note=lambda text: None) -> Path:
    """The cached wheel of PACKAGE==VERSION, downloaded with pip on first use."""
    cached = find_cached(package, version)
    if cached:
        return cached
    wheel_dir().mkdir(parents=True, exist_ok=True)
    note(f"downloading {package}=={version} (wheel, no dependencies) into {wheel_dir()}")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--disable-pip-version-check", "-q", "-d", str(wheel_dir()),
                           f"{package}=={version}"], capture_output=True, text=True, timeout=900)
    cached = find_cached(package, version)
    if done.returncode != 0 or not cached:
        raise WheelError(_download_failure(package, version, done.stdout + done.stderr))
    return cached


def _download_failure(package: str, version: str, output: str) -> str:
    """What a failed `pip download` means: the index has other releases but not this one (pip
    lists them), or it could not be read (pip says "versions: none" then too, so that case
    keeps the advice for a machine without the index)."""
    listed = re.search(r"\(from versions: ([^)]*)\)", output)
    versions = [v.strip() for v in listed.group(1).split(",") if v.strip() != "none"] if listed else []
    if versions and "No matching distribution" in output:
        return (f"the package index has no {package} {version} (a wheel, no dependencies); its latest releases "
                f"there: {', '.join(versions[-8:])}")
    return (f"pip download {package}=={version} failed; put the wheel into {wheel_dir()} by hand if this machine "
            f"cannot reach the index:\n{output[-1500:]}")


class Wheel:
    """One wheel file: its RECORD and its files, each read only after its hash checks out."""

    def __init__(self, path: Path, package: str, version: str):
        self.path, self.package, self.version = Path(path), package, version
        self._zip = zipfile.ZipFile(self.path)
        names = [n for n in self._zip.namelist() if n.endswith(".dist-info/RECORD")]
        if len(names) != 1:
            raise WheelError(f"{self.path.name}: expected one dist-info RECORD, found {len(names)}")
        self.dist_info = names[0].rsplit("/", 1)[0]
        self.record = parse_record(self._zip.read(names[0]).decode())
        self.sha256 = sha256_hex(self.path.read_bytes())

    def has(self, path: str) -> bool:
        return path in self.record

    def package_files(self, top: str | None = None) -> list[str]:
        """Files of the importable package (`sglang/...`), as RECORD lists them."""
        top = (top or _normal(self.package)) + "/"
        # some wheel builders list folders in RECORD too (`sglang/srt/,,`): those are no files
        return sorted(p for p in self.record if p.startswith(top) and not p.endswith("/"))

    def read(self, path: str) -> bytes:
        expected = self.record.get(path)
        if expected is None:
            raise WheelError(f"{path} is not a hashed file of {self.path.name}")
        data = self._zip.read(path)
        if sha256_hex(data) != expected:
            raise WheelError(f"{path} in {self.path.name} does not match the wheel's RECORD sha256;"
                             f" delete the cached wheel and run again")
        return data


@lru_cache(maxsize=8)
def _open(path: str, package: str, version: str, mtime: float) -> Wheel:
    return Wheel(Path(path), package, version)


def pristine(package: str, version: str, note=lambda text: None) -> Wheel:
    path = fetch(package, version, note)
    return _open(str(path), package, version, os.path.getmtime(path))

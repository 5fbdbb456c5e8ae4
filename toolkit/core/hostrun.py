"""Run host-side code in one round trip and get its JSON answer back.

Host-side work is done by standard-library-only modules in `toolkit/hostside/`; they import
each other with real (package-relative) imports. All of them, and `toolkit/server/refmodel.py`, travel
to the host as ONE zip (package `toolkit_hostside`), built in memory once per process with
fixed timestamps, so the same sources always give the same bytes and the same sha256. A call
sends a small bootstrap on stdin to the host's Python (`python3 -`) with the zip and the
arguments embedded as base64, as Ansible's AnsiballZ does: the bootstrap checks the zip's
sha256, writes it to a temporary file (in /dev/shm when the temporary folder's disk is
full), puts that on `sys.path` (zipimport), runs
`toolkit_hostside.<name>.main(args)`, removes the file, and prints one marked JSON line that
`parse_result` reads back. Nothing is installed on the host, and one step costs exactly one
round trip. This is the only way host code is shipped.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import logging
import zipfile
from importlib import resources

from toolkit.core.transport import CommandResult, Transport

log = logging.getLogger(__name__)

RESULT_MARKER = "@@TOOLKIT-RESULT@@"
PACKAGE = "toolkit_hostside"
# Modules of `toolkit` (outside hostside/) that also run on hosts, shipped in the same package:
# {name in the zip: the package that holds it here}.
EXTRA_MODULES = {"refmodel": "toolkit.server"}
ZIP_DATE = (1980, 1, 1, 0, 0, 0)   # the earliest a zip can say: the archive never depends on file times
# The line of the bootstrap that runs the entry; everything above it has made the zip importable.
# (tests/patch/faults.py inserts its fault points just before it.)
ENTRY_LINE = "    _lib.run_entry(_NAME, _FUNCTION, _ARGS, _MARKER)\n"

BOOTSTRAP = '''\
# toolkit host code (toolkit.core.hostrun): runs %(package)s.%(name)s.%(function)s from the zip below.
# Standard library only; the zip is checked against its sha256 before it is used.
import base64
import hashlib
import json
import os
import sys
import tempfile

_NAME, _FUNCTION, _MARKER = %(name)r, %(function)r, %(marker)r
_ARGS = %(args)r
_SHA256 = %(sha)r


def _fail(text):
    sys.stdout.write("\\n" + _MARKER + json.dumps({"_error": text}) + "\\n")
    sys.stdout.flush()
    sys.exit(1)


def _unpack(encoded):
    try:
        data = base64.b64decode(encoded)
    except (TypeError, ValueError) as exc:
        _fail("the toolkit's host code zip arrived corrupt (%%s); nothing ran" %% exc)
    found = hashlib.sha256(data).hexdigest()
    if found != _SHA256:
        _fail("the toolkit's host code zip arrived corrupt (sha256 %%s, sent %%s); nothing ran" %% (found, _SHA256))
    failures = []
    for folder in (None, "/dev/shm"):   # memory, when the temporary folder's disk is full or read-only
        path = None
        try:
            fd, path = tempfile.mkstemp(prefix="toolkit-hostside-", suffix=".zip", dir=folder)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            sys.path.insert(0, path)
            return path
        except OSError as exc:
            failures.append("%%s: %%s" %% (folder or tempfile.gettempdir(), exc))
            if path:
                os.unlink(path)
    _fail("cannot write the toolkit's host code zip (%%s); nothing ran" %% "; ".join(failures))


_ZIP = _unpack(%(zip)r)
try:
    try:
        from %(package)s import _lib
    except ImportError as exc:
        _fail("this host's Python (%%s, %%s) cannot import the toolkit's host code from its zip (zipimport): %%s;"
              " nothing ran" %% (sys.executable, sys.version.split()[0], exc))
''' + ENTRY_LINE + '''\
finally:
    os.unlink(_ZIP)
'''


class HostScriptError(RuntimeError):
    """The host-side script failed or answered nothing readable."""

    def __init__(self, message: str, result: CommandResult | None = None):
        super().__init__(message)
        self.result = result


def host_files() -> dict[str, bytes]:
    """{path in the zip: source bytes}: every module of toolkit/hostside/ and EXTRA_MODULES."""
    files = {}
    for entry in resources.files("toolkit.hostside").iterdir():
        if entry.name.endswith(".py"):
            files[f"{PACKAGE}/{entry.name}"] = entry.read_bytes()
    for name, package in EXTRA_MODULES.items():
        files[f"{PACKAGE}/{name}.py"] = resources.files(package).joinpath(f"{name}.py").read_bytes()
    return files


@functools.cache
def host_zip() -> bytes:
    """The zip of the host code, built once per process; the same sources give the same bytes."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in sorted(host_files().items()):
            info = zipfile.ZipInfo(path, date_time=ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, data, compresslevel=9)
    data = buffer.getvalue()
    log.debug("host code zip: %d files, %d bytes, sha256 %s", len(archive.infolist()), len(data),
              hashlib.sha256(data).hexdigest())
    return data


def zip_sha256() -> str:
    return hashlib.sha256(host_zip()).hexdigest()


@functools.cache
def _zip_text() -> str:
    return base64.b64encode(host_zip()).decode()


def build_payload(name: str, args: dict | None = None, function: str = "main") -> str:
    """The Python text that runs `toolkit_hostside.<name>.<function>(args)` on a host from stdin.

    With `args` None, the function is called with the command line's arguments instead
    (`python3 FILE A B` calls `function("A", "B")`) and its return value is the exit code:
    that is how a payload kept in a file on the host (the rollout guard) runs."""
    encoded = None if args is None else base64.b64encode(json.dumps(args).encode()).decode()
    return BOOTSTRAP % {"package": PACKAGE, "name": name, "function": function, "marker": RESULT_MARKER,
                        "args": encoded, "sha": zip_sha256(), "zip": _zip_text()}


def parse_result(result: CommandResult, name: str) -> dict:
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            answer = json.loads(line[len(RESULT_MARKER):])
            if isinstance(answer, dict) and answer.get("_error"):
                raise HostScriptError(f"host-side {name} failed: {answer['_error']}", result)
            return answer
    raise HostScriptError(
        f"host-side {name} answered nothing (exit {result.exit_code}):\n{result.tail()}", result)


def run_script(transport: Transport, name: str, args: dict | None = None, *,
               python: str = "python3", timeout: float | None = None,
               env: dict[str, str] | None = None, function: str = "main") -> dict:
    """Run `toolkit_hostside.<name>.<function>(args)` on the host; return its dict."""
    payload = build_payload(name, args or {}, function)
    result = transport.run(f"{python} -", stdin=payload, timeout=timeout, env=env)
    return parse_result(result, name)

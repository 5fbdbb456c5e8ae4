"""Test-only fault injection for the host-side patch run, through a wrapping transport.

The host script calls `checkpoint(point)` at named points (after-lock, after-checks,
after-backups, after-prepare, after-new-files, after-rename-K, after-state); the shipped one does nothing. Inside
`armed(point, ...)`, every transport that `Host.connect()` returns is wrapped so that the
payloads it sends carry code, placed just before the bootstrap's entry line (the zip of host
code is importable there), that replaces patch_apply's `checkpoint` with one that acts at that point
(in the payloads whose entry is patch_apply: a call ships only the modules its entry imports).
It kills the run (`os._exit(137)`, as SIGKILL would), holds it (`sleep:S`:
writes its pid to `pidfile` and sleeps, ending early once `release` exists, so a test can
cut the SSH connection or kill the process there), or runs test code (`run=`). The engine
reads and forwards no fault switch of any kind.
"""
from __future__ import annotations

import textwrap
from contextlib import contextmanager

from toolkit.core import hostrun
from toolkit.core.inventory import Host

CHECKPOINT = '''
import os
import time

from toolkit_hostside import patch_apply
from toolkit_hostside.patch_hostlib import write_atomic


def checkpoint(point, _at=%(at)r, _action=%(action)r, _pidfile=%(pidfile)r, _release=%(release)r, _code=%(code)r):
    if point != _at:
        return
    if _code:
        exec(_code, {})
        return
    if _action.startswith("sleep:"):
        if _pidfile:
            write_atomic(_pidfile, str(os.getpid()).encode())
        deadline = time.monotonic() + float(_action.split(":", 1)[1])
        while time.monotonic() < deadline and not (_release and os.path.exists(_release)):
            time.sleep(0.05)
        return
    os._exit(137)


patch_apply.checkpoint = checkpoint
'''


def checkpoint_source(point: str, action: str = "exit", pidfile=None, release=None, run: str | None = None) -> str:
    source = CHECKPOINT % {"at": point, "action": action, "pidfile": None if pidfile is None else str(pidfile),
                           "release": None if release is None else str(release), "code": run}
    # the bootstrap's entry line sits in a `try:` block; only patch_apply's zip holds patch_apply
    return '    if _NAME == "patch_apply":\n' + textwrap.indent(source, "        ")


class FaultTransport:
    """Wraps a real transport; only the stdin of host-script runs changes."""

    def __init__(self, inner, source: str):
        self.inner, self.source = inner, source

    def run(self, command, *, stdin=None, **kwargs):
        if isinstance(stdin, str) and hostrun.ENTRY_LINE in stdin:
            head, entry, tail = stdin.rpartition(hostrun.ENTRY_LINE)
            stdin = head + self.source + entry + tail
        return self.inner.run(command, stdin=stdin, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()


@contextmanager
def armed(point: str, **how):
    """Within the block, host-side patch runs meet `point` as described above."""
    real = Host.connect
    source = checkpoint_source(point, **how)
    Host.connect = lambda self: FaultTransport(real(self), source)
    try:
        yield
    finally:
        Host.connect = real

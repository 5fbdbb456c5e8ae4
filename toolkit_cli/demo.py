"""`invoke demo`: the whole pipeline on one host, as a user would type it, step by step.

It runs the same task functions as the individual commands (no separate code path), prints
each command line before running it, stops at the first failure, and always stops the server
it started and reverts the patchset it applied, so the host ends as it began.
"""
from __future__ import annotations

import time

from toolkit import report

from .bench import bench
from .parsing import command
from .patch import patch
from .provision import provision
from .sandbox import sandbox
from .server import server_task
from .smoke import smoke


def _step(title: str, fn, *args, **kwargs) -> None:
    report.line("")
    report.line(f"== invoke {title}")
    started = time.monotonic()
    fn(*args, **kwargs)
    report.note(f"   ({time.monotonic() - started:.1f} s)")


@command(positional=[], help={
    "host": "host to run it on (default: sandbox, which is started first)",
    "patchset": "patchset to apply, verify and revert (default sm120)",
    "profile": "server profile to start, smoke and bench (default: cpu-ref)",
    "concurrency": "bench levels (default 1,4,16)",
    "requests": "bench requests per level (default 12)",
    "output_len": "bench max tokens per answer (default 32: the CPU reference server is slow at concurrency 1)",
    "out": "bench output folder (default out/bench/RUN_ID)",
})
def demo(c, host=None, patchset="sm120", profile="cpu-ref", concurrency="1,4,16", requests=12, output_len=32,
         out=None):
    """Provision, patch apply/verify/revert, server start, smoke, bench, server stop on one host."""
    target = host or "sandbox"
    if target == "sandbox":
        _step("sandbox up", sandbox, c, "up")
    _step(f"provision --host {target}", provision, c, host=target)
    _step(f"patch check {patchset}", patch, c, "check", patchset)
    applied = False
    try:
        _step(f"patch apply {patchset} --host {target}", patch, c, "apply", patchset, host=target)
        applied = True
        _step(f"patch verify --host {target}", patch, c, "verify", host=target)
    finally:
        if applied:
            _step(f"patch revert --host {target}", patch, c, "revert", host=target)
    _step(f"patch verify --host {target}", patch, c, "verify", host=target)
    _step(f"server model --host {target}", server_task, c, "model", host=target)
    _step(f"server start {profile} --host {target}", server_task, c, "start", profile, host=target)
    try:
        _step(f"smoke --host {target}", smoke, c, host=target)
        _step(f"bench --no-restart --concurrency {concurrency} --requests {requests} --output-len {output_len}"
              f" --host {target}", bench, c, host=target, no_restart=True, concurrency=concurrency,
              requests=str(requests), output_len=str(output_len), out=out)
    finally:
        _step(f"server stop --host {target}", server_task, c, "stop", host=target)
    report.line("")
    report.line("demo: every step passed")


"""`invoke demo`: the whole pipeline on one host, as a user would type it, step by step.

It runs the same task functions as the individual commands (no separate code path), prints
each command line before running it, stops at the first failure, and always stops the server
it started and reverts the patchset it applied, so the host ends as it began.

The rollout part: PATCHSET rolled out onto the running server and rolled off again (both keep),
then a patchset that breaks the CPU server after three requests (a test fixture from
tests/rollout/data/patchsets, not shipped), which the rollout must roll back by itself.
"""
from __future__ import annotations

import contextlib
import os
import time

from invoke.exceptions import Exit

from toolkit.core import report
from toolkit.core.paths import PROJECT_ROOT
from toolkit.patch import patchsets
from toolkit.server import profiles

from toolkit_cli.bench import bench
from toolkit_cli.common import fail, int_list_option, int_option
from toolkit_cli.parsing import command
from toolkit_cli.patch import patch
from toolkit_cli.provision import provision
from toolkit_cli.rollout import rollout
from toolkit_cli.sandbox import sandbox
from toolkit_cli.server import server_task
from toolkit_cli.smoke import smoke

BREAKING = PROJECT_ROOT / "tests" / "rollout" / "data" / "patchsets"


@contextlib.contextmanager
def _patchsets_from(folder):
    saved = os.environ.get("TOOLKIT_PATCHSETS")
    os.environ["TOOLKIT_PATCHSETS"] = str(folder)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOOLKIT_PATCHSETS", None)
        else:
            os.environ["TOOLKIT_PATCHSETS"] = saved


def _check_options(patchset, profile, concurrency, requests, output_len) -> None:
    """Bad options stop the demo before its first step, not at the step that uses them."""
    try:
        patchsets.get(patchset, patchsets.load_all())
        profiles.load_profile(profile)
    except (patchsets.PatchsetError, profiles.ProfileError) as exc:
        fail(str(exc), code=2)
    int_list_option(concurrency, "--concurrency")
    for value, option in ((requests, "--requests"), (output_len, "--output-len")):
        int_option(value, option, minimum=1)


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
def demo(c, host=None, patchset="sm120", profile="cpu-ref", concurrency="1,4,16", requests="12", output_len="32",
         out=None):
    """Provision, patch apply/verify/revert, server start, smoke, bench, rollouts (kept, rolled back), server stop."""
    _check_options(patchset, profile, concurrency, requests, output_len)
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
        _step(f"rollout {patchset} --host {target}", rollout, c, patchset, host=target)
        _step(f"rollout {patchset} --revert --host {target}", rollout, c, patchset, revert=True, host=target)
        try:
            with _patchsets_from(BREAKING):
                _step(f"rollout cpu-breaks --host {target}   # TOOLKIT_PATCHSETS={BREAKING.relative_to(PROJECT_ROOT)}",
                      rollout, c, "cpu-breaks", host=target)
        except Exit as exc:
            if exc.code != 1:
                raise
            report.line("(that rollout failed as it should: the patch breaks the server after three requests)")
        else:
            raise Exit("error: the rollout of cpu-breaks was kept; it breaks the server and should have rolled back",
                       code=1)
        _step(f"rollout --status --host {target}", rollout, c, status=True, host=target)
    finally:
        _step(f"server stop --host {target}", server_task, c, "stop", host=target)
    report.line("")
    report.line("demo: every step passed")


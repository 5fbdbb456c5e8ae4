"""The two host-side patch scripts, run in one round trip each through `hostrun`.

`patch_probe` and `patch_apply` import what they share from `patch_hostlib`; hostrun ships
each with the modules it imports in one zip of host code.
"""
from __future__ import annotations

import os

from toolkit.core import hostrun
from toolkit.core.inventory import Host
from toolkit.core.transport import Transport

DEFAULT_LOCK_TIMEOUT = 30.0


class PatchRefused(RuntimeError):
    """Nothing was written: the host is not in a state this command may change."""

    def __init__(self, message: str, diff: str = ""):
        super().__init__(message + (f"\n{diff}" if diff else ""))
        self.reason, self.diff = message, diff


class PatchFailed(RuntimeError):
    """A host run changed files and could not put all of them back; `verify` shows each file."""


def lock_timeout() -> float:
    return float(os.environ.get("TOOLKIT_PATCH_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT))


def host_args(host: Host, package: str) -> dict:
    return {"host": host.name, "package": package, "venv": host.venv, "pythonpath": host.pythonpath,
            "state_dir": host.toolkit_state_dir, "lock_timeout": lock_timeout()}


def run(transport: Transport, script: str, args: dict, timeout: float = 600) -> dict:
    answer = hostrun.run_script(transport, script, args, timeout=timeout)
    if answer.get("refused"):
        raise PatchRefused(answer["refused"])
    if answer.get("failed"):
        raise PatchFailed(answer["failed"])
    return answer


def probe(transport: Transport, host: Host, package: str, paths=(), *, recover: bool = True,
          all_files: bool = False, fetch=()) -> dict:
    return run(transport, "patch_probe", dict(host_args(host, package), paths=sorted(paths), recover=recover,
                                              all_files=all_files, fetch=sorted(fetch)))


def execute(transport: Transport, host: Host, plan: dict) -> dict:
    return run(transport, "patch_apply", dict(host_args(host, plan["package"]), **plan))

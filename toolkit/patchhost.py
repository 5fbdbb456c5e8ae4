"""The two host-side patch scripts, run in one round trip each.

`patch_probe` and `patch_apply` share `hostside/patch_hostlib.py`, which is sent in
front of them. Variables named TOOLKIT_FAULT_* in this process's environment are passed
on to the host script: the documented fault-injection switch (docs/patching.md).
"""
from __future__ import annotations

import os
from importlib import resources

from . import hostrun
from .inventory import Host
from .transport import Transport

DEFAULT_LOCK_TIMEOUT = 30.0


class PatchRefused(RuntimeError):
    """Nothing was written: the host is not in a state this command may change."""

    def __init__(self, message: str, diff: str = ""):
        super().__init__(message + (f"\n{diff}" if diff else ""))
        self.reason, self.diff = message, diff


def lock_timeout() -> float:
    return float(os.environ.get("TOOLKIT_PATCH_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT))


def _fault_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("TOOLKIT_FAULT_")}


def host_args(host: Host, package: str) -> dict:
    return {"package": package, "venv": host.venv, "pythonpath": host.pythonpath,
            "state_dir": host.toolkit_state_dir, "lock_timeout": lock_timeout()}


def run(transport: Transport, script: str, args: dict, timeout: float = 600) -> dict:
    shared = resources.files("toolkit.hostside").joinpath("patch_hostlib.py").read_text()
    payload = shared + "\n\n" + hostrun.build_payload(script, args)
    result = transport.run("python3 -", stdin=payload, timeout=timeout, env=_fault_env())
    answer = hostrun.parse_result(result, script)
    if answer.get("refused"):
        raise PatchRefused(answer["refused"])
    return answer


def probe(transport: Transport, host: Host, package: str, paths=(), *, recover: bool = True,
          all_files: bool = False, fetch=()) -> dict:
    return run(transport, "patch_probe", dict(host_args(host, package), paths=sorted(paths), recover=recover,
                                              all_files=all_files, fetch=sorted(fetch)))


def execute(transport: Transport, host: Host, plan: dict) -> dict:
    return run(transport, "patch_apply", dict(host_args(host, plan["package"]), **plan))

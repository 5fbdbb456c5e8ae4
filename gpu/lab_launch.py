"""The lab's servers, launched as `invoke server start` launches them.

Every server a gpu/ driver starts is a product profile (`profiles/*.toml`, or one of the lab's
own in `gpu/profiles/`, which extend them) resolved by `toolkit.server.profiles.resolve` for a local
host, with what the lab needs given as that command's overrides (model and draft paths, port,
TP size, dyn-disable threshold and hysteresis, extra flags, extra environment), and rendered by
`toolkit.server.server.render_launch_script` (templates/launch.sh.j2). The driver runs the rendered
script with bash: the command line and environment are the ones the product would start.

    plan = lab_launch.plan("eagle3-v2-dyn", model=..., draft=..., port=30010, tp=1,
                           flags=["--mem-fraction-static", "0.8"], env={"CUDA_VISIBLE_DEVICES": "0"},
                           threshold=8)
    proc = lab_launch.start(plan, "/tmp/dyn-logs/x.launch.sh", log_file)

Needs jinja2 and unidiff beside the toolkit (the device's trimmed site carries both: jinja2
with torch, unidiff from .whl2).
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from toolkit.server import profiles  # noqa: E402
from toolkit.core.inventory import Host  # noqa: E402
from toolkit.server.server import render_launch_script  # noqa: E402

LAB_PROFILES = ROOT / "gpu" / "profiles"
# the launch scripts' working directories: <STATE_DIR>/server/<profile>
STATE_DIR = os.environ.get("LAB_STATE_DIR", "/tmp/lab-state")


def host() -> Host:
    """The device as an inventory host: this interpreter, no venv, state under /tmp."""
    return Host(name="lab", transport="local", python=sys.executable, state_dir=STATE_DIR)


@contextlib.contextmanager
def _lab_profiles():
    # The lab's profiles are read the way `TOOLKIT_PROFILES` adds a folder; the variable is put
    # back so that servers started later do not inherit it.
    before = os.environ.get("TOOLKIT_PROFILES")
    os.environ["TOOLKIT_PROFILES"] = os.pathsep.join(p for p in (before, str(LAB_PROFILES)) if p)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOOLKIT_PROFILES", None)
        else:
            os.environ["TOOLKIT_PROFILES"] = before


def _literal(text) -> str:
    """A value the profile resolver must keep as it is (it fills {placeholders}). `{checkout}`
    names this checkout: the launch script runs in the server's own folder, so a file of the
    checkout given to a server (e.g. a config in gpu/plans/) needs an absolute path."""
    return str(text).replace("{checkout}", "\0").replace("{", "{{").replace("}", "}}").replace("\0", str(ROOT))


def profile_flags(profile: str) -> list:
    """The flags a profile passes itself, `extends` resolved as `invoke server start` resolves it."""
    with _lab_profiles():
        return list(profiles.load_profile(profile).get("flags", []))


def is_dyn(profile: str) -> bool:
    """Whether the profile starts a dyn-disable server (it has a threshold)."""
    with _lab_profiles():
        return "dyn_threshold" in profiles.load_profile(profile)


# Server flags the lab passes that a later release renamed (found when 0.5.23's argparse refused
# the first call's servers: "ambiguous option: --cuda-graph-max-bs could match
# --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill"). 0.5.23 split CUDA-graph settings by
# phase; its prefill graphs ("breakable", on by default on CUDA) replace the piecewise ones the
# lab turns off on 0.5.11 / 0.5.17, so they are turned off the same way.
RENAMED_FLAGS = {
    "0.5.23": {"--cuda-graph-max-bs": ["--cuda-graph-max-bs-decode"],
               "--disable-piecewise-cuda-graph": ["--cuda-graph-backend-prefill", "disabled"]},
}


def flags_for_release(flags, release: str | None = None) -> list:
    """The lab's flags as the SGLang release on the device spells them (SGLANG_RELEASE,
    exported by gpu/device_env.sh; 0.5.11 when unset)."""
    renamed = RENAMED_FLAGS.get(release or os.environ.get("SGLANG_RELEASE", "0.5.11"), {})
    out = []
    for flag in flags:
        out += renamed.get(flag, [flag])
    return out


def plan(profile: str, *, model: str, port: int, draft: str | None = None, tp: int = 1,
         flags=(), env: dict | None = None, threshold: int | str | None = None,
         hysteresis: int | None = None) -> profiles.LaunchPlan:
    """The launch plan of one lab server: `profile` with the lab's overrides."""
    overrides = {"model": _literal(model), "port": int(port), "tp_size": int(tp),
                 "flags": [_literal(f) for f in flags_for_release(flags)],
                 "env": {k: _literal(v) for k, v in (env or {}).items()}}
    if draft:
        overrides["draft_model"] = _literal(draft)
    with _lab_profiles():
        if threshold is not None and is_dyn(profile):
            # as `invoke server start --threshold/--hysteresis` pass them: the profile resolver checks
            # them (an integer, or "auto", which takes no hysteresis)
            overrides["dyn_threshold"] = threshold
            if hysteresis is not None:
                overrides["dyn_hysteresis"] = hysteresis
        return profiles.resolve(host(), profile, overrides)


def script(launch: profiles.LaunchPlan) -> str:
    return render_launch_script(launch)


def start(launch: profiles.LaunchPlan, script_path: str, log) -> subprocess.Popen:
    """Write the rendered launch script and run it in its own session, output to `log`."""
    os.makedirs(launch.server_dir, exist_ok=True)
    pathlib.Path(script_path).write_text(script(launch))
    return subprocess.Popen(["bash", script_path], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)

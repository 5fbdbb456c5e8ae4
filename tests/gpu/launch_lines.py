"""Every server the gpu/ drivers start, built (not started) on the CPU, with its launch line.

`servers()` builds, per driver, the servers its default invocation and each plan in gpu/plans/
would start (the commands in gpu/README.md), keyed "driver/what/label".
tests/gpu/data/launch_before.json is what the drivers built by hand before they launched through
the product (argv with the interpreter as {python}, and the environment each driver added): it
was written by this module's `--record` at commit 75f7976, from those drivers, and its plan keys
renamed with the plans at e7fcde1. Recording again would record today's launch path against
itself, so that entry point is gone; tests/gpu/test_launch_lines.py compares today's rendered
launch scripts with the record flag by flag.
"""
import json
import pathlib
import sys
from types import SimpleNamespace

from tests.gpu.scripts import ROOT, load_gpu_script

# What the device scripts export (gpu/device_env.sh) where the image lacks IPython.
DEVICE_ENV = {"EXTRA_PYTHONPATH": "/tmp/site/_stubs"}
DATA = pathlib.Path(__file__).parent / "data" / "launch_before.json"


def plan_files():
    return sorted((ROOT / "gpu" / "plans").glob("*.json"))


def servers():
    """{key: server object}; needs DEVICE_ENV in os.environ (the drivers read it at build time)."""
    sys.path.insert(0, str(ROOT / "gpu"))
    shapes = load_gpu_script("shapes_device")
    dyn = load_gpu_script("dyn_device")
    out = {}
    small = "baseline,eagle3-stock,eagle3,eagle3-dyn,eagle3-v2,eagle3-v2-dyn,eagle3-naive".split(",")
    for srv in dyn.make_servers([(n, "sharp") for n in small], 0.15):
        out[f"dyn_device/small/{srv.name}"] = srv
    big = "baseline,eagle3,eagle3-dyn,eagle3-v2,eagle3-v2-dyn,baseline-nooverlap".split(",")
    for srv in dyn.make_servers([(n, "big") for n in big], 0.7):
        out[f"dyn_device/big/{srv.name}"] = srv
    smoke = load_gpu_script("smoke_device")
    for tp, spec in ((1, "clean=baseline,noisy=baseline"), (2, "clean=baseline,noisy=baseline,dyn=eagle3-v2-dyn")):
        for label, srv in smoke.make_servers(spec, tp).items():
            out[f"smoke_device/tp{tp}/{label}"] = srv
    metrics = load_gpu_script("metrics_device")
    for tp in (1, 2):
        args = SimpleNamespace(pair="sharp", port=31400, mem=0.5, decode_log_interval=40, tp=tp)
        out[f"metrics_device/tp{tp}/eagle3-v2-dyn"] = metrics.make_server(args)
    accept = load_gpu_script("accept_device")
    for srv in accept.make_servers(list(accept.SERVERS), 8, 0.09, "trained"):
        out[f"accept_device/{srv.label}"] = srv
    first = load_gpu_script("firstcross_device")
    for srv in first.make_servers(list(first.SERVERS), 12, 0.8):
        out[f"firstcross_device/{srv.label}"] = srv
    rare = load_gpu_script("rare_paths_device")
    out["rare_paths_device/sampling/eagle3-v2-dyn"] = rare.sampling_server(["0", "1"])
    for srv in rare.logit_servers(["0"]):
        out[f"rare_paths_device/logit/{srv.label}"] = srv
    for profile in ("eagle3-v2", "eagle3-v2-dyn"):
        out[f"rare_paths_device/memory/{profile}"] = rare.memory_server(profile, 0.885, "0")
    for path in plan_files():
        plan = json.loads(path.read_text())
        if "groups" not in plan:  # a config a plan's server reads, not a plan
            continue
        threshold = int(plan.get("threshold", 8))
        for i, group in enumerate(plan["groups"]):
            group["index"] = i
            specs = group.get("servers") or [shapes.profile_spec(p) for p in group["profiles"]]
            for k, spec in enumerate(specs):
                srv = shapes.Server(group, spec, k, threshold)
                out[f"plans/{path.stem}/{group['name']}/{k}-{srv.label}"] = srv
    return out

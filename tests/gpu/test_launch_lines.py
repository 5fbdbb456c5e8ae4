"""The lab drives the product: every server a gpu/ driver or plan starts is launched by a script
that toolkit.server.profiles + templates/launch.sh.j2 render, and that script starts what the drivers
started before they did (tests/gpu/data/launch_before.json, recorded from the old drivers),
flag by flag, except for the differences listed in EXPECTED_CHANGES."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.gpu import launch_lines
from tests.gpu.scripts import ROOT, load_gpu_script
from tests.helpers import sglang_options

BEFORE = json.loads(launch_lines.DATA.read_text())
# servers a plan no longer starts: the v1 pair of the TP=2 Kimi group, since five TP=2 servers per
# GPU ran out of memory (docs/evidence/dyn-disable-4/3-mla-check-and-tp2-oom, gpu/plan_memory.py)
DROPPED = {"plans/mla-plain-step-equal-and-kimi-tp2-speed/kimi-tp2/3-eagle3",
           "plans/mla-plain-step-equal-and-kimi-tp2-speed/kimi-tp2/4-eagle3-dyn"}


def options(argv):
    """{flag: value} as sglang's argparse reads the command line: the last of a repeated flag
    wins; a flag followed by another flag (or nothing) is a switch."""
    assert argv[1:3] == ["-m", "sglang.launch_server"], argv[:3]
    opts, rest = {}, argv[3:]
    for k, arg in enumerate(rest):
        if arg.startswith("--"):
            nxt = rest[k + 1] if k + 1 < len(rest) else None
            opts[arg] = True if nxt is None or nxt.startswith("--") else nxt
        else:
            assert k > 0 and rest[k - 1].startswith("--"), f"stray argument {arg!r} in {argv}"
    return opts


def rendered(script):
    """(argv, exported environment) of a launch script, read from its text."""
    env, argv = {}, None
    lines = script.replace("\\\n", " ").splitlines()
    for line in lines:
        if line.startswith("export "):
            key, _, value = shlex.split(line[len("export "):])[0].partition("=")
            env[key] = value
        elif line.startswith("exec "):
            argv = shlex.split(line[len("exec "):])
    assert argv is not None, script
    return argv, env


@pytest.fixture(scope="module")
def now(tmp_path_factory):
    """key -> (server, script text) of every server, built by today's drivers."""
    saved = dict(os.environ)
    os.environ.update(launch_lines.DEVICE_ENV)
    for var in ("CUDA_VISIBLE_DEVICES", "DYN_THRESHOLD", "SIM_ACC_LEN", "SGLANG_RELEASE", "TOOLKIT_PROFILES"):
        os.environ.pop(var, None)
    lab = load_gpu_script("lab_launch")
    try:
        return {key: (srv, lab.script(srv.plan)) for key, srv in launch_lines.servers().items()}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def hysteresis_default(threshold):
    # what the patch's policy module chooses when SGLANG_SPEC_DISABLE_HYSTERESIS is unset
    from toolkit.patch import patchsets
    policy = patchsets.added_module("dyn-disable", "sglang/srt/speculative/dyn_disable.py")
    return str(policy.default_hysteresis(int(threshold)))


def expected_changes(old_opts, old_env, srv):
    """What the product's launch path adds to the old command line, none of it a change for
    the server: `--tp-size 1` where the driver left sglang's default (1), the hysteresis the
    patch would have chosen itself, now written out by the dyn profiles, and the checkout's
    files by absolute path. One change that is meant (2026-12-02): sweeps run without the radix
    cache, which had given the baseline alone spurious prefix hits on random ids. The dyn profiles'
    own `--max-running-requests 4096` (they lift sglang's cap of 48 for speculative servers) needs
    no allowance: every recorded server passed the lab's cap after it, and the last one wins
    (test_a_recorded_dyn_server_keeps_its_own_request_cap_after_the_profiles)."""
    opts, env = dict(old_opts), dict(old_env)
    if hasattr(srv, "radix_cache_off") and srv.radix_cache_off(srv.group):  # plan servers only
        opts.setdefault("--disable-radix-cache", True)
    opts.setdefault("--tp-size", "1")
    # a file of the checkout, named relative to the driver's folder (the checkout) before, is
    # absolute now: the script runs in the server's own folder
    opts = {f: str(ROOT / v) if isinstance(v, str) and v.startswith("gpu/") else v for f, v in opts.items()}
    if "SGLANG_SPEC_DISABLE_THRESHOLD" in env:
        env.setdefault("SGLANG_SPEC_DISABLE_HYSTERESIS", hysteresis_default(env["SGLANG_SPEC_DISABLE_THRESHOLD"]))
    return opts, env


def test_every_server_of_every_driver_and_plan_is_still_built(now):
    # plans written after the move have no hand-built line to compare with; every recorded server is still built
    assert set(BEFORE) - DROPPED <= set(now)
    assert not DROPPED & set(now)
    assert len(BEFORE) == 120


@pytest.mark.parametrize("key", sorted(set(BEFORE) - DROPPED))
def test_the_rendered_launch_script_starts_what_the_driver_started(now, key):
    srv, script = now[key]
    argv, env = rendered(script)
    assert argv[0] == sys.executable and argv == srv.plan.argv
    old = BEFORE[key]
    want_opts, want_env = expected_changes(options(old["argv"]), old["env"], srv)
    got_opts = options(argv)
    assert {f: (want_opts.get(f), got_opts.get(f)) for f in set(want_opts) | set(got_opts)
            if want_opts.get(f) != got_opts.get(f)} == {}
    assert {k: (want_env.get(k), env.get(k)) for k in set(want_env) | set(env)
            if want_env.get(k) != env.get(k)} == {}


def test_only_the_listed_changes_were_needed():
    """The allowance above is used, and used only where the old line lacked the item."""
    added_tp = [k for k, v in BEFORE.items() if "--tp-size" not in v["argv"]]
    added_hyst = [k for k, v in BEFORE.items() if "SGLANG_SPEC_DISABLE_THRESHOLD" in v["env"]
                  and "SGLANG_SPEC_DISABLE_HYSTERESIS" not in v["env"]]
    assert {k.split("/")[0] for k in added_tp} == {"dyn_device", "metrics_device"}
    assert len(added_hyst) == 49
    relative = [k for k, v in BEFORE.items() if any(a.startswith("gpu/") for a in v["argv"])]
    assert relative == ["plans/sglang-0517-serves-and-vs-adaptive/peer-0517/2-eagle3-v2-adaptive"]


def test_a_recorded_dyn_server_keeps_its_own_request_cap_after_the_profiles(now):
    """The dyn profiles pass --max-running-requests 4096; a lab server with a numeric cap (a plan
    group's "max_running", 64 unless it says otherwise; the drivers' 64) passes its own after it,
    so sglang's argparse, which keeps a repeated flag's last value, reads what it read before."""
    assert all("--max-running-requests" in v["argv"] for v in BEFORE.values())
    dyn = [k for k in sorted(set(BEFORE) - DROPPED) if now[k][0].plan.dyn_threshold is not None]
    assert len(dyn) == 50
    for key in dyn:
        argv, _ = rendered(now[key][1])
        caps = [argv[k + 1] for k, a in enumerate(argv) if a == "--max-running-requests"]
        old = options(BEFORE[key]["argv"])
        assert caps == ["4096", old["--max-running-requests"]], key
        assert options(argv)["--cuda-graph-max-bs"] == old["--cuda-graph-max-bs"], key
    # one plan server of a group that leaves "max_running" to its default, spelled out
    key = "plans/equal-outputs-and-kimi-tp1-speed/kimi-tp1/2-eagle3-v2-dyn"
    srv, script = now[key]
    assert "max_running" not in srv.group
    argv, _ = rendered(script)
    k = len(argv) - 1 - argv[::-1].index("--max-running-requests")
    assert argv[k:k + 4] == ["--max-running-requests", "64", "--cuda-graph-max-bs", "64"]
    assert argv.index("--max-running-requests") < k and argv[argv.index("--max-running-requests") + 1] == "4096"
    assert options(argv)["--max-running-requests"] == "64"


def test_a_plan_server_runs_its_rendered_script(tmp_path, monkeypatch):
    """One server really started: bash runs the rendered script, whose exec line starts a
    stand-in sglang.launch_server that reports the command line and environment it got."""
    monkeypatch.setenv("EXTRA_PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("LAB_STATE_DIR", str(tmp_path / "state"))
    stand_in = tmp_path / "site" / "sglang"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("")
    (stand_in / "launch_server.py").write_text(
        "import json, os, sys\n"
        "print('ARGS ' + json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(),\n"
        "      'config_readable': os.path.isfile(sys.argv[sys.argv.index('--speculative-adaptive-config') + 1]),\n"
        "      'env': {k: os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'SGLANG_SPEC_DISABLE_THRESHOLD',\n"
        "              'SGLANG_SPEC_DISABLE_HYSTERESIS', 'SGLANG_SIMULATE_ACC_LEN', 'SGLANG_ENABLE_SPEC_V2')}}))\n")
    sys.path.insert(0, str(ROOT / "gpu"))
    shapes = load_gpu_script("shapes_device")
    lab = sys.modules["lab_launch"]  # the one the drivers import
    monkeypatch.setattr(lab, "STATE_DIR", str(tmp_path / "state"))
    group = {"name": "g", "index": 3, "gpus": "1", "pair": "kimi", "mem": 0.5}
    srv = shapes.Server(group, {"profile": "eagle3-v2-dyn", "flags": [
        "--speculative-adaptive-config", "{checkout}/gpu/plans/adaptive-stop-above-8.json"]}, 2, 12)
    log = open(tmp_path / "server.log", "w")
    proc = lab.start(srv.plan, str(tmp_path / "s.launch.sh"), log)
    assert proc.wait(timeout=60) == 0
    log.close()
    line = [l for l in (tmp_path / "server.log").read_text().splitlines() if l.startswith("ARGS ")]
    got = json.loads(line[0][5:])
    assert got["argv"] == srv.plan.argv[3:]
    assert got["cwd"] == str(tmp_path / "state" / "server" / "eagle3-v2-dyn")
    assert got["config_readable"]  # a file of the checkout, found from the server's own folder
    assert got["env"] == {"CUDA_VISIBLE_DEVICES": "1", "SGLANG_SPEC_DISABLE_THRESHOLD": "12",
                          "SGLANG_SPEC_DISABLE_HYSTERESIS": "3", "SGLANG_SIMULATE_ACC_LEN": "2.6",
                          "SGLANG_ENABLE_SPEC_V2": "1"}
    assert subprocess.run(["bash", "-n", str(tmp_path / "s.launch.sh")]).returncode == 0


def test_the_records_name_the_threshold_the_server_was_started_with(now):
    """shapes_device's records say threshold N exactly where the old line set SGLANG_SPEC_DISABLE_THRESHOLD=N."""
    plan_servers = {k: srv for k, (srv, _) in now.items() if hasattr(srv, "meta") and k in BEFORE}
    assert len(plan_servers) > 80
    for key, srv in plan_servers.items():
        old = BEFORE[key]["env"].get("SGLANG_SPEC_DISABLE_THRESHOLD")
        assert srv.meta()["threshold"] == (None if old is None else int(old)), key


def test_on_0523_every_flag_of_every_lab_server_is_one_sglang_0523_takes(monkeypatch):
    """The first 0.5.23 call's eight servers died at argparse ("ambiguous option:
    --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill"):
    with SGLANG_RELEASE=0.5.23 the lab spells them as 0.5.23 does, and nothing else is missing."""
    known = sglang_options("0.5.23")
    assert "--cuda-graph-max-bs" not in known and "--cuda-graph-max-bs-decode" in known
    monkeypatch.setenv("SGLANG_RELEASE", "0.5.23")
    sys.path.insert(0, str(ROOT / "gpu"))
    shapes = load_gpu_script("shapes_device")
    lab = sys.modules["lab_launch"]
    group = {"name": "g", "index": 0, "gpus": "0", "pair": "huge", "mem": 0.5}
    for k, profile in enumerate(["baseline", "eagle3-v2", "eagle3-v2-dyn"]):
        srv = shapes.Server(group, {"profile": profile}, k, 8)
        argv, _ = rendered(lab.script(srv.plan))
        flags = [a for a in argv[3:] if a.startswith("--")]
        assert [f for f in flags if f not in known] == [], profile
        opts = options(argv)
        assert opts["--cuda-graph-max-bs-decode"] == "64" and opts["--cuda-graph-backend-prefill"] == "disabled"

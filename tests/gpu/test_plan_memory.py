"""gpu/plan_memory.py: the GPU-memory estimate of a plan's servers, held to what the device measured,
and gpu/shapes_device.py refusing a plan that does not fit before it starts anything."""
import json
import os
import subprocess
import sys

import pytest

from .scripts import ROOT, load_gpu_script

PLANS = ROOT / "gpu" / "plans"
OLD = ROOT / "tests" / "gpu" / "data" / "plans-0ad2ced"  # the plans as they were at commit 0ad2ced

# the model knobs of each plan's command line (gpu/README.md); a plan not listed runs with run_shapes.sh's defaults
KNOBS = {
    "equal-outputs-and-kimi-tp1-speed": {"KIMI_EXPERTS": "128"},
    "kimi-and-dense-tp1-speed-by-backend": {"HUGE_LAYERS": "16"},
    "gpu-bound-kimi-tp2-speed": {"KIMI_DEEP_LAYERS": "16"},
    "kimi32-tp1-gpu-bound-speed": {"KIMI_DEEP_LAYERS": "32", "KIMI_DEEP_EXPERTS": "16"},
    "sglang-0517-serves-and-vs-adaptive": {"HUGE_LAYERS": "16"},
    "sglang-0523-peers": {"HUGE_LAYERS": "16"},
    "kimi16-tp1-why-dyn-prefills-faster": {"KIMI_DEEP_LAYERS": "16"},
    "kimi16-prefill-and-kimi6-at-measured-acceptance": {"KIMI_DEEP_LAYERS": "16"},
    "native-plain-dense-flashinfer-tp1-at-baseline-cost": {"HUGE_LAYERS": "16"},
    "native-plain-dense-triton-tp1-at-baseline-cost": {"HUGE_LAYERS": "16"},
    "native-plain-dense-flashinfer-tp1-defer-h100": {"HUGE_LAYERS": "16"},
    "native-plain-dense-triton-tp1-defer-h100": {"HUGE_LAYERS": "16"},
    "native-plain-dense-triton-tp1-c1-aa": {"HUGE_LAYERS": "16"},
    "native-plain-dense-fi-tp1-c1-ab": {"HUGE_LAYERS": "16"},
    "native-plain-kimi32-tp1-at-baseline-cost": {"KIMI_DEEP_LAYERS": "32", "KIMI_DEEP_EXPERTS": "16"},
    "native-plain-kimi16-tp2-at-baseline-cost": {"KIMI_DEEP_LAYERS": "16"},
}
# the plans gpu/README.md's evidence table says ran on the device with every server up
RAN = ["equal-outputs-and-kimi-tp1-speed", "kimi-and-dense-tp1-speed-by-backend", "tp2-equal-outputs-ranks-in-lockstep",
       "kimi-tp1-plain-step-traces-and-v1-speed", "kimi-tp1-speed-after-plain-step-fix", "kimi-tp1-plain-step-host-cost",
       "gpu-bound-kimi-tp2-speed", "kimi-tp2-speed", "kimi-tp1-why-dyn-is-slower-at-c1",
       "sglang-0517-serves-and-vs-adaptive", "sglang-0517-sm120-under-dyn-tp1", "sglang-0517-sm120-under-dyn-tp2",
       "kimi32-tp1-gpu-bound-speed", "kimi-tp2-c1-do-two-stock-servers-agree", "tiny-tp1-does-a-torch-profile-slow-a-server",
       "native-plain-dense-flashinfer-tp1-at-baseline-cost", "native-plain-kimi32-tp1-at-baseline-cost",
       "native-plain-dense-flashinfer-tp1-defer-h100", "native-plain-dense-triton-tp1-defer-h100",
       "native-plain-dense-triton-tp1-c1-aa"]


@pytest.fixture(scope="module")
def pm():
    return load_gpu_script("plan_memory")


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    """The plans here were written for an H200; a machine with another GPU must not change them."""
    monkeypatch.setenv("GPU_CAPACITY_GIB", "139.80")


def load(path):
    return json.loads(path.read_text())


def refusal(pm, path):
    plan = load(path)
    return pm.refusal(plan, pm.shapes_for(pm.plan_pairs(plan), KNOBS.get(path.stem, {})))


def test_the_plans_that_ran_out_of_memory_on_the_device_are_refused(pm):
    # three 16-layer Kimi servers (kimi16-prefill-and-cap/1 of 2026-12-02: 56.58 + 54.81 GiB, the third died loading)
    msg = refusal(pm, OLD / "kimi16-tp1-why-dyn-prefills-faster.json")
    assert msg is not None and "group kimi16-prefill-tp1 on GPU 0" in msg
    assert "baseline-cap48" in msg and "eagle3-v2-dyn" in msg and "\n" not in msg
    total = float(msg.split(" = ")[1].split(" GiB")[0])
    assert total > 139.8
    # four 6-layer Kimi servers (kimi16-prefill-and-cap/2: 34.72 + 38.53 + 39.01 GiB, the fourth died loading)
    msg = refusal(pm, OLD / "native-plain-kimi6-tp1-at-baseline-cost.json")
    assert msg is not None and "group native-kimi6-tp1" in msg and "eagle3-v2-dyn-native" in msg
    # the same four in the combined plan's second group, which ran after the 16-layer group
    msg = refusal(pm, OLD / "kimi16-prefill-and-kimi6-at-measured-acceptance.json")
    assert msg is not None and "group kimi6-acc25-tp1 on GPU 0" in msg and "kimi16" not in msg
    # five TP=2 Kimi servers per GPU (docs/evidence/dyn-disable-4/3: the v1 server's OOM in warm-up)
    assert "group mla-check + kimi-tp2" in refusal(pm, OLD / "mla-plain-step-equal-and-kimi-tp2-speed.json")
    # three 32-layer Kimi servers: 55 GiB of weights each
    assert refusal(pm, OLD / "native-plain-kimi32-tp1-at-baseline-cost.json") is not None


@pytest.mark.parametrize("name", RAN)
def test_every_plan_that_ran_on_the_device_fits(pm, name):
    assert refusal(pm, PLANS / f"{name}.json") is None


def test_every_plan_of_today_fits(pm):
    plans = [p for p in sorted(PLANS.glob("*.json")) if "groups" in load(p)]
    assert len(plans) > 20
    assert {p.name: refusal(pm, p) for p in plans} == {p.name: None for p in plans}


@pytest.mark.parametrize("key,measured", [
    (("kimi", 6, 64, 1), 33.13), (("kimi", 6, 64, 2), 16.69), (("kimi", 6, 128, 1), 59.38),
    (("kimideep", 16, 32, 1), 49.17), (("kimideep", 16, 32, 2), 24.84), (("kimideep", 32, 16, 1), 55.14),
    (("huge", 16, None, 1), 14.56)])
def test_the_weights_estimate_covers_what_sglang_loaded(pm, key, measured):
    """"Load weight end ... mem usage" of the evidence logs: never under it, at most 3 % over."""
    pair, layers, experts, tp = key
    est = pm.weights_gib(pair, {"layers": layers, "experts": experts}, tp)
    assert measured <= est <= 1.03 * measured


@pytest.mark.parametrize("pair,shape,profile,tp,kv,max_running,measured", [
    # per-process "GiB memory in use" listed by the CUDA OOM lines of the device runs
    ("kimi", (6, 64), "baseline", 1, 65536, 64, 34.72),                 # kimi16-prefill-and-cap/2
    ("kimi", (6, 64), "eagle3-v2", 1, 65536, 64, 38.53),
    ("kimi", (6, 64), "eagle3-v2-dyn", 1, 65536, 64, 39.01),
    ("kimideep", (16, 32), "baseline", 1, 262144, None, 56.58),          # kimi16-prefill-and-cap/1, sglang's own cap
    ("kimideep", (16, 32), "baseline", 1, 262144, 48, 54.81),            # capped at 48
    ("kimi", (6, 64), "baseline", 2, 65536, 64, 24.80),                  # dyn-disable-4/3, TP=2
    ("kimi", (6, 64), "eagle3-v2", 2, 65536, 64, 27.97),
    ("kimi", (6, 64), "eagle3-v2-dyn", 2, 65536, 64, 28.33),
    ("kimi", (6, 64), "eagle3", 2, 65536, 64, 29.33),
    ("kimi", (6, 64), "eagle3-dyn", 2, 65536, 64, 29.34)])
def test_a_server_estimate_covers_what_the_device_measured(pm, pair, shape, profile, tp, kv, max_running, measured):
    est, _ = pm.server_gib(pair, {"layers": shape[0], "experts": shape[1]}, profile, tp, kv, max_running)
    assert measured <= est <= measured + 1.5


def kimi_group(name, profiles, **extra):
    return dict({"name": name, "gpus": "0", "mode": "sweep", "side_by_side": True, "tp": 1,
                 "kv_tokens": 65536, "pair": "kimi", "profiles": profiles}, **extra)


KIMI6 = {"kimi": {"layers": 6, "experts": 64}, "kimideep": {"layers": 16, "experts": 32}}


def test_groups_that_run_after_each_other_are_not_added_up(pm):
    three = ["baseline", "eagle3-v2-dyn", "eagle3-v2"]
    together = {"groups": [kimi_group("a", three), kimi_group("b", three)]}
    assert pm.refusal(together, KIMI6) is not None
    chained = {"groups": [kimi_group("a", three), kimi_group("b", three, after="a")]}
    assert pm.refusal(chained, KIMI6) is None
    # through a third group: c runs after b, which runs after a
    chain3 = {"groups": [kimi_group("a", three), kimi_group("b", ["baseline"], after="a"),
                         kimi_group("c", three, after="b")]}
    assert pm.refusal(chain3, KIMI6) is None
    # start_after_healthy orders the start only: both groups stay resident
    healthy = {"groups": [kimi_group("a", three), kimi_group("b", three, start_after_healthy="a")]}
    assert "group a + b on GPU 0" in pm.refusal(healthy, KIMI6)


def test_a_sweep_without_side_by_side_holds_one_server_at_a_time(pm):
    four = ["baseline", "eagle3-v2", "eagle3-v2-dyn", "eagle3-v2-dyn-native"]
    assert pm.refusal({"groups": [kimi_group("a", four)]}, KIMI6) is not None
    one_by_one = {"groups": [kimi_group("a", four, side_by_side=False)]}
    assert pm.refusal(one_by_one, KIMI6) is None
    peak = pm.estimate(one_by_one, KIMI6)[0]
    assert len(peak["servers"]) == 1 and peak["servers"][0][0] != "baseline"  # a speculative one is the largest


def test_groups_on_other_gpus_do_not_add_up_and_tp_splits_the_weights(pm):
    three = ["baseline", "eagle3-v2-dyn", "eagle3-v2"]
    apart = {"groups": [kimi_group("a", three), kimi_group("b", three, gpus="1")]}
    assert pm.refusal(apart, KIMI6) is None
    assert sorted(w["gpu"] for w in pm.estimate(apart, KIMI6)) == [0, 1]
    # the same five servers at TP=2 over both GPUs ran out of memory; three at TP=2 did not
    five = ["baseline", "eagle3-v2", "eagle3-v2-dyn", "eagle3", "eagle3-dyn"]
    assert pm.refusal({"groups": [kimi_group("t", five, gpus="0,1", tp=2)]}, KIMI6) is not None
    tp2 = pm.estimate({"groups": [kimi_group("t", three, gpus="0,1", tp=2)]}, KIMI6)
    assert [w["gpu"] for w in sorted(tp2, key=lambda w: w["gpu"])] == [0, 1]
    tp1 = pm.estimate({"groups": [kimi_group("t", three)]}, KIMI6)[0]["total"]
    assert tp2[0]["total"] < tp1


def test_a_pool_sized_from_the_memory_fraction_takes_what_it_finds_free(pm):
    """kv_tokens null: sglang keeps mem x (free memory at its start) for weights and KV, so a second
    such server after a first finds less, and a plan of two at 0.9 does not leave the second room."""
    one = pm.estimate({"groups": [kimi_group("a", ["baseline"], kv_tokens=None, mem=0.5)]}, KIMI6)[0]
    assert 0.5 * 139.8 - 1 < one["total"] < 0.5 * 139.8 + 2
    assert pm.refusal({"groups": [kimi_group("a", ["baseline"] * 2, kv_tokens=None, mem=0.9)]}, KIMI6) is not None


def test_the_shapes_come_from_the_models_the_device_holds_before_the_knobs(pm, tmp_path):
    (tmp_path / "target-kimideep").mkdir()
    (tmp_path / "target-kimideep" / "config.json").write_text(
        json.dumps({"num_hidden_layers": 32, "n_routed_experts": 16}))
    shapes = pm.shapes_for({"kimideep", "kimi"}, {"KIMI_DEEP_LAYERS": "16", "KIMI_LAYERS": "8"}, str(tmp_path))
    assert shapes == {"kimideep": {"layers": 32, "experts": 16}, "kimi": {"layers": 8, "experts": 64}}
    # 16 layers and 32 experts fit two servers of the fixed kimi16 plan, 32 layers and 16 experts do not
    plan = load(PLANS / "kimi16-tp1-why-dyn-prefills-faster.json")
    assert pm.refusal(plan, pm.shapes_for({"kimideep"}, {"KIMI_DEEP_LAYERS": "16"})) is None
    assert pm.refusal(plan, shapes) is not None


def test_shapes_device_refuses_a_plan_that_does_not_fit_before_it_starts_anything(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), KIMI_DEEP_LAYERS="16")
    env.pop("SKIP_MEMORY_CHECK", None)
    done = subprocess.run([sys.executable, str(ROOT / "gpu" / "shapes_device.py"),
                           str(OLD / "kimi16-tp1-why-dyn-prefills-faster.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 3, done.stderr[-2000:]
    lines = [l for l in done.stdout.splitlines() if "plan refused" in l]
    assert len(lines) == 1 and "kimi16-prefill-tp1" in lines[0] and "GiB" in lines[0]
    assert not out.exists()  # nothing written, no server started


def test_the_override_lets_a_refused_plan_through(monkeypatch):
    shapes = load_gpu_script("shapes_device")
    plan = load(OLD / "kimi16-tp1-why-dyn-prefills-faster.json")
    monkeypatch.setenv("KIMI_DEEP_LAYERS", "16")
    monkeypatch.delenv("SKIP_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(shapes, "MODELS", "/nonexistent-models")
    assert "plan refused" in shapes.memory_refusal(plan)
    assert shapes.memory_refusal(plan, skip=True) is None
    monkeypatch.setenv("SKIP_MEMORY_CHECK", "1")
    assert shapes.memory_refusal(plan) is None


def test_run_shapes_refuses_before_its_setup_and_the_override_is_honoured(tmp_path):
    """run_shapes.sh checks the plan before it makes the site and models (device time): a refused
    plan ends it with status 3 and one line, and nothing under OUT."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), KIMI_DEEP_LAYERS="16", MODELS_DIR=str(tmp_path / "no-models"))
    env.pop("SKIP_MEMORY_CHECK", None)
    done = subprocess.run(["bash", "gpu/run_shapes.sh", str(OLD / "native-plain-kimi6-tp1-at-baseline-cost.json")],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 3
    assert done.stdout.count("plan refused") == 1 and "native-kimi6-tp1" in done.stdout
    assert not out.exists()
    check = [sys.executable, str(ROOT / "gpu" / "plan_memory.py"), "--check"]
    fixed = subprocess.run(check + [str(PLANS / "native-plain-kimi6-tp1-at-baseline-cost.json")],
                           capture_output=True, text=True, timeout=60, env=env)
    assert (fixed.returncode, fixed.stdout) == (0, "")
    skipped = subprocess.run(check + [str(OLD / "native-plain-kimi6-tp1-at-baseline-cost.json")],
                             capture_output=True, text=True, timeout=60, env=dict(env, SKIP_MEMORY_CHECK="1"))
    assert (skipped.returncode, skipped.stdout) == (0, "")


def test_a_request_cap_given_as_a_flag_is_read_from_its_value(pm):
    """sglang caps a speculative server at 48 unless --max-running-requests says otherwise: the dyn
    profiles pass 4096 themselves (sglang resolves what a baseline would), so a dyn server with
    the cap left to the profile holds the baseline's larger request table, as stock eagle3-v2
    lifted with a flag does; a dyn server capped at 48 by its entry's flag (after the profile's)
    does not, nor does a group's numeric max_running (the lab's cap, after the profile's too)."""
    def gib(profile, flags, max_running=None):
        group = dict(kimi_group("a", [{"profile": profile, "flags": flags}]), max_running=max_running)
        (server,) = pm.group_servers(group, KIMI6)
        return server["gib"]
    stock_capped = gib("eagle3-v2", [])
    assert gib("eagle3-v2", ["--max-running-requests", "2048"]) == pytest.approx(stock_capped + pm.UNCAPPED_BASELINE_GIB)
    assert gib("eagle3-v2-dyn", []) == pytest.approx(stock_capped + pm.UNCAPPED_BASELINE_GIB)
    assert gib("eagle3-v2-dyn", ["--max-running-requests", "2048"]) == pytest.approx(gib("eagle3-v2-dyn", []))
    assert gib("eagle3-v2-dyn", ["--max-running-requests", "48"]) == pytest.approx(stock_capped)
    assert gib("eagle3-v2-dyn", [], max_running=64) == pytest.approx(stock_capped)
    # the lab's profiles that extend eagle3-v2-dyn inherit its flags, the cap with them
    assert pm.profile_cap("eagle3-v2-dyn-native") == pm.profile_cap("eagle3-dyn") == 4096
    assert pm.profile_cap("eagle3-v2") is None and pm.profile_cap("baseline") is None


def test_run_shapes_stops_when_its_setup_fails(tmp_path):
    """A failed setup (a warm machine's /tmp/site of another release, the eleventh session's lost
    call) ends run_shapes.sh with status 4 before any server starts. The real run_shapes.sh,
    plan_memory.py and device_env.sh run from a copy of gpu/ whose run_dyn.sh fails and whose
    shapes_device.py would leave a mark."""
    import shutil
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    for name in ("run_shapes.sh", "plan_memory.py", "device_env.sh", "release.sh"):
        shutil.copy(ROOT / "gpu" / name, gpu / name)
    (gpu / "run_dyn.sh").write_text('echo "/tmp/site holds another sglang"; exit 1\n')
    (gpu / "shapes_device.py").write_text(f'open({str(tmp_path / "started")!r}, "w").close()\n')
    out = tmp_path / "out"
    done = subprocess.run(["bash", "gpu/run_shapes.sh", str(PLANS / "native-plain-kimi6-tp1-at-baseline-cost.json")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=dict(os.environ, OUT=str(out)))
    assert done.returncode == 4, done.stdout + done.stderr
    assert "holds another sglang" in done.stdout and "setup failed: nothing started" in done.stdout
    assert not (tmp_path / "started").exists()
    (gpu / "run_dyn.sh").write_text("exit 0\n")
    done = subprocess.run(["bash", "gpu/run_shapes.sh", str(PLANS / "native-plain-kimi6-tp1-at-baseline-cost.json")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=dict(os.environ, OUT=str(out)))
    assert (tmp_path / "started").exists(), done.stdout + done.stderr


def test_the_capacity_is_the_gpu_that_came(pm):
    """An H100 came for nvidia-h200 on 2026-12-05 and a plan sized for an H200 died loading its
    third server ("a total capacity of 79.18 GiB")."""
    env = {}
    assert pm.gpu_capacity_gib(env, smi="81559\n") == pytest.approx(79.05)          # an H100
    assert pm.gpu_capacity_gib(env, smi="143771\n143771\n") == pytest.approx(139.8)  # H200s
    assert pm.gpu_capacity_gib(env, smi="143771\n81559\n") == pytest.approx(79.05)   # the smallest counts
    assert pm.gpu_capacity_gib(env, smi="") == pm.CAPACITY_GIB                       # no GPU: an H200 assumed
    assert pm.gpu_capacity_gib({"GPU_CAPACITY_GIB": "50"}, smi="81559") == 50.0


def test_a_plan_sized_for_an_h200_is_refused_on_an_h100_and_its_h100_variant_fits(pm, monkeypatch):
    monkeypatch.setenv("GPU_CAPACITY_GIB", "79.05")
    msg = refusal(pm, PLANS / "native-plain-kimi6-tp1-defer-whole-waves.json")
    assert msg is not None and "> 77.0 GiB" in msg and "eagle3-v2-dyn-native-defer" in msg
    assert refusal(pm, PLANS / "native-plain-kimi6-tp1-defer-h100.json") is None
    # the dense target's five- and four-server plans (100.5 and 82.4 GiB) and their H100 variants, which ran
    # there with every server up (docs/evidence/plain-at-baseline section 12), and the c=1 A/A plan
    for full, h100 in (("native-plain-dense-flashinfer-tp1-at-baseline-cost", "native-plain-dense-flashinfer-tp1-defer-h100"),
                       ("native-plain-dense-triton-tp1-at-baseline-cost", "native-plain-dense-triton-tp1-defer-h100")):
        assert "> 77.0 GiB" in refusal(pm, PLANS / f"{full}.json")
        assert refusal(pm, PLANS / f"{h100}.json") is None
    assert refusal(pm, PLANS / "native-plain-dense-triton-tp1-c1-aa.json") is None   # ran there (section 13)
    assert refusal(pm, PLANS / "native-plain-dense-fi-tp1-c1-ab.json") is None

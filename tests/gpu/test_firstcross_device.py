"""gpu/firstcross_device.py on the CPU: its gap protocol and summary against stand-ins of SGLang's
/generate (tests/gpu/accept_standin.py) on loopback, the smoke servers' table from smoke results
shaped as dyn_device.run_smoke returns them, and the servers it would start."""
import asyncio
import json
import os

import aiohttp
import pytest

from tests.gpu import accept_standin as sa
from tests.gpu.scripts import load_gpu_script

fc = load_gpu_script("firstcross_device")
ad = fc.ad
THRESHOLD = 3


class CompilingStandIn(sa.StandIn):
    """Writes a file into its tvm-ffi cache the first time drafting stops, as a lazily
    JIT-compiled kernel of the plain step would."""

    def __init__(self, log_path, jit_file=None, **kw):
        super().__init__(log_path, **kw)
        self.jit_file = jit_file

    async def step(self, *args):  # the stand-in's own arguments, whichever they are
        out = await super().step(*args)
        if self.off and self.jit_file and not os.path.exists(self.jit_file):
            os.makedirs(os.path.dirname(self.jit_file), exist_ok=True)
            with open(self.jit_file, "w") as f:
                f.write("so")
        return out


def plan(crossings):
    return fc.make_plan(THRESHOLD, crossings, 2 * THRESHOLD + 2, 10, span_tokens=40)


def smoke_result(longest_s, stalled):
    """What dyn_device.run_smoke returns, with the smoke's burst_gaps (toolkit/check/smoke.py)."""
    return {"ok": not stalled, "burst_gaps": {"longest_s": longest_s, "median_s": 0.02, "bound_s": 2.0,
                                              "stalled": stalled, "gaps": 400, "judged": True},
            "checks": [{"check": "stream", "status": "pass", "seconds": 1.0, "detail": ""},
                       {"check": "burst", "status": "fail" if stalled else "pass", "seconds": 3.0,
                        "detail": f"longest gap {longest_s * 1000:.0f} ms"}]}


async def run_all(tmp_path, crossings=3, budget=300, smoke_raises=False):
    ad.BUDGET = ad.el() + budget
    jit_root = str(tmp_path / "jit")
    knobs = {"stock": {"accept": 2.5},
             "old-a": {"accept": 2.5, "threshold": THRESHOLD, "first_off_stall_s": 1.0},
             "new-a": {"accept": 2.5, "threshold": THRESHOLD}}
    handles = []
    for label, kw in knobs.items():
        dirs = fc.jit_dirs(label, jit_root)
        os.makedirs(dirs["triton"][1])
        with open(os.path.join(dirs["triton"][1], "at-start.cubin"), "w") as f:
            f.write("x")
        lazy = os.path.join(dirs["tvm-ffi"][1], "clamp_position_abc123", "clamp_position.so")
        if label == "new-a":  # the fix compiles it at start
            os.makedirs(os.path.dirname(lazy))
            with open(lazy, "w") as f:
                f.write("so")
        standin = CompilingStandIn(str(tmp_path / f"{label}.log"), jit_file=lazy if label == "old-a" else None, **kw)
        if label == "new-a":
            standin.write("[TP0] Dynamic speculation disable enabled: threshold=3 hysteresis=1")
            standin.write("[TP0] Dynamic speculation disable: plain step is a decode forward on TritonAttnBackend; "
                          "extra GPU memory 0.42 GiB (0.50 GiB kept out of the KV cache for it)")
        h = await sa.serve(label, standin, None)
        h.jit_dirs, h.shared_jit_dirs = dirs, {}
        handles.append(h)

    class SmokeOnly:  # a "-b" server: only the smoke talks to it
        def __init__(self, label):
            self.label, self.name = label, label
            self.jit_dirs, self.shared_jit_dirs = fc.jit_dirs(label, jit_root), {}

        def alive(self):
            return True

        def read_log(self):
            return ""

    smoked = []

    async def smoke_fn(srv):
        smoked.append(srv.label)
        if smoke_raises:
            raise RuntimeError("connection refused")
        await asyncio.sleep(0.05)
        return smoke_result(7.0, True) if srv.label == "old-b" else smoke_result(0.3, False)

    servers = handles + [SmokeOnly("old-b"), SmokeOnly("new-b")]
    prompts = fc.make_prompts(fc.prompts_needed(plan(crossings)), 6)
    try:
        async with aiohttp.ClientSession() as s:
            result = await fc.measure(s, servers, prompts, plan(crossings), str(tmp_path), smoke_fn=smoke_fn,
                                      reserve_s=5)
    finally:
        for h in handles:
            await h.runner.cleanup()
    return result, smoked


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("firstcross")
    res, smoked = asyncio.run(run_all(tmp))
    return tmp, res, smoked


def test_runs_in_the_issues_form_for_the_gap_servers_only(result):
    tmp, res, _ = result
    assert json.loads((tmp / "firstcross.json").read_text()) == json.loads(json.dumps(res))
    runs = {r["server"]: r for r in res["runs"]}
    assert set(runs) == {"stock", "old-a", "new-a"}
    assert {r["patch"] for r in runs.values()} == {"stock", "before-fix", "after-fix"}
    for r in runs.values():
        for k in ("tp", "first_crossing_max_gap_ms", "later_crossings_max_gap_ms_median",
                  "first_resume_max_gap_ms", "later_resumes_max_gap_ms_median", "median_step_ms",
                  "jit_new_after_healthy"):
            assert k in r, k
        assert r["tp"] == 1 and r["crossings"] == 3 and r["errors"] == 0
    records = [json.loads(x) for x in (tmp / "records.jsonl").read_text().splitlines()]
    # 3 gap servers x 3 crossings x 8 burst requests (+ spanning and resume ones); none to the smoke servers
    assert sum(1 for r in records if r["phase"] == "burst") == 3 * 3 * 8
    assert sum(1 for r in records if r["phase"] == "span") >= 3 * 3
    assert {r["server"] for r in records} == {"stock", "old-a", "new-a"}
    # every request had a prompt of its own (a radix-cache hit would make a later prefill cheaper)
    for label in ("stock", "old-a", "new-a"):
        heads = [tuple(r["prompt_head"]) for r in records if r["server"] == label]
        assert len(set(heads)) == len(heads) >= 30
    assert all(r["prompt_ids"] is None and r["prompt_len"] == 6 and len(r["prompt_head"]) == 4 for r in records)


def test_the_first_crossings_stall_and_what_it_compiled(result):
    _, res, _ = result
    runs = {r["server"]: r for r in res["runs"]}
    old, new = runs["old-a"], runs["new-a"]
    # the stand-in stalls 1 s once; a loaded client can read a gap shorter by a loop latency
    assert old["first_crossing_max_gap_ms"] >= 500
    assert old["first_crossing_max_gap_ms"] > 3 * old["later_crossings_max_gap_ms_median"]
    assert new["first_crossing_max_gap_ms"] < 500
    assert old["jit_new_after_healthy"] == ["tvm-ffi:clamp_position_abc123"]
    assert old["jit_new_after_healthy_files"] == ["tvm-ffi:clamp_position_abc123/clamp_position.so"]
    # what was there when the server turned healthy is not "new"
    assert new["jit_new_after_healthy"] == [] and runs["stock"]["jit_new_by_end"] == []
    assert new["jit_at_healthy_beyond_stock"] == ["tvm-ffi:clamp_position_abc123"]
    assert old["jit_at_healthy_beyond_stock"] == [] and runs["stock"]["jit_at_healthy_beyond_stock"] is None


def test_startup_memory_and_transitions(result):
    _, res, _ = result
    assert res["startup"]["new-a"]["extra_gpu_memory_gib"] == 0.42
    assert res["startup"]["new-a"]["patch"] == "after-fix"
    assert res["startup"]["old-a"]["extra_gpu_memory_gib"] is None  # a line without the figure
    assert "stock" not in res["startup"]
    assert res["transitions"]["old-a"]["stopped_lines"] == 3
    assert res["transitions"]["stock"]["stopped_lines"] == 0


def test_startup_memory_reads_the_plain_path_line_and_keeps_a_negative_figure():
    """The figure is on the plain-path line, after the 'enabled' line; beside other servers on one GPU
    it can be negative (another process freed memory during the start: 2026-12-05, call 10)."""
    lines = ["[2026-12-05 10:52:02] Dynamic speculation disable enabled: threshold=12 hysteresis=3",
             "[2026-12-05 10:52:21] Dynamic speculation disable: plain step is a decode forward on "
             "TritonAttnBackend ...; extra GPU memory -13.58 GiB (0.50 GiB kept out of the KV cache for it)"]
    line, gib = fc.startup_memory(lines)
    assert gib == -13.58 and "plain step" in line
    assert fc.startup_memory(lines[:1]) == (lines[0], None)
    assert fc.startup_memory(["INFO other"]) == (None, None)


def test_smoke_table_of_the_b_servers(result):
    _, res, smoked = result
    assert sorted(smoked) == ["new-b", "old-b"]
    old, new = res["smoke"]["old-b"], res["smoke"]["new-b"]
    assert old["patch"] == "before-fix" and old["ok"] is False and old["burst_status"] == "fail"
    assert old["burst_longest_gap_ms"] == 7000.0 and old["burst_bound_ms"] == 2000.0 and old["burst_stalled"]
    assert new["ok"] is True and new["burst_status"] == "pass" and new["burst_median_step_ms"] == 20.0
    assert old["checks"] == {"stream": "pass", "burst": "fail"}


def test_a_smoke_that_raises_is_recorded_and_the_gaps_still_measured(tmp_path):
    res, _ = asyncio.run(run_all(tmp_path, crossings=2, smoke_raises=True))
    assert res["smoke"]["old-b"]["ok"] is False and "connection refused" in res["smoke"]["old-b"]["error"]
    assert len(res["runs"]) == 3 and all(r["crossings"] == 2 for r in res["runs"])


def test_budget_stops_crossings_early_and_still_writes_firstcross(tmp_path):
    res, _ = asyncio.run(run_all(tmp_path, crossings=10_000, budget=15))
    runs = {r["server"]: r for r in res["runs"]}
    assert 1 <= runs["old-a"]["crossings"] < 10_000
    assert ad.left() > 0
    assert (tmp_path / "firstcross.json").exists()


def test_jit_modules_names_the_compiled_units():
    entries = ["tvm-ffi:clamp_position_ab12/build.ninja", "tvm-ffi:clamp_position_ab12/clamp_position.so",
               "triton:XYZ/_fwd_kernel.cubin", "triton:XYZ/_fwd_kernel.json",
               "flashinfer(shared):90/cached_ops/norm/norm.so"]
    assert fc.jit_modules(entries) == ["flashinfer(shared):90/cached_ops/norm", "triton:_fwd_kernel",
                                       "tvm-ffi:clamp_position_ab12"]


def test_prompts_share_no_prefix():
    ps = fc.make_prompts(520, 1024)
    assert len(ps) == 520 and all(len(p) == 1024 for p in ps)
    assert len({tuple(p[:2]) for p in ps}) == 520


def test_servers_run_the_profiles_on_their_sglang_with_their_own_jit_caches():
    servers = {s.label: s for s in fc.make_servers(list(fc.SERVERS), 12, 0.8, jit_root="/tmp/fc-jit")}
    assert set(servers) == {"stock", "old-a", "old-b", "new-a", "new-b"}
    ports = {s.port for s in servers.values()}
    assert len(ports) == 5 and min(ports) >= 30500  # clear of the accept run's 30000..30060
    first = {label: s.env["PYTHONPATH"].split(":")[0] for label, s in servers.items()}
    assert first == {"stock": "/tmp/stock", "old-a": "/tmp/site-r8", "old-b": "/tmp/site-r8",
                     "new-a": "/tmp/site", "new-b": "/tmp/site"}
    for label, s in servers.items():
        cmd = s.cmd
        assert cmd[cmd.index("--model-path") + 1].endswith("/target-kimi") and "dummy" in cmd
        assert cmd[len(cmd) - cmd[::-1].index("--decode-log-interval")] == "1"
        assert s.env["TVM_FFI_CACHE_DIR"] == f"/tmp/fc-jit/{label}/tvm-ffi"
        assert s.env["TRITON_CACHE_DIR"] == f"/tmp/fc-jit/{label}/triton"
        assert "SGLANG_SIMULATE_ACC_LEN" in s.env
        assert s.env.get("SGLANG_SPEC_DISABLE_THRESHOLD") == (None if label == "stock" else "12")
    assert len({s.env["TVM_FFI_CACHE_DIR"] for s in servers.values()}) == 5


def test_the_old_and_new_servers_can_run_another_profile_and_patch_stack(monkeypatch):
    """run_firstcross.sh's FC_PROFILE / FC_OLD: both dyn sides on the native plain path, the old one
    named after its fixture; stock stays stock."""
    monkeypatch.setattr(fc, "SERVERS", dict(fc.SERVERS))
    fc.configure_servers("eagle3-v2-dyn-native", "dyn-disable-before-spec-warmup", "spec-warmup")
    servers = {s.label: s for s in fc.make_servers(list(fc.SERVERS), 12, 0.8, jit_root="/tmp/fc-jit")}
    assert {label: s.env.get("SGLANG_SPEC_DISABLE_PLAIN_PATH") for label, s in servers.items()} == {
        "stock": None, "old-a": "native", "old-b": "native", "new-a": "native", "new-b": "native"}
    assert {label: s.env["PYTHONPATH"].split(":")[0] for label, s in servers.items()}["old-a"] == "/tmp/site-r8"
    assert [fc.patch_of(label) for label in ("stock", "old-a", "new-b")] == [
        "stock", "dyn-disable-before-spec-warmup", "spec-warmup"]


def run_main(tmp_path, **env_extra):
    """The driver as run_firstcross.sh runs it, its five servers started as processes (a stand-in
    sglang.launch_server on loopback), the real toolkit smoke against the -b ones."""
    import subprocess
    import sys
    from tests.gpu.scripts import ROOT
    env = dict(os.environ, EXTRA_PYTHONPATH=str(ROOT / "tests" / "gpu" / "fake_sglang"),
               LAB_STATE_DIR=str(tmp_path / "lab-state"), **env_extra)
    out, jit = tmp_path / "out", tmp_path / "jit"
    return out, subprocess.run([sys.executable, str(ROOT / "gpu" / "firstcross_device.py"), "--out", str(out),
                        "--budget-s", "120", "--threshold", "3", "--burst", "8", "--prompt-len", "6",
                        "--answer-tokens", "10", "--crossings", "3", "--models", str(tmp_path / "models"),
                        "--jit-root", str(jit), "--logs", str(tmp_path / "logs")], env=env, capture_output=True, text=True, timeout=300)


def test_main_end_to_end_on_stand_in_servers(tmp_path):
    out, p = run_main(tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "firstcross.json").read_text())
    assert all(w is not None for w in res["healthy_after_s"].values()), res["healthy_after_s"]
    runs = {r["server"]: r for r in res["runs"]}
    assert set(runs) == {"stock", "old-a", "new-a"} and all(r["crossings"] == 3 for r in runs.values())
    assert runs["old-a"]["first_crossing_max_gap_ms"] >= 500 > runs["new-a"]["first_crossing_max_gap_ms"]
    assert runs["old-a"]["jit_new_after_healthy"] == ["tvm-ffi:clamp_position_0"]
    assert runs["new-a"]["jit_at_healthy_beyond_stock"] == ["tvm-ffi:clamp_position_0"]
    assert {k: v["extra_gpu_memory_gib"] for k, v in res["startup"].items()} == {
        "old-a": 0.12, "old-b": 0.12, "new-a": 0.31, "new-b": 0.31}
    assert set(res["smoke"]) == {"old-b", "new-b"}  # the stand-in has no /v1: the smoke fails, and says so
    assert all(row["ok"] is False for row in res["smoke"].values())
    assert res["transitions"]["old-a"]["stopped_lines"] == 3
    assert (out / "firstcross_logs_scan.json").exists()


def test_main_measures_the_servers_that_came_up_when_others_died_at_start(tmp_path):
    out, p = run_main(tmp_path, FAKE_SGLANG_OLD_DIES="1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "firstcross.json").read_text())
    assert res["healthy_after_s"]["old-a"] is None and res["healthy_after_s"]["old-b"] is None
    assert res["healthy_after_s"]["new-a"] is not None
    assert {r["server"] for r in res["runs"]} == {"stock", "new-a"}
    assert set(res["smoke"]) == {"new-b"}
    scan = json.loads((out / "firstcross_logs_scan.json").read_text())
    assert scan["old-a"]["error_lines"] >= 1  # the dead server's last words are in the scan

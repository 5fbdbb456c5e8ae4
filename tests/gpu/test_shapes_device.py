"""gpu/shapes_device.py's plan options that need no GPU: the servers a plan entry describes, and
the toolkit's smoke run on a group's servers (against the loopback stand-in of tests/client,
since no SGLang server runs here)."""
import asyncio

import aiohttp
import pytest

from tests.client.fake_openai import FakeOpenAI

from .scripts import load_gpu_script, on_loopback_server

GROUP = {"name": "g", "index": 1, "gpus": "0", "pair": "huge", "tp": 1}


@pytest.fixture(scope="module")
def shapes():
    return load_gpu_script("shapes_device")


def test_a_profile_entry_adds_flags_and_puts_a_changed_site_first(shapes, monkeypatch):
    monkeypatch.setenv("EXTRA_PYTHONPATH", "/tmp/site/_stubs")
    monkeypatch.setenv("SGLANG_RELEASE", "0.5.17")
    adaptive = shapes.Server(GROUP, shapes.profile_spec(
        {"profile": "eagle3-v2", "label": "eagle3-v2-adaptive",
         "flags": ["--speculative-adaptive", "--speculative-adaptive-config", "a.json"]}), 2, 8)
    assert adaptive.name == "g-eagle3-v2-adaptive-huge-triton"
    assert adaptive.cmd[-3:] == ["--speculative-adaptive", "--speculative-adaptive-config", "a.json"]
    meta = adaptive.meta()
    assert (meta["profile"], meta["label"], meta["threshold"]) == ("eagle3-v2", "eagle3-v2-adaptive", None)
    assert meta["sglang"] == "0.5.17" and meta["extra_flags"][0] == "--speculative-adaptive"
    assert adaptive.env["PYTHONPATH"] == "/tmp/site:/tmp/site/_stubs"

    noisy = shapes.Server(GROUP, {"profile": "baseline", "label": "baseline-noisy",
                                  "site_first": "/tmp/noisy"}, 1, 8)
    assert noisy.env["PYTHONPATH"] == "/tmp/noisy:/tmp/site:/tmp/site/_stubs"
    assert "--speculative-draft-model-path" not in noisy.cmd and noisy.meta()["extra_flags"] == []
    # a dyn profile carries its threshold to the server and into every record
    dyn = shapes.Server(GROUP, shapes.profile_spec("eagle3-v2-dyn"), 3, 8)
    assert dyn.env["SGLANG_SPEC_DISABLE_THRESHOLD"] == "8" and dyn.meta()["threshold"] == 8
    assert "SGLANG_SPEC_DISABLE_PLAIN_PATH" not in dyn.env_shown and dyn.meta()["plain_path"] == "step"


def test_the_native_profile_runs_the_v2_dyn_server_with_the_native_plain_path(shapes):
    native = shapes.Server(GROUP, shapes.profile_spec("eagle3-v2-dyn-native@flashinfer"), 4, 12)
    assert native.env["SGLANG_SPEC_DISABLE_THRESHOLD"] == "12"
    assert native.env["SGLANG_SPEC_DISABLE_PLAIN_PATH"] == "native" and native.env["SGLANG_ENABLE_SPEC_V2"] == "1"
    meta = native.meta()
    assert (meta["plain_path"], meta["threshold"], meta["draft_kv_only"], meta["attention_backend"]) == (
        "native", 12, True, "flashinfer")
    assert meta["plain_draft_kv"] == "defer"   # the product profile's setting
    assert shapes.Server(GROUP, shapes.profile_spec("baseline"), 0, 12).meta()["plain_path"] is None
    write = shapes.Server(GROUP, {"profile": "eagle3-v2-dyn-native", "label": "eagle3-v2-dyn-native",
                                  "env": {"SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV": "write"}}, 5, 12)
    assert write.env["SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV"] == "write" and write.meta()["plain_draft_kv"] == "write"
    skip = shapes.Server(GROUP, {"profile": "eagle3-v2-dyn-native", "label": "eagle3-v2-dyn-native-skip",
                                 "env": {"SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV": "skip"}}, 5, 12)
    assert skip.env["SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV"] == "skip" and skip.meta()["plain_draft_kv"] == "skip"


def test_the_smoke_runs_on_every_server_and_sizes_the_dyn_burst(shapes, tmp_path):
    words = " ".join(f"w{i}" for i in range(16))
    # events 3 ms apart, so that the stream check sees them arrive one by one
    steady = FakeOpenAI(chunks=16, delay=0.003).start()
    noisy = FakeOpenAI(chunks=16, delay=0.003, answer=lambda n: f"{n} {words}").start()
    try:
        servers = []
        for k, (spec, fake) in enumerate(((shapes.profile_spec("eagle3-v2-dyn"), steady),
                                          ({"profile": "baseline", "label": "baseline-noisy"}, noisy))):
            srv = shapes.Server(GROUP, spec, k, 4)
            srv.base = fake.base_url
            srv.log_path = tmp_path / f"{srv.name}.log"
            srv.log_path.write_text("[2026-11-30 10:00:00] INFO ready\n")
            servers.append(srv)

        async def run():
            rep = {}
            async with aiohttp.ClientSession() as s:
                await shapes.run_checks(s, {"name": "g", "smoke": True}, str(tmp_path), rep, servers)
            return rep

        rep = asyncio.run(run())
    finally:
        steady.stop()
        noisy.stop()
    dyn, bad = (rep["smoke"][srv.name] for srv in servers)
    assert dyn["ok"] and all(c["status"] == "pass" for c in dyn["checks"])
    burst = next(c for c in dyn["checks"] if c["check"] == "burst")
    assert burst["detail"].startswith("10 concurrent streams ok")     # 2 x threshold 4 + 2
    assert not bad["ok"]
    assert [c["check"] for c in bad["checks"] if c["status"] == "fail"] == ["determinism"]
    # the report is saved as the group's JSON as it goes
    assert (tmp_path / "shapes_g.json").exists()


@pytest.mark.parametrize("context, concurrency, expected", [
    (4096, 1, 3072),      # the tiny pairs: a 6,000-token answer would be refused (400, no trace)
    (131072, 1, 6000),    # Kimi shape: long answers at low load
    (131072, 64, 900),
    (4096, 64, 900),
])
def test_profiled_answers_fit_the_target_context(shapes, monkeypatch, tmp_path, context, concurrency, expected):
    (tmp_path / "target-huge").mkdir()
    (tmp_path / "target-huge" / "config.json").write_text(f'{{"max_position_embeddings": {context}}}')
    monkeypatch.setattr(shapes, "MODELS", str(tmp_path))
    srv = shapes.Server(GROUP, {"profile": "baseline"}, 0, 8)
    assert shapes.profile_answer_tokens(srv, concurrency) == expected


def test_profile_after_round_profiles_between_rounds_and_not_again(shapes, monkeypatch, tmp_path):
    """An A/A pair with one server profiled between round 2 and 3: the rounds before and after
    the profile are what shows whether a profile leaves a server slower."""
    events = []

    async def nothing(*a, **k):
        return None

    async def healthy(s, servers, timeout):
        return {srv.name: 1.0 for srv in servers}

    async def measure(s, srv, group, out, rep, c, in_len, out_len, round_no):
        events.append(("measure", round_no, srv.label))

    async def profiles(group, out, rep, live, tag=""):
        events.append(("profile", tag))

    for name, fn in (("start_servers", nothing), ("wait_up", healthy), ("warm_up", nothing),
                     ("server_info", nothing), ("measure", measure), ("run_profiles", profiles)):
        monkeypatch.setattr(shapes, name, fn)
    monkeypatch.setattr(shapes.Server, "stop", lambda self: None)
    monkeypatch.setattr(shapes.Server, "read_log", lambda self: "")
    group = dict(GROUP, mode="sweep", side_by_side=True, levels=[1], rounds=4,
                 profiles=["eagle3-v2", {"profile": "eagle3-v2", "label": "eagle3-v2-b"}],
                 torch_profile=["eagle3-v2"], profile_after_round=2)
    asyncio.run(shapes.sweep_side_by_side(None, group, str(tmp_path), 8))
    profiled_at = events.index(("profile", "after-round-2"))
    assert [e for e in events if e[0] == "profile"] == [("profile", "after-round-2")]
    assert {e[1] for e in events[:profiled_at]} == {1, 2}
    assert {e[1] for e in events[profiled_at + 1:]} == {3, 4}
    assert sum(e[0] == "measure" for e in events) == 8    # both servers, every round


def test_a_profiled_server_says_so_in_its_records_and_gets_answers_its_context_allows(shapes, monkeypatch, tmp_path):
    import subprocess

    (tmp_path / "target-huge").mkdir()
    (tmp_path / "target-huge" / "config.json").write_text('{"max_position_embeddings": 4096}')
    monkeypatch.setattr(shapes, "MODELS", str(tmp_path))
    monkeypatch.setattr(shapes, "LOGS", str(tmp_path / "logs"))
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "HTTPError 400")   # no trace came back

    monkeypatch.setattr(shapes.subprocess, "run", fake_run)
    srv = shapes.Server(GROUP, shapes.profile_spec("eagle3-v2"), 0, 8)
    assert srv.meta()["profiled_before"] is False
    result = shapes.profile_allreduce(srv, concurrency=1)
    assert result["traces"] == 0 and result["driver_rc"] == 1
    # asked for, though no trace came back: the server's later records say it was profiled
    assert srv.meta()["profiled_before"] is True
    assert [cmd[cmd.index("--max-tokens") + 1] for cmd in calls] == ["3072", "3072"]


@pytest.mark.parametrize("plan", ["native-plain-kimi6-tp1-at-baseline-cost", "native-plain-dense-flashinfer-tp1-at-baseline-cost",
                                  "native-plain-dense-triton-tp1-at-baseline-cost", "native-plain-kimi32-tp1-at-baseline-cost",
                                  "native-plain-kimi6-tp2-at-baseline-cost", "native-plain-kimi16-tp2-at-baseline-cost"])
def test_the_native_plans_put_the_native_server_beside_a_baseline_and_profile_existing_servers(shapes, plan):
    """The issue #34 plans (gpu/README.md): the native-path servers run beside a baseline of the
    same pair and backend; every group measures above 4x the threshold,
    beside a baseline of its own (a group that runs "after" another, because all servers together
    do not fit the GPU, has its own), and its torch-profile labels name servers the group starts
    (a label that names none is silently skipped)."""
    import json
    from pathlib import Path

    spec = json.loads((Path(__file__).resolve().parents[2] / "gpu" / "plans" / f"{plan}.json").read_text())
    natives = []
    for index, group in enumerate(spec["groups"]):
        group = dict(group, index=index)
        servers = [shapes.Server(group, shapes.profile_spec(p), k, spec["threshold"])
                   for k, p in enumerate(group["profiles"])]
        native = [s for s in servers if s.meta()["plain_path"] == "native"]
        natives += native
        assert all(any(s.profile == "baseline" and s.backend == n.backend for s in servers) for n in native)
        assert any(s.profile == "baseline" for s in servers)
        assert max(group["levels"]) > 4 * spec["threshold"]
        assert set(group.get("torch_profile", [])) <= {s.label for s in servers}
        assert len({s.port for s in servers}) == len(servers)
    # the first plan (ran 2026-12-02) has the native path that writes the draft's KV; the others the
    # two lean settings side by side (SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=defer and skip)
    expected = ["write"] if plan == "native-plain-kimi6-tp1-at-baseline-cost" else ["defer", "skip"]
    assert sorted(s.meta()["plain_draft_kv"] for s in natives) == expected


def test_the_auto_trace_plan_alternates_auto_and_fixed_servers_that_start_as_the_product_starts_them(shapes):
    """gpu/plans/auto-vs-fixed64-big16-traces.json (issue #29): two auto and two fixed-64 servers,
    started alternately, each rendered with the threshold the product's `--threshold` gives it (auto
    takes no hysteresis), and one of each profiled."""
    import json
    from pathlib import Path

    spec = json.loads((Path(__file__).resolve().parents[2] / "gpu" / "plans" / "auto-vs-fixed64-big16-traces.json").read_text())
    group = dict(spec["groups"][0], index=0)
    servers = [shapes.Server(group, shapes.profile_spec(p), k, spec["threshold"]) for k, p in enumerate(group["profiles"])]
    assert [s.meta()["threshold"] for s in servers] == [64, "auto", 64, "auto"]
    env = [s.plan.env for s in servers]
    assert [e["SGLANG_SPEC_DISABLE_THRESHOLD"] for e in env] == ["64", "auto", "64", "auto"]
    # empty is unset to the patch (auto refuses a hysteresis); the fixed ones get the profile's own
    assert env[1].get("SGLANG_SPEC_DISABLE_HYSTERESIS", "") == "" and env[0]["SGLANG_SPEC_DISABLE_HYSTERESIS"] == "16"
    assert all(e["SGLANG_SIMULATE_ACC_LEN"] == "2.5" for e in env)
    assert set(group["torch_profile"]) == {"fixed-64-a", "auto-a"}
    assert len({s.port for s in servers}) == 4
    assert all(s.cmd.count("--sleep-on-idle") == 1 and s.meta()["sleep_on_idle"] for s in servers)  # as run_auto.sh


def test_prefill_profiles_run_profile_load_in_its_prefill_mode_at_each_concurrency(shapes, monkeypatch, tmp_path):
    """"profile_prefill" with a list of profile concurrencies: each profiled server is profiled at
    each load with prompts of the given length (capped to the context), without stacks, against
    the loopback stand-in of SGLang's batch loop and profiler (tests/gpu/profile_standin.py), and
    every trace that comes back holds prefill steps."""
    import threading

    from . import accept_standin
    from .profile_standin import ProfileStandIn

    (tmp_path / "target-huge").mkdir()
    (tmp_path / "target-huge" / "config.json").write_text('{"max_position_embeddings": 160}')
    monkeypatch.setattr(shapes, "MODELS", str(tmp_path))
    monkeypatch.setattr(shapes, "LOGS", str(tmp_path / "logs"))
    monkeypatch.setattr(shapes, "save", lambda *a: None)
    monkeypatch.setattr(shapes, "say", lambda *a: None)
    monkeypatch.setattr(shapes, "left", lambda: 500.0)
    runs = []
    real_run = shapes.subprocess.run
    monkeypatch.setattr(shapes.subprocess, "run", lambda cmd, **kw: runs.append(cmd) or real_run(cmd, **kw))

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    standin = ProfileStandIn(chunk=256)
    handle = asyncio.run_coroutine_threadsafe(accept_standin.serve("s", standin, ""), loop).result(30)
    try:
        srv = shapes.Server(GROUP, {"profile": "baseline"}, 0, 8)
        other = shapes.Server(GROUP, {"profile": "eagle3-v2"}, 1, 8)   # not under torch_profile
        srv.base = other.base = handle.base
        group = dict(GROUP, torch_profile=["baseline"], profile_concurrency=[4, 8],
                     profile_prefill={"prompt_tokens": 100, "max_tokens": 128, "rounds": 3, "steps": 30})
        rep = {}
        asyncio.run(shapes.run_profiles(group, str(tmp_path), rep, [srv, other]))
    finally:
        if standin.loop_task:
            loop.call_soon_threadsafe(standin.loop_task.cancel)
        asyncio.run_coroutine_threadsafe(handle.runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)

    name = srv.name
    assert sorted(rep["profiles"]) == [f"{name}@c4", f"{name}@c8"]
    assert all(r["mode"] == "prefill" and r["traces"] == 1 and r["driver_rc"] == 0
               for r in rep["profiles"].values()), rep
    # one run per load, without stacks, prompts of 100 ids, answers cut to the context's 60 left
    assert len(runs) == 2 and all("--no-stack" in cmd for cmd in runs)
    assert [(cmd[cmd.index("--concurrency") + 1], cmd[cmd.index("--prompt-tokens") + 1],
             cmd[cmd.index("--max-tokens") + 1]) for cmd in runs] == [("4", "100", "60"), ("8", "100", "60")]
    trace_steps = load_gpu_script("trace_steps")
    for c in (4, 8):
        (trace,) = (tmp_path / "logs" / "traces" / name / f"c{c}" / "prefill" / "nostack").glob("*.json.gz")
        rows = trace_steps.forwards(trace_steps.load(str(trace)))
        prefills = [r for r in rows if r["mode"] == "EXTEND"]
        assert prefills and all(r["toks"] == 100 * r["bs"] for r in prefills)


def test_the_prefill_plan_profiles_both_servers_with_prefills_and_documents_an_uncapped_dyn(shapes, monkeypatch, tmp_path):
    """gpu/plans/kimi16-tp1-where-prefill-time-goes.json: baseline and dyn with the cap left to
    the profiles (none for the baseline; the dyn profile's own 4096 since the dyn profiles lift
    sglang's cap of 48), both profiled in the prefill mode; its documented third server's
    --max-running-requests comes after the profile's and wins, with no lab value beside them."""
    import json
    from pathlib import Path

    (tmp_path / "target-kimideep").mkdir()
    (tmp_path / "target-kimideep" / "config.json").write_text('{"max_position_embeddings": 131072}')
    monkeypatch.setattr(shapes, "MODELS", str(tmp_path))
    spec = json.loads((Path(__file__).resolve().parents[2] / "gpu" / "plans"
                       / "kimi16-tp1-where-prefill-time-goes.json").read_text())
    (group,) = spec["groups"]
    group = dict(group, index=0)
    servers = [shapes.Server(group, shapes.profile_spec(p), k, spec["threshold"])
               for k, p in enumerate(group["profiles"])]
    assert [s.profile for s in servers] == ["baseline", "eagle3-v2-dyn"]
    assert set(group["torch_profile"]) == {s.label for s in servers}
    assert "--max-running-requests" not in servers[0].cmd
    assert servers[1].cmd.count("--max-running-requests") == 1
    assert servers[1].cmd[servers[1].cmd.index("--max-running-requests") + 1] == "4096"
    uncapped = shapes.Server(group, spec["_third_server_not_in_plan"]["entry"], 2, spec["threshold"])
    caps = [uncapped.cmd[k + 1] for k, a in enumerate(uncapped.cmd) if a == "--max-running-requests"]
    assert caps == ["4096", "2048"]  # the profile's, then the entry's: sglang's argparse keeps the last
    ((kind, load),) = shapes.profile_load_runs(servers[1], 96, group["profile_prefill"])
    args = dict(zip(load[::2], load[1::2]))
    assert kind == "prefill/nostack" and load[-1] == "--no-stack"
    # the steps cover a wave's 128 decode steps and the next wave's first prefill chunks
    assert (args["--prompt-tokens"], args["--max-tokens"], int(args["--steps"])) == ("1024", "128", 160)


def test_records_name_the_architecture_of_the_model_on_disk(shapes, monkeypatch, tmp_path):
    """The `trained` pair is Llama or, with PAIR_ARCH=mla, DeepseekV3: a record names what the
    target's config.json says, and the table only where no model is on this machine."""
    monkeypatch.setattr(shapes, "MODELS", str(tmp_path))
    srv = shapes.Server(GROUP, {"profile": "baseline", "pair": "trained"}, 0, 8)
    assert srv.meta()["arch"] == "LlamaForCausalLM"
    (tmp_path / "target-trained").mkdir()
    (tmp_path / "target-trained" / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"]}')
    assert srv.meta()["arch"] == "DeepseekV3ForCausalLM"


@pytest.mark.parametrize("group_over, off", [({"mode": "sweep"}, True), ({"mode": "check"}, False),
                                             ({"mode": "sweep", "radix_cache": True}, False)])
def test_sweeps_run_every_server_without_the_radix_cache_unless_the_group_keeps_it(shapes, group_over, off):
    # a sweep's random ids share 1-3 leading tokens by chance; only a plain server's radix cache
    # counts such hits (EAGLE keys by token pair), which moved the baseline's prefills to another path
    group = dict(GROUP, **group_over)
    for profile in ("baseline", "eagle3-v2-dyn"):
        srv = shapes.Server(group, shapes.profile_spec(profile), 0, 8)
        assert ("--disable-radix-cache" in srv.plan.argv) is off
        assert srv.meta()["radix_cache"] is (not off)


def test_a_group_that_sleeps_on_idle_starts_every_server_with_the_flag(shapes):
    """"sleep_on_idle": true (the dense-triton plan: its c=1 against stock): baselines, stock and dyn
    servers alike get --sleep-on-idle, so no idle scheduler busy-polls beside the measured one; a
    group without the key starts them as before."""
    import json
    from pathlib import Path

    plan = json.loads((Path(__file__).resolve().parents[2] / "gpu" / "plans" /
                       "native-plain-dense-triton-tp1-at-baseline-cost.json").read_text())
    group = dict(plan["groups"][0], index=0)
    servers = [shapes.Server(group, shapes.profile_spec(p), k, plan["threshold"]) for k, p in enumerate(group["profiles"])]
    assert {s.profile for s in servers} == {"baseline", "eagle3-v2", "eagle3-v2-dyn-native"}
    assert all(s.cmd.count("--sleep-on-idle") == 1 and s.meta()["sleep_on_idle"] for s in servers)
    plain = shapes.Server({k: v for k, v in group.items() if k != "sleep_on_idle"}, shapes.profile_spec("baseline"), 0, 8)
    assert "--sleep-on-idle" not in plain.cmd and plain.meta()["sleep_on_idle"] is False


def test_the_timeline_summary_tells_a_late_last_wave_from_a_late_client(shapes):
    # c=2: the third send follows the first completion, the fourth the second
    on_time = shapes.timeline_summary([0.0, 0.0, 1.0, 1.5], [1.0, 1.5, 2.0, 3.0], 2)
    assert on_time == {"last_wave_send_spread_ms": 500.0, "send_lag_ms_p50": 0.0, "send_lag_ms_max": 0.0}
    client_late = shapes.timeline_summary([0.0, 0.0, 1.2, 1.5], [1.0, 1.5, 2.2, 3.0], 2)
    assert client_late["send_lag_ms_max"] == 200.0 and client_late["last_wave_send_spread_ms"] == 300.0
    assert shapes.timeline_summary([0.0], [1.0], 4) == {"last_wave_send_spread_ms": 0.0}  # one wave, no lag


def test_a_level_keeps_each_requests_send_and_done_times_from_32_requests_on(shapes):
    """level() against a loopback /generate stand-in that holds every request 20 ms: a closed loop
    never sends before a completion lets it in, and the record says so."""
    from aiohttp import web

    async def generate(request):
        body = await request.json()
        await asyncio.sleep(0.02)
        return web.json_response({"meta_info": {"completion_tokens": body["sampling_params"]["max_new_tokens"]}})

    async def levels(s, srv):
        return await shapes.level(s, srv, 32, 96, 4, 3, 1), await shapes.level(s, srv, 4, 8, 4, 3, 1)

    wide, narrow = asyncio.run(on_loopback_server([("POST", "/generate", generate)], levels))
    sends, dones = wide["timeline_ms"]["send"], wide["timeline_ms"]["done"]
    assert len(sends) == len(dones) == 96 and wide["out_tokens"] == 96 * 3
    assert all(sends[k] >= dones[k - 32] for k in range(32, 96))  # the closed loop, kept
    assert wide["send_lag_ms_p50"] >= 0 and wide["send_lag_ms_max"] >= wide["send_lag_ms_p50"]
    assert "timeline_ms" not in narrow and "last_wave_send_spread_ms" in narrow


def test_a_level_counts_verify_steps_so_c1_rounds_compare_apart_from_simulated_draws(shapes):
    """level() against a loopback /generate stand-in that answers as a speculative server does
    (spec_verify_ct in meta_info) and as a plain one does (none): the speculative level's record
    carries the tokens per verify step and, at c=1, the wall time per verify step; the plain one
    carries neither."""
    from aiohttp import web

    async def spec(request):
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        await asyncio.sleep(0.02)  # a wall time that its 3-decimal rounding does not swamp
        return web.json_response({"meta_info": {"completion_tokens": n, "spec_verify_ct": n // 4}})

    async def plain(request):
        body = await request.json()
        return web.json_response({"meta_info": {"completion_tokens": body["sampling_params"]["max_new_tokens"]}})

    async def levels(s, srv):
        return await shapes.level(s, srv, 1, 4, 4, 40, 1), await shapes.level(s, srv, 2, 4, 4, 40, 1)

    one, two = asyncio.run(on_loopback_server([("POST", "/generate", spec)], levels))
    assert one["spec_verify_steps"] == 4 * 10 and one["accept_len"] == 4.0
    assert one["ms_per_verify_step"] == pytest.approx(1000 * one["wall_s"] / 40, rel=0.02)
    assert two["accept_len"] == 4.0 and "ms_per_verify_step" not in two  # c=2: steps overlap
    flat, _ = asyncio.run(on_loopback_server([("POST", "/generate", plain)], levels))
    assert not {"spec_verify_steps", "accept_len", "ms_per_verify_step"} & set(flat)


def test_the_acceptance_summary_leaves_out_requests_that_never_speculated(shapes):
    # a dyn server above its threshold: a request decoded plain throughout reports no verify steps
    assert shapes.acceptance_summary([100, 100], [25, 0], 2.0, 2) == {"spec_verify_steps": 25, "accept_len": 4.0}
    assert "ms_per_verify_step" not in shapes.acceptance_summary([100, 100], [25, None], 2.0, 1)
    assert shapes.acceptance_summary([100], [None], 1.0, 1) == {}


def test_a_records_simulated_draw_is_the_sites(shapes, monkeypatch, tmp_path):
    """Records say how the simulated acceptance drew (gpu/sim_accept.py's mark in the site), and say
    nothing where no acceptance is simulated (the target alone) or no site is there."""
    site = tmp_path / "site"
    spec_utils = site / shapes.sim_accept.SPEC_UTILS
    spec_utils.parent.mkdir(parents=True)
    monkeypatch.setattr(shapes.sim_accept, "SITE", str(site))

    def draws(profile, text):
        spec_utils.write_text(text)
        shapes.accept_draw.cache_clear()
        try:
            return shapes.Server(GROUP, shapes.profile_spec(profile), 1, 8).meta()["simulated_accept_draw"]
        finally:
            shapes.accept_draw.cache_clear()

    assert draws("eagle3-v2-dyn", shapes.sim_accept.MARK + "\n") == "per-request"
    assert draws("eagle3-v2-dyn", "def generate_simulated_accept_index(): pass\n") == "per-step"
    assert draws("baseline", shapes.sim_accept.MARK + "\n") is None
    monkeypatch.setattr(shapes.sim_accept, "SITE", str(tmp_path / "no-site"))
    assert draws("eagle3-v2", shapes.sim_accept.MARK + "\n") is None

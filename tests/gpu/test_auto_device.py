"""gpu/auto_device.py's load generators against a stand-in /generate server on 127.0.0.1 (the
real driver has not run on a GPU yet: these catch its bugs before device time is spent)."""
import asyncio
import json
import re

import pytest
from aiohttp import web

from .scripts import load_gpu_script, on_loopback_server


@pytest.fixture(scope="module")
def driver():
    return load_gpu_script("auto_device")


class StandIn:
    """/generate answers max_new_tokens tokens after a short sleep; counts requests in flight."""

    def __init__(self):
        self.inflight = 0
        self.peaks = []
        self.bodies = []

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.inflight += 1
        self.peaks.append(self.inflight)
        await asyncio.sleep(0.05)
        self.inflight -= 1
        n = body["sampling_params"]["max_new_tokens"]
        return web.json_response({"meta_info": {"completion_tokens": n}})

    async def server_info(self, request):
        return web.json_response({"internal_states": [{"dyn_spec_disable": {"threshold": "auto"}}]})


async def with_stand_in(fn):
    stand_in = StandIn()
    routes = [("POST", "/generate", stand_in.generate), ("GET", "/server_info", stand_in.server_info)]
    return stand_in, await on_loopback_server(routes, fn)


def test_a_level_runs_n_requests_at_concurrency_c_and_counts_their_tokens(driver):
    prompts = [[1, 2, 3], [4, 5, 6]]
    stand_in, res = asyncio.run(with_stand_in(lambda s, srv: driver.fixed_level(s, srv, prompts, 4, 10, 7)))
    assert res["requests"] == 10 and res["out_tokens"] == 70
    assert 1 < max(stand_in.peaks) <= 4   # concurrent, never above c
    assert all(b["sampling_params"]["ignore_eos"] and b["sampling_params"]["temperature"] == 0
               for b in stand_in.bodies)


def test_the_bursty_trace_moves_between_its_two_concurrencies(driver):
    stand_in, res = asyncio.run(with_stand_in(
        lambda s, srv: driver.bursty(s, srv, [[1, 2]], 1, 6, 0.4, 1.6, 5)))
    assert 1 < max(stand_in.peaks) <= 6   # the high phases ran requests together, never above 6
    assert res["requests"] == len(stand_in.bodies) and res["out_tokens"] == 5 * res["requests"]


def test_the_bursty_trace_keeps_the_load_each_server_was_offered(driver):
    stand_in, res = asyncio.run(with_stand_in(
        lambda s, srv: driver.bursty(s, srv, [[1, 2]], 1, 6, 0.4, 1.6, 5)))
    sends, dones = res["timeline_ms"]["send"], res["timeline_ms"]["done"]
    assert len(sends) == len(dones) == res["requests"]
    assert all(d >= t for t, d in zip(sorted(sends), sorted(dones)))
    assert 1 <= res["mean_inflight"] <= 6   # between the two targets, as the stand-in saw it
    # the load: request-seconds inside the window over its length
    assert driver.offered_load([0.0, 0.5], [1.0, 3.0], 2.0) == pytest.approx((1.0 + 1.5) / 2.0)
    # the same requests whatever order their times come in: no pairing
    assert driver.offered_load([0.5, 0.0], [3.0, 1.0], 2.0) == pytest.approx((1.0 + 1.5) / 2.0)
    assert driver.offered_load([0.0], [1.0], 0.0) == 0.0


def test_the_auto_state_is_read_from_server_info(driver):
    _, state = asyncio.run(with_stand_in(lambda s, srv: driver.dyn_state(s, srv)))
    assert state == {"threshold": "auto"}


def test_a_rounds_controller_delta_is_its_counters_after_minus_before(driver):
    before = {"spec_steps": 107, "plain_steps": 704, "switches_off": 1, "switches_on": 0, "probe_steps": 14,
              "time_accounting": {"spec": {"counted_s": 0.609, "uncounted_s": 0.162},
                                  "plain": {"counted_s": 2.023, "uncounted_s": 0.041}},
              "buckets": {"1": {"probes": 2}}}
    after = {"spec_steps": 131, "plain_steps": 3100, "switches_off": 4, "switches_on": 3, "probe_steps": 36,
             "time_accounting": {"spec": {"counted_s": 0.709, "uncounted_s": 0.262},
                                 "plain": {"counted_s": 10.023, "uncounted_s": 0.141}},
             "buckets": {"1": {"probes": 3}, "48": {"probes": 4}}}
    assert driver.dyn_delta(before, after) == {
        "spec_steps": 24, "plain_steps": 2396, "switches_off": 3, "switches_on": 3, "probe_steps": 22,
        "spec_s": 0.2, "plain_s": 8.1, "probes": 5}
    # a fixed threshold's state has counters but no auto accounting or buckets
    assert driver.dyn_delta({"spec_steps": 5, "switches_off": 0}, {"spec_steps": 9, "switches_off": 2}) == {
        "spec_steps": 4, "switches_off": 2}
    assert driver.dyn_delta({"error": "ConnectionError()"}, after) is None
    assert driver.dyn_delta(None, after) is None


class CountingStandIn(StandIn):
    """/server_info's speculative steps grow by the requests /generate answered."""

    async def server_info(self, request):
        return web.json_response({"internal_states": [{"dyn_spec_disable": {
            "threshold": "auto", "spec_steps": 3 * len(self.bodies)}}]})


def test_a_dyn_servers_bursty_round_keeps_its_controller_delta_and_the_baselines_does_not(driver):
    async def rounds(s, srv):
        out = {}
        for label in ("auto", "none"):
            srv.threshold_label = label
            out[label] = await driver.timed_round(
                s, srv, lambda: driver.segmented_bursty(s, srv, [[1, 2]], 1, 3, (1, 1), 1, 4))
        return out

    stand_in = CountingStandIn()
    routes = [("POST", "/generate", stand_in.generate), ("GET", "/server_info", stand_in.server_info)]
    out = asyncio.run(on_loopback_server(routes, rounds))
    assert out["auto"]["requests"] == 4    # one wave of 3, one of 1
    assert out["auto"]["dyn_delta"] == {"spec_steps": 12}
    assert "dyn_delta" not in out["none"]  # the target alone has no controller to read


def test_prompts_are_the_held_out_text_or_random_ids_of_the_vocabulary(driver, tmp_path):
    (tmp_path / "target-trained").mkdir()
    (tmp_path / "target-trained" / "config.json").write_text(json.dumps({"vocab_size": 50}))
    (tmp_path / "heldout.json").write_text(json.dumps({"prompts": [list(range(10)), list(range(20, 40))]}))
    own = driver.prompts_for("own", str(tmp_path), 3, 8)
    assert own == [list(range(8)), list(range(20, 28)), list(range(8))]
    rnd = driver.prompts_for("random", str(tmp_path), 3, 8)
    assert len(rnd) == 3 and all(len(p) == 8 and all(3 <= t < 50 for t in p) for p in rnd)
    assert rnd != own


def test_a_steady_level_keeps_c_requests_in_flight_until_its_time_is_up(driver):
    stand_in, res = asyncio.run(with_stand_in(
        lambda s, srv: driver.steady_level(s, srv, [[1, 2], [3]], 3, 0.3, 7)))
    assert max(stand_in.peaks) == 3            # c in flight, never more
    assert res["requests"] == len(stand_in.bodies) >= 3 * 5   # 50 ms answers over 0.3 s
    assert res["out_tokens"] == 7 * res["requests"] and res["wall_s"] >= 0.3


@pytest.mark.parametrize("args", [["--workload", "sim"], ["--workload", "own", "--pair", "big"]])
def test_the_simulated_workload_goes_with_a_config_only_pair_and_only_with_one(driver, monkeypatch, tmp_path, args):
    monkeypatch.setattr("sys.argv", ["auto_device.py", "--out", str(tmp_path), *args])
    with pytest.raises(SystemExit) as stop:
        asyncio.run(driver.main())
    assert stop.value.code == 2 and not any(tmp_path.iterdir())   # refused before anything started


def test_a_config_only_pair_simulates_acceptance_on_the_dyn_servers_only(driver):
    servers = driver.make_servers([2, 64], 0.12, pair="big", acc_len=1.6, kv_tokens=16384)
    by_label = {srv.label: srv for srv in servers}
    assert sorted(by_label) == ["auto", "baseline", "fixed-2", "fixed-64"]
    assert by_label["baseline"].plan.env.get("SGLANG_SIMULATE_ACC_LEN") is None
    assert all(by_label[k].plan.env["SGLANG_SIMULATE_ACC_LEN"] == "1.6" for k in ("auto", "fixed-2", "fixed-64"))
    assert all(srv.meta()["pair"] == "big" for srv in servers)
    # every server, the baseline included, sleeps on idle: one flag, recorded, not an "extra" flag
    assert all(srv.cmd.count("--sleep-on-idle") == 1 and srv.meta()["sleep_on_idle"] for srv in servers)
    assert all(srv.meta()["extra_flags"] == [] for srv in servers)


def test_the_native_plain_path_runs_on_every_threshold_server_and_only_there(driver, monkeypatch, tmp_path):
    """--dyn-profile eagle3-v2-dyn-native: the fixed and auto servers (variants included) all take
    the native path with defer, so the sweep compares thresholds on one plain path; the baseline
    stays the target alone, and every record says which path ran."""
    servers = driver.make_servers([2, 64], 0.12, pair="big", variants=driver.parse_variants("probe=0.0001"),
                                  dyn_profile="eagle3-v2-dyn-native")
    by_label = {srv.label: srv for srv in servers}
    for label in ("fixed-2", "fixed-64", "auto", "auto-probe0.0001"):
        env = by_label[label].plan.env
        assert (env["SGLANG_SPEC_DISABLE_PLAIN_PATH"], env["SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV"]) == ("native", "defer")
        assert (by_label[label].meta()["plain_path"], by_label[label].meta()["plain_draft_kv"]) == ("native", "defer")
    assert by_label["auto"].plan.env["SGLANG_SPEC_DISABLE_THRESHOLD"] == "auto"
    assert "SGLANG_SPEC_DISABLE_PLAIN_PATH" not in by_label["baseline"].plan.env
    assert by_label["baseline"].meta()["plain_path"] is None
    step = {srv.label: srv for srv in driver.make_servers([2], 0.12, pair="big")}
    assert step["auto"].meta()["plain_path"] == "step"   # the default stays the step path
    monkeypatch.setattr("sys.argv", ["auto_device.py", "--out", str(tmp_path), "--workload", "sim", "--pair", "big",
                                     "--dyn-profile", "eagle3-v2-dyn-full"])
    with pytest.raises(SystemExit) as stop:
        asyncio.run(driver.main())
    assert stop.value.code == 2 and not any(tmp_path.iterdir())   # refused before anything started


def test_the_bursty_rounds_run_auto_first_and_rotate_the_others(driver):
    """The second acc-1.6 call ran out of budget after the fixed servers' traces and before auto's:
    auto now goes first in every bursty round."""
    base, f2, f8, auto = "baseline", "fixed-2", "fixed-8", "auto"
    live = [base, f2, f8, auto]
    assert driver.bursty_order(live, auto, 0) == [auto, base, f2, f8]
    assert driver.bursty_order(live, auto, 1) == [auto, f2, f8, base]
    assert driver.bursty_order([base, f2], auto, 0) == [base, f2]     # auto died at start: the others still run


def test_auto_variants_run_beside_the_judged_auto_server_with_their_one_knob(driver):
    variants = driver.parse_variants("probe=0.0001, margin=0.05,probe_steps=20")
    servers = driver.make_servers([16, 64], 0.12, pair="big", variants=variants)
    labels = [srv.label for srv in servers]
    assert labels == ["baseline", "fixed-16", "fixed-64", "auto-probe0.0001", "auto-margin0.05",
                      "auto-probe_steps20", "auto"]
    by_label = {srv.label: srv for srv in servers}
    assert by_label["auto-probe0.0001"].plan.env["SGLANG_SPEC_DISABLE_AUTO_PROBE_BUDGET"] == "0.0001"
    assert "SGLANG_SPEC_DISABLE_AUTO_PROBE_BUDGET" not in by_label["auto"].plan.env
    assert by_label["auto-margin0.05"].plan.env["SGLANG_SPEC_DISABLE_AUTO_MARGIN"] == "0.05"
    assert len({srv.port for srv in servers}) == len(servers)          # each its own port
    assert by_label["auto-probe0.0001"].threshold_label == "auto-probe0.0001"
    # the servers whose state is kept after each level: the variants only, among fixed-N's int labels
    # (2026-12-04: the first call with variants stopped after c=1 on `int.startswith`)
    assert [srv.label for srv in driver.auto_variants(servers)] == ["auto-probe0.0001", "auto-margin0.05",
                                                                    "auto-probe_steps20"]
    assert by_label["auto-probe_steps20"].plan.env["SGLANG_SPEC_DISABLE_AUTO_PROBE_STEPS"] == "20"


def test_a_draft_kv_variant_overrides_the_native_profiles_defer(driver):
    """Row 2f asks whether a plain bucket's probes read acceptance low because the native path's
    defer leaves their draft context empty: an auto server whose plain steps write the draft's KV
    beside the judged one, every other setting of the profile kept."""
    servers = driver.make_servers([2, 64], 0.12, pair="big", variants=driver.parse_variants("draft_kv=write"),
                                  dyn_profile="eagle3-v2-dyn-native")
    by_label = {srv.label: srv for srv in servers}
    write, judged = by_label["auto-draft_kvwrite"].plan.env, by_label["auto"].plan.env
    assert (write["SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV"], judged["SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV"]) == ("write", "defer")
    assert write["SGLANG_SPEC_DISABLE_PLAIN_PATH"] == judged["SGLANG_SPEC_DISABLE_PLAIN_PATH"] == "native"
    assert write["SGLANG_SPEC_DISABLE_THRESHOLD"] == "auto"
    [(label, env)] = driver.parse_variants("deferred_accept=raw")
    assert (label, env) == ("auto-deferred_acceptraw", {"SGLANG_SPEC_DISABLE_AUTO_DEFERRED_ACCEPT": "raw"})


def test_a_fixed_twin_is_a_second_identical_fixed_server_labelled_apart(driver):
    """Four auto servers in two calls sat 0.964-1.006 of one fixed-2 server, with identical servers
    1-3 % apart: a question of 1-2 % needs an A/A pair on the fixed side too."""
    servers = driver.make_servers([2, 8], 0.12, pair="big", variants=driver.parse_variants("probe=0.005"),
                                  fixed_twins=driver.parse_fixed_twins("2", "2,8"))
    by_label = {srv.label: srv for srv in servers}
    assert [srv.label for srv in servers] == ["baseline", "fixed-2", "fixed-8", "fixed-2-twin", "auto-probe0.005", "auto"]
    assert by_label["fixed-2-twin"].plan.env["SGLANG_SPEC_DISABLE_THRESHOLD"] == "2"
    assert by_label["fixed-2-twin"].threshold_label == "2-twin"       # kept apart from fixed-2's rounds
    assert by_label["fixed-2-twin"].port != by_label["fixed-2"].port
    assert driver.auto_variants(servers) == [by_label["auto-probe0.005"]]
    assert servers[-1].label == "auto"                               # the judged one stays last
    for bad in ("16", "x", "2,2"):
        with pytest.raises(ValueError, match="--fixed-twins"):
            driver.parse_fixed_twins(bad, "2,8")


def test_the_auto_servers_start_between_the_others_not_after_them(driver):
    variants = driver.parse_variants("probe=0.0001, margin=0.02")
    servers = driver.make_servers([2, 8, 16, 64], 0.7, pair="big", variants=variants)
    order = [srv.label for srv in driver.start_order(servers)]
    assert order == ["baseline", "auto-probe0.0001", "fixed-2", "auto-margin0.02", "fixed-8", "auto",
                     "fixed-16", "fixed-64"]
    # without variants or baseline: still every server once, auto not last
    plain = [srv.label for srv in driver.start_order(driver.make_servers([2, 64], 0.7, baseline=False))]
    assert plain == ["fixed-2", "auto", "fixed-64"]


@pytest.mark.parametrize("text", ["probe", "speed=2", "probe="])
def test_an_auto_variant_that_is_not_knob_equals_value_is_refused(driver, text):
    with pytest.raises(ValueError, match="--auto-variants"):
        driver.parse_variants(text)


def test_a_rounds_server_rate_is_its_own_log_at_c_running_since_the_round_began(driver, tmp_path):
    log = tmp_path / "server.log"
    line = "[t] Decode batch, #running-req: {}, #token: 9, gen throughput (token/s): {}, #queue-req: 0\n"
    log.write_text(line.format(1, 100.0))                         # an earlier round
    srv = type("Srv", (), {"log_path": str(log)})()
    offset = driver.log_size(srv)
    with open(log, "a") as f:
        f.write(line.format(1, 20.0))                             # began before the round: left out
        f.write("[t] Prefill batch, #new-seq: 1\n")
        f.writelines(line.format(n, r) for n, r in [(1, 500.0), (1, 540.0), (2, 900.0), (1, 520.0)])
    none = {"server_accept_len": None}   # these lines log no accept length (a plain server's)
    assert driver.server_rate(srv, offset, 1) == {"server_decode_tok_s": 520.0, "server_intervals": 3, **none}
    assert driver.server_rate(srv, offset, 4) == {"server_decode_tok_s": None, "server_intervals": 0, **none}
    gone = type("Srv", (), {"log_path": str(tmp_path / "none.log")})()
    assert driver.server_rate(gone, 0, 1) == {"server_decode_tok_s": None, "server_intervals": 0, **none}


def test_the_segmented_bursty_load_is_the_same_work_for_every_server(driver):
    """3 cycles of a high segment (2 waves of 6) and a low one (3 waves of 1): 45 requests, each
    segment a closed loop at its own concurrency, the prompts moving on (no request repeats the one
    before it) -- the same sequence whichever server runs it."""
    prompts = [[i, i + 1] for i in range(50)]
    stand_in, res = asyncio.run(with_stand_in(
        lambda s, srv: driver.segmented_bursty(s, srv, prompts, 1, 6, (2, 3), 3, 5)))
    assert res["requests"] == len(stand_in.bodies) == 3 * (2 * 6 + 3 * 1) and res["out_tokens"] == 5 * 45
    assert 1 < max(stand_in.peaks) <= 6 and min(stand_in.peaks) == 1
    sent = [tuple(b["input_ids"]) for b in stand_in.bodies]
    # the high segment's 12, then (once they are done) the low one's 3: in any order inside each
    assert set(sent[:12]) == set(map(tuple, prompts[:12])) and set(sent[12:15]) == set(map(tuple, prompts[12:15]))
    again, _ = asyncio.run(with_stand_in(
        lambda s, srv: driver.segmented_bursty(s, srv, prompts, 1, 6, (2, 3), 3, 5)))
    assert sorted(sent) == sorted(tuple(b["input_ids"]) for b in again.bodies)


def test_segment_waves_are_two_whole_numbers(driver):
    assert driver.parse_waves("3,8") == (3, 8)
    for bad in ("3", "3,x", "0,2", "2,-1"):
        with pytest.raises(ValueError, match="--segment-waves"):
            driver.parse_waves(bad)


def test_the_acc_mix_level_sets_each_phases_acceptance_for_its_requests_and_then_clears_it(driver, tmp_path):
    """2 cycles of phases 2.5 (2 waves of 3) and 1.6 (1 wave of 3): every request is sent while its
    phase's value is in the server's file, one concurrency throughout, and the file is gone after."""
    control = str(tmp_path / "acc" / "auto")
    seen = []

    class Reading(StandIn):
        async def generate(self, request):
            with open(control) as f:
                seen.append(f.read().strip())
            return await super().generate(request)

    stand_in = Reading()
    prompts = [[i] for i in range(40)]

    async def run(s, srv):
        return await driver.acc_mix(s, srv, prompts, 3, [2.5, 1.6], [2, 1], 2, 5, control)

    res = asyncio.run(on_loopback_server([("POST", "/generate", stand_in.generate)], run))
    assert seen == ["2.5"] * 6 + ["1.6"] * 3 + ["2.5"] * 6 + ["1.6"] * 3
    assert res["requests"] == len(stand_in.bodies) == 18 and res["out_tokens"] == 90
    assert 1 < max(stand_in.peaks) <= 3
    assert (res["acc_phases"], res["waves"], res["cycles"], res["c"]) == ([2.5, 1.6], [2, 1], 2, 3)
    # each phase's own tokens and time, in order, for the summary's oracle
    assert [(p["acc"], p["out_tokens"]) for p in res["phase_times"]] == [(2.5, 30), (1.6, 15), (2.5, 30), (1.6, 15)]
    assert all(p["wall_s"] > 0 for p in res["phase_times"])
    assert sum(p["wall_s"] for p in res["phase_times"]) <= res["wall_s"] + 0.01
    assert not (tmp_path / "acc" / "auto").exists()


def test_the_acc_mix_file_is_cleared_when_a_phase_fails(driver, tmp_path):
    control = str(tmp_path / "auto")

    async def refuse(request):
        return web.json_response({"error": "no"}, status=500)

    async def run(s, srv):
        return await driver.acc_mix(s, srv, [[1]], 2, [2.5, 1.6], [1, 1], 1, 5, control)

    with pytest.raises(RuntimeError, match="HTTP 500"):
        asyncio.run(on_loopback_server([("POST", "/generate", refuse)], run))
    assert not (tmp_path / "auto").exists()


def test_acc_mix_phases_and_waves_pair_up(driver):
    assert driver.parse_acc_mix("2.5,1.6", "20,10") == ([2.5, 1.6], [20, 10])
    for acc, waves in (("2.5", "20"), ("2.5,0", "1,1"), ("2.5,x", "1,1"), ("2.5,1.6", "20"), ("2.5,1.6", "1,0")):
        with pytest.raises(ValueError, match="--acc-mix"):
            driver.parse_acc_mix(acc, waves)


def test_with_acc_files_every_server_reads_its_own(driver):
    servers = driver.make_servers([8, 16], 0.12, pair="big", variants=driver.parse_variants("probe=0.005"),
                                  fixed_twins=[8], acc_files=True)
    files = {srv.label: srv.plan.env.get("LAB_SIM_ACC_LEN_FILE") for srv in servers}
    assert files.pop("baseline") is None   # the target alone draws nothing
    assert files == {label: driver.acc_file(label) for label in files} and len(set(files.values())) == len(files)
    assert sorted(files) == ["auto", "auto-probe0.005", "fixed-16", "fixed-8", "fixed-8-twin"]
    plain = driver.make_servers([8], 0.12, pair="big")
    assert all("LAB_SIM_ACC_LEN_FILE" not in srv.plan.env for srv in plain)


@pytest.mark.parametrize("workload,draw", [("sim", "per-step"), ("own", "per-request")])
def test_acc_mix_is_refused_unless_simulated_and_drawn_per_request(driver, monkeypatch, tmp_path, workload, draw):
    site = tmp_path / "site"
    spec_utils = site / "sglang" / "srt" / "speculative" / "spec_utils.py"
    spec_utils.parent.mkdir(parents=True)
    spec_utils.write_text("# toolkit lab: gpu/sim_accept.py per-request\n" if draw == "per-request" else "x = 1\n")
    monkeypatch.setattr(driver.sim_accept, "SITE", str(site))
    out = tmp_path / "out"
    pair = ["--pair", "big"] if workload == "sim" else []
    monkeypatch.setattr("sys.argv", ["auto_device.py", "--out", str(out), "--workload", workload, *pair,
                                     "--acc-mix", "2.5,1.6"])
    with pytest.raises(SystemExit) as stop:
        asyncio.run(driver.main())
    assert stop.value.code == 2 and not out.exists()   # refused before anything started


def test_with_no_server_healthy_nothing_is_measured_and_it_says_why(driver, monkeypatch, tmp_path, capsys):
    """A budget too short for the servers to start (the twenty-fourth session's last call: three
    servers not healthy in its 60 s) ended in a ZeroDivisionError from the rounds' rotation; now
    it says so, stops the servers, writes no records, and exits 3."""
    import accept_device
    import shapes_device

    models = tmp_path / "models"
    (models / "target-big").mkdir(parents=True)
    (models / "target-big" / "config.json").write_text(json.dumps({"vocab_size": 100}))
    stopped = []
    monkeypatch.setattr(shapes_device, "LOGS", str(tmp_path / "logs"))
    (tmp_path / "logs").mkdir()

    async def start_servers(servers, *args):   # each launched, its log begun, none ever healthy
        for srv in servers:
            open(srv.log_path, "w").write("loading\n")

    async def wait_up(s, servers, timeout):
        return {}

    monkeypatch.setattr(shapes_device, "start_servers", start_servers)
    monkeypatch.setattr(shapes_device, "wait_up", wait_up)
    monkeypatch.setattr(accept_device, "stop_all", lambda servers, *a, **k: stopped.extend(servers))
    out = tmp_path / "out"
    monkeypatch.setattr("sys.argv", ["auto_device.py", "--out", str(out), "--models", str(models),
                                     "--workload", "sim", "--pair", "big", "--fixed", "8,16", "--levels", "16",
                                     "--budget-s", "200", "--no-baseline"])
    assert asyncio.run(driver.main()) == 3
    said = capsys.readouterr().out
    assert re.search(r"no server was healthy within \d+ s: nothing measured", said), said
    assert sorted(srv.label for srv in stopped) == ["auto", "fixed-16", "fixed-8"]
    assert not (out / "records.jsonl").exists() and not list(out.glob("part-*.json"))


def test_with_out_spread_each_prompt_gets_its_own_length_the_same_on_every_server(driver, monkeypatch):
    """--out-spread: a request's length an even draw in [1 - s, 1 + s] x out_tokens keyed on its
    prompt, so two servers get the same lengths and requests stop finishing in lockstep."""
    prompts = [[i, i + 1, i + 2] for i in range(40)]
    monkeypatch.setattr(driver, "out_spread", 0.5)

    def lengths():
        stand_in, res = asyncio.run(with_stand_in(lambda s, srv: driver.fixed_level(s, srv, prompts, 8, 40, 96)))
        got = {tuple(b["input_ids"]): b["sampling_params"]["max_new_tokens"] for b in stand_in.bodies}
        assert res["out_tokens"] == sum(got.values())
        return got

    first = lengths()
    assert lengths() == first                            # the same work for a second server
    values = list(first.values())
    assert all(48 <= n <= 144 for n in values) and len(set(values)) >= 20
    assert 80 <= sum(values) / len(values) <= 112       # about out_tokens on average
    monkeypatch.setattr(driver, "out_spread", 0.0)
    assert set(lengths().values()) == {96}


@pytest.mark.parametrize("spread", ["1.0", "-0.1"])
def test_an_out_spread_outside_0_to_1_is_refused(driver, monkeypatch, tmp_path, capsys, spread):
    monkeypatch.setattr("sys.argv", ["auto_device.py", "--out", str(tmp_path), "--workload", "own",
                                     "--out-spread", spread])
    with pytest.raises(SystemExit) as stop:
        asyncio.run(driver.main())
    assert stop.value.code == 2 and not any(tmp_path.iterdir())
    assert f"--out-spread must be in [0, 1), got {float(spread)}" in capsys.readouterr().err


def run_sim_driver(driver, monkeypatch, tmp_path, left_values):
    """auto_device.main() on a config-only pair at levels 4 and 2 (fixed-8 and auto, no bursty
    rounds), every server the stand-in on loopback; `left_values` are what left() returns in turn.
    Returns (exit code, auto_state.jsonl's lines, records.jsonl's lines)."""
    import accept_device
    import shapes_device

    models = tmp_path / "models"
    (models / "target-big").mkdir(parents=True)
    (models / "target-big" / "config.json").write_text(json.dumps({"vocab_size": 100}))
    monkeypatch.setattr(shapes_device, "LOGS", str(tmp_path / "logs"))
    (tmp_path / "logs").mkdir()
    out = tmp_path / "out"

    async def run(s, stand):
        async def start_servers(servers, *args):
            for srv in servers:
                srv.base = stand.base
                open(srv.log_path, "w").write("up\n")

        async def wait_up(s, servers, timeout):
            return {srv.name: 1.0 for srv in servers}

        rounds_left = iter(left_values)
        monkeypatch.setattr(shapes_device, "start_servers", start_servers)
        monkeypatch.setattr(shapes_device, "wait_up", wait_up)
        monkeypatch.setattr(accept_device, "stop_all", lambda servers, *a, **k: None)
        monkeypatch.setattr(driver, "left", lambda: next(rounds_left))
        monkeypatch.setattr("sys.argv", ["auto_device.py", "--out", str(out), "--models", str(models),
                                         "--workload", "sim", "--pair", "big", "--fixed", "8", "--levels", "4,2",
                                         "--budget-s", "200", "--no-baseline", "--min-s", "0.05",
                                         "--out-tokens", "3", "--bursty-rounds", "0"])
        return await driver.main()

    stand_in = StandIn()
    routes = [("POST", "/generate", stand_in.generate), ("GET", "/server_info", stand_in.server_info)]
    code = asyncio.run(on_loopback_server(routes, run))
    states = [json.loads(line) for line in (out / "auto_state.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return code, states, records


def test_a_level_the_budget_cuts_still_leaves_autos_state(driver, monkeypatch, tmp_path):
    """Row 2e's call ran out of budget one round before the end of its last level (c=32), and its
    auto_state.jsonl held only c=64's state: the level measured last had no bucket estimates to
    set beside the fixed servers. Now a cut level keeps auto's state (marked cut_by_budget) before
    the servers stop, and every steady round carries its epoch start and end for the host samples."""
    # wait_s, level 4's 3 rounds x 2 servers, level 2's first round, then no budget left
    code, states, records = run_sim_driver(driver, monkeypatch, tmp_path, [100.0] * 8 + [10.0] * 99)
    assert code == 0
    assert [(st["after"], st.get("cut_by_budget", False)) for st in states] == [("c=4", False), ("c=2", True)]
    assert states[1]["state"] == {"threshold": "auto"}
    assert [r["level"] for r in records] == ["4"] * 6 + ["2"]
    assert all(r["t_start"] < r["t_end"] and abs((r["t_end"] - r["t_start"]) - r["wall_s"]) < 0.01 for r in records)


def test_pinning_a_server_no_one_runs_is_refused_before_anything_starts(driver, monkeypatch, tmp_path, capsys):
    models = tmp_path / "models"
    (models / "target-big").mkdir(parents=True)
    (models / "target-big" / "config.json").write_text(json.dumps({"vocab_size": 100}))
    out = tmp_path / "out"
    monkeypatch.setattr("sys.argv", ["auto_device.py", "--out", str(out), "--models", str(models),
                                     "--workload", "sim", "--pair", "big", "--fixed", "8", "--no-baseline",
                                     "--pin", "fixed-8,fixed-64"])
    with pytest.raises(SystemExit) as stop:
        asyncio.run(driver.main())
    assert stop.value.code == 2
    assert "--pin: no server labelled fixed-64 (the servers: fixed-8, auto)" in capsys.readouterr().err
    assert not (out / "records.jsonl").exists()


def test_whole_levels_keep_one_state_each_and_no_bursty_one_without_bursty_rounds(driver, monkeypatch, tmp_path):
    """Without bursty rounds the driver wrote an `after: bursty` state anyway, a copy of the last
    level's (25-probe-log's call 2)."""
    code, states, records = run_sim_driver(driver, monkeypatch, tmp_path, [100.0] * 99)
    assert code == 0
    assert [(st["after"], st.get("cut_by_budget", False)) for st in states] == [("c=4", False), ("c=2", False)]
    # each state with this machine's time when it came (gpu/probe_rounds.py places probes by it)
    assert records[5]["t_end"] <= states[0]["read_at"] <= records[6]["t_start"]
    assert [r["level"] for r in records] == ["4"] * 6 + ["2"] * 6

"""gpu/accept_device.py end to end on the CPU: its protocol and summaries against stand-ins of
SGLang's /generate (tests/gpu/accept_standin.py) on loopback, one per server of the real run."""
import asyncio
import json
import time

import aiohttp
import pytest

from tests.gpu import accept_standin as sa
from tests.gpu.scripts import load_gpu_script

ad = load_gpu_script("accept_device")
THRESHOLD = 5  # the stand-ins' hysteresis is 2: drafting resumes at 3 running, above the 2 spanning

# label -> stand-in knobs: accept length, threshold, what goes wrong
STANDINS = {
    # its bigger batches flip token 7 of prompts whose first id is a multiple of 5; its margins are
    # exact ties (0.0, which the old counter took for 1)
    "baseline": {"batch_flip": 4, "margin": 0.0},
    "eagle3-v2": {"accept": 2.5},
    "eagle3-v2-dyn": {"accept": 2.5, "threshold": THRESHOLD, "first_off_stall_s": 1.0},
    "eagle3": {"accept": 2.0},
    "eagle3-dyn": {"accept": 2.0, "threshold": THRESHOLD, "plain_flip": True},
    # the negative controls: a request that decoded through plain steps accepts nothing after the
    # resume (a stale draft); one prefilled after it is fine
    "eagle3-v2-dyn-nc": {"accept": 2.5, "threshold": THRESHOLD, "collapse_steps": 400},
    "eagle3-dyn-nc": {"accept": 2.0, "threshold": THRESHOLD, "collapse_steps": 400},
}


def plan(crossings=3, **kw):
    kw = {"ab_rounds": 2, "ab_prompts": 1, "ab_tokens": 10, **kw}
    return ad.Plan(threshold=THRESHOLD, crossings=crossings, before_n=3, before_tokens=10, eq_n=6,
                   eq_conc=2, eq_tokens=10, burst_extra=2, burst_tokens=12, span_n=2, span_tokens=48,
                   span_lead=4, control_n=12, **kw)


async def run_all(tmp_path, crossings=3, budget=300, standins=None, handles_out=None, **plan_kw):
    ad.BUDGET = ad.el() + budget
    handles = []
    for label, knobs in (standins or STANDINS).items():
        tdir = tmp_path / f"triton-{label}"
        tdir.mkdir()
        (tdir / "warm.json").write_text("{}")
        handles.append(await sa.serve(label, sa.StandIn(str(tmp_path / f"{label}.log"), **knobs), str(tdir)))
    if handles_out is not None:
        handles_out.extend(handles)
    prompts = [[i, 7, 9, 11] for i in range(100)]
    report = {"arch": "mla", "size": "tiny", "seed": 0, "target": {"train_loss": 3.1, "heldout_loss": 3.4, "steps": 5},
              "draft": {"heldout_top1_per_position": [0.9, 0.8]}, "simulated_accept_len": {"mean": 2.4}}
    try:
        async with aiohttp.ClientSession() as s:
            return await ad.measure(s, handles, prompts, plan(crossings, **plan_kw), str(tmp_path), report,
                                    reserve_s=10)
    finally:
        for h in handles:
            await h.runner.cleanup()


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accept")
    # the JIT snapshot also lists ~/.cache/flashinfer: a home of its own, so that what other
    # programs left in this machine's cache does not show up as the stand-ins' JIT
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        summary, first = asyncio.run(run_all(tmp))
    return tmp, summary, first


def test_summary_has_issue_24_keys_and_is_written(result):
    tmp, summary, _ = result
    on_disk = json.loads((tmp / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for k in ("simulated", "pair", "target_loss", "accept_len_before", "accept_len_after_resume",
              "after_over_before", "negative_control_after_over_before", "greedy_equal_plain_vs_baseline",
              "greedy_equal_spec_vs_stock", "prompts"):
        assert k in summary, k
    assert summary["simulated"] is False and summary["target_loss"] == {"train": 3.1, "heldout": 3.4}
    assert summary["pair"]["arch"] == "mla"  # which target the acceptance was measured on
    assert set(summary["per_worker"]) == {"v1", "v2"}
    assert summary["errors"] == {label: 0 for label in STANDINS}
    assert summary["startup_lines"]["eagle3-v2-dyn"] == ["Dynamic speculation disable enabled"]
    recs = [json.loads(x) for x in (tmp / "records.jsonl").read_text().splitlines()]
    # 7 servers x (3 before + 6 eq + 3 crossings x (2 span + 12 burst) + 3 after), the A/B
    # rounds (2 phases x 2 rounds x 2 groups of 3 servers x 2 visits x 1 prompt) and the
    # baseline's control: crossing 1's 12 burst prompts in the burst shape again and at c=1
    assert len(recs) == 7 * (3 + 6 + 3 * 14 + 3) + 2 * 2 * 2 * 3 * 2 + 12 + 12
    ctrl = [r for r in recs if r["phase"] in ("burst_again", "burst_c1")]
    assert {r["server"] for r in ctrl} == {"baseline"} and {r["crossing"] for r in ctrl} == {1}
    # streamed events carry cumulative token counts, one per step
    span = next(r for r in recs if r["phase"] == "span" and r["server"] == "eagle3-v2")
    assert span["counts"][-1] == 48 and len(span["counts"]) == len(span["arrivals"]) < 48


def test_stale_draft_tails_against_stock(result):
    _, summary, _ = result
    v2, v1 = summary["per_worker"]["v2"], summary["per_worker"]["v1"]
    assert v2["accept_len_before"] == pytest.approx(2.5, abs=0.1)
    assert v1["accept_len_before"] == pytest.approx(2.0, abs=0.1)
    assert summary["crossings"] == 3
    for w in (v2, v1):
        assert len(w["stale_draft"]) == 3 and all(x["requests"] == 2 for x in w["stale_draft"])
        # the spanning requests decoded plain through the burst: their tails start past the lead
        for x in w["stale_draft"]:
            for lead, start in x["burst_start_and_tail_start_tokens"]:
                assert 4 <= lead < start < 48
        # a healthy draft: the tail accepts as much as stock's over the same tokens
        assert w["tail_over_stock_median"] == pytest.approx(1.0, abs=0.15)
        # the negative control's stale draft accepts one token per step on the tail
        assert w["negative_control_tail_over_stock_median"] < 0.7
        assert w["negative_control_after_over_before"] < 0.7
        assert w["verdict"].startswith("the negative control collapses")
    assert summary["after_over_before"] == v2["after_over_before"] == pytest.approx(1.0, abs=0.15)
    assert summary["stale_draft"]["v1"]["tail_over_stock"] == v1["tail_over_stock"]
    assert summary["accept_len_by_server"]["baseline"] is None


def test_greedy_equality_with_the_baseline_control_and_margin_classes(result):
    _, summary, _ = result
    v2, v1 = summary["per_worker"]["v2"], summary["per_worker"]["v1"]
    assert v2["greedy_equal_spec_vs_stock"] == 1.0
    # the baseline's own bursts flip token 7 of prompts 5k; dyn's plain steps do not
    flipped = {m["idx"] for m in v2["mismatches"]["plain_vs_baseline"]}
    assert flipped and all(i % 5 == 0 for i in flipped)
    assert all(m["first_diff"] == 7 for m in v2["mismatches"]["plain_vs_baseline"])
    ctrl = summary["equality_control"]
    c1 = ctrl["baseline_burst_vs_baseline_c1"]
    assert c1["of"] == 12 and c1["fraction"] < 1.0
    assert all(m["idx"] % 5 == 0 and m["first_diff"] == 7 for m in c1["mismatches"])
    assert ctrl["baseline_burst_again_vs_baseline_burst"]["fraction"] == 1.0
    # against the baseline at c=1, dyn's plain outputs are equal (crossing 1's prompts)
    assert v2["greedy_equal_plain_vs_baseline_c1"] == 1.0
    # eagle3-dyn's plain steps flip token 5 of prompts whose first id is a multiple of 4
    assert any(m["first_diff"] == 5 for m in v1["mismatches"]["plain_vs_baseline"])
    # every margin is an exact tie; the counter counts 0.0 (it used to take it for 1)
    allm = [m for ms in v1["mismatches"].values() for m in ms]
    assert allm and all(m["margin"] == 0.0 and m["margin_class"] == "tie" for m in allm)
    assert v1["mismatches_with_margin_below_1e-2"] == v1["mismatches_total"] == len(allm)
    assert v1["margin_classes"]["plain_vs_baseline"]["tie"] == len(v1["mismatches"]["plain_vs_baseline"])
    assert c1["margin_classes"]["tie"] == len(c1["mismatches"]) and c1["margin_classes"]["larger"] == 0
    assert "prompt_ids" not in allm[0]


def test_transitions_from_the_logs(result):
    _, summary, _ = result
    t = summary["transitions"]
    for label in ("eagle3-v2-dyn", "eagle3-dyn"):
        assert t[label]["stopped_lines"] >= 3 and t[label]["resumed_lines"] >= 3
        assert t[label]["decode_line_counters"] == [t[label]["stopped_lines"], t[label]["resumed_lines"]]
    assert t["baseline"]["stopped_lines"] == 0


def test_first_crossing_stall_is_seen(result):
    tmp, _, first = result
    runs = {r["server"]: r for r in first["runs"]}
    assert "baseline" not in runs and "eagle3-v2" in runs  # the stock server is the reference
    # the baseline's own burst ends, with no switch in them, for the dyn servers' resume gaps
    ref = first["baseline_burst_end"]
    assert len(ref["resume_window_max_gap_ms"]) == len(ref["burst_completion_spread_ms"]) == 3
    assert all(len(r["burst_completion_spread_ms"]) == 3 for r in runs.values())
    r = runs["eagle3-v2-dyn"]
    assert r["tp"] == 1 and len(r["crossing_max_gap_ms"]) == 3
    # the stand-in stalls 1 s once; the client reads chunks in the same event loop, so a gap can
    # come out shorter by one loop latency: half the stall leaves room for a loaded machine
    assert r["first_crossing_max_gap_ms"] >= 500
    raw = json.loads((tmp / "accept_raw.json").read_text())
    assert len(raw["windows"]["eagle3-v2-dyn"]) == 3
    assert raw["jit"]["eagle3-v2-dyn"]["healthy"] == ["triton:warm.json"]


def test_budget_stops_crossings_early_and_still_writes_summaries(tmp_path):
    summary, first = asyncio.run(run_all(tmp_path, crossings=10_000, budget=25))
    assert 1 <= summary["crossings"] < 10_000
    assert ad.left() > 0  # it ended inside its budget
    recs = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    # a request the budget cut short is marked failed, never taken for an (empty) output
    assert all(r["error"] is not None or r["completion_tokens"] > 0 for r in recs)
    assert (tmp_path / "summary.json").exists() and (tmp_path / "first_crossing.json").exists()


def test_stop_all_terms_every_server_at_once_and_kills_the_stubborn(tmp_path):
    import subprocess

    class Srv:
        def __init__(self, cmd):
            self.log = open(tmp_path / f"{len(cmd)}.log", "w")
            self.proc = subprocess.Popen(cmd, start_new_session=True, stdout=self.log)

    polite = Srv(["sleep", "60"])
    ready = tmp_path / "trap-set"
    stubborn = Srv(["bash", "-c", f"trap '' TERM; touch {ready}; sleep 60 & wait; sleep 60"])
    never = type("S", (), {"proc": None})()
    for _ in range(400):  # until the trap is set (a TERM before it would end bash)
        if ready.exists():
            break
        time.sleep(0.05)
    ad.stop_all([polite, stubborn, never], grace_s=0.5)
    assert polite.proc.returncode == -15 and stubborn.proc.returncode == -9
    assert polite.log.closed and stubborn.log.closed


def test_servers_carry_the_flags_and_env_of_the_toolkits_profiles():
    import pathlib
    import tomllib
    root = pathlib.Path(__file__).resolve().parents[2]

    def profile(name):   # the product's profiles, and the lab's (gpu/profiles)
        path = root / "profiles" / f"{name}.toml"
        p = tomllib.loads((path if path.exists() else root / "gpu" / "profiles" / f"{name}.toml").read_text())
        base = profile(p["extends"]) if "extends" in p else {"flags": [], "env": {}}
        return {"flags": p.get("flags", base["flags"]), "env": {**base["env"], **p.get("env", {})}}

    servers = {s.label: s for s in ad.make_servers(list(ad.SERVERS), 8, 0.09, "trained")}
    assert set(servers) == set(ad.SERVERS)
    for label, srv in servers.items():
        want = profile(ad.SERVERS[label][0])
        flags = [f.replace("{draft_model}", "/tmp/models/draft-trained") for f in want["flags"]]
        cmd = srv.cmd
        for k in range(0, len(flags), 2):  # every flag of the profile, with its value
            i = cmd.index(flags[k])
            assert cmd[i + 1] == flags[k + 1], (label, flags[k])
        assert cmd[len(cmd) - cmd[::-1].index("--decode-log-interval")] == "1"  # the last one wins
        for key, value in {**want["env"], **ad.SERVERS[label][1]}.items():   # the driver's env wins
            if key == "SGLANG_SPEC_DISABLE_THRESHOLD":
                assert srv.env_shown[key] == "8"
            elif key != "SGLANG_SPEC_DISABLE_HYSTERESIS":  # left to the patch's default
                assert srv.env_shown[key] == value, (label, key)
        assert srv.env_shown.get("SGLANG_SPEC_DISABLE_DEBUG_SKIP_DRAFT_KV") == ("1" if label.endswith("-nc") else None)
        assert srv.env_shown.get("SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV") == (   # the product profile's defer
            None if "native" not in label else label.rsplit("-", 1)[1] if label.endswith(("-skip", "-defer"))
            else "write")
        assert srv.meta()["plain_path"] == ("native" if "native" in label else "step" if "dyn" in label else None)
        assert srv.env_shown["TRITON_CACHE_DIR"] == srv.triton_dir == f"/tmp/triton-{label}"
    # every worker's three servers exist; the default run is the seven servers it always was
    assert all(label in ad.SERVERS for labels in ad.WORKERS.values() for label in labels)
    assert len(ad.DEFAULT_SERVERS) == 7 and "eagle3-v2-dyn-native" not in ad.DEFAULT_SERVERS


@pytest.mark.parametrize("phase", ["before", "after"])
def test_the_c1_phases_measure_one_server_at_a_time(result, phase):
    # c=1 throughput before against after a burst is a goal of issue #24: no other server may
    # decode while one is measured
    tmp, _, _ = result
    recs = [json.loads(line) for line in (tmp / "records.jsonl").read_text().splitlines()]
    spans = {}
    for r in recs:
        if r["phase"] == phase and r["t_start"] is not None:
            lo, hi = spans.get(r["server"], (r["t_start"], r["t_end"]))
            spans[r["server"]] = (min(lo, r["t_start"]), max(hi, r["t_end"]))
    assert len(spans) == len(STANDINS)
    ordered = sorted(spans.values())
    assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:])), ordered


def test_ab_rounds_visit_the_group_in_mirrored_order_one_server_at_a_time(result):
    tmp, summary, _ = result
    recs = [json.loads(line) for line in (tmp / "records.jsonl").read_text().splitlines()]
    for name in ("ab_before", "ab_after"):
        ab = sorted((r for r in recs if r["phase"] == name), key=lambda r: r["t_start"])
        assert all(a["t_end"] <= b["t_start"] for a, b in zip(ab, ab[1:]))  # c=1, one server at a time
        order = {}
        for r in ab:
            order.setdefault(r["round"], []).append(r["server"])
        v2 = ["eagle3-v2-dyn", "eagle3-v2", "eagle3-v2-dyn-nc"]
        v1 = ["eagle3-dyn", "eagle3", "eagle3-dyn-nc"]
        assert order[0] == v2 + v2[::-1] + v1 + v1[::-1]
        assert order[1] == v2[::-1] + v2 + v1[::-1] + v1
        assert {r["idx"] for r in ab if r["round"] == 1} == {1}  # the held-out "before" prompts
    v2 = summary["per_worker"]["v2"]
    assert len(v2["c1_dyn_over_stock_before_rounds"]) == 2 and len(v2["negative_control_c1_nc_over_stock_after_rounds"]) == 2
    assert set(summary["c1_goal_met"]) == {"v1", "v2"}
    # every server's log gives a c=1 step time in every c=1 phase it ran (the stand-ins' step: 2 ms;
    # the baseline has no stock peer, so no A/B rounds)
    for label in STANDINS:
        for name in ("before", "ab_before", "ab_after", "after"):
            if label == "baseline" and name.startswith("ab_"):
                assert summary["c1_step_ms"][label][name] is None
            else:
                assert 1.5 < summary["c1_step_ms"][label][name] < 20, (label, name)


@pytest.fixture(scope="module")
def c1_result(tmp_path_factory):
    """Two pairs at c=1 with 10 ms steps: v2 with noise common to dyn and stock (both 1.6x slower
    after the first crossing), v1 whose dyn server is 1.5x slower after it."""
    tmp = tmp_path_factory.mktemp("c1")
    noise = sa.Noise(after_crossing=1.6)
    standins = {
        "eagle3-v2": {"accept": 2.5, "step_s": 0.01, "noise": noise},
        "eagle3-v2-dyn": {"accept": 2.5, "threshold": THRESHOLD, "step_s": 0.01, "noise": noise},
        "eagle3": {"accept": 2.0, "step_s": 0.01},
        "eagle3-dyn": {"accept": 2.0, "threshold": THRESHOLD, "step_s": 0.01, "slow_after_cross_s": 0.005},
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home-c1")))
        summary, _ = asyncio.run(run_all(tmp, crossings=1, standins=standins, ab_rounds=5, ab_tokens=30))
    return summary


def test_c1_ab_flags_a_dyn_server_slower_after_the_bursts(c1_result):
    v1 = c1_result["per_worker"]["v1"]
    assert v1["c1_dyn_over_stock_before"] == pytest.approx(1.0, abs=0.1)
    assert v1["c1_after_over_before"] < 0.8 and v1["c1_goal_met"] is False
    assert c1_result["c1_goal_met"]["v1"] is False
    assert len(v1["c1_dyn_over_stock_after_rounds"]) == 5
    lo, hi = v1["c1_dyn_over_stock_after_spread"]
    assert lo <= v1["c1_dyn_over_stock_after"] <= hi < 0.8
    # the logs say the same: dyn's step grew against stock's
    assert v1["c1_step_after_over_before"] > 1.3
    assert v1["c1_step_ms"]["dyn"]["ab_after"]["median_step_ms"] > 13


def test_c1_ab_does_not_flag_noise_common_to_the_pair(c1_result):
    v2 = c1_result["per_worker"]["v2"]
    # one server alone, before against after: the shared slowdown looks like a regression
    assert v2["c1_raw_after_over_before"] < 0.8
    # dyn against stock in the same rounds: it cancels (0.99-1.01 in repeated runs; the margins
    # here are wide so a loaded CI machine's scheduling jitter cannot flip it, and still far from
    # the 0.68 / 1.48 of the slowed dyn server above)
    assert v2["c1_after_over_before"] == pytest.approx(1.0, abs=0.1)
    assert v2["c1_step_after_over_before"] == pytest.approx(1.0, abs=0.2)
    assert v2["c1_step_ms"]["stock"]["ab_after"]["median_step_ms"] > 13  # the noise is in the logs too


# the late spanning requests (--late-spans): a defer server whose requests prefilled while plain
# accept nothing for their first 400 steps after the resume (the draft's KV of their prompts never
# written), against skip (prompt prefilled for the draft, healthy) and stock
LATE_STANDINS = {
    "baseline": {},
    "eagle3-v2": {"accept": 2.5},
    "eagle3-v2-dyn-native-skip": {"accept": 2.5, "threshold": THRESHOLD},
    "eagle3-v2-dyn-native-defer": {"accept": 2.5, "threshold": THRESHOLD, "arrival_collapse_steps": 400},
}


@pytest.fixture(scope="module")
def late_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("late")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        # 2 spanning + 1 late = 3 running after the burst: drafting resumes (at <= 5 - 2)
        summary, _ = asyncio.run(run_all(tmp, crossings=2, standins=LATE_STANDINS, late_n=1))
    return tmp, summary


def test_late_spanning_requests_arrive_while_plain_and_their_tails_tell_defer_from_skip(late_result):
    tmp, summary = late_result
    recs = [json.loads(x) for x in (tmp / "records.jsonl").read_text().splitlines()]
    late = [r for r in recs if r["phase"] == "late_span"]
    assert len(late) == 4 * 2 * 1 and not any(r["error"] for r in late)   # servers x crossings x late_n
    # each started after every burst request of its crossing had streamed the lead: drafting was off
    for r in late:
        burst = [b for b in recs if b["phase"] == "burst" and b["server"] == r["server"]
                 and b["crossing"] == r["crossing"]]
        assert all(len([t for t in b["arrivals"] if t <= r["t_start"]]) >= 1 for b in burst)
        assert r["completion_tokens"] == 48
    # the prompt indices of the next crossing follow the late ones: no prompt runs twice per server
    idx = [(r["server"], r["idx"]) for r in recs if r["phase"] in ("span", "burst", "late_span")]
    assert len(idx) == len(set(idx))
    w = summary["per_worker"]["v2-defer"]
    assert w["late_tail_over_stock_median"] < 0.7                       # defer's prompts: stale draft
    assert w["negative_control_late_tail_over_stock_median"] == pytest.approx(1.0, abs=0.15)   # skip's
    assert w["tail_over_stock_median"] == pytest.approx(1.0, abs=0.15)  # the early spanners: healthy
    assert summary["stale_draft"]["v2-defer"]["late_tail_over_stock_median"] == w["late_tail_over_stock_median"]
    assert "late_tail_over_stock" not in summary["per_worker"].get("v2", {})


def test_without_late_spans_the_protocol_and_summary_are_as_before(result):
    tmp, summary, _ = result
    recs = [json.loads(x) for x in (tmp / "records.jsonl").read_text().splitlines()]
    assert not [r for r in recs if r["phase"] == "late_span"]
    assert all(summary["stale_draft"][w]["late_tail_over_stock"] is None for w in summary["stale_draft"])


def test_late_spans_that_would_keep_drafting_off_after_the_burst_are_refused(monkeypatch, capsys):
    """Spanning and late spanning requests together above the resume point would keep drafting off
    after the burst drains, so their 'tails' would be plain steps: the driver refuses to start."""
    monkeypatch.setattr("sys.argv", ["accept_device.py", "--out", "/nonexistent", "--late-spans", "3"])
    with pytest.raises(SystemExit) as e:
        asyncio.run(ad.main())
    assert e.value.code == 2
    assert "--late-spans 3: 4 spanning + 3 late requests stay above the resume point 6" in capsys.readouterr().err


# 10-ms steps for the profile tests: the ask must land within the burst's last profile_lead steps,
# 8 ms at the stand-ins' default 2-ms steps, which a loaded 2-core host missed once
PROFILED_STANDINS = {label: {**cfg, "step_s": 0.01} for label, cfg in LATE_STANDINS.items()}


def test_a_profile_is_asked_across_the_first_two_resumes_of_one_server_only(tmp_path, monkeypatch):
    """The first resume's 115-125 ms gap sat at the resume itself (plain-at-baseline section 11);
    --profile-resume asks the named server for a torch profile while its burst's last plain steps
    run, at crossings 1 and 2, and nothing of the others."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    handles = []
    asyncio.run(run_all(tmp_path, crossings=3, standins=PROFILED_STANDINS, handles_out=handles, late_n=1,
                        profile_label="eagle3-v2-dyn-native-skip", profile_lead=4,
                        profile_dir=str(tmp_path / "traces")))
    by = {h.label: h.standin for h in handles}
    asked = by["eagle3-v2-dyn-native-skip"].profiles
    assert [b["output_dir"] for b, _, _ in asked] == [
        str(tmp_path / "traces" / "eagle3-v2-dyn-native-skip" / f"crossing-{c}") for c in (1, 2)]
    assert all(b["num_steps"] == 60 and b["with_stack"] is False for b, _, _ in asked)
    # asked while the burst still ran, its requests 4 tokens or less from their end (12 tokens each)
    assert all(running > THRESHOLD and streamed >= 12 - 4 for _, running, streamed in asked)
    assert all(not sa_.profiles for label, sa_ in by.items() if label != "eagle3-v2-dyn-native-skip")
    raw = json.loads((tmp_path / "accept_raw.json").read_text())
    kept = raw["profiles"]["eagle3-v2-dyn-native-skip"]
    assert sorted(kept) == ["1", "2"] and all(e["error"] is None and e["asked_at_s"] >= 0 for e in kept.values())


def test_later_crossings_can_be_profiled_instead_of_the_first_two(tmp_path, monkeypatch):
    """The warm-up took the first resume's compiles away; later resumes still ran 60-83 ms on skip
    (plain-at-baseline section 13): profile_crossings puts the profiles on the crossings asked for."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    handles = []
    asyncio.run(run_all(tmp_path, crossings=3, standins=PROFILED_STANDINS, handles_out=handles, late_n=1,
                        profile_label="eagle3-v2-dyn-native-skip", profile_lead=4, profile_crossings=(3,),
                        profile_dir=str(tmp_path / "traces")))
    asked = {h.label: h.standin for h in handles}["eagle3-v2-dyn-native-skip"].profiles
    assert [b["output_dir"] for b, _, _ in asked] == [
        str(tmp_path / "traces" / "eagle3-v2-dyn-native-skip" / "crossing-3")]


@pytest.mark.parametrize("crossings", ["0,1", "2,11", "x", ""])
def test_profile_crossings_outside_the_run_are_refused_before_anything_starts(tmp_path, monkeypatch, capsys, crossings):
    monkeypatch.setattr("sys.argv", ["accept_device.py", "--out", str(tmp_path), "--servers",
                                     "baseline,eagle3-v2,eagle3-v2-dyn-native-skip", "--profile-resume",
                                     "eagle3-v2-dyn-native-skip", "--profile-crossings", crossings])
    with pytest.raises(SystemExit) as stop:
        asyncio.run(ad.main())
    assert stop.value.code == 2 and not any(tmp_path.iterdir())
    assert "--profile-crossings" in capsys.readouterr().err


def test_profile_resume_names_a_dyn_server_of_the_run(tmp_path, monkeypatch):
    for label in ("eagle3-v2", "eagle3-v2-dyn-native-defer"):
        monkeypatch.setattr("sys.argv", ["accept_device.py", "--out", str(tmp_path), "--servers",
                                         "baseline,eagle3-v2,eagle3-v2-dyn-native-skip", "--profile-resume", label])
        with pytest.raises(SystemExit) as stop:
            asyncio.run(ad.main())
        assert stop.value.code == 2 and not any(tmp_path.iterdir())   # refused before anything started

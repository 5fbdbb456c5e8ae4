"""The rollout's planning, as pure functions over what was probed: no host, no sshd."""
from __future__ import annotations

import time

import pytest

from toolkit.patch import patchsets
from toolkit.core.paths import PATCHSETS_DIR
from toolkit.rollout import (Change, HostResult, Probe, RolloutInputError, compare_bench, describe_state, fleet_stop,
                             plan_host, waves)
from toolkit.server import profiles


@pytest.fixture(scope="module")
def known():
    return patchsets.load_all(PATCHSETS_DIR)   # the shipped ones: sm120 (order 10), dyn-disable (order 20)


def probe(stack=(), server=None, **kw) -> Probe:
    return Probe(kw.pop("host", "h1"), "sglang", kw.pop("version", "0.5.11"), list(stack), kw.pop("files_ok", True),
                 kw.pop("file_problems", []), server, **kw)


def running(profile, overrides=None, status="ready"):
    return {"profile": profile, "overrides": overrides or {}, "timeout_s": 900.0, "status": status,
            "started_at": 1000.0, "pid": 42, "tp_size": 2, "log_path": "/x.log"}


def test_apply_with_a_new_profile_takes_only_the_options_given_now(known):
    plan = plan_host(probe(server=running("eagle3-v2", {"port": 31000})), Change("dyn-disable"), known,
                     profile="eagle3-v2-dyn", overrides={"dyn_threshold": 8, "dyn_hysteresis": None})
    assert plan.action == "roll out"
    assert plan.stack_before == [] and plan.stack_after == ["dyn-disable"]
    assert plan.server_before["profile"] == "eagle3-v2" and plan.server_before["overrides"] == {"port": 31000}
    assert plan.server_after == {"profile": "eagle3-v2-dyn", "overrides": {"dyn_threshold": 8}, "timeout_s": None}
    assert plan.server_started_at == 1000.0
    assert plan.steps[0].startswith("invoke patch apply dyn-disable --host h1")
    assert "invoke server start eagle3-v2-dyn --threshold 8 --host h1" in plan.steps
    assert any("eagle3-v2 (port=31000) again" in s for s in plan.steps)
    assert [g.split(" ")[0] for g in plan.gates] == ["smoke"]


def test_the_running_profile_keeps_its_options_and_a_bench_gate_is_listed(known):
    plan = plan_host(probe(stack=["sm120"], server=running("eagle3-dyn", {"port": 31000, "dyn_threshold": 5})),
                     Change("dyn-disable"), known, overrides={"dyn_threshold": 12}, gate_bench=True,
                     bench_levels=(2, 16), tolerance=0.03)
    assert plan.stack_after == ["sm120", "dyn-disable"]
    assert plan.server_after == {"profile": "eagle3-dyn", "overrides": {"port": 31000, "dyn_threshold": 12},
                                 "timeout_s": 900.0}
    assert "c=2,16" in plan.gates[1] and "97%" in plan.gates[1]


def test_the_stack_is_sorted_by_order_whatever_was_applied_first(known):
    plan = plan_host(probe(stack=["dyn-disable"], server=running("baseline")), Change("sm120"), known)
    assert plan.stack_after == ["sm120", "dyn-disable"]


def test_revert_pops_the_patchset_and_what_lies_above_it(known):
    plan = plan_host(probe(stack=["sm120", "dyn-disable"], server=running("eagle3-v2-dyn")),
                     Change("sm120", revert=True), known, profile="eagle3-v2")
    assert plan.stack_after == []
    assert plan.steps[0].startswith("invoke patch revert sm120 --host h1")


def test_nothing_to_do_when_applied_and_the_same_server_runs(known):
    plan = plan_host(probe(stack=["dyn-disable"], server=running("eagle3-v2-dyn", {"dyn_threshold": 8})),
                     Change("dyn-disable"), known, overrides={"dyn_threshold": 8})
    assert plan.action == "unchanged" and plan.steps == []
    # the same stack but another threshold is a restart, so a rollout
    again = plan_host(probe(stack=["dyn-disable"], server=running("eagle3-v2-dyn", {"dyn_threshold": 8})),
                      Change("dyn-disable"), known, overrides={"dyn_threshold": 12})
    assert again.action == "roll out" and not any("patch apply" in s for s in again.steps)


@pytest.mark.parametrize("kwargs, change, profile, words", [
    ({"files_ok": False, "file_problems": ["sglang/a.py: drifted"]}, "dyn-disable", "baseline",
     "files differ from the patch state (sglang/a.py: drifted)"),
    ({}, "dyn-disable", None, "no server runs on h1 and no --profile was given"),
    ({"version": "0.5.3"}, "dyn-disable", "baseline", "dyn-disable has no diff for sglang 0.5.3"),
    ({"version": None}, "dyn-disable", "baseline", "sglang is not installed on h1"),
    ({}, "no-such", "baseline", "unknown patchset 'no-such'"),
])
def test_refusals_change_nothing(known, kwargs, change, profile, words):
    plan = plan_host(probe(**kwargs), Change(change), known, profile=profile)
    assert plan.action == "refused" and words in plan.reason
    assert plan.stack_after == plan.stack_before and plan.steps == []


def test_no_server_and_no_profile_is_refused_even_when_one_was_started_before(known):
    """docs/rollout.md §Plan: a rollout never starts a server nobody was running; the refusal names
    the last profile started there, as the option to pass."""
    plan = plan_host(probe(last_profile="cpu-ref"), Change("dyn-disable"), known)
    assert plan.action == "refused" and plan.steps == [] and plan.server_after is None
    assert "no --profile was given" in plan.reason and "--profile cpu-ref" in plan.reason
    dead = plan_host(probe(server=running("baseline", status="dead")), Change("dyn-disable"), known)
    assert dead.action == "refused" and "--profile baseline" in dead.reason
    given = plan_host(probe(last_profile="cpu-ref"), Change("dyn-disable"), known, profile="cpu-ref")
    assert given.action == "roll out" and given.server_after["profile"] == "cpu-ref"


def test_options_the_launch_plan_refuses_are_bad_input(known):
    """The target server is resolved while planning (as `server restart` does), so a bad option
    raises before any step, with the running profile's options merged in as the restart would."""
    seen = []

    def launch(profile, overrides):
        seen.append((profile, overrides))
        raise profiles.ProfileError(f"profile {profile}: dyn_threshold must be >= 1, got 0")

    with pytest.raises(RolloutInputError, match="h1: profile eagle3-dyn: dyn_threshold must be >= 1"):
        plan_host(probe(server=running("eagle3-dyn", {"port": 31000})), Change("dyn-disable"), known,
                  overrides={"dyn_threshold": 0}, launch=launch)
    assert seen == [("eagle3-dyn", {"port": 31000, "dyn_threshold": 0})]
    plan = plan_host(probe(server=running("eagle3-dyn")), Change("dyn-disable"), known,
                     overrides={"dyn_threshold": 8}, launch=lambda p, o: None)
    assert plan.action == "roll out"


def test_a_dead_server_does_not_count_as_the_one_to_bring_back(known):
    plan = plan_host(probe(server=running("baseline", status="dead")), Change("dyn-disable"), known,
                     profile="eagle3-dyn")
    assert plan.server_before is None and plan.server_started_at is None
    assert plan.steps[-1].endswith("stops the server")


def test_an_in_flight_rollout_is_converged_first_from_its_recorded_state(known):
    journal = {"id": "r1", "phase": "restarted", "change": {"label": "apply dyn-disable"},
               "before": {"stack": [], "server": {"profile": "eagle3-v2", "overrides": {}, "timeout_s": 900}}}
    plan = plan_host(probe(stack=["dyn-disable"], server=running("eagle3-v2-dyn"), journal=journal),
                     Change("dyn-disable"), known, profile="eagle3-v2-dyn")
    assert "rollout r1 (apply dyn-disable) is in flight at phase restarted" in plan.converge_first
    assert plan.stack_before == [] and plan.server_before["profile"] == "eagle3-v2"
    assert plan.action == "roll out" and plan.stack_after == ["dyn-disable"]


@pytest.mark.parametrize("canary, parallel, expected", [
    (1, 2, [["a"], ["b", "c"], ["d", "e"]]),
    (2, 1, [["a", "b"], ["c"], ["d"], ["e"]]),
    (0, 3, [["a", "b", "c"], ["d", "e"]]),
    (9, 2, [["a", "b", "c", "d", "e"]]),
])
def test_waves(canary, parallel, expected):
    assert waves(list("abcde"), canary, parallel) == expected


def test_fleet_stop_rule():
    assert "the canary failed (1 of 2 host(s))" in fleet_stop(0, 2, 1, 0, max_failures=5)
    assert fleet_stop(0, 1, 0, 0, max_failures=0) == ""
    assert "more than --max-failures 0" in fleet_stop(1, 1, 0, 1, max_failures=0)
    assert fleet_stop(1, 1, 0, 1, max_failures=1) == ""
    assert "2 host(s) failed" in fleet_stop(2, 1, 0, 2, max_failures=1)
    # without a canary the first wave is counted like any other
    assert fleet_stop(0, 0, 0, 1, max_failures=1) == ""


def test_compare_bench():
    ok, detail = compare_bench({"1": 96.0, "8": 400.0}, {"1": 100.0, "8": 400.0}, tolerance=0.05)
    assert ok and "c=1: 96.0 vs 100.0 tok/s (0.96x, ok)" in detail and "tolerance 5%" in detail
    ok, detail = compare_bench({"1": 94.0, "8": 400.0}, {"1": 100.0, "8": 400.0}, tolerance=0.05)
    assert not ok and "(0.94x, LOW)" in detail
    ok, detail = compare_bench({"1": 10.0}, None)
    assert ok and "recorded as the reference" in detail


def test_failed_outcomes():
    assert [HostResult("h", o).failed for o in ("kept", "unchanged", "not started", "rolled back", "refused",
                                                 "lost contact")] == [False, False, False, True, True, True]


@pytest.mark.parametrize("phase, state", [("kept", "new"), ("rolled-back", "old"), ("restarted", "in flight"),
                                          ("rollback-failed", "rollback failed")])
def test_describe_state(phase, state):
    journal = {"phase": phase, "change": {"label": "apply dyn-disable"}, "lease_s": 60,
               "events": [{"phase": phase, "at": time.time(), "detail": "x"}], "rolled_back_by": "asked"}
    got, detail = describe_state(probe(stack=["dyn-disable"], server=running("eagle3-v2-dyn"), journal=journal,
                                       lease_age_s=75.0))
    assert got == state and "apply dyn-disable" in detail and "now dyn-disable; eagle3-v2-dyn" in detail
    if state == "in flight":
        assert "silent for 75 s of 60" in detail and "rerun the rollout" in detail
    assert describe_state(probe())[0] == "no rollout"


def test_the_gpu_broken_patchset_compiles_onto_the_pristine_release(monkeypatch):
    """gpu/patchsets/naive-bypass (the user's hand-made bypass, rolled out on the H200 to be rolled back)."""
    from toolkit.patch import patching
    from toolkit.core.paths import PROJECT_ROOT

    monkeypatch.setenv("TOOLKIT_PATCHSETS", str(PROJECT_ROOT / "gpu" / "patchsets"))
    report = patching.check("naive-bypass")
    assert report.ok and report.versions == ["0.5.11"], report.error
    assert [f.path for f in report.files["0.5.11"]] == ["sglang/srt/speculative/eagle_worker.py"]


@pytest.mark.parametrize("args, words", [
    ([], "`invoke rollout` needs a PATCHSET (or --status)"),
    (["dyn-disable", "--parallel", "0"], "--parallel, bench levels and --smoke-max-tokens >= 1"),
    (["dyn-disable", "--canary", "x"], "--canary takes an integer, got 'x'"),
    (["dyn-disable", "--tolerance", "150"], "--tolerance 0-99"),
])
def test_bad_input_exits_2_before_any_host_is_contacted(args, words):
    from .conftest import invoke_cli

    done = invoke_cli("rollout", *args, env={"TOOLKIT_SANDBOX_PORT": "9"})   # nothing listens there
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_a_rollback_claimed_after_a_request_records_the_phase_the_rollout_had_reached(tmp_path):
    """A controller that asks for the rollback (a rerun after a kill) must not hide where the
    rollout was interrupted: the guard claims it from "rollback-requested", the record says "restarted"."""
    from toolkit.hostside import rollout_hostlib as lib

    journal = {}
    for phase in ("armed", "applied", "restarted"):
        lib.add_event(journal, phase)
    lib.add_event(journal, "rollback-requested", "a rerun asked")
    lib.write_journal(str(tmp_path), journal)
    claimed = lib.claim(str(tmp_path), "asked by the controller")
    assert claimed["interrupted_phase"] == "restarted"
    assert lib.read_journal(str(tmp_path))["phase"] == "rolling-back"


def test_rollout_takes_the_thresholds_server_start_takes():
    """`invoke rollout --threshold` parses as `server start --threshold`: an integer, or auto (the
    patch's controller, issue #29); anything else exits 2 naming the option."""
    from invoke.exceptions import Exit

    from toolkit_cli import rollout as rollout_cli
    assert rollout_cli._overrides("auto", None) == {"dyn_threshold": "auto"}
    assert rollout_cli._overrides("12", "3") == {"dyn_threshold": 12, "dyn_hysteresis": 3}
    assert rollout_cli._overrides(None, None) == {}
    with pytest.raises(Exit) as stopped:
        rollout_cli._overrides("twelve", None)
    assert stopped.value.code == 2

"""The switching policy of the dyn-disable patch (pure Python, loaded from the patched tree)."""
from __future__ import annotations

import pytest


def cfg(dyn, threshold, hysteresis=None):
    env = {dyn.THRESHOLD_ENV: str(threshold)}
    if hysteresis is not None:
        env[dyn.HYSTERESIS_ENV] = str(hysteresis)
    return dyn.config_from_env(env)


@pytest.mark.parametrize("env", [{}, {"SGLANG_SPEC_DISABLE_THRESHOLD": ""},
                                 {"SGLANG_SPEC_DISABLE_THRESHOLD": "  "},
                                 {"SGLANG_SPEC_DISABLE_HYSTERESIS": "2"}])
def test_unset_threshold_means_inert(dyn, env):
    assert dyn.config_from_env(env) is None


@pytest.mark.parametrize("threshold,expected", [(1, 0), (2, 1), (5, 1), (8, 2), (16, 4), (64, 16)])
def test_default_hysteresis(dyn, threshold, expected):
    c = cfg(dyn, threshold)
    assert (c.threshold, c.hysteresis, c.resume_at) == (threshold, expected, threshold - expected)


def test_explicit_hysteresis(dyn):
    c = cfg(dyn, 10, 3)
    assert (c.hysteresis, c.resume_at) == (3, 7)
    assert cfg(dyn, 10, 0).resume_at == 10


@pytest.mark.parametrize("threshold,hysteresis,needle", [
    ("abc", None, "SGLANG_SPEC_DISABLE_THRESHOLD='abc' is not an integer"),
    ("0", None, "must be >= 1"),
    ("-3", None, "must be >= 1"),
    ("4.5", None, "is not an integer"),
    ("5", "5", "0 <= hysteresis < threshold"),
    ("5", "-1", "0 <= hysteresis < threshold"),
    ("5", "x", "SGLANG_SPEC_DISABLE_HYSTERESIS='x' is not an integer"),
])
def test_bad_values_are_rejected_with_the_variable_named(dyn, threshold, hysteresis, needle):
    env = {dyn.THRESHOLD_ENV: threshold}
    if hysteresis is not None:
        env[dyn.HYSTERESIS_ENV] = hysteresis
    with pytest.raises(dyn.DynDisableConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        dyn.config_from_env(env)


def run(switch, sizes):
    return [switch.decide(n) for n in sizes]


def test_switches_off_above_threshold_and_on_at_resume_point(dyn):
    s = dyn.SpecSwitch(cfg(dyn, 5, 2))  # off when > 5, on again when <= 3
    assert run(s, [1, 5, 5]) == [True, True, True]
    assert s.decide(6) is False and s.last_switch == "off"
    assert run(s, [7, 5, 4]) == [False, False, False]  # inside the hysteresis band: stays off
    assert s.decide(3) is True and s.last_switch == "on"
    assert run(s, [4, 5]) == [True, True]
    assert (s.spec_steps, s.plain_steps, s.switches_off, s.switches_on) == (6, 4, 1, 1)


def test_no_flapping_around_the_threshold(dyn):
    s = dyn.SpecSwitch(cfg(dyn, 5))  # hysteresis 1
    decisions = run(s, [5, 6, 5, 6, 5, 6, 5, 6])
    assert decisions == [True] + [False] * 7
    assert (s.switches_off, s.switches_on) == (1, 0)


def test_zero_hysteresis_follows_the_threshold_exactly(dyn):
    s = dyn.SpecSwitch(cfg(dyn, 5, 0))
    assert run(s, [5, 6, 5, 6]) == [True, False, True, False]
    assert (s.switches_off, s.switches_on) == (2, 1)


def test_bursts_cross_up_and_down_fifty_times(dyn):
    s = dyn.SpecSwitch(cfg(dyn, 5))
    sizes = []
    for _ in range(25):
        sizes += [1, 2, 12, 12, 9, 7, 5, 4, 2, 1]  # ramp above, drain below resume point
    decisions = run(s, sizes)
    assert (s.switches_off, s.switches_on) == (25, 25)
    assert s.spec_steps + s.plain_steps == len(sizes)
    # within one burst: drafting stops at 12, stays off at 5 (band), resumes at 4
    assert decisions[:10] == [True, True, False, False, False, False, False, True, True, True]


def test_decisions_follow_the_config_read_at_start_not_the_environment_later(dyn, monkeypatch):
    """Every TP rank reads the environment once at start; a later change of it (or a rank whose
    environment differs after start) must not change its decisions mid-run."""
    monkeypatch.setenv(dyn.THRESHOLD_ENV, "5")
    switch = dyn.SpecSwitch(dyn.config_from_env())
    assert run(switch, [6, 6]) == [False, False]
    monkeypatch.setenv(dyn.THRESHOLD_ENV, "50")
    monkeypatch.setenv(dyn.HYSTERESIS_ENV, "40")
    assert run(switch, [6, 4, 9]) == [False, True, False]


@pytest.mark.parametrize("raw, expected", [(None, True), ("", True), ("1", True), (" 0 ", False)])
def test_draft_kv_only_defaults_on(dyn, raw, expected):
    env = {} if raw is None else {dyn.DRAFT_KV_ONLY_ENV: raw}
    assert dyn.draft_kv_only_from_env(env) is expected


@pytest.mark.parametrize("raw", ["yes", "2", "off"])
def test_draft_kv_only_bad_value_names_the_variable(dyn, raw):
    with pytest.raises(dyn.DynDisableConfigError, match=dyn.DRAFT_KV_ONLY_ENV):
        dyn.draft_kv_only_from_env({dyn.DRAFT_KV_ONLY_ENV: raw})


@pytest.mark.parametrize("raw, expected", [(None, False), ("", False), ("0", False), (" 1 ", True)])
def test_debug_skip_draft_kv_defaults_off(dyn, raw, expected):
    env = {} if raw is None else {dyn.DEBUG_SKIP_DRAFT_KV_ENV: raw}
    assert dyn.debug_skip_draft_kv_from_env(env) is expected


@pytest.mark.parametrize("raw", ["yes", "2", "true"])
def test_debug_skip_draft_kv_bad_value_names_the_variable(dyn, raw):
    with pytest.raises(dyn.DynDisableConfigError, match=dyn.DEBUG_SKIP_DRAFT_KV_ENV):
        dyn.debug_skip_draft_kv_from_env({dyn.DEBUG_SKIP_DRAFT_KV_ENV: raw})


@pytest.mark.parametrize("raw, expected", [(None, 0.5), ("", 0.5), ("0", 0.0), (" 1.25 ", 1.25)])
def test_reserve_defaults_to_the_estimate(dyn, raw, expected):
    env = {} if raw is None else {dyn.RESERVE_GIB_ENV: raw}
    assert dyn.reserve_gib_from_env(0.5, env) == expected


@pytest.mark.parametrize("raw", ["lots", "-1", "inf", "nan"])
def test_reserve_bad_value_names_the_variable(dyn, raw):
    with pytest.raises(dyn.DynDisableConfigError, match=dyn.RESERVE_GIB_ENV):
        dyn.reserve_gib_from_env(0.5, {dyn.RESERVE_GIB_ENV: raw})


def test_forced_spec_steps_do_not_move_the_switch(dyn):
    s = dyn.SpecSwitch(cfg(dyn, 5))
    assert s.decide(9) is False
    assert s.decide(9, force_spec=True) is True
    assert s.speculating is False and s.forced_spec_steps == 1
    assert s.decide(9) is False
    assert s.decide(2, force_spec=True) is True and s.speculating is True
    assert s.as_dict() == {"threshold": 5, "hysteresis": 1, "speculating": True, "spec_steps": 2,
                           "plain_steps": 2, "forced_spec_steps": 1, "switches_off": 1, "switches_on": 1}


def test_log_messages(dyn):
    s = dyn.SpecSwitch(cfg(dyn, 5))
    assert s.startup_message().startswith("Dynamic speculation disable enabled: threshold=5 hysteresis=1")
    s.decide(1)
    assert s.switch_message(1) is None
    s.decide(6)
    assert "drafting stopped at 6 running decode requests" in s.switch_message(6)
    s.decide(4)
    msg = s.switch_message(4)
    assert "drafting resumed at 4" in msg and "spec steps: 2, plain steps: 1" in msg
    assert s.counters_message() == "spec steps: 2, plain steps: 1, spec off/on switches: 1/1"

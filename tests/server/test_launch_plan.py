"""`profiles.plan_launch`: the launch plan from a profile given as data (no profile file, no
patchset read): precedence, placeholders, and every refusal."""
from __future__ import annotations

import pytest

from toolkit.core.inventory import Host
from toolkit.server.profiles import ProfileError, plan_launch

HOST = Host(name="h", venv="/v", server={"model": "/models/m"})
SGLANG = {"kind": "sglang", "flags": ["--mem-fraction-static", "0.8"], "env": {"A": "{port}"}}
DYN = {**SGLANG, "dyn_threshold": 8, "env": {"T": "{dyn_threshold}", "H": "{dyn_hysteresis}"}}


def halve(values):
    return {"dyn_hysteresis": values["dyn_threshold"] // 2}


def test_overrides_win_over_the_host_which_wins_over_the_profile():
    host = Host(name="h", venv="/v", server={"model": "/models/m", "port": 31000, "tp_size": 2})
    plan = plan_launch(host, "p", {**SGLANG, "port": 30500, "tp_size": 4}, {"tp_size": 8})
    assert (plan.port, plan.tp_size) == (31000, 8)
    assert plan.argv[:4] == ["/v/bin/python", "-m", "sglang.launch_server", "--model-path"]
    assert plan.argv[-2:] == ["--mem-fraction-static", "0.8"] and plan.env == {"A": "31000"}


def test_the_default_hysteresis_is_asked_of_the_defaults_function_only_when_needed():
    asked = []

    def defaults(values):
        asked.append(dict(values))
        return halve(values)

    assert plan_launch(HOST, "p", DYN, defaults=defaults).env == {"T": "8", "H": "4"}
    assert asked == [{"dyn_threshold": 8, "dyn_hysteresis": None, "tp_size": 1}]
    assert plan_launch(HOST, "p", {**DYN, "dyn_hysteresis": 3}, defaults=defaults).dyn_hysteresis == 3
    # a threshold given on the command line drops the profile's hysteresis (made for its own threshold)
    assert plan_launch(HOST, "p", {**DYN, "dyn_hysteresis": 3}, {"dyn_threshold": 20},
                       defaults=defaults).dyn_hysteresis == 10
    assert plan_launch(HOST, "p", SGLANG, defaults=defaults).dyn_hysteresis is None
    assert len(asked) == 2


@pytest.mark.parametrize("profile, overrides, host, message", [
    (SGLANG, {"colour": "red"}, HOST, "cannot override colour"),
    (SGLANG, None, Host(name="h", server={"model": "/m", "gpu": 1}), "host h: unknown keys in \\[server\\]: gpu"),
    (SGLANG, {"port": 70000}, HOST, "port 70000 is out of range"),
    (SGLANG, {"tp_size": "two"}, HOST, "tp_size must be an integer, not 'two'"),
    (SGLANG, {"tp_size": 0}, HOST, "tp_size must be >= 1, got 0"),
    (SGLANG, None, Host(name="h", venv="/v", server={"model": "/m", "tp_size": -3}), "tp_size must be >= 1, got -3"),
    (DYN, {"dyn_threshold": 0}, HOST, "dyn_threshold must be >= 1, got 0"),
    (DYN, {"dyn_hysteresis": 8}, HOST, "dyn_hysteresis must satisfy 0 <= hysteresis < threshold \\(8\\)"),
    (DYN, None, HOST, "no patchset's hook gives a default one"),
    (SGLANG, None, Host(name="h", venv="/v"), "profile p needs a model on host h"),
    ({**SGLANG, "draft_model_required": True}, None, HOST, "profile p needs a draft model on host h"),
    ({**SGLANG, "env": {"HF_TOKEN": "x"}}, None, HOST, "profile env HF_TOKEN looks like a secret"),
    ({**SGLANG, "env": {"1BAD": "x"}}, None, HOST, "'1BAD' is not a valid variable name"),
    ({**SGLANG, "flags": ["{nope}"]}, None, HOST, "bad placeholder in flags"),
])
def test_refusals(profile, overrides, host, message):
    with pytest.raises(ProfileError, match=message):
        plan_launch(host, "p", profile, overrides)

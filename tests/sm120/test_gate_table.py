"""Every sm120 gate decision, from one table (gate_cases.toml), through both callers of the rule:
the toolkit's prediction from a host's facts, and the patched SGLang's runtime probes (faked:
no SM120 GPU here). Both must reach the table's state and reason for every feature."""
from __future__ import annotations

import pytest

from toolkit.patch import patchsets

from .conftest import CASES, RULE, case_env, facts_for, predict, rule

IDS = [c["name"] for c in CASES]


def check(decisions, case, side):
    got = {d.feature: d for d in decisions}
    assert set(got) == {"fusion", "symm_mem", "deep_gemm"}
    for feature, state in case["expect"].items():
        assert got[feature].state == state, f"{side}: {feature}: {got[feature]}"
        assert got[feature].forced == (feature in case.get("forced", [])), f"{side}: {feature}: {got[feature]}"
    for feature, piece in case.get("why", {}).items():
        assert piece in got[feature].why, f"{side}: {feature}: {got[feature].why!r} lacks {piece!r}"


def test_the_toolkit_loads_exactly_the_file_the_patch_installs(patched_tree):
    """The prediction runs the bytes SGLang runs: the rule text read out of the diff equals the file
    in the patched tree (made from the real 0.5.11 wheel files with git apply)."""
    assert patchsets.added_file_text("sm120", RULE) == (patched_tree / RULE).read_text()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_prediction_from_facts(case):
    prediction = predict(facts_for(case), tp_size=case.get("tp", case["gpus"]), env=case_env(case))
    check(prediction.decisions, case, "facts")
    assert prediction.applied and prediction.gpus == list(range(case["gpus"]))[:case.get("tp", case["gpus"])]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_decision_from_runtime_probes(case, patched_rule, fake_machine):
    fake_machine(case)
    gpus = list(range(case.get("tp", case["gpus"])))
    inputs = patched_rule.runtime_inputs(gpus, len(gpus))
    import os
    check(patched_rule.decide(inputs, os.environ), case, "runtime")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_both_sides_give_the_same_lines(case, patched_rule, fake_machine):
    """Not only the states: the toolkit prints, word for word, the lines the server will log."""
    import os
    tp = case.get("tp", case["gpus"])
    predicted = predict(facts_for(case), tp_size=tp, env=case_env(case)).lines()
    fake_machine(case)
    logged = [patched_rule.line(d) for d in patched_rule.decide(patched_rule.runtime_inputs(list(range(tp)), tp),
                                                                os.environ)]
    assert predicted == logged
    assert all(text.startswith("sm120: ") for text in logged)


@pytest.mark.parametrize("stack_name, majors, fusion", [
    ("gpu", [9, 10], "off"), ("gpu-0.5.17", [9, 10], "off"), ("gpu-0.5.23", [9, 10, 12], "on")])
def test_each_gpu_stacks_flashinfer_decides_the_fusion_on_a_p2p_sm120_host(stack_name, majors, fusion):
    """The jit/comm.py of the FlashInfer each GPU stack pins (the real wheel), read as the patched server
    and `invoke facts` read it: only 0.5.23's FlashInfer 0.7.2 builds trtllm_comm for SM12x (first in
    0.6.17), so only there does an SM120 host with P2P between every pair get the fusion."""
    from toolkit.provision import stack
    from toolkit.patch import wheels

    version = {p.name: p.version for p in stack.load(stack_name).pins}["flashinfer-python"]
    text = wheels.pristine("flashinfer-python", version).read("flashinfer/jit/comm.py").decode()
    module = rule()
    assert module.trtllm_comm_majors(text) == majors
    from toolkit.hostside import facts as host_facts
    assert host_facts.trtllm_comm_majors(text) == majors
    case = next(c for c in CASES if c["name"].startswith("8x RTX PRO 6000 with P2P but no P2P atomics, the gpu-0.5.23"))
    host = dict(case, flashinfer=version, majors=majors)
    decisions = {d.feature: d for d in predict(facts_for(host), tp_size=8).decisions}
    assert decisions["fusion"].state == fusion, decisions["fusion"]
    assert version in decisions["fusion"].why

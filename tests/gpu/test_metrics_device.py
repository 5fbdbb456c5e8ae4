"""gpu/metrics_device.py's end-of-run checks, on log text written by the patch's own messages
(the SpecSwitch of patchsets/dyn-disable, driven through bursts) at TP=1 and TP=2."""
from __future__ import annotations

import pytest

from tests.dyn.conftest import PATCHSET, load_by_path, tree_with

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def device():
    return load_gpu_script("metrics_device")


@pytest.fixture(scope="module")
def dyn(tmp_path_factory):
    tree = tree_with(tmp_path_factory.mktemp("md"), [PATCHSET / "0.5.11" / "0001-dyn-disable.patch"])
    return load_by_path("dyn_for_metrics_device", tree / "sglang/srt/speculative/dyn_disable.py")


def run_log(dyn, ranks=1, log_every=7):
    """(log text, the switch's final counters): bursts across threshold 4, a Decode batch line every
    `log_every` steps and a line per switch, as every TP rank prints them."""
    switch = dyn.SpecSwitch(dyn.DynDisableConfig(threshold=4, hysteresis=1))
    lines = []

    def emit(text):
        for rank in range(ranks):
            prefix = f"[2026-12-01 10:00:00 TP{rank}]" if ranks > 1 else "[2026-12-01 10:00:00]"
            lines.append(f"{prefix} {text}")

    step = 0
    for running in [1, 2, 6, 6, 8, 5, 3, 2, 7, 7, 2, 1, 9, 9, 9, 3, 1, 1]:
        switch.decide(running)
        step += 1
        message = switch.switch_message(running)
        if message:
            emit(message)
        if step % log_every == 0:
            emit(f"Decode batch, #running-req: {running}, accept len: 2.10, {switch.counters_message()}, "
                 f"cuda graph: True")
    return "\n".join(lines), switch.as_dict()


@pytest.mark.parametrize("ranks", [1, 2])
def test_final_metrics_equal_to_the_switch_pass(device, dyn, ranks):
    text, final = run_log(dyn, ranks)
    log = device.log_counters(text)
    assert (log["stopped_lines"], log["resumed_lines"]) == (final["switches_off"], final["switches_on"]) == (3, 3)
    verdicts = device.checks(dict(final), dict(final), log, failures=0)
    assert all(v["ok"] for v in verdicts), verdicts


def test_a_metric_that_missed_a_switch_or_a_step_fails(device, dyn):
    text, final = run_log(dyn)
    log = device.log_counters(text)
    missed = {**final, "switches_off": final["switches_off"] - 1}
    failed = {v["check"] for v in device.checks(missed, final, log, failures=0) if not v["ok"]}
    assert "switches_off == 'drafting stopped' lines" in failed and "every counter == /server_info" in failed
    behind = {**final, "plain_steps": 0}
    failed = {v["check"] for v in device.checks(behind, behind, log, failures=1) if not v["ok"]}
    assert failed == {"steps >= the last logged counters", "no failed request"}

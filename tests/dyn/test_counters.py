"""The counters of steps with and without speculation, where each release reports them: the
periodic "Decode batch" line (0.5.11: observability/scheduler_metrics_mixin.py; 0.5.17:
managers/scheduler_components/metrics_reporter.py, which reaches the scheduler through
self.scheduler; 0.5.23: the same file) and /server_info's internal state (managers/scheduler.py on
0.5.11 and 0.5.17; on 0.5.23 the contributor SchedulerInternalStateController._add_speculative of
managers/scheduler_components/internal_state.py, which reaches the worker through its scheduler). The
patched statements are taken from each release's patched file and run against a real SpecSwitch."""
from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

SCHEDULER = "sglang/srt/managers/scheduler.py"
DECODE_LINE = {
    "0.5.11": "sglang/srt/observability/scheduler_metrics_mixin.py",
    "0.5.17": "sglang/srt/managers/scheduler_components/metrics_reporter.py",
    "0.5.23": "sglang/srt/managers/scheduler_components/metrics_reporter.py",
}
# where /server_info's internal state is built, and the names the patched statements use there
SERVER_INFO = {
    "0.5.11": (SCHEDULER, "self", "ret"),
    "0.5.17": (SCHEDULER, "self", "ret"),
    "0.5.23": ("sglang/srt/managers/scheduler_components/internal_state.py", "scheduler", "state"),
}


def patched_statements(path: Path):
    """The patch's two statements in `path`: `dyn_disable = getattr(...)` and the `if` after it."""
    for node in ast.walk(ast.parse(path.read_text())):
        for body in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if isinstance(body, list):
                found = _the_two(body)
                if found is not None:
                    return compile(ast.Module(body=found, type_ignores=[]), str(path), "exec")
    raise AssertionError(f"no dyn_disable statements in {path}")


def _the_two(body):
    for i, stmt in enumerate(body):
        if (isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id == "dyn_disable"):
            return body[i:i + 2]
    return None


@pytest.fixture()
def switch(dyn):
    s = dyn.SpecSwitch(dyn.config_from_env({dyn.THRESHOLD_ENV: "4"}))
    for running in (2, 6, 6, 3, 2):
        s.decide(running)
    return s


def scheduler_with(release, draft_worker):
    """`self` as the patched method sees it: the scheduler (0.5.11 mixin, scheduler.py) or 0.5.17's
    metrics reporter, which holds the scheduler."""
    scheduler = types.SimpleNamespace(draft_worker=draft_worker)
    return scheduler if release == "0.5.11" else types.SimpleNamespace(scheduler=scheduler)


def test_the_decode_batch_line_carries_the_counters(release, release_tree, switch):
    code = patched_statements(release_tree / DECODE_LINE[release])
    namespace = {"self": scheduler_with(release, types.SimpleNamespace(dyn_disable=switch)),
                 "msg": "accept len: 2.00, "}
    exec(code, namespace)
    assert namespace["msg"] == "accept len: 2.00, spec steps: 3, plain steps: 2, spec off/on switches: 1/1, "


@pytest.mark.parametrize("draft_worker", [None, types.SimpleNamespace(dyn_disable=None)])
def test_without_the_switch_the_decode_batch_line_is_stock(release, release_tree, draft_worker):
    code = patched_statements(release_tree / DECODE_LINE[release])
    namespace = {"self": scheduler_with(release, draft_worker), "msg": "accept len: 2.00, "}
    exec(code, namespace)
    assert namespace["msg"] == "accept len: 2.00, "


def test_server_info_carries_the_counters(release, release_tree, switch):
    path, owner, answer = SERVER_INFO[release]
    code = patched_statements(release_tree / path)
    namespace = {owner: types.SimpleNamespace(draft_worker=types.SimpleNamespace(dyn_disable=switch)), answer: {}}
    exec(code, namespace)
    assert namespace[answer]["dyn_spec_disable"] == {
        "threshold": 4, "hysteresis": 1, "speculating": True, "spec_steps": 3, "plain_steps": 2,
        "forced_spec_steps": 0, "switches_off": 1, "switches_on": 1}
    stock = {owner: types.SimpleNamespace(draft_worker=None), answer: {}}
    exec(code, stock)
    assert stock[answer] == {}

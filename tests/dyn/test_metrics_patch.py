"""The dyn-disable metrics diff (0002-dyn-disable-metrics.patch) on the files of each release the
patchset has diffs for (0.5.11, 0.5.17 and 0.5.23), with its 0001 below it: the patched
`dyn_disable_metrics` module driven by the patch's own `SpecSwitch`, exported with the real
prometheus_client and read back from the exposition text, in-process and in prometheus_client's
multiprocess mode as SGLang serves it; and the patched `report_decode_stats`
(0.5.11: the scheduler's metrics mixin; 0.5.17 and 0.5.23: its SchedulerMetricsReporter) executed with a
stand-in scheduler, so the hook itself is what is tested."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from toolkit.patch import patchsets
from toolkit.server import scrape

from .conftest import PATCHSET, RELEASES, load_by_path, method_source, stub_modules, tree_with

LABELS = {"model_name": "m", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}


@pytest.fixture(scope="module", params=RELEASES)
def release(request):
    return request.param


@pytest.fixture(scope="module")
def tree(tmp_path_factory, release):
    folder = PATCHSET / release
    return tree_with(tmp_path_factory.mktemp(f"dyn-metrics-{release}"),
                     [folder / "0001-dyn-disable.patch", folder / "0002-dyn-disable-metrics.patch"], release)


@pytest.fixture(scope="module")
def dyn(tree, release):
    return load_by_path(f"dyn_disable_for_metrics_{release}", tree / "sglang/srt/speculative/dyn_disable.py")


@pytest.fixture(scope="module")
def metrics_mod(tree, release):
    return load_by_path(f"dyn_disable_metrics_under_test_{release}",
                        tree / "sglang/srt/speculative/dyn_disable_metrics.py")


def switch(dyn, threshold=8, hysteresis=2):
    return dyn.SpecSwitch(dyn.DynDisableConfig(threshold=threshold, hysteresis=hysteresis))


def exposition(registry) -> dict:
    return scrape.parse(generate_latest(registry).decode())


def test_the_metrics_diff_is_applied_after_0001_in_file_name_order():
    dyn_disable = patchsets.load_all()["dyn-disable"]
    for release in RELEASES:
        names = [p.name for p in dyn_disable.patches(release)]
        assert names[:2] == ["0001-dyn-disable.patch", "0002-dyn-disable-metrics.patch"]
        assert names == sorted(names)


def test_switch_state_reads_back_from_the_exposition(dyn, metrics_mod):
    sw = switch(dyn)
    registry = CollectorRegistry()
    metrics = metrics_mod.DynDisableMetrics(sw, LABELS, registry=registry)
    values = exposition(registry)
    assert values["sglang:spec_dyn_disable_threshold"] == 8
    assert values["sglang:spec_dyn_disable_hysteresis"] == 2
    assert values["sglang:spec_dyn_disable_drafting"] == 1
    assert values["sglang:spec_dyn_disable_switches_off_total"] == 0

    # a burst: 4 steps below, 5 above (off at the first), down to 7 (stays off), 6 (resumes)
    for running in (3, 4, 5, 8, 9, 12, 12, 10, 9, 7, 6, 5):
        sw.decide(running)
        metrics.sync()
    sw.decide(20, force_spec=False)
    sw.decide(20, force_spec=True)     # a forced speculative step while off
    metrics.sync()
    values = exposition(registry)
    state = sw.as_dict()
    for field in ("spec_steps", "plain_steps", "forced_spec_steps", "switches_off", "switches_on"):
        assert values[f"sglang:spec_dyn_disable_{field}_total"] == state[field], field
    assert (state["switches_off"], state["switches_on"], state["plain_steps"], state["forced_spec_steps"]) == (2, 1, 7, 1)
    assert values["sglang:spec_dyn_disable_drafting"] == 0
    # what `server watch` and bench read from it is the switch's own /server_info view
    parsed = scrape.Snapshot(0.0, values).dyn_state()
    assert {k: parsed[k] for k in state} == state
    assert parsed["since"] > 0


def test_help_text_and_types_follow_sglang(dyn, metrics_mod):
    registry = CollectorRegistry()
    metrics_mod.DynDisableMetrics(switch(dyn), LABELS, registry=registry)
    text = generate_latest(registry).decode()
    assert "# TYPE sglang:spec_dyn_disable_plain_steps_total counter" in text
    assert "# TYPE sglang:spec_dyn_disable_drafting gauge" in text
    assert 'sglang:spec_dyn_disable_threshold{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 8.0' in text
    for line in text.splitlines():
        if line.startswith("# HELP sglang:"):
            assert line.rstrip().endswith("."), line


def test_attach_makes_nothing_when_inert_or_metrics_are_off(dyn, metrics_mod):
    def reporter(enabled):
        return types.SimpleNamespace(current_scheduler_metrics_enabled=enabled,
                                     metrics_collector=types.SimpleNamespace(labels=dict(LABELS)))

    def draft(dyn_switch):
        return types.SimpleNamespace(dyn_disable=dyn_switch)

    assert metrics_mod.attach(reporter(True), draft(None)) is None          # patch inert: no threshold
    assert metrics_mod.attach(reporter(False), draft(switch(dyn))) is None  # --enable-metrics off, or rank 1..
    assert metrics_mod.attach(reporter(True), None) is None                 # no speculative decoding at all


REPORTERS = {"0.5.11": ("sglang/srt/observability/scheduler_metrics_mixin.py", "SchedulerMetricsMixin"),
             "0.5.17": ("sglang/srt/managers/scheduler_components/metrics_reporter.py", "SchedulerMetricsReporter"),
             "0.5.23": ("sglang/srt/managers/scheduler_components/metrics_reporter.py", "SchedulerMetricsReporter")}


def _report_decode_stats(tree, release):
    """The patched report_decode_stats of the release as a plain function."""
    path, owner = REPORTERS[release]
    source = method_source(tree / path, owner, "report_decode_stats")
    namespace = {"ScheduleBatch": object}
    exec(compile("from __future__ import annotations\n" + source, "report_decode_stats", "exec"), namespace)
    return namespace["report_decode_stats"]


class _Collector:
    def __init__(self):
        self.labels = dict(LABELS)
        self.realtime_tokens = 0

    def increment_realtime_tokens(self, decode_tokens, dp_cooperation_info):
        self.realtime_tokens += decode_tokens


def _scheduler(dyn_switch, enabled=True):
    """The object report_decode_stats runs on: 0.5.11's scheduler (the mixin's self) and 0.5.17's
    metrics reporter (its `scheduler` attribute) in one."""
    batch = types.SimpleNamespace(batch_size=lambda: 12, dp_cooperation_info=None)
    draft_worker = types.SimpleNamespace(dyn_disable=dyn_switch)
    return types.SimpleNamespace(
        current_scheduler_metrics_enabled=enabled, running_batch=batch, metrics_collector=_Collector(),
        enable_mfu_metrics=False, scheduler_status_logger=None, forward_ct_decode=1, decode_log_interval=40,
        server_args=types.SimpleNamespace(decode_log_interval=40), is_stats_logging_rank=enabled,
        draft_worker=draft_worker, waiting_queue=[],
        scheduler=types.SimpleNamespace(running_batch=batch, draft_worker=draft_worker, waiting_queue=[]))


def test_every_decode_step_of_the_scheduler_brings_the_metrics_up_to_date(tree, release, dyn, metrics_mod,
                                                                          monkeypatch):
    registry = CollectorRegistry()
    real = metrics_mod.DynDisableMetrics
    monkeypatch.setattr(metrics_mod, "DynDisableMetrics",
                        lambda sw, labels: real(sw, labels, registry=registry))
    report = _report_decode_stats(tree, release)
    sw = switch(dyn, threshold=4, hysteresis=1)
    sched = _scheduler(sw)
    # 0.5.23 counts the tokens its caller says the step generated, not the batch size
    generated = {"num_generated_tokens": 12} if release == "0.5.23" else {}
    with stub_modules({"sglang.srt.speculative.dyn_disable_metrics": vars(metrics_mod)}):
        for running in (2, 3, 6, 6, 6, 3, 2):
            sw.decide(running)
            report(sched, True, **generated)
    assert sched.metrics_collector.realtime_tokens == 7 * 12     # SGLang's own per-step work still runs
    values = exposition(registry)
    assert values["sglang:spec_dyn_disable_plain_steps_total"] == 3
    assert values["sglang:spec_dyn_disable_switches_off_total"] == 1
    assert values["sglang:spec_dyn_disable_switches_on_total"] == 1
    assert values["sglang:spec_dyn_disable_drafting"] == 1


def test_no_metrics_object_on_a_scheduler_that_does_not_export(tree, release, dyn, metrics_mod):
    report = _report_decode_stats(tree, release)
    for sched in (_scheduler(switch(dyn), enabled=False), _scheduler(None)):
        if sched.draft_worker.dyn_disable is not None:
            sched.draft_worker.dyn_disable.decide(9)
        with stub_modules({"sglang.srt.speculative.dyn_disable_metrics": vars(metrics_mod)}):
            report(sched, True)
        assert getattr(sched, "dyn_disable_metrics", None) is None


def test_multiprocess_mode_as_sglang_serves_it(tree, tmp_path):
    """SGLang sets PROMETHEUS_MULTIPROC_DIR and its HTTP process serves what the scheduler wrote there."""
    speculative = tree / "sglang/srt/speculative"
    code = textwrap.dedent(f"""
        import importlib.util, os, sys
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
        def load(name, path):
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); return module
        dyn = load("d", {str(speculative / "dyn_disable.py")!r})
        metrics = load("m", {str(speculative / "dyn_disable_metrics.py")!r})
        sw = dyn.SpecSwitch(dyn.DynDisableConfig(threshold=2, hysteresis=1))
        m = metrics.DynDisableMetrics(sw, {{"model_name": "m", "tp_rank": 0}})
        for running in (1, 3, 3, 1, 3):
            sw.decide(running); m.sync()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    read = textwrap.dedent(f"""
        import os
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        registry = CollectorRegistry(); multiprocess.MultiProcessCollector(registry)
        print(generate_latest(registry).decode())
    """)
    served = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True)
    assert served.returncode == 0, served.stderr
    values = scrape.parse(served.stdout)
    assert values["sglang:spec_dyn_disable_switches_off_total"] == 2
    assert values["sglang:spec_dyn_disable_switches_on_total"] == 1
    assert values["sglang:spec_dyn_disable_plain_steps_total"] == 3
    assert values["sglang:spec_dyn_disable_drafting"] == 0
    assert values["sglang:spec_dyn_disable_threshold"] == 2

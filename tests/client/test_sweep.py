"""The sweep engine over several profiles, with a server that dies in the middle (fake servers)."""
from __future__ import annotations

import contextlib

from toolkit.bench.outputs import RunWriter, load_records
from toolkit.bench.prompts import PromptSource
from toolkit.bench.runner import BenchOptions, ServedProfile, SweepListener, run_sweep

from .fake_openai import FakeOpenAI


class FakeServers:
    """A ServerControl that starts a fresh fake server per profile and stops it afterwards."""

    def __init__(self):
        self.current: FakeOpenAI | None = None
        self.started: list[str] = []

    @contextlib.contextmanager
    def serve(self, profile):
        if profile == "wont-start":
            raise RuntimeError("wont-start did not start: port taken")
        self.current = FakeOpenAI(chunks=4).start()
        self.started.append(profile)
        try:
            yield ServedProfile(profile, self.current.base_url, {"kind": "fake"})
        finally:
            self.current.stop()


class SeenProcess(FakeServers):
    """FakeServers whose control also sees the server's "process" (gone once it is stopped)."""

    def gone(self, served):
        return None if self.current.running else f"the {served.profile} fake server was stopped"


class KillMidLevel(SweepListener):
    """Stops the server after `after` answers of level `level`: that level ends with failures."""

    def __init__(self, servers, level, after):
        self.servers, self.level, self.after, self.seen, self.current = servers, level, after, 0, None

    def level_started(self, profile, concurrency, requests):
        self.current = concurrency

    def request_done(self, record):
        if self.current == self.level:
            self.seen += 1
            if self.seen == self.after:
                self.servers.current.stop()


def test_a_server_that_dies_mid_level_stops_the_sweep_at_that_level(tmp_path):
    servers = SeenProcess()
    writer = RunWriter(tmp_path)
    options = BenchOptions(concurrency=[1, 2, 4, 8], requests=8, prompts=PromptSource(output_len=4), warmup=1)
    result = run_sweep(["eagle3"], options, servers, on_level=writer.append,
                       listener=KillMidLevel(servers, level=2, after=3))
    levels = [(r["concurrency"], r["metrics"]["completed"] + r["metrics"]["failed"]) for r in load_records(tmp_path)]
    assert levels == [(1, 8), (2, 8)]   # the level that found it dead is kept, none after it is sent
    died = result.records[1]["metrics"]
    assert 3 <= died["completed"] < 8 and died["failed"] > 0
    [error] = result.errors
    assert error.startswith("eagle3: server unreachable after concurrency 2: ")
    assert error.endswith("; the eagle3 fake server was stopped; the sweep of eagle3 stopped there"
                          " (levels not run: c=4, c=8), the levels measured are kept")


class KillAfterFirstLevel(SweepListener):
    def __init__(self, servers, victim):
        self.servers, self.victim, self.notes = servers, victim, []

    def level_done(self, record):
        if record["profile"] == self.victim and record["concurrency"] == 1:
            self.servers.current.stop()

    def note(self, text):
        self.notes.append(text)


def test_a_dying_server_loses_its_profile_not_the_sweep(tmp_path):
    servers = FakeServers()
    listener = KillAfterFirstLevel(servers, victim="eagle3")
    writer = RunWriter(tmp_path)
    options = BenchOptions(concurrency=[1, 2, 4], requests=6, prompts=PromptSource(output_len=4), warmup=1)
    result = run_sweep(["baseline", "wont-start", "eagle3", "eagle3-dyn"], options, servers,
                       on_level=writer.append, listener=listener)
    assert servers.started == ["baseline", "eagle3", "eagle3-dyn"]
    levels = [(r["profile"], r["concurrency"], r["metrics"]["completed"], r["metrics"]["failed"])
              for r in load_records(tmp_path)]
    assert levels == [("baseline", 1, 6, 0), ("baseline", 2, 6, 0), ("baseline", 4, 6, 0),
                      ("eagle3", 1, 6, 0), ("eagle3", 2, 0, 6),
                      ("eagle3-dyn", 1, 6, 0), ("eagle3-dyn", 2, 6, 0), ("eagle3-dyn", 4, 6, 0)]
    assert len(result.errors) == 2
    assert result.errors[0].startswith("wont-start: ") and "port taken" in result.errors[0]
    assert result.errors[1].startswith("eagle3: server unreachable after concurrency 2")
    assert all(r["run_id"] == result.run_id for r in result.records)
    server = result.records[0]["server"]
    assert (server["kind"], server["model"]) == ("fake", "fake-model")
    # the fake answers no /server_info and the control gives no launch plan: nothing is claimed
    assert server["attention_backend"] is None and set(server["config_source"].values()) == {None}


def test_repeat_runs_whole_passes_and_every_run_is_kept(tmp_path):
    servers = FakeServers()
    writer = RunWriter(tmp_path)
    options = BenchOptions(concurrency=[1, 2], requests=4, prompts=PromptSource(output_len=4), warmup=1, repeat=3)
    result = run_sweep(["baseline"], options, servers, on_level=writer.append)
    assert not result.errors
    order = [(r["repeat"], r["concurrency"]) for r in load_records(tmp_path)]
    assert order == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]   # passes, not runs in a row
    assert all(r["params"]["repeat"] == 3 and r["metrics"]["completed"] == 4 for r in result.records)


def test_an_interrupt_right_after_a_level_reached_the_disk_keeps_that_level(tmp_path, monkeypatch):
    # Ctrl-C as the first level's line is written (what a user, or `invoke bench`'s Ctrl-C test,
    # does on seeing it): the CSV and the plot still hold that level
    from toolkit.bench import session

    written = RunWriter.append

    def append_then_interrupt(self, record):
        written(self, record)
        raise KeyboardInterrupt

    monkeypatch.setattr(RunWriter, "append", append_then_interrupt)
    servers = FakeServers()
    plan = session.BenchPlan(["baseline"], servers, "fake")
    options = BenchOptions(concurrency=[1, 2], requests=2, prompts=PromptSource(output_len=4), warmup=0)
    outcome = session.run(plan, options, tmp_path / "run")
    assert outcome.interrupted
    assert [(r["profile"], r["concurrency"]) for r in outcome.records] == [("baseline", 1)]
    assert (tmp_path / "run" / "results.csv").read_text().count("\n") == 2     # header + the level
    assert (tmp_path / "run" / "throughput.png").exists()

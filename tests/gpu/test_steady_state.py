"""gpu/steady_state.py on small synthetic SGLang logs."""
import pytest

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def steady_state():
    return load_gpu_script("steady_state")


def log_line(running, tok_s):
    return (f"[2026-11-30 12:46:37] Decode batch, #running-req: {running}, #token: 36640, "
            f"token usage: 0.56, cuda graph: True, gen throughput (token/s): {tok_s}, #queue-req: 0\n")


def test_only_intervals_at_exactly_that_running_count_and_only_the_best_three(steady_state):
    text = "".join(log_line(r, t) for r, t in [(64, 100.0), (64, 300.0), (640, 999.0), (6, 999.0),
                                                  (64, 200.0), (64, 250.0), (32, 50.0)])
    assert steady_state.best_intervals(text, 64) == [300.0, 250.0, 200.0]
    assert steady_state.best_intervals(text, 16) == []


def test_ratios_are_over_the_first_log_and_missing_counts_say_so(steady_state, tmp_path, capsys):
    base, other = tmp_path / "base.log", tmp_path / "dyn.log"
    base.write_text(log_line(64, 1000.0) + log_line(64, 1000.0) + log_line(64, 900.0))
    other.write_text(log_line(64, 960.0) + log_line(64, 950.0) + log_line(64, 100.0) + log_line(32, 5.0))
    steady_state.main([str(base), str(other), "--running", "64,16"])
    out = capsys.readouterr().out
    assert "| 64 | dyn.log | 960 / 950 / 100 | 950 | 0.950 unsettled |" in out
    assert "| 16 | base.log | none logged | - |  |" in out


def test_a_ratio_is_unsettled_when_either_log_passed_through_that_count(steady_state, tmp_path, capsys):
    """Round eight's 16-running row: the baseline's best three were 2,327 / 1,380 / 1,252."""
    base, dyn = tmp_path / "base.log", tmp_path / "dyn.log"
    base.write_text("".join(log_line(64, t) for t in (3949, 3921, 3900))
                    + "".join(log_line(16, t) for t in (2327, 1380, 1252)))
    dyn.write_text("".join(log_line(64, t) for t in (3909, 3867, 3851))
                   + "".join(log_line(16, t) for t in (1342, 1236, 1226)))
    steady_state.main([str(base), str(dyn), "--running", "64,16,32"])
    out = capsys.readouterr().out
    assert "| 64 | dyn.log | 3,909 / 3,867 / 3,851 | 3,867 | 0.986 |" in out     # both within 10 %
    assert "| 16 | dyn.log | 1,342 / 1,236 / 1,226 | 1,236 | 0.896 unsettled |" in out
    assert "| 32 | dyn.log | none logged | - |  |" in out


def dyn_line(running, accept, spec, plain):
    """A dyn server's line (gpu/dyn-disable's counters are cumulative since start)."""
    return (f"[2026-12-07 16:32:54] Decode batch, #running-req: {running}, #token: 6964, token usage: 0.21, "
            f"accept len: {accept}, accept rate: 0.51, spec steps: {spec}, plain steps: {plain}, "
            f"spec off/on switches: 0/0, cuda graph: True, gen throughput (token/s): 13622.16, #queue-req: 0\n")


def test_the_accept_length_comes_from_speculative_intervals_at_that_count_only(steady_state, tmp_path, capsys):
    """A dyn server's 100-step line averages its plain steps in as 1 (row 2e's auto logs read 1.0-1.5
    at c=32 while fixed-64 read 2.55): only intervals whose plain-step count did not move count,
    and a log's first line (plain steps since start unknown) does not."""
    text = "".join([dyn_line(32, 2.5, 100, 0),      # first line: left out
                    dyn_line(32, 2.4, 200, 0),
                    dyn_line(32, 1.3, 230, 70),     # plain steps in it
                    dyn_line(32, 2.6, 330, 70),
                    dyn_line(64, 2.2, 430, 70),
                    dyn_line(32, 2.7, 530, 70)])
    assert steady_state.accept_lens(text, 32) == [2.4, 2.6, 2.7]
    assert steady_state.median_accept(text, 32) == (2.6, 3)
    assert steady_state.median_accept(text, 16) == (None, 0)
    stock = "".join(line.replace(", spec steps: 1, plain steps: 0", "") for line in
                    [dyn_line(8, 3.0, 1, 0), dyn_line(8, 3.2, 1, 0)])   # no dyn counters: every line
    assert steady_state.accept_lens(stock, 8) == [3.0, 3.2]
    log = tmp_path / "fixed-64.log"
    log.write_text(text)
    steady_state.main(["--accept", str(log), "--running", "32,16"])
    out = capsys.readouterr().out
    assert "| 32 | fixed-64.log | 2.6 | 3 |" in out and "| 16 | fixed-64.log | - | 0 |" in out

"""gpu/turnover.py on small SGLang logs in the servers' own line format."""
import pytest

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def turnover():
    return load_gpu_script("turnover")


def prefill(new_seq):
    return (f"[2026-12-06 19:14:56] Prefill batch, #new-seq: {new_seq}, #new-token: {64 * new_seq}, "
            "#cached-token: 0, token usage: 0.23, #running-req: 60, #queue-req: 0, #pending-token: 0, "
            "cuda graph: False, input throughput (token/s): 696.15\n")


def decode(running, tok_s, spec=None, plain=None):
    counters = f"spec steps: {spec}, plain steps: {plain}, spec off/on switches: 0/0, " if spec is not None else ""
    return (f"[2026-12-06 19:14:57] Decode batch, #running-req: {running}, #token: 7189, token usage: 0.22, "
            f"accept len: 2.54, accept rate: 0.51, {counters}cuda graph: True, "
            f"gen throughput (token/s): {tok_s}, #queue-req: 0\n")


def test_forwards_and_admitted_requests_are_per_100_steps_of_the_counters(turnover):
    # the first decode line only starts the count; then 200 steps with 4 forwards of 2, and 100 with one of 9
    lines = [prefill(32), decode(61, 400.0, 100, 0), prefill(2), prefill(2), prefill(2), prefill(2),
             decode(62, 14000.0, 300, 0), prefill(9), decode(64, 15000.0, 350, 50)]
    rows = turnover.intervals(lines)
    assert [(r["running"], r["steps"], r["forwards"], r["admitted"]) for r in rows] == [(62, 200, 4, 8), (64, 100, 1, 9)]
    s = turnover.summary(rows, min_running=56)
    assert s["forwards_per_100_steps"] == 1.5   # median of 2 and 1
    assert s["admitted_per_100_steps"] == 6.5   # median of 4 and 9
    assert s["admitted_per_forward"] == 5.5     # median of 2 and 9
    assert s["gen_tok_s"] == 14500.0


def test_a_log_without_counters_takes_the_interval_and_the_running_floor_filters(turnover):
    lines = [decode(64, 1.0), prefill(9), decode(64, 30000.0), prefill(3), prefill(3), decode(20, 9000.0)]
    rows = turnover.intervals(lines, interval=40)
    assert [r["steps"] for r in rows] == [40, 40]
    assert turnover.summary(rows, 56) == {"intervals": 1, "forwards_per_100_steps": 2.5,
                                          "admitted_per_100_steps": 22.5, "admitted_per_forward": 9.0,
                                          "gen_tok_s": 30000.0}
    assert turnover.summary(rows, 65) is None


def test_the_cli_prints_per_log_and_refuses_what_it_cannot_read(turnover, tmp_path, capsys):
    spec, plain = tmp_path / "fixed-64.log", tmp_path / "fixed-2.log"
    spec.write_text(decode(61, 1.0, 100, 0) + prefill(2) * 80 + decode(61, 14000.0, 200, 0))
    plain.write_text(decode(64, 1.0, 0, 100) + prefill(9) * 7 + decode(64, 29000.0, 0, 200))
    assert turnover.main(["--min-running", "56", str(spec), str(plain)]) == 0
    out = capsys.readouterr().out
    assert "fixed-64.log: intervals 1, forwards_per_100_steps 80.0, admitted_per_100_steps 160.0" in out
    assert "fixed-2.log: intervals 1, forwards_per_100_steps 7.0, admitted_per_100_steps 63.0" in out
    assert turnover.main(["--min-running", "100", str(plain)]) == 0
    assert "no decode line at 100 or more running requests" in capsys.readouterr().out
    assert turnover.main([str(tmp_path / "missing.log")]) == 1
    assert "missing.log" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        turnover.main(["--min-running", "0", str(plain)])
    assert e.value.code == 2

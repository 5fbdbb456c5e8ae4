"""gpu/host_check.py: rounds joined to host samples by time."""
import json

import pytest

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def check():
    return load_gpu_script("host_check")


def sample(t, busy, steal=0.0, util=10.0, top=("sglang::scheduler", 1.0)):
    return {"t": t, "dt": 0.5, "busy": busy, "cpu": {"steal": steal}, "mhz": 2100.0,
            "gpu": [{"sm_mhz": 1980.0, "util": util, "power_w": 120.0, "temp_c": 35.0}],
            "top": [[7, top[0], top[1]]]}


def rec(server, rnd, t0, t1, tok_s, level="64"):
    return {"level": level, "server": server, "round": rnd, "t_start": t0, "t_end": t1,
            "out_tok_per_s": tok_s, "server_decode_tok_s": tok_s * 1.01, "cpus": [2, 10] if server == "a" else None}


def test_each_round_gets_only_the_samples_inside_it(check):
    # samples every 0.5 s; a sample's interval middle is t - 0.25
    samples = [sample(t / 2, busy=0.1 if t <= 10 else 0.9) for t in range(1, 21)]   # the sample at 5.0 covers 4.5-5.0
    out = check.host_check([rec("a", 0, 0.0, 4.9, 100.0), rec("a", 1, 5.0, 10.0, 50.0)], samples)
    first, second = out["rounds"]
    assert (first["samples"], second["samples"]) == (10, 10)
    assert (first["busy"], second["busy"]) == (0.1, 0.9)
    assert first["top"] == "sglang::scheduler" and first["cpus"] == [2, 10]


def test_a_measure_that_moves_with_the_rounds_correlates_and_a_constant_one_reads_none(check):
    samples, records = [], []
    for i, (tok_s, steal) in enumerate([(100.0, 0.0), (60.0, 0.4), (90.0, 0.1), (70.0, 0.3)]):
        t0 = 10.0 * i
        records.append(rec("a", i, t0, t0 + 5.0, tok_s))
        samples += [sample(t0 + 0.5 * k, busy=0.2, steal=steal) for k in range(1, 10)]
    out = check.host_check(records, samples)
    level = out["servers"]["64"]
    assert level["a"]["rounds"] == 4 and level["a"]["median_tok_s"] == 80.0
    assert level["a"]["spread"] == pytest.approx(100.0 / 60.0 - 1.0, abs=1e-4)
    corr = level["correlation_with_relative_tok_s"]
    assert corr["steal"] < -0.95          # slower rounds had more steal
    assert corr["busy"] is None and corr["sm_mhz"] is None   # never moved


def test_records_without_times_are_left_out_and_the_cli_prints_json(check, tmp_path, capsys):
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"level": "64", "server": "old", "out_tok_per_s": 1.0}) + "\n"
                       + json.dumps(rec("a", 0, 0.0, 2.0, 10.0)) + "\n")
    samples = tmp_path / "host.jsonl"
    samples.write_text("".join(json.dumps(sample(t, 0.3)) + "\n" for t in (0.5, 1.0, 1.5)))
    assert check.main([str(records), str(samples)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["server"] for r in out["rounds"]] == ["a"]
    assert check.main([str(records)]) == 2

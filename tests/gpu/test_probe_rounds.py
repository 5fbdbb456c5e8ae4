"""gpu/probe_rounds.py: an auto server's probes placed in its rounds."""
import json

import pytest

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def rounds():
    return load_gpu_script("probe_rounds")


RECORDS = [{"server": "fixed-2", "level": "64", "round": 0, "t_start": 1000.0, "t_end": 1008.0},
           {"server": "auto", "level": "64", "round": 0, "t_start": 1010.0, "t_end": 1018.0},
           {"server": "auto", "level": "64", "round": 1, "t_start": 1030.0, "t_end": 1038.0}]


def probe(at_s, step_ms, side="plain"):
    return {"at_s": at_s, "side": side, "steps": 5, "samples": 3, "step_ms": step_ms, "estimate_ms": 4.0,
            "accepts": None if side == "plain" else [2.0, 2.4]}


def test_with_the_controllers_clock_each_probe_lands_exactly_in_its_round(rounds):
    # the state read at epoch 1040.0 when the controller's clock read 500.0; the bucket first ran
    # at clock 460.0, i.e. epoch 1000.0: a probe at_s 11.0 began at epoch 1011.0, 1 s into round 0
    state = {"clock_s": 500.0, "buckets": {"64": {"first_seen_s": 460.0,
                                                   "probe_log": [probe(11.0, 8.0), probe(36.5, 4.0), probe(20.0, 3.0)]}}}
    placed = rounds.place_probes(RECORDS, [{"after": "c=64", "read_at": 1040.0, "state": state}])
    assert placed["anchor"] == "exact"
    where = [(p["at_s"], p["round"], p["into_round_s"]) for p in placed["probes"]]
    assert where == [(11.0, 0, 1.0), (20.0, None, None), (36.5, 1, 6.5)]   # at_s 20: between its rounds
    sides = rounds.early_later(placed["probes"], 2.0)
    assert sides["plain"]["early"] == {"n": 1, "mean_step_ms": 8.0, "range_ms": [8.0, 8.0]}
    assert sides["plain"]["later"]["n"] == 1


def test_older_states_anchor_the_first_levels_bucket_at_its_warm_up_and_leave_the_others_out(rounds):
    state = {"buckets": {"64": {"probe_log": [probe(12.4, 6.0, "spec")]},
                         "32": {"probe_log": [probe(5.0, 1.0)]}}}
    states = [{"after": "c=64", "state": state},
              {"after": "c=64", "server": "auto-probe0.01", "state": {"buckets": {"64": {"probe_log": [probe(1.0, 9.0)]}}}}]
    placed = rounds.place_probes(RECORDS, states, warmup_s=0.4)
    assert placed["anchor"] == "warm-up"
    [p] = placed["probes"]   # bucket 32's first launch is unknown; the variant's line is not auto's
    assert (p["bucket"], p["round"], p["into_round_s"], p["accepts"]) == (64, 0, 2.0, [2.0, 2.4])


def test_a_probe_kept_in_two_states_counts_once_and_the_cli_prints_json(rounds, tmp_path, capsys):
    state = {"clock_s": 500.0, "buckets": {"64": {"first_seen_s": 460.0, "probe_log": [probe(11.0, 8.0)]}}}
    records, states = tmp_path / "records.jsonl", tmp_path / "auto_state.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    states.write_text(json.dumps({"after": "c=64", "read_at": 1040.0, "state": state}) + "\n"
                      + json.dumps({"after": "c=32", "read_at": 1050.0, "state": dict(state, clock_s=510.0)}) + "\n")
    assert rounds.main([str(records), str(states), "--early-s", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["probes"]) == 1 and out["early_s"] == 0.5
    assert out["by_side"]["plain"]["later"]["n"] == 1


def test_speculative_probes_accept_means_line_up_by_their_step(rounds):
    spec = [dict(probe(1.0, 5.0, "spec"), accepts=[1.5, 2.0, 2.5]), dict(probe(2.0, 5.0, "spec"), accepts=[1.7, 2.2]),
            dict(probe(3.0, 5.0, "spec"), accepts=[]), probe(4.0, 3.0)]
    rows = rounds.accepts_by_step(spec)
    assert rows == [{"step": 1, "n": 2, "mean": 1.6, "range": [1.5, 1.7]},
                    {"step": 2, "n": 2, "mean": 2.1, "range": [2.0, 2.2]},
                    {"step": 3, "n": 1, "mean": 2.5, "range": [2.5, 2.5]}]
    # a server that marks deferred requests logs the same steps' requests with their draft context
    spec[0]["accepts_full"], spec[1]["accepts_full"] = [None, 2.5, 3.0], [None, 2.7]
    rows = rounds.accepts_by_step(spec)
    assert "full_n" not in rows[0]
    assert rows[1] == {"step": 2, "n": 2, "mean": 2.1, "range": [2.0, 2.2], "full_n": 2, "full_mean": 2.6}

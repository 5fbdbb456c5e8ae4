"""Recommendation arithmetic, JSONL/CSV round trips, compare and the plot (no server)."""
from __future__ import annotations

import csv
import json
import math

import pytest

from toolkit.bench.compare import compare
from toolkit.bench.outputs import OutputError, RunWriter, load_records, median_by_level
from toolkit.bench.plot import plot_throughput
from toolkit.bench.recommend import crossover, recommend, recommend_all
from toolkit.bench.session import finalize


def record(profile, concurrency, output_tps, per_request=None, run_id="r1", completed=10):
    return {"run_id": run_id, "profile": profile, "concurrency": concurrency, "requests": 10,
            "params": {"dataset": "builtin", "output_len": 64, "seed": 0}, "server": {"kind": "test"},
            "metrics": {"completed": completed, "failed": 0, "output_throughput": output_tps,
                        "mean_request_output_throughput_tok_s": per_request or output_tps / concurrency,
                        "median_ttft_ms": 10.0 * concurrency}}


def sweep(base, eagle, dyn=None, levels=(1, 2, 4, 8, 16)):
    out = [record("baseline", c, v) for c, v in zip(levels, base)]
    out += [record("eagle3", c, v) for c, v in zip(levels, eagle)]
    if dyn:
        out += [record("eagle3-dyn", c, v) for c, v in zip(levels, dyn)]
    return out


def test_crossover_interpolates_in_log2_concurrency():
    # ratio 1.5 at 4, 0.5 at 16: halfway in log2 -> 8
    assert crossover([4, 16], [1.5, 0.5]) == pytest.approx(8.0)
    # ratio 1.2 at 8, 0.9 at 16: 2/3 of the way from log2(8)=3 to 4
    assert crossover([8, 16], [1.2, 0.9]) == pytest.approx(2 ** (3 + 2 / 3))
    assert crossover([1, 2], [1.1, 1.05]) is None


def test_recommendation_threshold_and_dyn_ratio():
    rec = recommend(sweep(base=[100, 190, 360, 640, 1000], eagle=[200, 360, 600, 640 * 0.9, 800],
                          dyn=[195, 350, 590, 630, 990]))
    assert rec.verdict == "crossover"
    # eagle3/baseline: 2.0, 1.89, 1.67, 0.9, 0.8 -> falls through 1 between 4 and 8
    expected = 2 ** (2 + (1.6666666 - 1.0) / (1.6666666 - 0.9))
    assert rec.crossover_concurrency == pytest.approx(expected, rel=1e-4)
    assert rec.threshold == math.floor(expected) == 7
    by_level = {level.concurrency: level for level in rec.levels}
    assert by_level[1].dyn_over_best == pytest.approx(195 / 200)
    assert by_level[16].dyn_over_best == pytest.approx(990 / 1000)
    assert "threshold: 7" in rec.text


def test_recommendation_when_eagle3_always_or_never_wins():
    always = recommend(sweep(base=[100, 200, 300, 400, 500], eagle=[150, 260, 330, 410, 510]))
    assert always.verdict == "eagle3-always-wins" and always.threshold is None
    assert "16" in always.text
    never = recommend(sweep(base=[100, 200, 300, 400, 500], eagle=[90, 150, 200, 300, 400]))
    assert never.verdict == "eagle3-never-wins" and never.threshold is None
    missing = recommend([record("baseline", 1, 100)])
    assert missing.verdict == "not-enough-data"


H200_LEVELS = (1, 2, 4, 8, 16, 32, 64)   # docs/evidence/dyn-disable-2: one call, 8B-shape target
H200 = {"baseline": [211.4, 366.8, 810.8, 1571.1, 2733.7, 5350.7, 9145.1],
        "eagle3-v2": [356.6, 475.6, 979.9, 1675.2, 2807.3, 4855.2, 6420.1],
        "eagle3-v2-dyn": [337.9, 619.6, 1225.4, 1050.4, 1947.5, 3672.8, 6586.2],
        "eagle3": [266.3, 384.6, 753.5, 1365.5, 2050.6, 2954.5, 3765.4]}


def h200_records(*profiles):
    return [record(p, c, v) for p in profiles for c, v in zip(H200_LEVELS, H200[p])]


def test_the_v2_pair_gets_its_own_recommendation():
    recs = recommend_all(h200_records("baseline", "eagle3", "eagle3-v2", "eagle3-v2-dyn"))
    # eagle3-dyn was not measured: its answer does not name it
    assert [(r.speculative, r.dynamic) for r in recs] == [("eagle3", None), ("eagle3-v2", "eagle3-v2-dyn")]
    v1, v2 = recs
    # v1 loses from 4 on (753.5 < 810.8): ratios 1.049 at 2, 0.929 at 4 -> crossover 2.65;
    # v2 only from 32 (4855.2 < 5350.7): 1.027 at 16, 0.907 at 32 -> 18.7
    assert v1.crossover_concurrency == pytest.approx(2 ** (1 + 0.04853 / (0.04853 + 0.07067)), rel=1e-3)
    assert v2.crossover_concurrency == pytest.approx(2 ** (4 + 0.02692 / (0.02692 + 0.09260)), rel=1e-3)
    assert v1.threshold == 2 and v2.threshold == 18
    assert v2.text.startswith("eagle3-v2 stops paying off") and "SGLANG_SPEC_DISABLE_THRESHOLD=18" in v2.text
    # dyn (run with threshold 5) over the better of baseline/eagle3-v2: 0.63 at c=8, 1.30 at c=2
    assert "eagle3-v2-dyn reaches 0.63-1.30 of the better of baseline/eagle3-v2" in v2.text
    assert {l.concurrency: l.eagle3_dyn for l in v2.levels}[64] == 6586.2


def test_without_a_speculative_reference_the_answer_names_the_missing_one():
    only_dyn = recommend_all(h200_records("baseline", "eagle3-v2-dyn"))
    assert [(r.speculative, r.dynamic) for r in only_dyn] == [(None, "eagle3-v2-dyn")]
    assert only_dyn[0].verdict == "not-enough-data" and only_dyn[0].measured == ["baseline", "eagle3-v2-dyn"]
    assert "need both 'baseline' and 'eagle3-v2'" in only_dyn[0].text
    # what was measured is still summarised: dyn over baseline, 0.67 at c=8 to 1.69 at c=2
    assert "eagle3-v2-dyn reaches 0.67-1.69 of baseline across levels" in only_dyn[0].text
    v2_only = recommend_all(h200_records("baseline", "eagle3-v2"))
    assert [(r.speculative, r.dynamic) for r in v2_only] == [("eagle3-v2", None)]
    assert v2_only[0].verdict == "crossover"


def test_a_run_without_speculative_profiles_names_only_what_it_measured(tmp_path):
    cpu = [record("cpu-ref", c, 100.0 * c) for c in (1, 4, 16)]
    recs = recommend_all(cpu)
    assert len(recs) == 1 and recs[0].verdict == "not-enough-data" and recs[0].threshold is None
    writer = RunWriter(tmp_path / "run")
    finalize(writer, cpu, "cpu")
    saved = json.loads(writer.recommendation.read_text())
    assert saved["measured"] == ["cpu-ref"] and saved["speculative"] is None and saved["dynamic"] is None
    assert saved["levels"] == [] and "only cpu-ref" in saved["text"]


def test_failed_levels_are_left_out_of_the_curves():
    records = sweep(base=[100, 200], eagle=[150, 150], levels=(1, 2))
    records.append(record("eagle3", 4, 0.0, completed=0))
    records.append(record("baseline", 4, 300))
    rec = recommend(records)
    # ratios 1.5 at 1 and 0.75 at 2 (the failed eagle3 level at 4 is no data point, not a zero)
    assert rec.verdict == "crossover"
    assert rec.crossover_concurrency == pytest.approx(2 ** (0.5 / 0.75))
    assert {l.concurrency: l.eagle3 for l in rec.levels}[4] is None


def test_jsonl_csv_round_trip_and_torn_last_line(tmp_path):
    writer = RunWriter(tmp_path / "run")
    records = sweep(base=[100, 200], eagle=[150, 180], levels=(1, 4))
    for r in records:
        writer.append(r)
    with open(writer.jsonl, "a") as handle:
        handle.write('{"profile": "baseline", "concur')      # a run killed mid-write
    loaded = load_records(tmp_path / "run")
    assert loaded == records
    writer.write_csv(loaded)
    rows = list(csv.DictReader(open(writer.csv)))
    assert [(r["profile"], r["concurrency"], float(r["output_throughput"])) for r in rows] == \
        [("baseline", "1", 100.0), ("baseline", "4", 200.0), ("eagle3", "1", 150.0), ("eagle3", "4", 180.0)]


def test_load_records_rejects_what_is_not_a_run(tmp_path):
    with pytest.raises(OutputError, match="no such file"):
        load_records(tmp_path / "missing")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"b": 2}\n')
    with pytest.raises(OutputError, match="not a bench record"):
        load_records(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("not json\n" + json.dumps(record("baseline", 1, 1.0)) + "\n")
    with pytest.raises(OutputError, match=":1: not a JSON line"):
        load_records(broken)


def test_compare_puts_runs_side_by_side(tmp_path):
    for name, value in (("monday", 100.0), ("tuesday", 120.0)):
        writer = RunWriter(tmp_path / name)
        for c in (1, 4):
            writer.append(record("baseline", c, value * c, run_id=name))
        writer.append(record("eagle3", 1, value * 2, run_id=name))
    comparison = compare([tmp_path / "monday", tmp_path / "tuesday" / "results.jsonl"])
    assert comparison.columns == ["monday:baseline", "monday:eagle3", "tuesday:baseline", "tuesday:eagle3"]
    table = comparison.tables["output tok/s"]
    assert table == [[1, 100.0, 200.0, 120.0, 240.0], [4, 400.0, None, 480.0, None]]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_throughput(sweep(base=[100, 190, 360], eagle=[200, 250, 300], levels=(1, 2, 4)),
                           tmp_path / "plot.png", title="test", crossover=3.0)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_recommendation_file_keeps_eagle3_first_and_the_v2_answer_under_others(tmp_path):
    writer = RunWriter(tmp_path / "run")
    recs, written = finalize(writer, h200_records("baseline", "eagle3", "eagle3-v2"), "h200")
    assert written == [writer.jsonl, writer.csv, writer.plot, writer.recommendation]
    saved = json.loads(writer.recommendation.read_text())
    assert saved["speculative"] == "eagle3" and saved["threshold"] == recs[0].threshold == 2
    assert [other["speculative"] for other in saved["others"]] == ["eagle3-v2"]
    assert saved["others"][0]["threshold"] == 18 and writer.plot.exists()


def test_repeated_levels_report_the_median_and_the_spread():
    runs = [record("baseline", 8, v) for v in (1500.0, 1600.0, 1200.0)] + [record("baseline", 16, 2700.0)]
    for k, r in enumerate(runs[:3]):
        r["repeat"] = k
    merged = median_by_level(runs)
    assert [(r["concurrency"], r["metrics"]["output_throughput"]) for r in merged] == [(8, 1500.0), (16, 2700.0)]
    assert merged[0]["metrics"]["repeats"] == 3 and merged[0]["metrics"]["output_throughput_range"] == [1200.0, 1600.0]
    assert merged[0]["metrics"]["median_ttft_ms"] == 80.0 and "repeats" not in merged[1]["metrics"]
    # a repeat that completed nothing is no data point; the others still give the median
    runs.append(record("baseline", 8, 0.0, completed=0))
    assert median_by_level(runs)[0]["metrics"]["output_throughput"] == 1500.0


def test_the_recommendation_and_compare_use_the_median_of_repeats(tmp_path):
    records = sweep(base=[100, 200], eagle=[150, 150], levels=(1, 2))
    # a noisy second and third eagle3 run at concurrency 2: median 150 (not the last, 400)
    records += [record("eagle3", 2, 100.0), record("eagle3", 2, 400.0)]
    rec = recommend(records)
    assert {l.concurrency: l.eagle3 for l in rec.levels}[2] == 150.0 and rec.verdict == "crossover"
    writer = RunWriter(tmp_path / "run")
    for r in records:
        writer.append(r)
    table = compare([tmp_path / "run"]).tables["output tok/s"]
    assert table == [[1, 100.0, 150.0], [2, 200.0, 150.0]]


def test_csv_rounds_each_column_to_its_precision_and_carries_the_server_config(tmp_path):
    noisy = record("eagle3-dyn", 8, 1394.2618290013)
    noisy["metrics"].update(median_ttft_ms=12.345678901, request_throughput=0.16044983110072442,
                            duration_s=22.206456365000122, mean_input_tokens=64.33333333,
                            coalesced_event_share=0.1866666667, total_output_tokens=2048)
    noisy["server"].update(attention_backend="flashinfer", tp_size=2, architecture="DeepseekV3ForCausalLM",
                           dyn_disable={"threshold": 5, "hysteresis": 1}, avg_spec_accept_length=2.5871234)
    plain = record("baseline", 8, 1000.0)
    plain["server"].update(dyn_disable="off")
    writer = RunWriter(tmp_path / "run")
    writer.write_csv([noisy, plain])
    rows = list(csv.DictReader(open(writer.csv)))
    row = rows[0]
    assert (row["output_throughput"], row["median_ttft_ms"], row["request_throughput"], row["duration_s"]) == \
        ("1394.3", "12.35", "0.16", "22.206")
    assert (row["mean_input_tokens"], row["coalesced_event_share"], row["avg_spec_accept_length"]) == \
        ("64.3", "0.187", "2.587")
    assert row["total_output_tokens"] == "2048"
    assert (row["attention_backend"], row["tp_size"], row["architecture"], row["dyn_threshold"],
            row["dyn_hysteresis"]) == ("flashinfer", "2", "DeepseekV3ForCausalLM", "5", "1")
    assert (rows[1]["dyn_threshold"], rows[1]["dyn_hysteresis"]) == ("", "")
    # the JSONL keeps full precision
    writer.append(noisy)
    assert load_records(writer.jsonl)[0]["metrics"]["median_ttft_ms"] == 12.345678901


def test_a_writer_makes_its_folder_only_when_it_writes_and_refuses_an_old_run(tmp_path):
    from toolkit.bench.outputs import OutputError
    writer = RunWriter(tmp_path / "new")
    writer.check_new()
    assert not (tmp_path / "new").exists()
    writer.append(record("baseline", 1, 10.0))
    with pytest.raises(OutputError, match="already holds a bench run"):
        RunWriter(tmp_path / "new").check_new()


KIMI_LEVELS = (1, 4, 16, 32, 64)   # docs/evidence/dyn-disable-5 call 1: Kimi shape, TP=1, in128/out160
# (baseline on GPU 0, the v1 pair on GPU 1 of the same call)
KIMI_V1 = {"baseline": [376, 1340, 4802, 7701, 10706], "eagle3": [366, 1101, 2858, 3320, 3630],
           "eagle3-dyn": [394, 1138, 2387, 4000, 6265]}


def with_threshold(records, profile, threshold):
    for r in records:
        if r["profile"] == profile:
            r["server"] = {"kind": "test", "dyn_disable": {"threshold": threshold, "hysteresis": 2}}
    return records


def test_the_threshold_is_placed_where_eagle3_falls_below_the_plain_steps_not_below_baseline():
    records = with_threshold([record(p, c, v) for p, vs in KIMI_V1.items() for c, v in zip(KIMI_LEVELS, vs)],
                             "eagle3-dyn", 8)
    rec = recommend(records)
    # eagle3-dyn's plain steps (levels >= 16 = 2 x threshold 8): 2387/4802, 4000/7701, 6265/10706
    share = sorted([2387 / 4802, 4000 / 7701, 6265 / 10706])[1]
    assert rec.plain_share == pytest.approx(share) and rec.break_even == pytest.approx(share)
    # eagle3/baseline 0.595 at 16, 0.431 at 32: falls through the share (0.519) at about 22
    r16, r32 = 2858 / 4802, 3320 / 7701
    expected = 2 ** (4 + (r16 - share) / (r16 - r32))
    assert rec.crossover_concurrency == pytest.approx(expected, rel=1e-6)
    assert rec.threshold == math.floor(expected) == 22
    # eagle3 loses to baseline already at c=1 (0.97): baseline is named the faster server first
    assert rec.verdict == "eagle3-never-wins"
    assert rec.text.startswith("eagle3 does not beat baseline even at concurrency 1")
    assert "0.52 of baseline, what eagle3-dyn's plain steps reached at concurrency 16, 32, 64" in rec.text
    assert "SGLANG_SPEC_DISABLE_THRESHOLD=22" in rec.text


def test_plain_steps_at_baseline_or_unmeasured_keep_the_baseline_crossover():
    base = [100, 190, 360, 640, 1000]
    eagle = [200, 360, 600, 640 * 0.9, 800]
    # plain steps above baseline (noise) count as baseline: the crossover stays where it was
    above = recommend(with_threshold(sweep(base, eagle, dyn=[195, 350, 590, 700, 1100]), "eagle3-dyn", 4))
    assert above.plain_share == pytest.approx((700 / 640 + 1100 / 1000) / 2) and above.break_even == 1.0
    assert above.threshold == 7
    # the dyn profile never ran at 2 x its threshold or more: no share, baseline's crossover
    unmeasured = recommend(with_threshold(sweep(base, eagle, dyn=[195, 350, 590, 630, 990]), "eagle3-dyn", 16))
    assert unmeasured.plain_share is None and unmeasured.break_even == 1.0 and unmeasured.threshold == 7


def test_slightly_slower_plain_steps_move_the_crossover_up_a_little():
    base = [100, 190, 360, 640, 1000]
    eagle = [200, 360, 600, 640 * 0.9, 800]
    rec = recommend(with_threshold(sweep(base, eagle, dyn=[195, 350, 590, 640 * 0.96, 960]), "eagle3-dyn", 4))
    assert rec.plain_share == pytest.approx(0.96) and rec.verdict == "crossover"
    # eagle3/baseline 1.667 at 4, 0.9 at 8: through 0.96 instead of 1.0
    assert rec.crossover_concurrency == pytest.approx(2 ** (2 + (1.6666667 - 0.96) / (1.6666667 - 0.9)), rel=1e-5)
    baseline_only = recommend(sweep(base, eagle))
    assert rec.crossover_concurrency > baseline_only.crossover_concurrency
    assert rec.threshold == 7 and "0.96 of baseline" in rec.text


def test_a_dyn_server_with_threshold_auto_is_benched_without_a_plain_share():
    """threshold=auto has no level above which every step is plain: the recommendation runs, against
    baseline, instead of failing on the threshold."""
    records = with_threshold([record(p, c, v) for p, vs in KIMI_V1.items() for c, v in zip(KIMI_LEVELS, vs)],
                             "eagle3-dyn", "auto")
    rec = recommend(records)
    assert rec.plain_share is None and rec.break_even == 1.0
    assert rec.verdict == "eagle3-never-wins"

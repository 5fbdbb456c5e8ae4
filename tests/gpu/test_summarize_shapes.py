"""gpu/summarize_shapes.py on small synthetic records: medians, ratios, and the mark on a ratio
whose two servers differ in whether they had been torch-profiled before the run."""
import pytest

from .scripts import load_gpu_script


@pytest.fixture(scope="module")
def summarize():
    return load_gpu_script("summarize_shapes")


def rec(label, c, tok_s, round_no, profiled=None, backend="triton"):
    r = {"group": "g", "input_len": 128, "output_len": 160, "conc": c, "out_tok_per_s": tok_s,
         "profile": label.replace("-b", ""), "label": label, "attention_backend": backend,
         "arch": "DeepseekV3ForCausalLM", "tp_size": 2, "threshold": 8 if "dyn" in label else None,
         "round": round_no}
    if profiled is not None:
        r["profiled_before"] = profiled
    return r


def test_ratios_use_medians_and_the_faster_baseline(summarize):
    records = [rec("baseline", 64, t, k) for k, t in enumerate((100.0, 110.0, 90.0))]
    records += [rec("baseline", 64, 120.0, 1, backend="flashinfer")]
    records += [rec("eagle3-v2-dyn", 64, t, k) for k, t in enumerate((114.0, 200.0, 10.0))]
    records += [rec("eagle3-v2", 64, 57.0, 1)]
    table = summarize.tables(records)
    # dyn's median 114 over the faster baseline (flashinfer's 120), and over its stock (57)
    assert "| 64 | 100 ±22% | 120 | 57 | 114 ±1900% | eagle3-v2-dyn: 0.950 | eagle3-v2-dyn: 2.000 |" in table
    assert "†" not in table


def test_a_ratio_between_a_profiled_and_an_unprofiled_server_is_marked(summarize):
    records = [rec("eagle3-v2", 1, 412.0, 1, profiled=True),
               rec("eagle3-v2-dyn", 1, 433.0, 1, profiled=False),
               rec("baseline", 1, 300.0, 1, profiled=False),
               rec("eagle3-v2", 64, 9000.0, 1, profiled=True),
               rec("eagle3-v2-dyn", 64, 13000.0, 1, profiled=True),
               rec("baseline", 64, 12000.0, 1, profiled=True)]
    table = summarize.tables(records)
    # c=1: dyn and baseline unprofiled (no mark), dyn's stock profiled (marked)
    assert "| 1 | 300 | 412 | 433 | eagle3-v2-dyn: 1.443 | eagle3-v2-dyn: 1.051† |" in table
    # c=64: all three profiled, nothing marked
    assert "| 64 | 12000 | 9000 | 13000 | eagle3-v2-dyn: 1.083 | eagle3-v2-dyn: 1.444 |" in table
    assert "† the two servers of this ratio differ" in table


def test_baselines_and_stock_workers_are_known_by_profile_whatever_their_label(summarize):
    """A plan labels servers by backend ("baseline-fi", "eagle3-v2-fi"): they are still the
    baseline and the stock worker of the ratios (2026-12-04: both columns read "-")."""
    def labelled(label, profile, tok_s, backend):
        return dict(rec(label, 64, tok_s, 1, backend=backend), profile=profile)

    records = [labelled("baseline-fi", "baseline", 100.0, "flashinfer"),
               labelled("baseline-triton", "baseline", 104.0, "triton"),
               labelled("eagle3-v2-fi", "eagle3-v2", 80.0, "flashinfer"),
               labelled("eagle3-v2-dyn-native-defer-fi", "eagle3-v2-dyn-native", 99.0, "flashinfer")]
    table = summarize.tables(records)
    row = next(line for line in table.splitlines() if line.startswith("| 64 |"))
    assert row.endswith("| eagle3-v2-dyn-native-defer-fi@flashinfer: 0.952 "
                        "| eagle3-v2-dyn-native-defer-fi@flashinfer: 1.238 |")
    assert table.index("baseline-fi@flashinfer") < table.index("eagle3-v2-dyn")


def test_a_group_mixing_fixed_thresholds_and_auto_gets_its_table(summarize):
    records = [dict(rec("eagle3-v2-dyn", 16, 100.0, 1), label="fixed-64", threshold=64),
               dict(rec("eagle3-v2-dyn", 16, 97.0, 1), label="auto-a", threshold="auto")]
    table = summarize.tables(records)
    assert "dyn threshold [64, 'auto']" in table
    assert "| 16 | 97 | 100 |" in table


def test_a_stock_profile_with_extra_flags_is_not_the_own_stock_when_the_plain_one_runs(summarize):
    """0.5.17's plans run upstream's adaptive mode as profile eagle3-v2 labelled eagle3-v2-adaptive
    beside plain stock: dyn is compared with the plain one; alone, the adaptive one is no stock."""
    def server(label, profile, tok_s, flags=()):
        return dict(rec(label, 64, tok_s, 1), profile=profile, extra_flags=list(flags))

    both = [server("baseline", "baseline", 100.0), server("eagle3-v2", "eagle3-v2", 50.0),
            server("eagle3-v2-adaptive", "eagle3-v2", 80.0, ["--speculative-adaptive"]),
            server("eagle3-v2-dyn", "eagle3-v2-dyn", 99.0)]
    assert "| eagle3-v2-dyn: 1.980 |" in summarize.tables(both)
    alone = [both[0], both[2], both[3]]
    assert summarize.tables(alone).splitlines()[-1].endswith("| eagle3-v2-dyn: 0.990 | - |")


def replica(label, c, tok_s, round_no, threshold, env=None):
    r = {"group": "g", "input_len": 128, "output_len": 96, "conc": c, "out_tok_per_s": tok_s,
         "profile": "eagle3-v2-dyn", "label": label, "attention_backend": "triton", "pair": "big",
         "arch": "LlamaForCausalLM", "tp_size": 1, "threshold": threshold, "round": round_no,
         "sglang": "0.5.11", "sleep_on_idle": True, "extra_flags": ["--sleep-on-idle"],
         "env": env if env is not None else {"SGLANG_SIMULATE_ACC_LEN": "2.5"}}
    return r


def test_servers_of_one_configuration_give_the_spread_a_difference_must_beat(summarize):
    records = []
    for k in range(1, 6):
        records += [replica("auto-a", 4, 1900.0 + k, k, "auto"), replica("auto-b", 4, 1800.0 + k, k, "auto"),
                    replica("fixed-64-a", 4, 2000.0 + k, k, 64), replica("fixed-64-b", 4, 2100.0 + k, k, 64)]
    table = summarize.tables(records)
    # auto-a's median 1903 against auto-b's 1803: 5.5 % apart; fixed: 2103 / 2003, 5.0 %
    assert "| 4 | auto-a + auto-b | 1853 | 5.5 % |" in table
    assert "| 4 | fixed-64-a + fixed-64-b | 2053 | 5.0 % |" in table
    row = next(l for l in table.splitlines() if "auto-a + auto-b / fixed-64-a + fixed-64-b" in l)
    # pooled medians of ten values each: 1853 / 2053; round k's ratio (1850 + k) / (2050 + k)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "0.903"
    lo, hi = (float(x) for x in cells[3].split("-"))
    assert lo <= 0.9026 <= hi and hi < 1.0
    assert cells[4] == "0.902-0.903 (5)"


def test_servers_that_differ_only_in_env_or_whose_records_lack_it_are_not_replicas(summarize):
    skip = {"SGLANG_SIMULATE_ACC_LEN": "2.5", "SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV": "skip"}
    records = [replica("native", 4, 1900.0, 1, 8), replica("native-skip", 4, 1800.0, 1, 8, env=skip)]
    assert "A/A" not in summarize.tables(records)
    old = [dict(r) for r in (replica("x", 4, 1900.0, 1, 8), replica("y", 4, 1800.0, 1, 8))]
    for r in old:
        del r["env"]
    assert "A/A" not in summarize.tables(old)
    assert "A/A" in summarize.tables([replica("x", 4, 1900.0, 1, 8), replica("y", 4, 1800.0, 1, 8)])


def test_a_round_whose_last_wave_came_spread_out_is_listed_with_the_clients_delay(summarize):
    spread = dict(rec("eagle3-v2-dyn", 64, 9035.0, 3), approx_step_ms=7.1, last_wave_send_spread_ms=300.0,
                  send_lag_ms_max=1.5)
    whole = dict(rec("eagle3-v2-dyn", 64, 9868.0, 2), approx_step_ms=6.5, last_wave_send_spread_ms=20.0,
                 send_lag_ms_max=1.2)
    older = rec("baseline", 64, 9900.0, 1)  # a record from before the timeline: nothing to say
    text = summarize.tables([spread, whole, older])
    assert ("- c=64 round 3 eagle3-v2-dyn: the last wave sent over 300 ms (~42 steps), the client's largest "
            "delay 1.5 ms; 9035 tok/s") in text
    assert "round 2" not in text and "round 1 baseline" not in text
    assert "last wave" not in summarize.tables([whole, older])


def test_c1_step_times_set_a_dyn_server_against_its_stock_apart_from_the_draws(summarize):
    # stock's rounds drew more accepted tokens (higher tok/s) at the same step time as the dyn server
    def c1(label, tok_s, round_no, ms, acc):
        return dict(rec(label, 1, tok_s, round_no), ms_per_verify_step=ms, accept_len=acc)

    records = [c1("eagle3-v2", 290.0, 1, 5.0, 2.7), c1("eagle3-v2", 280.0, 2, 5.2, 2.6),
               c1("eagle3-v2-dyn", 270.0, 1, 5.0, 2.5), c1("eagle3-v2-dyn", 268.0, 2, 4.8, 2.5),
               rec("baseline", 1, 160.0, 1)]
    text = summarize.tables(records)
    assert "| eagle3-v2 | 5.100 (5.000, 5.200) | 2.65 | - |" in text
    # stock 5.1 ms / dyn 4.9 ms: the dyn step is the faster one although its tok/s is lower
    assert "| eagle3-v2-dyn | 4.900 (5.000, 4.800) | 2.50 | 1.041 |" in text
    assert "verify step" not in summarize.tables([rec("eagle3-v2", 1, 290.0, 1), rec("baseline", 1, 160.0, 1)])


def test_beside_an_aa_pair_of_stock_servers_the_c1_step_time_is_set_against_their_pooled_rounds(summarize):
    def c1(label, profile, round_no, ms):
        return dict(rec(label, 1, 280.0, round_no), profile=profile, ms_per_verify_step=ms, accept_len=2.6)

    records = [c1("stock-a", "eagle3-v2", 1, 9.0), c1("stock-a", "eagle3-v2", 2, 9.2),
               c1("stock-b", "eagle3-v2", 1, 9.1), c1("stock-b", "eagle3-v2", 2, 9.3),
               c1("dyn", "eagle3-v2-dyn", 1, 9.0), c1("dyn", "eagle3-v2-dyn", 2, 9.0)]
    text = summarize.tables(records)
    # the stock rounds pooled: median of 9.0, 9.1, 9.2, 9.3 = 9.15; 9.15 / 9.0
    assert "| dyn | 9.000 (9.000, 9.000) | 2.60 | 1.017 (stock servers pooled) |" in text

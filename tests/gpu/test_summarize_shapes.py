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

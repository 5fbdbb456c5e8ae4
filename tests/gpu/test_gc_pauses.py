"""gpu/gc_log/sitecustomize.py (the servers' garbage-collection log) in real interpreters, and
gpu/gc_pauses.py setting logged collections against an accept run's resume gaps."""
import json
import os
import subprocess
import sys

from .scripts import ROOT, load_gpu_script

CHILD = """
import gc, multiprocessing
class Node:
    pass
for _ in range(2000):
    a, b = Node(), Node()
    a.other, b.other = b, a
gc.collect()
if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=gc.collect)
    p.start(); p.join()
"""


def run_child(tmp_path, env_extra):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("LAB_GC_LOG_MS", "PYTHONPATH")}
    env.update(PYTHONPATH=str(ROOT / "gpu" / "gc_log"), **env_extra)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_every_interpreter_logs_its_own_full_collections_when_asked(tmp_path):
    gc_pauses = load_gpu_script("gc_pauses")
    err = run_child(tmp_path, {"LAB_GC_LOG_MS": "0.000001"})
    found = gc_pauses.pauses(err)
    pids = {pid for _, _, gen, pid in found if gen == 2}
    # the script's own gc.collect() and the spawned child's, as a scheduler's would be (and
    # multiprocessing's resource tracker, an interpreter of its own too)
    assert len(pids) >= 2
    assert all(ms >= 0 for _, ms, _, _ in found)


def test_nothing_is_logged_unless_asked(tmp_path):
    assert "[lab-gc]" not in run_child(tmp_path, {})
    assert "[lab-gc]" not in run_child(tmp_path, {"LAB_GC_LOG_MS": "0"})


def test_a_collection_inside_a_long_resume_gap_is_named_and_one_outside_is_not(tmp_path):
    gc_pauses = load_gpu_script("gc_pauses")
    (tmp_path / "accept").mkdir()
    t1 = 1_800_000_000.0
    windows = {"skip": [{"crossing": 1, "burst_t0": t1 - 2, "burst_t1": t1},
                        {"crossing": 2, "burst_t0": t1 + 8, "burst_t1": t1 + 10}]}
    (tmp_path / "accept" / "accept_raw.json").write_text(json.dumps({"windows": windows}))
    # crossing 1: a 70 ms gap ending 15 ms after the burst; crossing 2: 12 ms, under the floor
    runs = [{"server": "skip", "resume_max_gap_ms": [70.0, 12.0], "resume_max_gap_end_ms": [15.0, 3.0]}]
    (tmp_path / "accept" / "first_crossing.json").write_text(json.dumps({"runs": runs}))
    log = (f"x\n[lab-gc] pid=7 gen=2 start={t1 - 0.040:.4f} ms=48.0 collected=9\n"  # inside crossing 1's gap
           f"[lab-gc] pid=7 gen=0 start={t1 + 5:.4f} ms=11.0 collected=1\n")         # between crossings
    (tmp_path / "acc-skip-trained-triton.log").write_text(log)
    (line,) = gc_pauses.report(str(tmp_path), min_gap_ms=30)
    assert line["collections_logged"] == 2 and line["by_generation"]["2"] == {"n": 1, "median_ms": 48.0, "max_ms": 48.0}
    (gap,) = line["resume_gaps_over_min"]
    assert gap["crossing"] == 1 and gap["gap_ms"] == 70.0
    # the gap ran from t1 - 55 ms to t1 + 15 ms; the collection from t1 - 40 ms to t1 + 8 ms
    assert gap["collections"] == [{"gen": 2, "ms": 48.0, "pid": 7, "overlap_ms": 48.0}]


def test_a_log_belongs_to_the_longest_label_it_starts_with():
    gc_pauses = load_gpu_script("gc_pauses")
    labels = ["eagle3-v2", "eagle3-v2-dyn-native-skip", "baseline"]
    assert gc_pauses.log_owner("acc-eagle3-v2-trained-triton.log", labels) == "eagle3-v2"
    assert gc_pauses.log_owner("acc-eagle3-v2-dyn-native-skip-trained-triton.log", labels) == "eagle3-v2-dyn-native-skip"
    assert gc_pauses.log_owner("acc-other-trained-triton.log", labels) is None

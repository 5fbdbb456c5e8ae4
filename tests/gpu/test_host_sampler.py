"""gpu/host_sampler.py on this machine's own /proc: the samples `auto_summary.py hostcheck` sets
beside a GPU call's rounds."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .scripts import load_gpu_script

SCRIPT = Path(__file__).resolve().parents[2] / "gpu" / "host_sampler.py"


@pytest.fixture(scope="module")
def sampler():
    return load_gpu_script("host_sampler")


def test_the_cpu_states_shares_between_two_reads_add_up_to_one(sampler):
    before = sampler.read_cpu(Path("/proc/stat").read_text())
    time.sleep(0.2)
    after = sampler.read_cpu(Path("/proc/stat").read_text())
    shares = sampler.cpu_shares(before, after)
    assert set(shares) == set(sampler.CPU_FIELDS)
    assert abs(sum(shares.values()) - 1.0) < 0.01
    assert sampler.cpu_shares(after, after) == {k: 0.0 for k in after}   # no time passed: no division by zero


def test_a_process_name_with_spaces_and_parentheses_is_read_whole(sampler, tmp_path):
    # /proc/PID/stat: pid (comm) state ppid ... utime is the 14th field, stime the 15th
    rest = "S 1 1 1 0 -1 0 0 0 0 0 {u} {s} 0 0 20 0 1 0"
    for pid, name, u, s in ((10, "sglang::scheduler (tp 0)", 300, 50), (11, "python3", 5, 5)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) " + rest.format(u=u, s=s))
    (tmp_path / "self").mkdir()   # not a pid: skipped
    times = sampler.proc_times(str(tmp_path))
    assert times == {10: ("sglang::scheduler (tp 0)", 350), 11: ("python3", 10)}
    later = {10: ("sglang::scheduler (tp 0)", 400), 11: ("python3", 10), 12: ("new", 7)}
    # 50 jiffies at 100 Hz over 0.5 s: one core; an idle process and one not seen before are left out
    assert sampler.busiest(times, later, 0.5, 100, 6) == [[10, "sglang::scheduler (tp 0)", 1.0]]


def test_the_mean_clock_of_the_cores_or_none_where_cpuinfo_has_none(sampler):
    assert sampler.mean_mhz("processor\t: 0\ncpu MHz\t\t: 2000.0\nprocessor\t: 1\ncpu MHz\t\t: 3000.5\n") == 2500.2
    assert sampler.mean_mhz("processor\t: 0\nBogoMIPS\t: 50.00\n") is None


def test_a_busy_process_shows_in_the_samples_and_sigterm_stops_the_sampler(tmp_path):
    out = tmp_path / "host.jsonl"
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
    try:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(out), "--interval-s", "0.3", "--max-s", "30"])
        time.sleep(1.6)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0   # long before its 30 s
    finally:
        spin.kill()
        spin.wait()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 2
    assert all(0.0 <= r["busy"] <= 1.0 and r["dt"] > 0 and "steal" in r["cpu"] for r in rows)
    spin_share = max((share for r in rows for pid, _, share in r["top"] if pid == spin.pid), default=0.0)
    assert spin_share > 0.5, rows   # a core's worth of spinning, seen as such
    assert "gpu" not in rows[0]     # only with --gpu


def test_the_sampler_stops_by_itself_after_max_s(tmp_path):
    out = tmp_path / "host.jsonl"
    t0 = time.time()
    subprocess.run([sys.executable, str(SCRIPT), str(out), "--interval-s", "0.2", "--max-s", "0.7"],
                   check=True, timeout=10)
    assert time.time() - t0 < 5
    assert 1 <= len(out.read_text().splitlines()) <= 5


@pytest.mark.parametrize("flag", ["--interval-s", "--max-s"])
def test_a_zero_interval_or_duration_is_refused(tmp_path, flag):
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "h.jsonl"), flag, "0"],
                         capture_output=True, text=True, timeout=10)
    assert res.returncode == 2 and "must be positive" in res.stderr
    assert not os.path.exists(tmp_path / "h.jsonl")

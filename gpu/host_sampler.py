"""The host's state twice a second during a GPU call, to set a round's throughput beside what the
machine was doing then (stdlib only; tested on the CPU, tests/gpu/test_host_sampler.py).

On the trained pair every step is host work (docs/evidence/auto-threshold/3-interleaved), and one
server's rounds at one load read 0-53 % apart (24-probed-price, 25-probe-log) with the server's own
decode rate moving with the client's: the server, not the client, went slower. Whether that is the
CPU (steal time on a shared host, another process busy, the cores' clock) or the GPU (its clock,
power) is what these samples can say; `gpu/host_check.py` joins them to the rounds.

  python3 gpu/host_sampler.py OUT.jsonl [--interval-s 0.5] [--max-s 900] [--top 6]

Each line: {"t": epoch seconds, "dt": seconds since the last sample, "cpu": the share of all
cores' time in each /proc/stat state since the last sample (user, system, idle, iowait, steal,
...), "busy": 1 - idle - iowait, "running": processes running, "mhz": the cores' mean clock from
/proc/cpuinfo (null where it has none), "top": the busiest processes since the last sample as
[pid, name, share of one core]}, and with --gpu, the GPU's SM clock, utilization and power from
nvidia-smi, one query per sample. Stops by itself after --max-s seconds, or on SIGTERM/SIGINT.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_pin  # noqa: E402

CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
GPU_QUERY = "clocks.sm,utilization.gpu,power.draw,temperature.gpu"


def read_cpu(stat_text):
    """The aggregate `cpu` line of /proc/stat as {field: jiffies} (the fields CPU_FIELDS names)."""
    for line in stat_text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            return {k: int(v) for k, v in zip(CPU_FIELDS, parts[1:])}
    raise ValueError("no aggregate cpu line in /proc/stat")


def running_count(stat_text):
    for line in stat_text.splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    return None


def cpu_shares(before, after):
    """Each state's share of all cores' time between two read_cpu samples."""
    delta = {k: after[k] - before.get(k, 0) for k in after}
    total = sum(delta.values())
    if total <= 0:
        return {k: 0.0 for k in delta}
    return {k: round(v / total, 4) for k, v in delta.items()}


def mean_mhz(cpuinfo_text):
    mhz = [float(line.split(":", 1)[1]) for line in cpuinfo_text.splitlines()
           if line.startswith("cpu MHz") and ":" in line]
    return round(sum(mhz) / len(mhz), 1) if mhz else None


def proc_times(proc_root="/proc"):
    """{pid: (name, utime + stime in jiffies)} of every process readable now."""
    return {pid: (name, jiffies) for pid, (name, _, jiffies) in cpu_pin.proc_stats(proc_root).items()}


def busiest(before, after, dt, hz, top):
    """The `top` processes by CPU time between two proc_times samples, as [pid, name, cores]."""
    used = []
    for pid, (name, jiffies) in after.items():
        prev = before.get(pid)
        if prev is not None and prev[0] == name and jiffies > prev[1]:
            used.append([pid, name, round((jiffies - prev[1]) / hz / dt, 3)])
    used.sort(key=lambda row: -row[2])
    return used[:top]


def gpu_sample():
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = []
    for line in out.strip().splitlines():
        try:
            sm, util, power, temp = (float(x) for x in line.split(","))
        except ValueError:
            return None
        rows.append({"sm_mhz": sm, "util": util, "power_w": power, "temp_c": temp})
    return rows or None


def read(path):
    with open(path) as f:
        return f.read()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--interval-s", type=float, default=0.5)
    ap.add_argument("--max-s", type=float, default=900.0, help="stop after this long (default 900)")
    ap.add_argument("--top", type=int, default=6, help="busiest processes kept per sample")
    ap.add_argument("--gpu", action="store_true", help="also query nvidia-smi each sample")
    a = ap.parse_args(argv)
    if a.interval_s <= 0 or a.max_s <= 0:
        ap.error("--interval-s and --max-s must be positive")
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    hz = os.sysconf("SC_CLK_TCK")
    start = time.time()
    stat = read("/proc/stat")
    cpu, procs, last = read_cpu(stat), proc_times(), time.time()
    with open(a.out, "a") as f:
        while not stop and time.time() - start < a.max_s:
            time.sleep(a.interval_s)
            stat = read("/proc/stat")
            now_cpu, now_procs, now = read_cpu(stat), proc_times(), time.time()
            dt = now - last
            shares = cpu_shares(cpu, now_cpu)
            try:
                mhz = mean_mhz(read("/proc/cpuinfo"))
            except OSError:
                mhz = None
            row = {"t": round(now, 3), "dt": round(dt, 3), "cpu": shares,
                   "busy": round(1.0 - shares.get("idle", 0.0) - shares.get("iowait", 0.0), 4),
                   "running": running_count(stat), "mhz": mhz,
                   "top": busiest(procs, now_procs, dt, hz, a.top)}
            if a.gpu:
                row["gpu"] = gpu_sample()
            f.write(json.dumps(row) + "\n")
            f.flush()
            cpu, procs, last = now_cpu, now_procs, now
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Provisioning on the sandbox: first-run time, re-run time and the round trips of a re-run.

Starts a private sandbox sshd on 127.0.0.1 (its own folder and a free port, like the tests),
provisions the cpu-ref stack into a fresh venv in a temporary folder, then provisions again
`--repeats` times (goal: a re-run <= 3 s in a constant number of round trips). With
`--wheelhouse`, the same again from the cached cpu-ref wheelhouse with the index unreachable.

    python benchmarks/bench_provision.py [--repeats 5] [--wheelhouse] [--save FILE.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import figures_file  # noqa: E402
from toolkit.core import paths, sandbox
from toolkit.provision import provision, stack, wheelhouse  # noqa: E402
from toolkit.core.inventory import resolve_hosts  # noqa: E402


def measure(host, chosen, repeats: int, env: dict, wheels: str | None = None) -> dict:
    started = time.monotonic()
    first = provision.provision(host, chosen, env=env, wheelhouse=wheels,
                                note=lambda text: print(f"  {text}", file=sys.stderr))
    first_s = time.monotonic() - started
    if first.failed:
        failed = next(s for s in first.steps if s.status == "failed")
        raise SystemExit(f"first run failed at {failed.name}: {failed.detail}\n{failed.tail}")
    reruns, trips, changed = [], [], []
    for _ in range(repeats):
        started = time.monotonic()
        again = provision.provision(host, chosen, env=env, wheelhouse=wheels)
        reruns.append(time.monotonic() - started)
        trips.append(again.round_trips)
        changed.append(again.changed)
    return {
        "first_run_s": round(first_s, 1), "first_run_round_trips": first.round_trips,
        "first_run_changed": first.changed, "wheels_sent": len(first.wheels_sent),
        "steps": {s.name: [s.status, s.seconds] for s in first.steps},
        "rerun_s": [round(x, 3) for x in reruns], "rerun_median_s": round(statistics.median(reruns), 3),
        "rerun_round_trips": trips, "rerun_changed": changed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="re-runs to time (default 5)")
    parser.add_argument("--wheelhouse", action="store_true", help="also measure the offline wheelhouse mode")
    parser.add_argument("--save", help="write the figures as JSON to this file")
    options = parser.parse_args()

    chosen = stack.load("cpu-ref")
    pip_env = {"PIP_CACHE_DIR": str(paths.cache_dir() / "pip")}
    figures: dict = {"stack": chosen.name, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                     "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="bench-provision-") as scratch:
        folder, port = Path(scratch) / "sandbox", sandbox.free_loopback_port()
        os.environ.update(TOOLKIT_SANDBOX_DIR=str(folder), TOOLKIT_SANDBOX_PORT=str(port))
        sandbox.up(folder, port)
        try:
            base = resolve_hosts("sandbox")[0]
            host = dataclasses.replace(base, venv=str(Path(scratch) / "online" / "venv"))
            print(f"online: provisioning {chosen.name} into a fresh venv over SSH (127.0.0.1:{port})", file=sys.stderr)
            figures["online"] = measure(host, chosen, options.repeats, pip_env)
            if options.wheelhouse:
                python, tag = wheelhouse.this_machine()
                started = time.monotonic()
                manifest = wheelhouse.build(chosen, python=python, platform=tag,
                                            note=lambda text: print(f"  {text}", file=sys.stderr))
                figures["wheelhouse_build_s"] = round(time.monotonic() - started, 1)
                offline = {**pip_env, "PIP_INDEX_URL": f"http://127.0.0.1:{sandbox.free_loopback_port()}/simple"}
                host = dataclasses.replace(base, venv=str(Path(scratch) / "offline" / "venv"))
                print("wheelhouse: provisioning a second fresh venv with the index unreachable", file=sys.stderr)
                figures["wheelhouse"] = measure(host, chosen, options.repeats, offline, manifest.folder)
                figures["wheelhouse"]["wheels_in_manifest"] = len(manifest.wheels)
        finally:
            sandbox.down(folder)

    for mode in ("online", "wheelhouse"):
        if mode not in figures:
            continue
        f = figures[mode]
        print(f"{mode:10s} first run {f['first_run_s']:6.1f} s ({f['first_run_changed']} changed,"
              f" {f['first_run_round_trips']} round trips{', ' + str(f['wheels_sent']) + ' wheels sent' if mode == 'wheelhouse' else ''})")
        print(f"{mode:10s} re-run    {f['rerun_median_s']:6.3f} s median of {len(f['rerun_s'])}"
              f" (max {max(f['rerun_s']):.3f} s), round trips {f['rerun_round_trips']}, changed {f['rerun_changed']}")
    if options.save:
        figures_file.write(options.save, figures)


if __name__ == "__main__":
    main()

"""SSH round trips and wall time of patch apply / verify / revert, for 1 file and for 20 files.

    python benchmarks/bench_patch_roundtrips.py [--repeat 5]

Starts a private sandbox sshd on 127.0.0.1 (a free port, its own temporary folder), installs
the real SGLang 0.5.11 wheel `--no-deps` into a temporary venv, and runs the synthetic
patchsets `one-file` and `twenty` (tests/patch/data/patchsets) against it. The goal is at
most 2 round trips per command, the same for 1 and for 20 files. Not a test: it prints.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (median wall time is shown)")
    options = parser.parse_args()
    os.environ["TOOLKIT_PATCHSETS"] = str(ROOT / "tests" / "patch" / "data" / "patchsets")
    with tempfile.TemporaryDirectory(prefix="bench-patch-") as tmp:
        from toolkit.patch import patching, wheels
        from toolkit.core import sandbox
        from toolkit.core.inventory import resolve_hosts

        port = sandbox.free_loopback_port()
        os.environ.update(TOOLKIT_SANDBOX_DIR=str(Path(tmp) / "sandbox"), TOOLKIT_SANDBOX_PORT=str(port))

        sandbox.up(Path(tmp) / "sandbox", port)
        try:
            wheel = wheels.pristine("sglang", "0.5.11", note=print)
            venv = Path(tmp) / "venv"
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                            "--prefix", str(venv), str(wheel.path)], check=True)
            host = dataclasses.replace(resolve_hosts("sandbox")[0], venv=str(venv))
            patching.check("twenty")  # compile once, as `invoke patch check` would; the cache serves the rest
            patching.check("one-file")
            rows = []
            for name, files in (("one-file", 1), ("twenty", 20)):
                timings: dict[str, list[float]] = {"apply": [], "apply again (0 changed)": [], "verify": [],
                                                   "verify --all-files": [], "revert": []}
                trips: dict[str, int] = {}
                for _ in range(options.repeat):
                    for label, call in (("apply", lambda: patching.apply(host, name)),
                                        ("apply again (0 changed)", lambda: patching.apply(host, name)),
                                        ("verify", lambda: patching.verify(host)),
                                        ("verify --all-files", lambda: patching.verify(host, all_files=True)),
                                        ("revert", lambda: patching.revert(host))):
                        start = time.perf_counter()
                        result = call()
                        timings[label].append(time.perf_counter() - start)
                        trips[label] = result.round_trips
                for label, values in timings.items():
                    rows.append((files, label, trips[label], statistics.median(values)))
        finally:
            sandbox.down(Path(tmp) / "sandbox")
    print(f"\npatch engine on the sandbox (sshd on 127.0.0.1), median of {options.repeat} runs")
    print(f"{'files':>5}  {'command':<26} {'round trips':>11}  {'wall s':>7}")
    for files, label, count, seconds in rows:
        print(f"{files:>5}  {label:<26} {count:>11}  {seconds:>7.3f}")


if __name__ == "__main__":
    main()

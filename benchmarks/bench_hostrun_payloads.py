"""Bytes each host call sends: its zip and its stdin, per entry, with the whole zip (before) and with its closure.

    python benchmarks/bench_hostrun_payloads.py

The entries are those the toolkit calls (read from its sources by tests/hostrun_entries.py) and
`echo`. Stdin is measured with empty arguments: a call adds its own (base64 JSON) to both columns.
"Before" is the same bootstrap carrying the zip of every host module, as each call did until
hostrun shipped closures. Not a test: it prints.
"""
from __future__ import annotations

import base64
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from toolkit.core import hostrun
    from tests.hostrun_entries import called_entries

    whole = hostrun.host_zip()
    whole_text = len(base64.b64encode(whole))
    entries = sorted(called_entries()[0] | {("echo", "main")})
    print(f"{'entry':<28} {'modules':>7} {'zip before':>10} {'zip now':>8} {'stdin before':>12} {'stdin now':>9}")
    for name, function in entries:
        mine = hostrun.host_zip(name)
        stdin = len(hostrun.build_payload(name, {}, function).encode())
        before = stdin - len(base64.b64encode(mine)) + whole_text
        modules = len(hostrun.closure_of(hostrun.host_files(), name))
        print(f"{name + '.' + function:<28} {modules:>7} {len(whole):>10,} {len(mine):>8,} {before:>12,} {stdin:>9,}")
    print(f"every module: {len(hostrun.host_files())} files, zip {len(whole):,} bytes, sha256 {hostrun.zip_sha256()}")


if __name__ == "__main__":
    main()

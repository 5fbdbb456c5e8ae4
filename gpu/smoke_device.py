"""Run the toolkit's smoke checks (toolkit/smoke.py, the engine of `invoke smoke`) against
servers already listening on this machine, and write one JSON object per server.

Usage: python3 gpu/smoke_device.py OUT.json NAME=URL=LOG [NAME=URL=LOG ...]
"""
import asyncio
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from toolkit.smoke import run_smoke_async  # noqa: E402


async def main():
    results = {}
    for arg in sys.argv[2:]:
        name, url, log = arg.split("=", 2)
        result = await run_smoke_async(url, read_log=lambda log=log: pathlib.Path(log).read_text())
        results[name] = [{"check": c.name, "status": c.status, "detail": c.detail} for c in result.checks]
        for c in result.checks:
            print(f"{name}: {c.name:12s} {c.status:7s} {c.detail}", flush=True)
    pathlib.Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


asyncio.run(main())

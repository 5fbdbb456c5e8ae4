"""The toolkit's smoke checks (toolkit/smoke.py, the engine of `invoke smoke`) on two tiny
"sharp" baseline servers side by side: one on the site as provisioned (/tmp/site), one on a copy
whose greedy sampler was broken to change outputs (/tmp/noisy, made by smoke_determinism.sh).
The determinism check should pass on the first and fail on the second.

Usage (device, after gpu/run_dyn.sh setup): python3 gpu/smoke_device.py OUT.json
"""
import asyncio
import json
import pathlib
import sys

import aiohttp

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import dyn_device  # noqa: E402
from toolkit.smoke import run_smoke_async  # noqa: E402


async def main(out):
    servers = {"clean": dyn_device.Server("baseline", "sharp", 30000, 0.15),
               "noisy": dyn_device.Server("baseline", "sharp", 30010, 0.15)}
    noisy = servers["noisy"]
    noisy.env["PYTHONPATH"] = "/tmp/noisy:" + noisy.env["PYTHONPATH"]
    results = {}
    try:
        for name, srv in servers.items():
            srv.log_path = f"{dyn_device.LOGS}/{name}.log"
            srv.start()
        async with aiohttp.ClientSession() as s:
            for name, srv in servers.items():
                up = await dyn_device.wait_health(s, srv, 180)
                dyn_device.say(f"{name}: healthy after {up} s")
        for name, srv in servers.items():
            result = await run_smoke_async(srv.base, read_log=lambda path=srv.log_path: open(path).read())
            results[name] = [{"check": c.name, "status": c.status, "detail": c.detail} for c in result.checks]
            for c in result.checks:
                print(f"{name}: {c.name:12s} {c.status:7s} {c.detail}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
        pathlib.Path(out).write_text(json.dumps(results, indent=1))


asyncio.run(main(sys.argv[1]))

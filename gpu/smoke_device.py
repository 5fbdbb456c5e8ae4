"""The toolkit's smoke checks (toolkit/check/smoke.py, the engine of `invoke smoke`) on tiny "sharp"
servers side by side: by default one baseline on the site as provisioned (/tmp/site, "clean")
and one whose greedy sampler was broken to change outputs (/tmp/noisy, made by
make_noisy_site.sh, "noisy"). The determinism check should pass on the first and fail on the
second.

Usage (device, after gpu/run_dyn.sh setup): python3 gpu/smoke_device.py OUT.json
Env: SMOKE_SERVERS (default "clean=baseline,noisy=baseline"): LABEL=PROFILE pairs (profiles as
     in dyn_device.py; the label "noisy" runs on /tmp/noisy); SMOKE_TP (default 1): TP size,
     on GPUs 0..TP-1.
"""
import asyncio
import json
import os
import pathlib
import sys

import aiohttp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import dyn_device  # noqa: E402


def make_servers(spec, tp):
    """label -> server, from SMOKE_SERVERS ("label=profile,...")."""
    servers = {}
    for k, item in enumerate(spec.split(",")):
        label, _, profile = item.partition("=")
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(tp))}
        if label == "noisy":
            env["PYTHONPATH"] = dyn_device.site_path("/tmp/noisy")
        servers[label] = dyn_device.Server(profile, "sharp", 30000 + 10 * k, 0.15, tp=tp,
                                           flags=["--nccl-port", str(35000 + 10 * k)], env=env)
    return servers


async def main(out):
    tp = int(os.environ.get("SMOKE_TP", "1"))
    servers = make_servers(os.environ.get("SMOKE_SERVERS", "clean=baseline,noisy=baseline"), tp)
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
            results[name] = (await dyn_device.run_smoke(srv))["checks"]
            for c in results[name]:
                print(f"{name}: {c['check']:12s} {c['status']:7s} {c['detail']}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
        pathlib.Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))

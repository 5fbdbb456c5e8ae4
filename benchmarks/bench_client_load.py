"""How hard can the bench client drive a server, and does its timing hold under a realistic load?

Two loads, each from the stand-in streaming server (tests/client/fake_openai.py) in its own
process on 127.0.0.1, with `--concurrency` requests kept in flight (a closed loop, as a bench
level runs):

1. headroom: a trivial answer (4 one-token events, no delay): the highest request rate the
   client reaches. A benchmark client must stay far above what the server under test answers.
2. realistic: a GPU-like stream, `--chunks` one-token events `--delay` s apart (default 160
   tokens, 10 ms: 64 streams make ~6400 events/s, more than an H200 running an 8B target
   answers at c=64). The server's timing is known, so the client's error is visible: ITL p50
   against the delay, output tok/s against the ideal (tokens / (chunks x delay) x concurrency).

`--compare-client FILE` runs the same loads with another client module of the same interface
(an `OpenAIClient` whose `chat()` returns records with `ok`, `completion_tokens`, `ttft`,
`latency` and `itl`), e.g. the hand-written HTTP/1.1 pool this client replaced:

    git show a05d83e:toolkit/check/client.py > /tmp/old_client.py
    python benchmarks/bench_client_load.py --compare-client /tmp/old_client.py [--reps 3]
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import free_port          # noqa: E402
from benchmarks import figures_file  # noqa: E402
from toolkit.check import client as this_client  # noqa: E402


def load_client(path: str):
    spec = importlib.util.spec_from_file_location("compared_client", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def start_fake(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(ROOT / "tests" / "client" / "fake_openai.py"), str(port), *args],
                            stdout=subprocess.PIPE, text=True)
    fake.stdout.readline()     # "fake OpenAI server on ..."
    return fake, f"http://127.0.0.1:{port}"


async def closed_loop(module, base_url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    async with module.OpenAIClient(base_url, model="fake-model", max_connections=concurrency) as client:
        records = []
        remaining = requests

        async def worker():
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                records.append(await client.chat([{"role": "user", "content": f"q{remaining}"}],
                                                  max_tokens=max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - started
    good = [r for r in records if r.ok and r.completion_tokens]
    itls = [gap for r in good for gap in r.itl]
    return {"requests_per_s": len(good) / duration, "output_tok_s": sum(r.completion_tokens for r in good) / duration,
            "failed": len(records) - len(good),
            "ttft_p50_ms": statistics.median(r.ttft for r in good) * 1000 if good else None,
            "itl_p50_ms": statistics.median(itls) * 1000 if itls else None,
            "itl_p99_ms": sorted(itls)[int(0.99 * (len(itls) - 1))] * 1000 if itls else None}


def measure(module, base_url, args, *, requests, max_tokens) -> dict:
    runs = [asyncio.run(closed_loop(module, base_url, args.concurrency, requests, max_tokens))
            for _ in range(args.reps)]
    median = {key: statistics.median(run[key] for run in runs if run[key] is not None)
              for key in runs[0] if any(run[key] is not None for run in runs)}
    return {"median": median, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--headroom-requests", type=int, default=2000)
    parser.add_argument("--realistic-requests", type=int, default=192)
    parser.add_argument("--chunks", type=int, default=160, help="realistic: tokens (one per event) per answer")
    parser.add_argument("--delay", type=float, default=0.01, help="realistic: seconds between events")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--compare-client", help="another client module (FILE.py) to run the same loads")
    parser.add_argument("--record", help="also write the figures as JSON to this path")
    args = parser.parse_args()
    clients = {"toolkit.check.client (aiohttp)": this_client}
    if args.compare_client:
        clients[f"compared: {args.compare_client}"] = load_client(args.compare_client)
    figures = {"machine": {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
               "concurrency": args.concurrency, "clients": {}}
    ideal = args.concurrency / args.delay
    for name, module in clients.items():
        entry = figures["clients"][name] = {}
        fake, url = start_fake("--chunks", "4")
        try:
            entry["headroom"] = measure(module, url, args, requests=args.headroom_requests, max_tokens=4)
        finally:
            fake.terminate()
            fake.wait(10)
        fake, url = start_fake("--chunks", str(args.chunks), "--delay", str(args.delay))
        try:
            entry["realistic"] = measure(module, url, args, requests=args.realistic_requests, max_tokens=args.chunks)
        finally:
            fake.terminate()
            fake.wait(10)
        head, real = entry["headroom"]["median"], entry["realistic"]["median"]
        print(f"{name}: headroom {head['requests_per_s']:.0f} req/s; realistic ({args.chunks} tokens, "
              f"{args.delay * 1000:.0f} ms apart, c={args.concurrency}): {real['output_tok_s']:.0f} out tok/s "
              f"(ideal below {ideal:.0f}), ITL p50 {real['itl_p50_ms']:.2f} ms / p99 {real['itl_p99_ms']:.2f} ms "
              f"(server: {args.delay * 1000:.0f} ms), TTFT p50 {real['ttft_p50_ms']:.2f} ms", flush=True)
    figures["load_average_at_end"] = os.getloadavg()
    if args.record:
        figures_file.write(args.record, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

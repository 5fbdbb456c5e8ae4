"""Device: dyn-disable in SGLang's Prometheus metrics, shown on a real server.

An eagle3-v2-dyn server (the tiny `sharp` pair, or `--pair`) started with --enable-metrics and the
dyn-disable patchset (0001 + 0002-dyn-disable-metrics.patch, applied by run_dyn.sh setup) goes
through load cycles (a ramp across the threshold, a burst above it, a pause at one request) while
its /metrics is scraped every --interval seconds into OUT/scrape.jsonl (toolkit.server.scrape lines: what
`invoke server dashboard --record OUT/scrape.jsonl` draws). At the end, with the server idle:

- switches_off / switches_on from /metrics == the number of "drafting stopped" / "drafting
  resumed" lines in the server's log == the counters of its last switch line;
- every counter from /metrics == /server_info's internal_states[0].dyn_spec_disable;
- spec and plain steps from /metrics >= those of the last log line that prints counters (the
  log prints them every --decode-log-interval steps and at switches; later steps are counted);
- no failed request.

OUT/check.json holds the verdicts, OUT/metrics-final.txt the last /metrics body (a capture for
tests/client/sglang_metrics.py), OUT/server.log.gz the log. Exit 1 when a check fails.

    PYTHONPATH=/tmp/site python3 gpu/metrics_device.py --out $OUT [--cycles 10] [--interval 0.25]
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import re
import shutil
import sys
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import dyn_device as dd  # noqa: E402  (its Server, prompts and /generate client)

from toolkit.server import scrape  # noqa: E402

SWITCH_LINE = re.compile(r"Dynamic speculation disable: drafting (stopped|resumed) at (\d+) running decode requests "
                         r"\(spec steps: (\d+), plain steps: (\d+), spec off/on switches: (\d+)/(\d+)\)")
COUNTERS_IN_LINE = re.compile(r"spec steps: (\d+), plain steps: (\d+), spec off/on switches: (\d+)/(\d+)")


def say(*a):
    print(f"[t={dd.el()}s]", *a, flush=True)


async def scraper(s, base, path, interval, stop: asyncio.Event, counts: dict):
    while not stop.is_set():
        try:
            async with s.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                text = await r.text()
            if r.status == 200:
                scrape.append_series(path, scrape.Snapshot(time.time(), scrape.parse(text)))
                counts["scrapes"] += 1
            else:
                counts["errors"] += 1
        except Exception:
            counts["errors"] += 1
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def drive(s, srv, threshold, cycles, failures: list):
    """Each cycle: a ramp 1, 2, 4, ... past the threshold, a burst of 3x threshold, then one
    request alone (drafting resumes)."""
    async def one(i, tokens):
        try:
            await dd.generate(s, srv, dd.PROMPTS[i % 32], tokens)
        except Exception as exc:
            failures.append(str(exc)[:200])

    for cycle in range(cycles):
        width = 1
        while width <= 2 * threshold:
            await asyncio.gather(*(one(cycle + k, 48) for k in range(width)))
            width *= 2
        await asyncio.gather(*(one(cycle + k, 160) for k in range(3 * threshold)))
        await one(cycle, 64)
        await asyncio.sleep(0.5)


def log_counters(text: str) -> dict:
    """The counters the log printed; at TP > 1 every rank logs them, so rank 0's lines only."""
    lines = text.splitlines()
    if any("TP1" in line.split("]")[0] for line in lines if line.startswith("[")):
        text = "\n".join(line for line in lines if "TP0" in line.split("]")[0])
    switches = SWITCH_LINE.findall(text)
    counted = COUNTERS_IN_LINE.findall(text)
    last_switch = switches[-1] if switches else None
    return {"stopped_lines": sum(1 for m in switches if m[0] == "stopped"),
            "resumed_lines": sum(1 for m in switches if m[0] == "resumed"),
            "last_switch_line": None if last_switch is None else
            dict(zip(("spec_steps", "plain_steps", "switches_off", "switches_on"), map(int, last_switch[2:]))),
            "last_counters_line": None if not counted else
            dict(zip(("spec_steps", "plain_steps", "switches_off", "switches_on"), map(int, counted[-1])))}


def checks(metrics: dict, info: dict | None, log: dict, failures: int) -> list[dict]:
    out = []

    def check(name, ok, detail):
        out.append({"check": name, "ok": bool(ok), "detail": detail})

    check("switches_off == 'drafting stopped' lines", metrics["switches_off"] == log["stopped_lines"],
          f"{metrics['switches_off']} vs {log['stopped_lines']}")
    check("switches_on == 'drafting resumed' lines", metrics["switches_on"] == log["resumed_lines"],
          f"{metrics['switches_on']} vs {log['resumed_lines']}")
    last = log["last_switch_line"] or {}
    check("switches == the last switch line's", last and (metrics["switches_off"], metrics["switches_on"]) ==
          (last["switches_off"], last["switches_on"]), f"{metrics} vs {last}")
    counters = ("spec_steps", "plain_steps", "forced_spec_steps", "switches_off", "switches_on")
    check("every counter == /server_info", info is not None and all(metrics[k] == info.get(k) for k in counters),
          f"metrics {[metrics[k] for k in counters]} server_info {[None if info is None else info.get(k) for k in counters]}")
    logged = log["last_counters_line"] or {}
    check("steps >= the last logged counters", logged and metrics["spec_steps"] >= logged["spec_steps"]
          and metrics["plain_steps"] >= logged["plain_steps"], f"{metrics} vs {logged}")
    check("switches happened", metrics["switches_off"] > 0, f"{metrics['switches_off']} off")
    check("no failed request", failures == 0, f"{failures} failed")
    return out


def make_server(args):
    return dd.Server("eagle3-v2-dyn", args.pair, args.port, args.mem, tp=args.tp,
                     flags=["--enable-metrics", "--decode-log-interval", str(args.decode_log_interval)])


async def main_async(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    series = os.path.join(args.out, "scrape.jsonl")
    if os.path.exists(series):
        os.remove(series)
    threshold = dd.THRESHOLD
    srv = make_server(args)
    srv.start()
    report = {"threshold": threshold, "pair": args.pair, "tp": args.tp, "cycles": args.cycles,
              "interval_s": args.interval}
    code = 1
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            ready = await dd.wait_health(s, srv, args.ready_timeout)
            report["ready_s"] = ready
            if ready is None:
                say("server not healthy; log tail:\n" + open(srv.log_path, errors="replace").read()[-3000:])
                return 1
            stop, counts, failures = asyncio.Event(), {"scrapes": 0, "errors": 0}, []
            task = asyncio.create_task(scraper(s, srv.base, series, args.interval, stop, counts))
            await asyncio.sleep(2 * args.interval)
            t0 = time.time()
            await drive(s, srv, threshold, args.cycles, failures)
            report["load_s"] = round(time.time() - t0, 1)
            await asyncio.sleep(max(3.0, 4 * args.interval))   # idle: the last steps are done
            stop.set()
            await task
            async with s.get(srv.base + "/metrics") as r:
                final_text = await r.text()
            async with s.get(srv.base + "/server_info") as r:
                info = await r.json()
        with open(os.path.join(args.out, "metrics-final.txt"), "w") as handle:
            handle.write(final_text)
        final = scrape.Snapshot(time.time(), scrape.parse(final_text)).dyn_state()
        scrape.append_series(series, scrape.Snapshot(time.time(), scrape.parse(final_text)))
        info_dyn = scrape.dyn_from_server_info(info)
        report.update(scrapes=counts["scrapes"] + 1, scrape_errors=counts["errors"], failed_requests=len(failures),
                      failures=failures[:5], metrics=final, server_info=info_dyn)
        if final is None:
            say("the server exports no sglang:spec_dyn_disable_* metrics (0002 not applied?)")
            return 1
    finally:
        srv.stop()
        await asyncio.sleep(1)
    text = open(srv.log_path, errors="replace").read()
    with open(srv.log_path, "rb") as src, gzip.open(os.path.join(args.out, "server.log.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    report["log"] = log_counters(text)
    report["checks"] = checks(final, info_dyn, report["log"], len(failures))
    code = 0 if all(c["ok"] for c in report["checks"]) else 1
    with open(os.path.join(args.out, "check.json"), "w") as handle:
        json.dump(report, handle, indent=2, sort_keys=True)
    for c in report["checks"]:
        say(f"{'PASS' if c['ok'] else 'FAIL'}  {c['check']}: {c['detail']}")
    say(f"{report['scrapes']} scrapes over {report['load_s']} s of load into {series}; exit {code}")
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--pair", default="sharp")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--port", type=int, default=31400)
    parser.add_argument("--mem", type=float, default=0.5)
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--decode-log-interval", type=int, default=40)
    parser.add_argument("--ready-timeout", type=float, default=300)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())

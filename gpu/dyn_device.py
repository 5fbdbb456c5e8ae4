"""Device-side driver for the dyn-disable proof (runs on the H200 machine).

Usage (from the repo root, after gpu/run_dyn.sh has prepared /tmp/site and /tmp/models):
  python3 gpu/dyn_device.py PHASE [PHASE ...] --out DIR [--budget-s 520]

PHASE:
  small  tiny "sharp" models (context-dependent greedy output), CUDA graphs on:
         servers baseline, eagle3-stock (unpatched 0.5.11), eagle3, eagle3-dyn,
         eagle3-v2, eagle3-v2-dyn and eagle3-naive (stock + a naive batch-size
         bypass). Runs the 32-prompt mixed-concurrency equality schedule, the
         up/down burst cycles (outputs compared with baseline), reads
         /server_info counters, scans the logs.
  big    config-only 16-layer hidden-4096 target + draft with --load-format
         dummy and SGLANG_SIMULATE_ACC_LEN on the speculative servers: sweep of
         total output tok/s at concurrency 1..64 for baseline, eagle3,
         eagle3-dyn, eagle3-v2, eagle3-v2-dyn.
Writes DIR/results_<phase>.json, DIR/summary_<phase>.txt and server logs under
/tmp/dyn-logs (the wrapper tars them into DIR/logs.tgz).
Only aiohttp and the standard library are needed on the client side.
"""
import argparse
import asyncio
import json
import os
import re
import signal
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # toolkit/, for run_smoke
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lab_launch  # noqa: E402
T0 = time.time()
LOGS = "/tmp/dyn-logs"
MODELS = "/tmp/models"
SITE = "/tmp/site"
STOCK = "/tmp/stock"  # unpatched copy of the sglang package (eagle3-stock / naive)
THRESHOLD = int(os.environ.get("DYN_THRESHOLD", "5"))
OUT_DIR = "/tmp/out"

COMMON = [
    "--attention-backend", "triton", "--sampling-backend", "pytorch",
    "--grammar-backend", "none", "--disable-piecewise-cuda-graph", "--random-seed", "0",
    "--max-running-requests", "64", "--cuda-graph-max-bs", "64", "--log-level", "info",
    "--decode-log-interval", "200",
]
HARMLESS = re.compile(r"openai_harmony|OpenAIServingResponses")
ERROR_RE = re.compile(r"Traceback|Error|error:|Exception|CUDA error|core dumped")
# driver name -> (profile, sglang copy put before SITE on the path); the profiles are the
# product's (profiles/) or the lab's (gpu/profiles/), resolved by gpu/lab_launch.py
PROFILES = {
    "baseline": ("baseline", None), "baseline-nooverlap": ("baseline-nooverlap", None),
    "eagle3": ("eagle3", None), "eagle3-dyn": ("eagle3-dyn", None),
    "eagle3-v2": ("eagle3-v2", None), "eagle3-v2-dyn": ("eagle3-v2-dyn", None),
    "eagle3-stock": ("eagle3", STOCK), "eagle3-naive": ("eagle3", "/tmp/naive"),
}


def el():
    return round(time.time() - T0, 1)


def say(*a):
    print(f"[t={el()}s]", *a, flush=True)


def site_path(first=None):
    """PYTHONPATH of a server: an sglang copy first (if any), the site, the device's stubs."""
    extra = os.environ.get("EXTRA_PYTHONPATH", "")
    return ":".join(p for p in (first, SITE, extra) if p)


class Server:
    """One server of a phase, launched through the product's profiles (gpu/lab_launch.py).
    `flags` and `env` are added to the profile's; the lab's common flags come first."""

    def __init__(self, name, pair, port, mem, tp=1, flags=(), env=None):
        self.name, self.pair, self.port = name, pair, port
        self.base = f"http://127.0.0.1:{port}"
        profile, first = PROFILES[name]
        lab_flags = COMMON + ["--mem-fraction-static", str(mem),
                              "--max-total-tokens", "16384" if pair == "big" else "65536"]
        if pair == "big":
            lab_flags += ["--load-format", "dummy"]
        lab_env = {"PYTHONPATH": site_path(first)}
        if name == "eagle3-naive":
            lab_env["NAIVE_BYPASS_THRESHOLD"] = str(THRESHOLD)
        if pair == "big" and name != "baseline":
            lab_env["SGLANG_SIMULATE_ACC_LEN"] = os.environ.get("SIM_ACC_LEN", "2.6")
        lab_env.update(env or {})
        self.plan = lab_launch.plan(profile, model=f"{MODELS}/target-{pair}", draft=f"{MODELS}/draft-{pair}",
                                    port=port, tp=tp, flags=lab_flags + list(flags), env=lab_env,
                                    threshold=THRESHOLD)
        self.env_shown = {k: v for k, v in self.plan.env.items() if k != "PYTHONPATH"}
        self.log_path = f"{LOGS}/{name}-{pair}.log"
        self.proc = None

    @property
    def cmd(self):
        """The command line the launch script runs."""
        return self.plan.argv

    @property
    def env(self):
        """The environment the server runs with: the driver's, plus what the script exports."""
        return dict(os.environ, **self.plan.env)

    def start(self):
        self.log = open(self.log_path, "w")
        self.proc = lab_launch.start(self.plan, self.log_path[:-len(".log")] + ".launch.sh", self.log)
        say(f"start {self.describe()} env={self.env_shown}")

    def describe(self):
        return f"{self.name}/{self.pair} port {self.port}"

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self):
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        for _ in range(40):
            if self.proc.poll() is not None:
                break
            time.sleep(0.25)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()

    def read_log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def scan_log(self):
        lines = self.read_log().splitlines()
        errors = [l for l in lines if ERROR_RE.search(l) and not HARMLESS.search(l)]
        return {
            "lines": len(lines),
            "error_lines": len(errors),
            "first_errors": errors[:8],
            "startup": [l for l in lines if "Dynamic speculation disable" in l][:6],
            "decode_log_tail": [l for l in lines if "Decode batch" in l][-3:],
            "cuda_graph_lines": [l for l in lines if "Capture cuda graph end" in l][:4],
        }



async def run_smoke(srv):
    """The toolkit's smoke (toolkit/check/smoke.py, the engine of `invoke smoke`) on a running server,
    its burst sized as `invoke smoke` sizes it for the dyn-disable threshold the server was
    started with (none for a server without one): {"ok", "checks"}."""
    from toolkit.check.smoke import burst_size, run_smoke_async
    result = await run_smoke_async(srv.base, read_log=srv.read_log, burst=burst_size(srv.plan.dyn_threshold))
    # burst_gaps: the burst's stall figures, where the smoke reports them (docs/smoke.md)
    return {"ok": result.ok, "burst_gaps": getattr(result, "burst_gaps", None), "checks": [
        {"check": c.name, "status": c.status, "seconds": round(c.seconds, 2), "detail": c.detail}
        for c in result.checks]}

PROMPTS = [
    f"Request {i}: please write a short note about {w} and why it matters to {v}."
    for i, (w, v) in enumerate(zip(
        ("apples rivers compilers tensors kernels gardens trains music bridges clouds "
         "oceans deserts forests cities robots planets").split() * 4,
        ("farmers sailors students engineers painters doctors pilots").split() * 10))
]


async def generate(s, srv, prompt, max_tokens, ignore_eos=True):
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens,
                                                "ignore_eos": ignore_eos}}
    async with s.post(srv.base + "/generate", json=body) as r:
        j = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{srv.name}: HTTP {r.status}: {str(j)[:300]}")
        return j


async def wait_health(s, srv, timeout):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if not srv.alive():
            return None
        try:
            async with s.get(srv.base + "/health_generate", timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status == 200:
                    return round(time.time() - t0, 1)
        except Exception:
            pass
        await asyncio.sleep(1.0)
    return None


async def server_info(s, srv):
    err = "not answering"
    for path in ("/server_info", "/get_server_info"):
        try:
            async with s.get(srv.base + path) as r:
                if r.status == 200:
                    j = await r.json()
                    states = j.get("internal_states") or [{}]
                    return {"dyn_spec_disable": states[0].get("dyn_spec_disable"),
                            "avg_spec_accept_length": states[0].get("avg_spec_accept_length")}
        except Exception as e:
            err = str(e)
    return {"error": f"no server_info ({err})"}


def lens32():
    return [24 + (i * 13) % 41 for i in range(32)]


async def equality_schedule(s, srv):
    """32 prompts at mixed concurrency: c=1, a burst of 12, c=2, a staggered burst of 12."""
    L = lens32()
    out = {}

    async def one(i, delay=0.0):
        if delay:
            await asyncio.sleep(delay)
        j = await generate(s, srv, PROMPTS[i], L[i])
        out[i] = j["output_ids"]

    for i in range(0, 4):
        await one(i)
    await asyncio.gather(*(one(i) for i in range(4, 16)))
    sem = asyncio.Semaphore(2)

    async def limited(i):
        async with sem:
            await one(i)

    await asyncio.gather(*(limited(i) for i in range(16, 20)))
    await asyncio.gather(*(one(i, 0.03 * (i - 20)) for i in range(20, 32)))
    return [out[i] for i in range(32)]


async def burst_cycles(s, srv, cycles, width=12):
    """Up/down crossings: a burst of `width` requests, then one request alone."""
    outs = []
    for c in range(cycles):
        idx = [(c * width + k) % 32 for k in range(width)]
        rs = await asyncio.gather(*(generate(s, srv, PROMPTS[i], 10 + (i % 5)) for i in idx))
        outs.extend((i, r["output_ids"]) for i, r in zip(idx, rs))
        i = c % 32
        r = await generate(s, srv, PROMPTS[i], 6)
        outs.append((i, r["output_ids"]))
    return outs


async def load(s, srv, n, conc, max_tokens):
    sem = asyncio.Semaphore(conc)
    toks = []

    async def one(i):
        async with sem:
            j = await generate(s, srv, PROMPTS[i % 32], max_tokens)
            toks.append(j["meta_info"]["completion_tokens"])

    t0 = time.time()
    await asyncio.gather(*(one(i) for i in range(n)))
    dt = time.time() - t0
    return {"conc": conc, "n": n, "out_tokens": sum(toks), "wall_s": round(dt, 3),
            "out_tok_per_s": round(sum(toks) / dt, 1)}


def make_servers(specs, mem):
    return [Server(name, pair, 31000 + 10 * (pair == "big") + k, mem) for k, (name, pair) in enumerate(specs)]


def start_all(specs, mem, wait_kv=False, stagger=3.0):
    """Start servers one after another. sglang sizes its pools from the memory free
    between two readings around weight loading, so with wait_kv the next server
    starts only once the previous one has allocated its KV cache."""
    servers = []
    for srv in make_servers(specs, mem):
        srv.start()
        servers.append(srv)
        t0 = time.time()
        while wait_kv and time.time() - t0 < 120 and srv.alive():
            text = open(srv.log_path, errors="replace").read()
            if "KV Cache is allocated" in text or "max_total_num_tokens" in text:
                break
            time.sleep(0.5)
        time.sleep(stagger)
    return servers


async def wait_all(s, servers, timeout):
    res = await asyncio.gather(*(wait_health(s, srv, timeout) for srv in servers))
    up = {}
    for srv, w in zip(servers, res):
        say(f"{srv.name}/{srv.pair}: health after {w} s" if w is not None else
            f"{srv.name}/{srv.pair}: NOT healthy (alive={srv.alive()})")
        up[srv.name] = w
    return up


def compare(a, b):
    same = sum(1 for x, y in zip(a, b) if x == y)
    first_diff = []
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((p for p, (u, v) in enumerate(zip(x or [], y or [])) if u != v), None)
            first_diff.append({"prompt": k, "first_diff_token": pos})
    return {"match": same, "of": min(len(a), len(b)), "diffs": first_diff[:8]}


async def phase_small(s, rep, budget):
    names = os.environ.get("SMALL_PROFILES", "baseline,eagle3-stock,eagle3,eagle3-dyn,eagle3-v2,"
                           "eagle3-v2-dyn,eagle3-naive").split(",")
    servers = start_all([(n, "sharp") for n in names], mem=0.15)
    by = {srv.name: srv for srv in servers}
    rep["health_s"] = await wait_all(s, servers, timeout=min(240, budget - el() - 60))
    try:
        # 1. equality, 32 prompts at mixed concurrency
        eq = {}
        for n in names:
            if n == "eagle3-naive" or not by[n].alive() or rep["health_s"].get(n) is None:
                continue
            try:
                eq[n] = await equality_schedule(s, by[n])
            except Exception as e:
                rep.setdefault("failures", {})[f"equality/{n}"] = repr(e)[:400]
        rep["equality"] = {n: compare(eq["baseline"], eq[n]) for n in eq if "baseline" in eq}
        rep["equality_vs_eagle3"] = {n: compare(eq["eagle3"], eq[n]) for n in eq if "eagle3" in eq}
        rep["equality_vs_eagle3_v2"] = {n: compare(eq["eagle3-v2"], eq[n]) for n in eq
                                        if "eagle3-v2" in eq}
        say("equality vs baseline:", {k: f"{v['match']}/{v['of']}" for k, v in rep["equality"].items()})
        # 2. bursts: up/down crossings, outputs checked against baseline's
        cycles = int(os.environ.get("BURST_CYCLES", "35"))
        bursts = {}
        ref = None
        for n in ["baseline", "eagle3-dyn", "eagle3-v2-dyn", "eagle3"]:
            if n not in by:
                continue
            srv = by[n]
            if not srv.alive() or rep["health_s"].get(n) is None or el() > budget - 60:
                continue
            before = await server_info(s, srv)
            t0 = time.time()
            try:
                outs = await burst_cycles(s, srv, cycles)
                err = None
            except Exception as e:
                outs, err = [], repr(e)[:400]
            after = await server_info(s, srv)
            entry = {"cycles": cycles, "wall_s": round(time.time() - t0, 1), "error": err,
                     "requests": len(outs), "server_info_before": before,
                     "server_info_after": after, "alive_after": srv.alive()}
            if n == "baseline":
                ref = outs
            elif ref:
                entry["match_vs_baseline"] = sum(1 for a, b in zip(ref, outs) if a == b)
                entry["compared"] = min(len(ref), len(outs))
            bursts[n] = entry
            say(f"bursts {n}: {entry['requests']} requests in {entry['wall_s']} s, err={err}, "
                f"after={after}, match={entry.get('match_vs_baseline')}/{entry.get('compared')}")
        rep["bursts"] = bursts
        # 3. naive bypass under the same bursts
        srv = by.get("eagle3-naive")
        if srv is not None and srv.alive():
            try:
                outs = await burst_cycles(s, srv, 3)
                rep["naive"] = {"error": None, "requests": len(outs)}
            except Exception as e:
                rep["naive"] = {"error": repr(e)[:400]}
            await asyncio.sleep(3)
            rep["naive"]["alive_after"] = srv.alive()
            say("naive:", rep["naive"])
    finally:
        for srv in servers:
            srv.stop()
        rep["logs"] = {srv.name: srv.scan_log() for srv in servers}
        for n, lg in rep["logs"].items():
            say(f"log {n}: {lg['error_lines']} error lines; startup={lg['startup'][:1]}; "
                f"first={lg['first_errors'][:2]}")


async def phase_big(s, rep, budget):
    names = os.environ.get("BIG_PROFILES", "baseline,eagle3,eagle3-dyn,eagle3-v2,eagle3-v2-dyn").split(",")
    # Concurrent starts: sglang sizes its pools from free memory read before and after
    # its own weight load, so the fraction must leave room for the others loading in
    # between (BIG_MEM, e.g. 0.7 for five 32-layer servers); KV is capped by
    # --max-total-tokens. BIG_WAIT_KV=1 starts them one after another instead.
    servers = start_all([(n, "big") for n in names], mem=float(os.environ.get("BIG_MEM", "0.2")),
                        wait_kv=os.environ.get("BIG_WAIT_KV", "1") == "1",
                        stagger=float(os.environ.get("BIG_STAGGER_S", "3")))
    by = {srv.name: srv for srv in servers}
    rep["health_s"] = await wait_all(s, servers, timeout=min(300, budget - el() - 30))
    levels = [int(x) for x in os.environ.get("SWEEP_LEVELS", "1,2,4,8,16,32,64").split(",")]
    max_tokens = int(os.environ.get("SWEEP_MAX_TOKENS", "128"))
    sweep = {n: [] for n in names}
    try:
        live = [n for n in names if by[n].alive() and rep["health_s"].get(n) is not None]
        for n in live:  # warm-up: compile shapes for small and large batches
            await load(s, by[n], 8, 1, 8)
            await load(s, by[n], 64, 64, 16)
        for c in levels:
            for n in live:
                if el() > budget - 15:
                    break
                n_req = max(int(os.environ.get("SWEEP_MIN_N", "6")), int(os.environ.get("SWEEP_N_PER_C", "3")) * c)
                try:
                    r = await load(s, by[n], n_req, c, max_tokens)
                except Exception as e:
                    r = {"conc": c, "error": repr(e)[:300]}
                sweep[n].append(r)
                say(f"sweep {n} c={c}: {r.get('out_tok_per_s')} tok/s")
            with open(os.path.join(OUT_DIR, "sweep_partial.json"), "w") as f:
                json.dump(sweep, f)
        rep["sweep"] = sweep
        rep["server_info"] = {n: await server_info(s, by[n]) for n in live}
    finally:
        for srv in servers:
            srv.stop()
        rep["logs"] = {srv.name: srv.scan_log() for srv in servers}
        for n, lg in rep["logs"].items():
            say(f"log {n}: {lg['error_lines']} error lines; first={lg['first_errors'][:2]}")
    table = ratios(sweep)
    rep["ratios"] = table
    for line in table["lines"]:
        print(line, flush=True)


def ratios(sweep):
    def at(n, c):
        for r in sweep.get(n, []):
            if r.get("conc") == c and "out_tok_per_s" in r:
                return r["out_tok_per_s"]
        return None

    lines = ["conc | baseline | eagle3 | eagle3-dyn | eagle3-v2 | eagle3-v2-dyn | "
             "dyn/base | dyn/eagle3 | v2dyn/base | v2dyn/v2 | baseline-nooverlap"]
    rows = []
    for c in sorted({r["conc"] for v in sweep.values() for r in v}):
        b, e, d, e2, d2 = (at(n, c) for n in ["baseline", "eagle3", "eagle3-dyn", "eagle3-v2",
                                                "eagle3-v2-dyn"])
        q = lambda x, y: round(x / y, 3) if x and y else None
        row = {"conc": c, "baseline": b, "eagle3": e, "eagle3-dyn": d, "eagle3-v2": e2,
               "eagle3-v2-dyn": d2, "dyn_over_baseline": q(d, b), "dyn_over_eagle3": q(d, e),
               "v2dyn_over_baseline": q(d2, b), "v2dyn_over_v2": q(d2, e2),
               "baseline-nooverlap": at("baseline-nooverlap", c)}
        rows.append(row)
        lines.append(" | ".join(str(row[k]) for k in row))
    return {"rows": rows, "lines": lines}


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("phases", nargs="+", choices=["small", "big"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=520)
    a = ap.parse_args()
    global OUT_DIR
    OUT_DIR = a.out
    os.makedirs(LOGS, exist_ok=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as s:
        for ph in a.phases:
            rep = {"phase": ph, "threshold": THRESHOLD, "started_at_s": el()}
            try:
                await (phase_small if ph == "small" else phase_big)(s, rep, a.budget_s)
            except Exception as e:
                rep["fatal"] = repr(e)[:600]
                say("FATAL", rep["fatal"])
            rep["ended_at_s"] = el()
            with open(os.path.join(a.out, f"results_{ph}.json"), "w") as f:
                json.dump(rep, f, indent=1)
            say(f"phase {ph} done")


if __name__ == "__main__":
    asyncio.run(main())

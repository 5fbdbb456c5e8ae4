"""Device-side driver for dyn-disable on the reference shapes (runs on the H200 machines).

Usage (from the repo root, after gpu/run_dyn.sh setup has prepared /tmp/site and /tmp/models):
  python3 gpu/shapes_device.py PLAN.json --out DIR [--budget-s 520] [--skip-memory-check]

Before anything starts, gpu/plan_memory.py estimates the GPU memory of the servers a plan runs at
the same time; a plan that does not fit is refused with one line (exit status 3) unless
--skip-memory-check or SKIP_MEMORY_CHECK=1 is given.

A plan (gpu/plans/*.json) lists groups that run at the same time, each on its own GPUs:
  {"threshold": 8, "groups": [
     {"name": "check", "gpus": "0", "mode": "check", "tp": 1, "mem": 0.08,
      "servers": [{"profile": "baseline", "pair": "sharp", "backend": "triton"}, ...],
      "burst_cycles": 30, "stream_probe": true},
     {"name": "kimi-tp1", "gpus": "1", "mode": "sweep", "tp": 1, "mem": 0.85, "pair": "kimi",
      "backend": "triton", "profiles": ["baseline", "eagle3-v2", "eagle3-v2-dyn"],
      "levels": [1, 4, 16, 32, 64], "shapes": [[128, 160]], "n_per_c": 3, "min_n": 8}]}

check: the servers start side by side; each answers the 32-prompt equality schedule (outputs
  compared with the baseline of the same model pair and backend), each dyn server takes
  burst_cycles up/down crossings of its threshold (transitions counted as /server_info deltas over
  the burst phase, and the per-rank sequence of switch log lines compared across TP ranks), the
  logs are scanned for errors, and with stream_probe one streamed chat request per server records
  when each content chunk arrived.
  Options: "plain_equality" (32 prompts of one length sent at once to every server: on a dyn
  server with threshold 1 and hysteresis 0 every step after the first is plain, so its outputs
  show whether a plain step computes what a baseline decode step computes), "determinism" (the
  same prompt twice at c=1, then twice again with POST /flush_cache before each), "profile"
  (servers marked "profile": true get a torch profile of a few steps under load; the all-reduce
  kernels in it are counted by name; list the servers' labels under "torch_profile").
sweep: each level a fixed number of requests of exact input length (token ids) and output length
  (ignore_eos), c at a time as a closed loop; every record carries the backend, TP size, model
  architecture, threshold, profile and the server's env (summarize_shapes.py tells servers of one
  configuration by it), and how the loop ran: send_lag_ms_p50 / _max (how long after a completion
  the request it let in was sent: the client's own delay), last_wave_send_spread_ms (how far apart
  the last c requests were sent), and from c >= 32 on every request's send and done times
  (timeline_ms, ms from the round's start). summarize_shapes.py lists the rounds whose last wave
  came spread out. "side_by_side": true starts every profile's server at once (one after another up to
  its KV-cache allocation) and measures them in turns, level by level, for "rounds" rounds;
  otherwise one server at a time (start, warm up, measure, stop). Every sweep server runs with
  --disable-radix-cache unless the group says "radix_cache": true (Server.radix_cache_off says
  why: random ids gave the baseline alone spurious prefix hits). Each server is warmed up at
  every level and shape first (short outputs), so JIT compiles do not land in a measurement.
  The checks ("bursts", "torch_profile", ...) run after the rounds, or before them with
  "checks_first": true ("profile_after": true then takes the torch profiles again after the
  rounds; "profile_after_round": N takes them between round N and round N+1 instead, so the
  rounds before and after show what a profile leaves behind). "profile_concurrency" (default
  64, or a list: each server profiled at each) sets the load the profiles are taken under;
  "profile_prefill": {"prompt_tokens": 1024, ...} takes them with prefill steps in the window
  (profile_load.py's prefill mode; see profile_load_runs);
  "warmup_levels" (default: the levels) the levels warmed up before anything is measured, e.g.
  [1] so that a dyn server has never crossed its threshold when the first profile is taken.
  "start_after_healthy": NAME starts a group's servers once group NAME's are healthy (each sizes
  its KV pool from what is really free); "measure_after": NAME holds a sweep's warm-up and
  rounds until group NAME has finished (e.g. a check group on the same GPU).
  "smoke": true runs the toolkit's smoke (toolkit/check/smoke.py, as `invoke smoke` does) on every
  server with the checks, its burst sized for the server's threshold.
  "sleep_on_idle": true starts every server of the group with --sleep-on-idle: an idle 0.5.11
  scheduler busy-polls (one core at 100 %), which puts host noise into the measured server's
  host-bound steps (c=1 above all); auto_device.py's servers run with it for that reason.
  A profile entry may be an object: {"profile": "eagle3-v2", "label": "eagle3-v2-adaptive",
  "flags": [...], "env": {...}, "site_first": "/tmp/noisy"} (a stock profile with extra server
  flags, e.g. upstream's --speculative-adaptive, or on a changed sglang put first on the path).
  A server runs in its own folder (its launch script's), so a file of this checkout is named
  "{checkout}/gpu/plans/..." in a flag or env value.
Profiles: the product's (profiles/*.toml: baseline; eagle3, the v1 tree; eagle3-dyn; eagle3-v2;
eagle3-v2-dyn; eagle3-v2-dyn-native, plain steps as a non-speculative batch with
SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=defer, 0004, issue #34: a plan server sets write or skip in its
env) and the lab's (gpu/profiles/: eagle3-v2-dyn-full, eagle3-v2-dyn with
SGLANG_SPEC_DISABLE_DRAFT_KV_ONLY=0), launched through gpu/lab_launch.py as `invoke server start`
launches them, with the plan's settings as overrides. Config-only pairs (big, huge, kimi, kimideep, tinymla)
load with --load-format dummy; on them the speculative servers run SGLANG_SIMULATE_ACC_LEN
(default 2.6) so acceptance is that of a trained draft.
Writes DIR/shapes_<group>.json (updated as it goes), DIR/records.jsonl and server logs under
/tmp/dyn-logs (the wrapper tars them).
"""
import argparse
import asyncio
import functools
import json
import os
import random
import re
import subprocess
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dyn_device  # noqa: E402  (shared with the first rounds' driver)
import lab_launch  # noqa: E402
import plan_memory  # noqa: E402
import sim_accept  # noqa: E402
import summarize_shapes  # noqa: E402
from dyn_device import (  # noqa: E402
    ERROR_RE, HARMLESS, LOGS, MODELS, PROMPTS, compare, el, equality_schedule, generate, run_smoke,
    say, server_info, wait_health)

CONFIG_ONLY = {"big", "huge", "kimi", "kimideep", "tinymla"}
ARCH = {"kimi": "DeepseekV3ForCausalLM", "kimideep": "DeepseekV3ForCausalLM", "tinymla": "DeepseekV3ForCausalLM", "mlasharp": "DeepseekV3ForCausalLM"}


def target_config(pair):
    with open(f"{MODELS}/target-{pair}/config.json") as f:
        return json.load(f)


def arch_of(pair):
    """The target's architecture as its config.json names it (the `trained` pair is Llama or,
    with PAIR_ARCH=mla, DeepseekV3); the table above where the model is not on this machine."""
    try:
        return target_config(pair)["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return ARCH.get(pair, "LlamaForCausalLM")


SWITCH_RE = re.compile(r"^\[[^\]]*?(?: TP(\d+))?\] Dynamic speculation disable: drafting "
                       r"(stopped|resumed) at (\d+) running decode requests \((.*)\)")
RECORDS = None
BUDGET = 520.0
HEALTHY = {}  # group name -> asyncio.Event set once its (check) servers are healthy
DONE = {}  # group name -> asyncio.Event set once the group has finished


def left():
    return BUDGET - el()


DYN_SUFFIXES = ("-dyn", "-dyn-full", "-dyn-native")  # the dyn-disable profiles


@functools.lru_cache(maxsize=None)
def accept_draw():
    """How the site's simulated acceptance draws (gpu/sim_accept.py): "per-step" (SGLang's own: one
    length for every request of a step) or "per-request"; None without a site. Read once a run:
    run_dyn.sh sets it before any server starts."""
    return sim_accept.mode(sim_accept.SITE)


class Server(dyn_device.Server):
    """A server of a plan group (start/alive/stop are the first rounds' driver's own)."""

    def __init__(self, group, spec, index, threshold):  # noqa: D107 (no super().__init__: other ports, names)
        self.group = group
        self.profile = spec["profile"]
        self.pair = spec.get("pair", group.get("pair"))
        self.backend = spec.get("backend", group.get("backend", "triton"))
        self.tp = int(spec.get("tp", group.get("tp", 1)))
        threshold = spec.get("threshold", threshold)
        self.threshold = threshold if threshold == "auto" else int(threshold)
        self.label = spec.get("label", self.profile)
        self.name = f"{group['name']}-{self.label}-{self.pair}-{self.backend}"
        self.port = 30000 + 100 * group["index"] + 10 * index
        self.base = f"http://127.0.0.1:{self.port}"
        mem = spec.get("mem", group.get("mem", 0.8))
        kv = spec.get("kv_tokens", group.get("kv_tokens", 65536))
        max_running = group.get("max_running", 64)
        lab_flags = ["--nccl-port", str(self.port + 5000),
                     "--attention-backend", self.backend, "--sampling-backend", "pytorch",
                     "--grammar-backend", "none", "--disable-piecewise-cuda-graph", "--random-seed", "0"]
        # None: the profile's own (the dyn profiles pass --max-running-requests 4096, the others leave
        # sglang's default); a number comes after the profile's flags, and sglang keeps the last
        if max_running is not None:
            lab_flags += ["--max-running-requests", str(max_running), "--cuda-graph-max-bs", str(max_running)]
        lab_flags += ["--mem-fraction-static", str(mem)]
        if self.radix_cache_off(group):
            lab_flags += ["--disable-radix-cache"]
        if kv is not None:  # None: the KV cache sized from the memory fraction alone
            lab_flags += ["--max-total-tokens", str(kv)]
        lab_flags += ["--log-level", "info", "--decode-log-interval", "100", "--trust-remote-code"]
        if group.get("sleep_on_idle"):
            lab_flags += ["--sleep-on-idle"]
        if self.pair in CONFIG_ONLY:
            lab_flags += ["--load-format", "dummy"]
        env = {}
        if self.profile != "baseline" and self.pair in CONFIG_ONLY and group.get("simulate_acc", True):
            env["SGLANG_SIMULATE_ACC_LEN"] = str(group.get("acc_len", 2.6))
        env.update(spec.get("env", {}))
        # the plan's threshold and hysteresis are the profile's own options, not raw environment
        hysteresis = env.pop("SGLANG_SPEC_DISABLE_HYSTERESIS", None)
        self.flags = spec.get("flags", [])
        env["CUDA_VISIBLE_DEVICES"] = spec.get("gpus", group["gpus"])
        env["PYTHONPATH"] = dyn_device.site_path(spec.get("site_first"))  # e.g. /tmp/noisy first
        self.plan = lab_launch.plan(
            self.profile, model=f"{MODELS}/target-{self.pair}", draft=f"{MODELS}/draft-{self.pair}",
            port=self.port, tp=self.tp, flags=lab_flags + list(self.flags), env=env,
            threshold=self.threshold, hysteresis=hysteresis)
        self.env_shown = {k: v for k, v in self.plan.env.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
        if spec.get("site_first"):
            self.env_shown["PYTHONPATH_FIRST"] = spec["site_first"]
        self.log_path = f"{LOGS}/{self.name}.log"
        self.proc = None
        # set once a torch profile has been asked of this server: in round eight two identical
        # servers differed by 26-28 % at c=1, the profiled one the slower (docs/evidence/dyn-disable-8)
        self.profiled = False

    @staticmethod
    def radix_cache_off(group):
        """Sweeps send random token ids: a prompt shares no text with another, but one in ~1000
        starts with the same id as a cached one. SGLang keys a plain server's radix cache by token
        and an EAGLE server's by token pair, so only the baseline counted those 1-3 token hits, and
        a prefill batch holding any cached prefix runs DeepseekV2's absorbed-MLA path instead of
        MHA (507 against 402 ms per 8192-token batch on the 16-layer Kimi shape, 2026-12-02:
        docs/evidence/kimi16-prefill-and-cap/). With the cache off both prefill alike, as they do
        on this workload where nothing is shared. A group can keep it with "radix_cache": true."""
        return group.get("mode") == "sweep" and not group.get("radix_cache", False)

    def meta(self):
        dyn = self.plan.dyn_threshold is not None
        return {"profile": self.profile, "label": self.label, "pair": self.pair, "arch": arch_of(self.pair),
                "attention_backend": self.backend, "tp_size": self.tp,
                "threshold": self.threshold if dyn else None,
                "draft_kv_only": (not self.profile.endswith("-full")) if dyn and "v2" in self.profile else None,
                "plain_path": self.env_shown.get("SGLANG_SPEC_DISABLE_PLAIN_PATH", "step") if dyn else None,
                "plain_draft_kv": self.env_shown.get("SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV", "write") if dyn else None,
                "simulated_accept_len": self.env_shown.get("SGLANG_SIMULATE_ACC_LEN"),
                "simulated_accept_draw": (accept_draw() if self.env_shown.get("SGLANG_SIMULATE_ACC_LEN")
                                          else None),
                "sglang": os.environ.get("SGLANG_RELEASE", "0.5.11"), "extra_flags": list(self.flags),
                "sleep_on_idle": bool(self.group.get("sleep_on_idle")),
                "profiled_before": self.profiled, "radix_cache": not self.radix_cache_off(self.group),
                "env": dict(sorted(self.env_shown.items()))}

    def describe(self):
        return f"{self.name} port {self.port} gpus {self.group['gpus']}"

    def log_lines(self):
        return self.read_log().splitlines()

    def scan_log(self):
        lines = self.log_lines()
        errors = [l for l in lines if ERROR_RE.search(l) and not HARMLESS.search(l)]
        return {"lines": len(lines), "error_lines": len(errors), "first_errors": errors[:8],
                "dyn_lines": [l for l in lines if "Dynamic speculation disable" in l
                              and "drafting" not in l][:8],
                "graph_lines": [l for l in lines if "Capture cuda graph end" in l
                                or "Capture draft" in l][:6],
                "kv_lines": [l for l in lines if "KV Cache is allocated" in l][:2],
                "sm120_lines": [l for l in lines if "sm120: " in l][:8]}

    def switch_sequences(self):
        """Per TP rank: the switch log lines (kind, running requests, counters) in order."""
        ranks = {}
        for line in self.log_lines():
            m = SWITCH_RE.match(line)
            if m:
                ranks.setdefault(int(m.group(1) or 0), []).append(m.group(2, 3, 4))
        return ranks


def record(rec):
    with open(RECORDS, "a") as f:
        f.write(json.dumps(rec) + "\n")


def save(out, group, rep):
    with open(os.path.join(out, f"shapes_{group['name']}.json"), "w") as f:
        json.dump(rep, f, indent=1)


async def start_servers(servers, wait_kv, stagger_s):
    """Start servers one after another; with wait_kv the next starts once the previous one has
    allocated its KV cache (SGLang sizes its pools from free memory read around its own weight
    load, so concurrent loads would misjudge it)."""
    for srv in servers:
        srv.start()
        t0 = time.time()
        while wait_kv and srv.alive() and time.time() - t0 < 240:
            text = open(srv.log_path, errors="replace").read()
            if "KV Cache is allocated" in text or "max_total_num_tokens" in text:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(stagger_s)


async def wait_up(s, servers, timeout):
    res = await asyncio.gather(*(wait_health(s, srv, timeout) for srv in servers))
    for srv, w in zip(servers, res):
        say(f"{srv.name}: " + (f"healthy after {w} s" if w is not None else f"NOT healthy (alive={srv.alive()})"))
    return {srv.name: w for srv, w in zip(servers, res)}


async def gen_ids(s, srv, ids, max_tokens):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens,
                                                  "ignore_eos": True}}
    t0 = time.time()
    async with s.post(srv.base + "/generate", json=body) as r:
        j = await r.json()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {str(j)[:200]}")
    meta = j["meta_info"]
    return meta["completion_tokens"], time.time() - t0, meta.get("spec_verify_ct")


TIMELINE_MIN_C = 32  # levels whose records keep every request's send and done times


def timeline_summary(sends, dones, c):
    """What a closed loop of c requests tells apart from a round's send and done times (seconds
    from its start): send_lag_ms, how long after a completion the request it let in was sent
    (the client's own delay: the k-th send follows the (k-c)-th completion), and
    last_wave_send_spread_ms, how far apart the last c requests were sent (a late part of the last
    wave decodes alone at the end of the round)."""
    sends, dones = sorted(sends), sorted(dones)
    lags = [1000 * (sends[k] - dones[k - c]) for k in range(c, len(sends))]
    out = {"last_wave_send_spread_ms": round(1000 * (sends[-1] - sends[-min(c, len(sends))]), 1)}
    if lags:
        lags.sort()
        out.update(send_lag_ms_p50=round(lags[len(lags) // 2], 1), send_lag_ms_max=round(lags[-1], 1))
    return out


def acceptance_summary(toks, verify, wall, c):
    """What the level's requests accepted, from /generate's per-request spec_verify_ct (a speculative
    server's verify steps; plain steps count none): accept_len, the tokens per verify step over the
    requests that speculated; at c=1 also ms_per_verify_step, the round's wall time per verify step of
    a server that speculated in every step, which sets servers side by side apart from the draws of a
    simulated acceptance (SGLANG_SIMULATE_ACC_LEN draws each step's length, so a short c=1 round's
    tokens vary by a few per cent with the draws alone). Empty for a server without speculation."""
    steps = sum(v for v in verify if v)
    if not steps:
        return {}
    spec_tokens = sum(k for k, v in zip(toks, verify) if v)
    out = {"spec_verify_steps": steps, "accept_len": round(spec_tokens / steps, 3)}
    if c == 1 and all(verify):
        out["ms_per_verify_step"] = round(1000 * wall / steps, 3)
    return out


async def level(s, srv, c, n, in_len, out_len, seed):
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(10, 1000) for _ in range(in_len)] for _ in range(n)]
    sem = asyncio.Semaphore(c)
    toks, lat, sends, dones, verify = [], [], [], [], []

    async def one(ids):
        async with sem:
            sends.append(time.time() - t0)
            try:
                k, dt, v = await gen_ids(s, srv, ids, out_len)
            except aiohttp.ServerDisconnectedError:  # a reused keep-alive connection the server closed
                k, dt, v = await gen_ids(s, srv, ids, out_len)
            dones.append(time.time() - t0)
            toks.append(k)
            lat.append(dt)
            verify.append(v)

    t0 = time.time()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.time() - t0
    out_tps = sum(toks) / wall
    r = {"conc": c, "requests": n, "input_len": in_len, "output_len": out_len,
         "out_tokens": sum(toks), "wall_s": round(wall, 3), "out_tok_per_s": round(out_tps, 1),
         "mean_latency_s": round(sum(lat) / len(lat), 3),
         # a step serves min(c, n) requests: its time is about c / (tok/s) once all run
         "approx_step_ms": round(1000 * min(c, n) / out_tps, 2)}
    r.update(timeline_summary(sends, dones, c))
    r.update(acceptance_summary(toks, verify, wall, c))
    if c >= TIMELINE_MIN_C:
        r["timeline_ms"] = {"send": [round(1000 * t) for t in sorted(sends)],
                            "done": [round(1000 * t) for t in sorted(dones)]}
    return r


profile_spec = plan_memory.profile_spec


async def warm_up(s, srv, group):
    await level(s, srv, 1, 2, 64, 8, 1)
    for in_len, _ in group.get("shapes", [[128, 160]]):
        for c in group.get("warmup_levels", group["levels"]):
            await level(s, srv, c, c, in_len, 16, 7 + c)


async def measure(s, srv, group, out, rep, c, in_len, out_len, round_no):
    n = max(group.get("min_n", 8), group.get("n_per_c", 3) * c)
    try:
        r = await level(s, srv, c, n, in_len, out_len, 1000 * round_no + c)
    except Exception as e:
        r = {"conc": c, "input_len": in_len, "output_len": out_len, "error": repr(e)[:300]}
    r.update(srv.meta(), group=group["name"], gpus=group["gpus"], round=round_no, t=el())
    record(r)
    rep["runs"].append(r)
    say(f"{srv.name} r{round_no} in{in_len}/out{out_len} c={c}: {r.get('out_tok_per_s')} tok/s "
        f"(step ~{r.get('approx_step_ms')} ms)")
    save(out, group, rep)


async def sweep_side_by_side(s, group, out, threshold):
    rep = {"group": group["name"], "mode": "sweep", "side_by_side": True, "runs": [], "logs": {}}
    servers = [Server(group, profile_spec(p), k, threshold) for k, p in enumerate(group["profiles"])]
    try:
        await start_servers(servers, group.get("wait_kv", True), group.get("stagger_s", 1))
        rep["health_s"] = await wait_up(s, servers, min(360, left() - 30))
        live = [srv for srv in servers if rep["health_s"][srv.name] is not None]
        if group.get("measure_after"):  # another group on the same GPU: measure once it is done
            await DONE[group["measure_after"]].wait()
        for srv in live:
            await warm_up(s, srv, group)
        say(f"{group['name']}: warmed up ({left():.0f} s left)")
        if group.get("checks_first"):  # e.g. torch profiles that must not be cut by the budget
            await run_checks(s, group, out, rep, live)
        for round_no in range(1, group.get("rounds", 1) + 1):
            for in_len, out_len in group.get("shapes", [[128, 160]]):
                for c in group["levels"]:
                    order = live if round_no % 2 else list(reversed(live))
                    for srv in order:
                        if left() < group.get("stop_left_s", 20):
                            break
                        await measure(s, srv, group, out, rep, c, in_len, out_len, round_no)
            if round_no == group.get("profile_after_round"):  # e.g. an A/A pair, one profiled
                await run_profiles(group, out, rep, live, tag=f"after-round-{round_no}")
        rep["server_info"] = {srv.name: await server_info(s, srv) for srv in live}
        if not group.get("checks_first"):
            await run_checks(s, group, out, rep, live)
        elif group.get("profile_after"):  # the same torch profiles again, after the rounds
            await run_profiles(group, out, rep, live, tag="after")
    finally:
        for srv in servers:
            srv.stop()
            rep["logs"][srv.name] = srv.scan_log()
            rep.setdefault("switch_sequences", {})[srv.name] = {
                r: len(v) for r, v in srv.switch_sequences().items()}
    rep["table"] = summarize_shapes.tables(rep["runs"])   # medians, spreads, ratios (markdown)
    print(rep["table"], flush=True)
    save(out, group, rep)
    return rep


async def run_profiles(group, out, rep, live, tag=""):
    """Torch profiles of the servers labelled under "torch_profile", at "profile_concurrency"
    requests (default 64; a list profiles each server at each, keyed NAME@cC), in the prefill mode
    with "profile_prefill"; a tag ("after") keeps a second set apart from the first."""
    key = f"profiles_{tag}" if tag else "profiles"
    levels = group.get("profile_concurrency", 64)
    levels = levels if isinstance(levels, list) else [levels]
    for c in levels:  # every server at one load before the next load: a cut budget cuts a load, not a server
        for srv in live:
            if srv.label in group.get("torch_profile", []) and left() > 45:
                name = srv.name if len(levels) == 1 else f"{srv.name}@c{c}"
                rep.setdefault(key, {})[name] = await asyncio.to_thread(
                    profile_allreduce, srv, c, tag, group.get("profile_prefill"))
                say(f"profile {name} {tag}: {rep[key][name]}")
                save(out, group, rep)


async def run_checks(s, group, out, rep, live):
    """On running servers (a check group's, or a sweep's after its levels): bursts across the
    threshold for dyn servers, torch profiles, determinism, a stream probe (group keys "bursts",
    "torch_profile": [labels], "determinism", "stream_probe")."""
    if group.get("bursts"):
        rep["bursts"] = {}
        for srv in live:
            if "-dyn" in srv.profile and left() > 40:
                b = await burst_phase(s, srv, group.get("burst_cycles", 28), group.get("burst_width", 12))
                rep["bursts"][srv.name] = b
                say(f"bursts {srv.name}: {b['requests']} requests, {b['transitions']} transitions "
                    f"({b['delta']}), err={b['error']}, ranks {b['ranks']} lines "
                    f"{b['switch_lines_per_rank']} agree={b['ranks_agree']}")
                save(out, group, rep)
    if not group.get("profile_after_round"):
        await run_profiles(group, out, rep, live)
    if group.get("smoke"):
        rep["smoke"] = {}
        for srv in live:
            if left() < 40:
                break
            rep["smoke"][srv.name] = await run_smoke(srv)
            for c in rep["smoke"][srv.name]["checks"]:
                say(f"smoke {srv.name}: {c['check']:12s} {c['status']:7s} {c['detail'][:240]}")
            save(out, group, rep)
    if group.get("determinism"):
        rep["determinism"] = {}
        for srv in live:
            if left() > 20:
                rep["determinism"][srv.name] = await determinism(s, srv)
                say(f"determinism {srv.name}: {rep['determinism'][srv.name]}")
    if group.get("stream_probe"):
        rep["stream"] = {}
        for srv in live:
            if left() < 10:
                break
            try:
                rep["stream"][srv.name] = await stream_probe(s, srv)
            except Exception as e:
                rep["stream"][srv.name] = {"error": repr(e)[:300]}
            say(f"stream {srv.name}: {rep['stream'][srv.name]}")
    save(out, group, rep)


async def sweep_group(s, group, out, threshold):
    if group.get("side_by_side"):
        return await sweep_side_by_side(s, group, out, threshold)
    rep = {"group": group["name"], "mode": "sweep", "runs": [], "logs": {}}
    profiles = group["profiles"]
    for k, profile in enumerate(profiles):
        if left() < group.get("min_left_s", 90):
            rep.setdefault("skipped", []).append(profile)
            say(f"{group['name']}: skip {profile} ({left():.0f} s left)")
            continue
        srv = Server(group, profile_spec(profile), k, threshold)
        srv.start()
        try:
            up = await wait_health(s, srv, min(300, left() - 20))
            say(f"{srv.name}: healthy after {up} s")
            if up is None:
                rep["runs"].append(dict(srv.meta(), error="not healthy"))
                continue
            await warm_up(s, srv, group)
            for in_len, out_len in group.get("shapes", [[128, 160]]):
                for c in group["levels"]:
                    if left() < 25:
                        break
                    await measure(s, srv, group, out, rep, c, in_len, out_len, 1)
            rep.setdefault("server_info", {})[profile] = await server_info(s, srv)
        finally:
            srv.stop()
            rep["logs"][profile] = srv.scan_log()
            save(out, group, rep)
    rep["table"] = summarize_shapes.tables(rep["runs"])   # medians, spreads, ratios (markdown)
    print(rep["table"], flush=True)
    save(out, group, rep)
    return rep


async def burst_phase(s, srv, cycles, width):
    before = await server_info(s, srv)
    t0 = time.time()
    err, n = None, 0
    try:
        for c in range(cycles):
            if left() < 20:
                err = f"budget: stopped after {c} cycles"
                break
            idx = [(c * width + k) % 32 for k in range(width)]
            await asyncio.gather(*(generate(s, srv, PROMPTS[i], 12 + (i % 5)) for i in idx))
            await generate(s, srv, PROMPTS[c % 32], 8)
            n += width + 1
    except Exception as e:
        err = repr(e)[:400]
    after = await server_info(s, srv)
    d0 = (before or {}).get("dyn_spec_disable") or {}
    d1 = (after or {}).get("dyn_spec_disable") or {}
    delta = {k: d1.get(k, 0) - d0.get(k, 0) for k in ("switches_off", "switches_on", "spec_steps",
                                                        "plain_steps", "forced_spec_steps")}
    seqs = srv.switch_sequences()
    return {"cycles": cycles, "width": width, "requests": n, "error": err,
            "wall_s": round(time.time() - t0, 1), "delta": delta,
            "transitions": delta["switches_off"] + delta["switches_on"],
            "ranks": sorted(seqs), "switch_lines_per_rank": {r: len(v) for r, v in seqs.items()},
            "ranks_agree": len({json.dumps(v) for v in seqs.values()}) <= 1,
            "last_switch_per_rank": {r: v[-1] if v else None for r, v in seqs.items()},
            "alive_after": srv.alive(), "server_info_after": after}


async def stream_probe(s, srv, max_tokens=48):
    """One streamed chat request: when each content chunk arrived and how much text it held."""
    body = {"model": "x", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPTS[3]}], "ignore_eos": True}
    t0 = time.time()
    chunks = []
    async with s.post(srv.base + "/v1/chat/completions", json=body) as r:
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            try:
                delta = json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
            except Exception:
                continue
            if delta:
                chunks.append((round(time.time() - t0, 4), len(delta), delta[:24]))
    span = chunks[-1][0] - chunks[0][0] if len(chunks) > 1 else 0.0
    return {"content_chunks": len(chunks), "first_s": chunks[0][0] if chunks else None,
            "span_s": round(span, 4), "chars": sum(c[1] for c in chunks), "head": chunks[:6]}


async def plain_equality(s, live):
    """32 prompts of one output length, sent at once to every server; outputs compared with the
    baseline of the same pair and backend."""
    outs = {}
    for srv in live:
        if left() < 40:
            break
        rs = await asyncio.gather(*(generate(s, srv, PROMPTS[i], 24) for i in range(32)))
        outs[srv.name] = [r["output_ids"] for r in rs]
    res = {}
    for srv in live:
        ref = next((r for r in live if r.profile == "baseline" and r.pair == srv.pair
                    and r.backend == srv.backend and r.name in outs), None)
        if ref is not None and srv.name in outs and ref is not srv:
            res[srv.name] = compare(outs[ref.name], outs[srv.name])
            say(f"plain equality {srv.name}: {res[srv.name]['match']}/32 vs {ref.name}")
    return res


async def flush(s, srv):
    async with s.post(srv.base + "/flush_cache") as r:
        return r.status


async def determinism(s, srv):
    """The same prompt twice at temperature 0 (the second hits the prefix cache), then twice
    with the cache flushed before each (both compute the same full prefill)."""
    prompt = PROMPTS[5]
    try:
        a = (await generate(s, srv, prompt, 48))["output_ids"]
        b = (await generate(s, srv, prompt, 48))["output_ids"]
        await flush(s, srv)
        c = (await generate(s, srv, prompt, 48))["output_ids"]
        await flush(s, srv)
        d = (await generate(s, srv, prompt, 48))["output_ids"]
    except Exception as e:
        return {"error": repr(e)[:300]}

    def first_diff(x, y):
        return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None if x == y else min(len(x), len(y)))

    return {"cached_second_equal": a == b, "cached_first_diff": first_diff(a, b),
            "flushed_equal": c == d, "flushed_first_diff": first_diff(c, d),
            "flushed_vs_first_equal": a == c}


def target_context(srv, default):
    return target_config(srv.pair).get("max_position_embeddings", default)


def profile_answer_tokens(srv, concurrency):
    """How long the profiled requests' answers are. At low load the steps are short, so longer
    answers keep the load up until the profiled steps have run; never longer than the target's
    context leaves after a prompt (the tiny pairs have 4,096 positions: a 6,000-token answer
    is refused with 400 and no trace is taken). SGLang admits a request only while the KV pool can
    hold its whole answer, so a group's kv_tokens caps the traced batch: with 32768 tokens and
    900-token answers the c=64 profiles ran 35-36 requests, 28 waiting (plain-at-baseline section 8);
    shorter answers would end before the profiled steps on a 5 ms step."""
    wanted = 900 if concurrency >= 16 else 6000
    return max(64, min(wanted, target_context(srv, wanted + 1024) - 1024))


def profile_load_runs(srv, concurrency, prefill=None):
    """profile_load.py's runs for one profile: (trace folder kind, arguments). Decode mode: first
    without Python stacks (the host at nearly full speed: step timing), then with them (which
    SGLang function issued what), both after every prefill is done (settle 2 s). Prefill mode
    ("profile_prefill": {"prompt_tokens": 1024, "max_tokens": 128, "rounds": 3, "steps": ..., "stack":
    false}): prompts of that many token ids in a closed loop, profiled from the second wave's
    arrival (profile_load.py --prompt-tokens); without stacks only unless "stack": true (a window
    of prefill chunks with stacks runs the host several times slower). Steps default to the
    answer's length plus 32: the second wave's prefill chunks, its decode, and the third wave's
    first chunks (a server that queues part of a wave, as a speculative one capped at 48 running
    requests does at c=96, may have prefilled the queued part before the profile started)."""
    if not prefill:
        load = ["--max-tokens", str(profile_answer_tokens(srv, concurrency)), "--settle", "2", "--steps", "10"]
        return [("nostack", load + ["--no-stack"]), ("stack", load)]
    tokens = prefill.get("prompt_tokens", 1024)
    answer = max(1, min(prefill.get("max_tokens", 128), target_context(srv, tokens + 128) - tokens))
    load = ["--prompt-tokens", str(tokens), "--max-tokens", str(answer), "--rounds", str(prefill.get("rounds", 3)),
            "--steps", str(prefill.get("steps", answer + 32))]
    return [("prefill/nostack", load + ["--no-stack"])] + ([("prefill/stack", load)] if prefill.get("stack") else [])


def profile_allreduce(srv, concurrency=64, tag="", prefill=None):
    """A torch profile of a few steps under load (decode steps, or with `prefill` prefill steps
    among them: profile_load_runs); all-reduce kernels counted by name. Traces go to
    traces/NAME/[TAG/][cC/][prefill/]{nostack,stack}/ (cC unless C is the default 64)."""
    import collections
    import glob
    import gzip

    outdir = f"{LOGS}/traces/{srv.name}" + (f"/{tag}" if tag else "") + (
        f"/c{concurrency}" if concurrency != 64 else "")
    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profile_load.py")
    srv.profiled = True   # even if no trace comes back, /start_profile may have run
    runs = profile_load_runs(srv, concurrency, prefill)
    for kind, load in runs:
        done = subprocess.run([sys.executable, driver, srv.base, f"{outdir}/{kind}", "--concurrency", str(concurrency),
                               "--timeout", "60"] + load, capture_output=True, text=True, timeout=120)
    traces = sorted(p for kind, _ in runs for p in glob.glob(f"{outdir}/{kind}/*.json*"))
    counts = collections.Counter()
    pat = re.compile(r"all_?reduce|allreduce|two_shot|one_shot|multimem|cross_device|AllReduce", re.I)
    for path in traces:
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rt") as f:
                events = json.load(f).get("traceEvents", [])
        except Exception:
            continue
        for ev in events:
            if ev.get("cat") == "kernel" and pat.search(ev.get("name", "")):
                counts[ev["name"][:90]] += 1
    return {"mode": "prefill" if prefill else "decode", "traces": len(traces),
            "allreduce_kernels": dict(counts.most_common(8)),
            "driver_rc": done.returncode, "driver_tail": done.stdout[-300:] + done.stderr[-300:]}


async def check_group(s, group, out, threshold):
    rep = {"group": group["name"], "mode": "check"}
    servers = [Server(group, spec, k, threshold) for k, spec in enumerate(group["servers"])]
    try:
        await start_servers(servers, group.get("wait_kv", False), group.get("stagger_s", 2))
        rep["health_s"] = await wait_up(s, servers, min(300, left() - 60))
        HEALTHY[group["name"]].set()
        live = [srv for srv in servers if rep["health_s"][srv.name] is not None]
        outs = {}
        for srv in live:
            if left() < 60:
                break
            try:
                outs[srv.name] = await equality_schedule(s, srv)
            except Exception as e:
                rep.setdefault("failures", {})[f"equality/{srv.name}"] = repr(e)[:400]
        eq = {}
        for srv in live:
            if srv.name not in outs:
                continue
            ref = next((r for r in live if r.profile == "baseline" and r.pair == srv.pair
                        and r.backend == srv.backend and r.name in outs), None)
            stock = next((r for r in live if r.profile == ("eagle3-v2" if "v2" in srv.profile else "eagle3")
                          and r.pair == srv.pair and r.backend == srv.backend and r.name in outs), None)
            eq[srv.name] = {"vs_baseline": compare(outs[ref.name], outs[srv.name]) if ref else None,
                            "vs_stock": compare(outs[stock.name], outs[srv.name]) if stock else None}
            say(f"equality {srv.name}: baseline {eq[srv.name]['vs_baseline'] and eq[srv.name]['vs_baseline']['match']}"
                f"/32, stock {eq[srv.name]['vs_stock'] and eq[srv.name]['vs_stock']['match']}/32")
        rep["equality"] = eq
        save(out, group, rep)
        if group.get("plain_equality"):
            rep["plain_equality"] = await plain_equality(s, live)
        await run_checks(s, dict(group, bursts=group.get("bursts", True)), out, rep, live)
        rep["server_info"] = {srv.name: await server_info(s, srv) for srv in live}
    finally:
        for srv in servers:
            srv.stop()
        rep["logs"] = {srv.name: srv.scan_log() for srv in servers}
        rep["meta"] = {srv.name: srv.meta() for srv in servers}
        for name, lg in rep["logs"].items():
            say(f"log {name}: {lg['error_lines']} error lines; first={lg['first_errors'][:2]}; "
                f"dyn={lg['dyn_lines'][:3]}")
        save(out, group, rep)
    return rep


def memory_refusal(plan, skip=False):
    """The one-line refusal of a plan whose servers do not fit the GPU memory (gpu/plan_memory.py),
    or None; the model folders the device holds (else the KIMI_*/HUGE_* knobs) give the shapes."""
    if skip or os.environ.get("SKIP_MEMORY_CHECK") == "1":
        return None
    shapes = plan_memory.shapes_for(plan_memory.plan_pairs(plan), os.environ, MODELS)
    return plan_memory.refusal(plan, shapes)


async def main():
    global RECORDS, BUDGET
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=520)
    ap.add_argument("--skip-memory-check", action="store_true",
                    help="start the plan even if gpu/plan_memory.py estimates it does not fit (also SKIP_MEMORY_CHECK=1)")
    a = ap.parse_args()
    BUDGET = a.budget_s
    plan = json.load(open(a.plan))
    refused = memory_refusal(plan, a.skip_memory_check)
    if refused:
        say(refused)
        sys.exit(3)
    os.makedirs(LOGS, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    RECORDS = os.path.join(a.out, "records.jsonl")
    threshold = int(plan.get("threshold", 8))
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as s:
        DONE.update({g["name"]: asyncio.Event() for g in plan["groups"]})
        HEALTHY.update({g["name"]: asyncio.Event() for g in plan["groups"]})

        async def run(group):
            try:
                if group.get("after"):  # another group's GPUs: wait until it has finished
                    await DONE[group["after"]].wait()
                if group.get("start_after_healthy"):
                    # servers sharing a GPU start after the others have taken their memory, so
                    # each sizes its KV pool from what is really free
                    other = group["start_after_healthy"]
                    await asyncio.wait([asyncio.ensure_future(HEALTHY[other].wait()),
                                        asyncio.ensure_future(DONE[other].wait())],
                                       return_when=asyncio.FIRST_COMPLETED)
                body = check_group if group["mode"] == "check" else sweep_group
                return await body(s, group, a.out, threshold)
            finally:
                HEALTHY[group["name"]].set()
                DONE[group["name"]].set()

        for i, group in enumerate(plan["groups"]):
            group["index"] = i
            tasks.append(run(group))
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for group, res in zip(plan["groups"], results):
        if isinstance(res, Exception):
            say(f"group {group['name']} FAILED: {res!r}")
    say("all groups done")


if __name__ == "__main__":
    asyncio.run(main())

"""The first-crossing stall (issue #25 part 1) on a Kimi-shape target, before and after the fix.

Usage (from the repo root, after gpu/run_firstcross.sh has built /tmp/site-r8 and the models):
  python3 gpu/firstcross_device.py --out DIR [--budget-s 200] [--threshold 12] [--crossings 10]

Five servers side by side on one GPU (shapes_device.Server: the profiles' flags, pair "kimi",
--load-format dummy, SGLANG_SIMULATE_ACC_LEN), decode log every step:
  stock  eagle3-v2 on the pristine sglang (/tmp/stock first on the path): the reference
  old-a  eagle3-v2-dyn on the dyn-disable patch before the fix (/tmp/site-r8 first)
  old-b  the same, for the smoke
  new-a  eagle3-v2-dyn on the current patch (/tmp/site)
  new-b  the same, for the smoke
(--dyn-profile gives old-*/new-* another profile, --old-patch / --new-patch the names their records
carry; run_firstcross.sh's FC_OLD picks the old patch stack.)
Each server has its own, empty, triton and tvm-ffi (sglang.jit_kernel) caches, as on a host
that never ran SGLang: otherwise the first server to compile a kernel would hide the
compile from the others (the fixed servers compile clamp_position at start). FlashInfer's JIT
cache stays shared (its ninja files hold absolute paths, a copy would rebuild); its entries are
listed too.
Once every server is healthy, at the same time:
- stock, old-a, new-a: crossings 1..N (accept_device's crossing: streamed requests spanning it,
  a burst of 48 streamed requests with 1024-token prompts and 64-token answers; drafting resumes
  once it has drained, seen by the spanning requests, or by 3 fresh c=1 streamed requests with
  accept_device before its round two: make_plan); per crossing and resume the longest inter-chunk gap
  (accept_analysis.stall_gaps); the JIT caches' files new since healthy (after crossing 1 and
  at the end) and the log lines after healthy;
- old-b, new-b: the toolkit's smoke right away (its burst is the server's first crossing).
Writes DIR/firstcross.json (also after a budget cut), DIR/records.jsonl (one line per request)
and DIR/firstcross_logs_scan.json; server logs under /tmp/dyn-logs.
"""
import argparse
import asyncio
import json
import os
import random
import re
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accept_analysis as an  # noqa: E402
import accept_device as ad  # noqa: E402

# label -> (profile, sglang put first on the path, patch)
SERVERS = {
    "stock": ("eagle3-v2", "/tmp/stock", "stock"),
    "old-a": ("eagle3-v2-dyn", "/tmp/site-r8", "before-fix"),
    "old-b": ("eagle3-v2-dyn", "/tmp/site-r8", "before-fix"),
    "new-a": ("eagle3-v2-dyn", None, "after-fix"),
    "new-b": ("eagle3-v2-dyn", None, "after-fix"),
}
JIT_ROOT = "/tmp/fc-jit"
GROUP_INDEX = 5  # ports 30500.. (the accept run's are 30000..)
# negative where another process on the GPU freed memory during the start (side-by-side servers)
MEMORY_RE = re.compile(r"extra GPU memory (-?[\d.]+) GiB")
STARTUP_PREFIX = "Dynamic speculation disable"


def configure_servers(dyn_profile="eagle3-v2-dyn", old_patch="before-fix", new_patch="after-fix"):
    """The old-*/new-* servers' profile and patch names for this run (run_firstcross.sh's FC_PROFILE,
    FC_OLD): the same profile on both, the old patch stack from its fixture under /tmp/site-r8."""
    for label in SERVERS:
        if label.startswith("old-"):
            SERVERS[label] = (dyn_profile, "/tmp/site-r8", old_patch)
        elif label.startswith("new-"):
            SERVERS[label] = (dyn_profile, None, new_patch)


def patch_of(label):
    return SERVERS.get(label, (None, None, None))[2]


def is_smoke_server(label):
    return label.endswith("-b")


def jit_dirs(label, root=JIT_ROOT):
    """tag -> cache folder of one server (env var that points the server there, folder)."""
    return {"triton": ("TRITON_CACHE_DIR", f"{root}/{label}/triton"),
            "tvm-ffi": ("TVM_FFI_CACHE_DIR", f"{root}/{label}/tvm-ffi")}


def shared_jit_dirs():
    return {"flashinfer(shared)": os.path.expanduser("~/.cache/flashinfer")}


def jit_snapshot(srv):
    """Files in the server's JIT caches, as 'tag:relative/path'."""
    roots = {tag: path for tag, (_, path) in getattr(srv, "jit_dirs", {}).items()}
    roots.update(getattr(srv, "shared_jit_dirs", {}))
    names = []
    for tag, root in roots.items():
        if root and os.path.isdir(root):
            for d, _, files in os.walk(root):
                names += [f"{tag}:{os.path.relpath(os.path.join(d, f), root)}" for f in files]
    return sorted(names)


def jit_modules(entries):
    """The compiled units behind a list of cache files: the tvm-ffi build folder (the kernel's
    name and source hash), the triton kernel's .json/.cubin stem, flashinfer's op folder."""
    out = set()
    for e in entries:
        tag, _, rel = e.partition(":")
        parts = rel.split("/")
        if tag == "tvm-ffi":
            out.add(f"tvm-ffi:{parts[0]}")
        elif tag == "triton" and rel.endswith((".cubin", ".so")):
            out.add(f"triton:{os.path.splitext(parts[-1])[0]}")
        elif tag.startswith("flashinfer") and len(parts) > 1:
            out.add(f"{tag}:{'/'.join(parts[:-1])}")
    return sorted(out)


def startup_memory(lines):
    """(the dyn-disable start-up line that gives the 'extra GPU memory' figure, that figure in GiB),
    else (the first dyn-disable line, None), or (None, None)."""
    found = [l for l in lines if STARTUP_PREFIX in l]
    for line in found:
        m = MEMORY_RE.search(line)
        if m:
            return line.strip()[-400:], float(m.group(1))
    return (found[0].strip()[-400:], None) if found else (None, None)


def make_prompts(n, length, seed=0):
    """n prompts of `length` token ids, none sharing a prefix with another (no radix-cache hits
    that would make later crossings' prefills cheaper than the first's)."""
    rnd = random.Random(seed)
    return [[rnd.randrange(10, 30000) for _ in range(length)] for _ in range(n)]


def make_plan(threshold, crossings, burst, answer_tokens, span_tokens=None):
    """accept_device.Plan for this protocol: no c=1/c=4 phases, `burst` requests per crossing;
    the resume seen by the spanning requests (span_n of them, in accept_device since its round
    two) or by 3 fresh c=1 requests after the burst (before it). Both Plan versions take it."""
    import inspect
    params = inspect.signature(ad.Plan).parameters
    kw = dict(threshold=threshold, crossings=crossings, before_n=0, eq_n=0,
              burst_extra=burst - 2 * threshold, burst_tokens=answer_tokens,
              span_tokens=span_tokens or 3 * answer_tokens, span_lead=8,
              resume_n=3, resume_tokens=32, span_n=2, control_n=0)
    return ad.Plan(**{k: v for k, v in kw.items() if k in params})


def prompts_needed(plan):
    """Prompts for every request of the crossings (either Plan version), none used twice."""
    per = plan.burst + getattr(plan, "span_n", 1) + getattr(plan, "resume_n", 0)
    return plan.crossings * per + 8


def make_servers(labels, threshold, mem, pair="kimi", kv_tokens=65536, jit_root=JIT_ROOT):
    import shapes_device
    group = {"name": "fc", "index": GROUP_INDEX, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
             "mem": mem, "kv_tokens": kv_tokens, "max_running": 64}
    servers = []
    for k, label in enumerate(labels):
        profile, site_first, _ = SERVERS[label]
        dirs = jit_dirs(label, jit_root)
        spec = {"profile": profile, "label": label, "pair": pair,
                "env": {var: path for var, path in dirs.values()},
                "flags": ["--decode-log-interval", "1"]}
        if site_first:
            spec["site_first"] = site_first
        srv = shapes_device.Server(group, spec, k, threshold)
        srv.jit_dirs, srv.shared_jit_dirs = dirs, shared_jit_dirs()
        servers.append(srv)
    return servers


def log_after(srv, from_line, limit=40):
    lines = srv.read_log().splitlines()[from_line:]
    return [l for l in lines if not any(x in l for x in (
        "Decode batch", "Prefill batch", "POST /generate", "GET /health"))][:limit]


async def gap_protocol(run, live, raw, crossings, reserve_s):
    """Crossings 1..crossings on every live server at once (accept_device's crossing), stopping
    before the budget's reserve; JIT snapshots and log lines after crossing 1."""
    longest = 0.0
    for c in range(1, crossings + 1):
        if ad.left() - reserve_s < max(longest * 1.5, 5):
            ad.say(f"budget: stopping after {c - 1} crossings")
            break
        t = time.time()
        await run.phase(f"crossing {c}", lambda srv: run.crossing(srv, c), live)
        longest = max(longest, time.time() - t)
        if c == 1:
            for srv in live:
                raw[srv.label]["jit_after_first_crossing"] = jit_snapshot(srv)
                raw[srv.label]["log_after_first_crossing"] = log_after(srv, raw[srv.label]["from_line"])


async def smoke_one(srv, smoke_fn, results):
    t = time.time()
    try:
        results[srv.label] = await smoke_fn(srv)
    except Exception as e:  # a smoke that raises is a finding, not the end of the run
        results[srv.label] = {"ok": False, "error": repr(e)[:300]}
    results[srv.label]["seconds"] = round(time.time() - t, 1)
    ad.say(f"smoke {srv.label}: ok={results[srv.label].get('ok')}")


def smoke_table(results):
    """Per smoke server: every check's status, and the burst's stall figures."""
    table = {}
    for label, r in results.items():
        checks = {c["check"]: c["status"] for c in r.get("checks", [])}
        burst = next((c for c in r.get("checks", []) if c["check"] == "burst"), {})
        g = r.get("burst_gaps") or {}
        table[label] = {"patch": patch_of(label), "ok": r.get("ok"), "checks": checks,
                        "details": {c["check"]: c.get("detail") for c in r.get("checks", [])},
                        "burst_status": burst.get("status"), "burst_detail": burst.get("detail"),
                        "burst_longest_gap_ms": (round(1000 * g["longest_s"], 1)
                                                 if g.get("longest_s") is not None else None),
                        "burst_median_step_ms": (round(1000 * g["median_s"], 2)
                                                 if g.get("median_s") is not None else None),
                        "burst_bound_ms": (round(1000 * g["bound_s"], 1)
                                           if g.get("bound_s") is not None else None),
                        "burst_stalled": g.get("stalled"), "error": r.get("error")}
    return table


def summarize(run, raw, smoke, servers, tp=1):
    """firstcross.json from the records, windows, snapshots and logs."""
    by = {}
    for r in run.records:
        by.setdefault(r["server"], []).append(r)
    runs = []
    stock_healthy = set(raw["stock"]["jit_healthy"]) if "stock" in raw else None
    for srv in servers:
        if srv.label not in by:
            continue
        recs = by[srv.label]
        st = an.stall_summary(an.stall_gaps(recs, run.windows[srv.label]), tp=tp, server=srv.label,
                              median_step_ms=an.median_gap_ms([r for r in recs if r["phase"] in ("span", "resume")]))
        snap = raw.get(srv.label, {})
        healthy = snap.get("jit_healthy", [])
        new = an.new_entries(healthy, snap.get("jit_after_first_crossing", healthy))
        new_end = an.new_entries(healthy, snap.get("jit_end", healthy))
        runs.append({"patch": patch_of(srv.label), **st,
                     "jit_new_after_healthy": jit_modules(new),
                     "jit_new_after_healthy_files": new[:60],
                     "jit_new_by_end": jit_modules(new_end),
                     # what the server compiled before healthy that the stock one did not (the fix's warm-up)
                     "jit_at_healthy_beyond_stock": (jit_modules(sorted(set(healthy) - stock_healthy))
                                                     if stock_healthy is not None and srv.label != "stock" else None),
                     "log_after_healthy": snap.get("log_after_first_crossing"),
                     "errors": sum(1 for r in recs if r.get("error"))})
    startup = {}
    for srv in servers:
        line, gib = startup_memory(srv.read_log().splitlines())
        if line is not None:
            startup[srv.label] = {"patch": patch_of(srv.label), "extra_gpu_memory_gib": gib, "line": line}
    table = smoke_table(smoke)
    for label, row in table.items():
        snap = raw.get(label, {})
        row["jit_new_by_end"] = jit_modules(an.new_entries(snap.get("jit_healthy", []), snap.get("jit_end", [])))
    return {"runs": runs, "startup": startup, "smoke": table,
            "transitions": {srv.label: an.log_transitions(srv.read_log().splitlines()) for srv in servers},
            "threshold": run.plan.threshold, "burst": run.plan.burst,
            "note": ("gaps: client-side inter-chunk gaps of streamed /generate requests in each "
                     "crossing's window (burst) and resume's (after it); 'stock' (eagle3-v2) is the "
                     "reference; JIT caches per server, empty at start")}


def gpu_memory():
    """nvidia-smi's per-process GPU memory (text), or why not."""
    import subprocess
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        return [repr(e)[:200]]


def write_result(out, result):
    with open(os.path.join(out, "firstcross.json"), "w") as f:
        json.dump(result, f, indent=1)


async def measure(s, servers, prompts, plan, out, smoke_fn=None, reserve_s=20):
    """The gap protocol on the non-smoke servers and the smoke on the '-b' ones, at once;
    firstcross.json written to out (also when the budget cuts the protocol short)."""
    if smoke_fn is None:
        import dyn_device
        smoke_fn = dyn_device.run_smoke
    gap = [srv for srv in servers if not is_smoke_server(srv.label) and srv.alive()]
    smokers = [srv for srv in servers if is_smoke_server(srv.label) and srv.alive()]
    run = ad.Run(s, gap, prompts, plan, out)
    raw = {srv.label: {"jit_healthy": jit_snapshot(srv), "from_line": len(srv.read_log().splitlines())}
           for srv in servers}
    smoke = {}
    tasks = [smoke_one(srv, smoke_fn, smoke) for srv in smokers]
    tasks.append(gap_protocol(run, gap, raw, plan.crossings, reserve_s))
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=max(10, ad.left() - reserve_s / 2))
    except asyncio.TimeoutError:
        ad.say("budget: protocol cut short")
    for srv in servers:
        raw[srv.label]["jit_end"] = jit_snapshot(srv)
    # 1024 random ids per prompt would make the records most of the returned tgz
    with open(os.path.join(out, "records.jsonl"), "w") as f:
        for r in run.records:
            ids = r.get("prompt_ids") or []
            f.write(json.dumps(dict(r, prompt_ids=None, prompt_len=len(ids), prompt_head=ids[:4])) + "\n")
    result = summarize(run, raw, smoke, servers)
    write_result(out, result)
    return result


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--threshold", type=int, default=12)
    ap.add_argument("--crossings", type=int, default=10)
    ap.add_argument("--burst", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--models", default="/tmp/models")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--mem", type=float, default=0.8)
    ap.add_argument("--jit-root", default=JIT_ROOT)
    ap.add_argument("--logs", default="/tmp/dyn-logs")
    ap.add_argument("--dyn-profile", default="eagle3-v2-dyn",
                    help="the old-*/new-* servers' profile (eagle3-v2-dyn-native for the native plain path)")
    ap.add_argument("--old-patch", default="before-fix", help="the name the old-* servers' records carry")
    ap.add_argument("--new-patch", default="after-fix", help="the name the new-* servers' records carry")
    a = ap.parse_args()
    configure_servers(a.dyn_profile, a.old_patch, a.new_patch)
    import dyn_device
    import shapes_device
    ad.BUDGET = ad.el() + a.budget_s
    shapes_device.BUDGET = dyn_device.el() + a.budget_s
    shapes_device.MODELS = dyn_device.MODELS = a.models
    shapes_device.LOGS = dyn_device.LOGS = a.logs
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.logs, exist_ok=True)
    plan = make_plan(a.threshold, a.crossings, a.burst, a.answer_tokens)
    prompts = make_prompts(prompts_needed(plan), a.prompt_len)
    servers = make_servers(a.servers.split(","), a.threshold, a.mem, jit_root=a.jit_root)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as s:
        try:
            await shapes_device.start_servers(servers, False, 2)
            # cold JIT caches make the start long: wait while ~45 s remain for the smoke and a few crossings
            health = await shapes_device.wait_up(s, servers, max(10, ad.left() - 45))
            live = [srv for srv in servers if health.get(srv.name) is not None]
            memory = gpu_memory()
            result = await measure(s, live, prompts, plan, a.out)
            result.update(healthy_after_s={srv.label: health.get(srv.name) for srv in servers},
                          gpu_memory_after_healthy=memory, pids={srv.label: srv.proc.pid for srv in servers if srv.proc})
            write_result(a.out, result)
            for r in result["runs"]:
                ad.say("stall", r["server"], r["patch"], json.dumps({k: r[k] for k in (
                    "first_crossing_max_gap_ms", "later_crossings_max_gap_ms_median",
                    "first_resume_max_gap_ms", "later_resumes_max_gap_ms_median", "median_step_ms",
                    "crossings", "goal_met")}))
                ad.say("  jit new after healthy:", r["jit_new_after_healthy"][:12])
            ad.say("start-up memory:", json.dumps({k: v["extra_gpu_memory_gib"] for k, v in result["startup"].items()}))
            for label, row in result["smoke"].items():
                ad.say("smoke", label, json.dumps({k: row[k] for k in (
                    "ok", "burst_status", "burst_longest_gap_ms", "burst_median_step_ms", "burst_bound_ms")}))
                for check, status in row["checks"].items():
                    if status != "pass":
                        ad.say(f"  {label} {check} {status}: {row['details'].get(check)}")
        finally:
            if not os.path.exists(os.path.join(a.out, "firstcross.json")):  # ended before measuring
                write_result(a.out, {"runs": [], "alive_at_end": {srv.label: srv.alive() for srv in servers}})
            ad.stop_all(servers)
            scans = {srv.label: srv.scan_log() for srv in servers}
            with open(os.path.join(a.out, "firstcross_logs_scan.json"), "w") as f:
                json.dump(scans, f, indent=1)
            for lab, sc in scans.items():
                ad.say(f"log {lab}: {sc['error_lines']} error lines; first={sc['first_errors'][:2]}")


if __name__ == "__main__":
    asyncio.run(main())

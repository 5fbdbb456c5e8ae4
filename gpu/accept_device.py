"""Real acceptance across dyn-disable's crossings (issue #24) and the first-crossing stall
(issue #25 part 1), on the trained pair (gpu/train_pair.py), simulation off.

Usage (from the repo root, after gpu/run_accept.sh has prepared /tmp/site and trained the pair):
  python3 gpu/accept_device.py --out DIR [--budget-s 300] [--threshold 8] [--crossings 10]
      [--c1-rounds 8] [--c1-prompts 1] [--c1-tokens 192]

Servers side by side on one GPU (shapes_device.Server: the flags `invoke server start` gives
the profiles), pair "trained", decode log every step, each with its own TRITON_CACHE_DIR:
  baseline, eagle3-v2 (stock), eagle3-v2-dyn, eagle3 (stock v1 tree), eagle3-dyn, and the
  negative controls eagle3-v2-dyn-nc / eagle3-dyn-nc (SGLANG_SPEC_DISABLE_DEBUG_SKIP_DRAFT_KV=1:
  the draft's KV is not written while plain).
Every server runs the same protocol, phase by phase, all servers at once (so each phase meets
the same neighbours on the GPU), except the c=1 phases, which run one server at a time: `before`
(8 held-out prompts at c=1, 64 tokens; raw, not the goal's measure: see below), `ab_before` (the
A/B rounds, below), `spec_eq`
(64 prompts at c=4, below the threshold), then per crossing 4 streamed requests that span it
(`span`, 384 tokens; the burst starts once each has streamed 16 tokens) and a burst of
2*threshold+4 streamed requests (`burst`, 128 tokens) that holds the server above the threshold
for ~128 plain steps while the spanning requests keep decoding; after the burst drains they run
their tail speculatively, and their tail's tokens per step against the stock server's over the
same tokens is the stale-draft measure (accept_analysis.stale_draft). With --late-spans N, N more
spanning requests (`late_span`) start once every burst request has streamed 16 tokens, so they
are prefilled while drafting is off (what SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=defer leaves without
the draft's prefill), and their tails are measured the same way (late_tail_over_stock). Then `ab_after`, `after` (the
`before` prompts again) and, on the baseline only, the equality control: the first crossings' burst prompts
in the same burst shape again (`burst_again`) and one by one at c=1 (`burst_c1`). Then the baseline
is asked for the top-2 logprobs at every mismatch's first differing position.
c=1 after the bursts against before (issue #24's goal >= 0.98x): the raw `before`/`after` tok/s of
one server (~1 s a phase, minutes apart) moved +-20-40 % on stock servers that never cross, so the
goal's measure is A/B: in `ab_before` and `ab_after`, --c1-rounds rounds in which each dyn server,
its stock peer and its negative control decode the same --c1-prompts held-out prompts of
--c1-tokens tokens at c=1, one server at a time, in mirrored order (dyn stock nc nc stock dyn; the
next round nc stock dyn dyn stock nc), so that noise common to the pair and a linear drift cancel;
accept_analysis.ab_summary takes the median over rounds of dyn/stock and after/before of those.
Writes DIR/records.jsonl (one line per request), DIR/summary.json (issue #24),
DIR/first_crossing.json (issue #25) and DIR/accept_raw.json (JIT cache snapshots, log lines
after healthy, transitions); server logs under /tmp/dyn-logs. With --profile-resume LABEL, a torch
profile (no Python stacks) across crossings 1's and 2's resumes on that server (--profile-crossings
picks others), under /tmp/dyn-logs/traces/LABEL/crossing-N (gpu/trace_steps.py reads them).
"""
import argparse
import asyncio
import inspect
import json
import os
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accept_analysis as an  # noqa: E402

T0 = time.time()
BUDGET = 300.0
NC_ENV = {"SGLANG_SPEC_DISABLE_DEBUG_SKIP_DRAFT_KV": "1"}
# label -> (profile, extra env)
SERVERS = {
    "baseline": ("baseline", {}),
    "eagle3-v2": ("eagle3-v2", {}),
    "eagle3-v2-dyn": ("eagle3-v2-dyn", {}),
    "eagle3": ("eagle3", {}),
    "eagle3-dyn": ("eagle3-dyn", {}),
    "eagle3-v2-dyn-nc": ("eagle3-v2-dyn", NC_ENV),
    "eagle3-dyn-nc": ("eagle3-dyn", NC_ENV),
    # the native plain path (issue #34), writing the draft's KV, skipping it, deferring it (the
    # product profile's own setting): opt-in (--servers)
    "eagle3-v2-dyn-native": ("eagle3-v2-dyn-native", {"SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV": "write"}),
    "eagle3-v2-dyn-native-skip": ("eagle3-v2-dyn-native", {"SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV": "skip"}),
    "eagle3-v2-dyn-native-defer": ("eagle3-v2-dyn-native", {"SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV": "defer"}),
}
DEFAULT_SERVERS = tuple(label for label in SERVERS if "-native" not in label)
# per worker: the dyn server, its stock reference, its negative control. For v2-native the third
# server is skip, which leaves the draft's KV in the negative control's state on purpose: its
# acceptance after a resume is what the negative_control_* keys of that worker report. For
# v2-defer the third is skip too: the same plain steps, but the late spanning requests' prompts
# prefilled for the draft, so negative_control_late_* is defer's reference with the prompt's draft KV.
WORKERS = {"v2": ("eagle3-v2-dyn", "eagle3-v2", "eagle3-v2-dyn-nc"),
           "v1": ("eagle3-dyn", "eagle3", "eagle3-dyn-nc"),
           "v2-native": ("eagle3-v2-dyn-native", "eagle3-v2", "eagle3-v2-dyn-native-skip"),
           "v2-defer": ("eagle3-v2-dyn-native-defer", "eagle3-v2", "eagle3-v2-dyn-native-skip")}
# the workers whose third server is a healthy reference, not a negative control (their verdict compares)
THIRD_IS_REFERENCE = {"v2-defer"}


def el():
    return time.time() - T0


def left():
    return BUDGET - el()


def say(*a):
    print(f"[t={el():.1f}s]", *a, flush=True)


class Plan:
    """The protocol's sizes (tests shrink them)."""

    def __init__(self, threshold=8, crossings=10, before_n=8, before_tokens=64, eq_n=64,
                 eq_conc=4, eq_tokens=48, burst_extra=4, burst_tokens=128, span_n=4, span_tokens=384,
                 span_lead=16, control_n=64, ab_rounds=8, ab_prompts=1, ab_tokens=192, late_n=0,
                 profile_label=None, profile_crossings=(1, 2), profile_steps=60, profile_lead=24,
                 profile_dir="/tmp/dyn-logs/traces"):
        self.threshold, self.crossings = threshold, crossings
        self.before_n, self.before_tokens = before_n, before_tokens
        self.eq_n, self.eq_conc, self.eq_tokens = eq_n, eq_conc, eq_tokens
        self.burst = 2 * threshold + burst_extra
        self.burst_tokens, self.span_tokens, self.span_lead = burst_tokens, span_tokens, span_lead
        self.span_n = span_n
        # spanning requests started once the burst holds drafting off (--late-spans)
        self.late_n = late_n
        # burst prompts the baseline runs again (same shape, then c=1): >= 64 for the equality
        self.control_n = control_n
        # the A/B c=1 rounds (ab_before / ab_after). Time, per phase: 2 workers x 3 servers x 2 visits
        # x rounds x prompts x tokens = 2*3*2*8*1*192 = 18,432 tokens at c=1; at the MLA pair's 525-733
        # tok/s (~550 with prefill and HTTP) ~34 s, so ~67 s for both phases out of --budget-s (8 rounds:
        # the median of 8 per-round ratios; the MLA call of 2026-12-02 left 108 s of its 540 unused)
        self.ab_rounds, self.ab_prompts, self.ab_tokens = ab_rounds, ab_prompts, ab_tokens
        # --profile-resume: a torch profile of profile_steps forward steps on the server
        # profile_label, started when one of its burst requests is profile_lead tokens from its end,
        # so that it holds the burst's last plain steps, the resume and the first speculative steps
        # (the first resume's 115-125 ms gap sat at the resume itself: plain-at-baseline section 11)
        self.profile_label, self.profile_crossings = profile_label, tuple(profile_crossings)
        self.profile_steps, self.profile_lead, self.profile_dir = profile_steps, profile_lead, profile_dir

    def burst_base(self, c):
        """The prompt index of crossing c's first burst request (its spanning ones come before,
        its late spanning ones after)."""
        return self.before_n + self.eq_n + (c - 1) * (self.span_n + self.burst + self.late_n) + self.span_n


# ---------------------------------------------------------------- requests

def body(ids, max_tokens, stream=False):
    return {"input_ids": ids, "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True}}


def outputs_of(chunks):
    """output_ids from a stream's chunks, whether the server sends them whole or in pieces."""
    if not chunks:
        return []
    last = chunks[-1]
    n = last.get("meta_info", {}).get("completion_tokens")
    if n is None or len(last.get("output_ids") or []) == n:
        return list(last.get("output_ids") or [])
    return [t for c in chunks for t in (c.get("output_ids") or [])]


async def request(s, srv, rec, ids, max_tokens, stream=False, progress=None):
    """One /generate request; fills rec with outputs, meta and (streamed) chunk arrival times.
    progress: an asyncio.Event set once `rec["lead"]` tokens have streamed."""
    rec.update(prompt_ids=ids, t_start=time.time(), arrivals=[], counts=[])
    try:
        async with s.post(srv.base + "/generate", json=body(ids, max_tokens, stream)) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            if not stream:
                j = await r.json()
                chunks = [j]
            else:
                chunks, seen = [], 0
                async for raw in r.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    c = json.loads(line[5:])
                    chunks.append(c)
                    n = c.get("meta_info", {}).get("completion_tokens", seen)
                    if n > seen:
                        rec["arrivals"].append(time.time())
                        rec["counts"].append(n)
                        seen = n
                    if progress is not None and seen >= rec.get("lead", 0):
                        progress.set()
        meta = chunks[-1].get("meta_info", {})
        rec.update(output_ids=outputs_of(chunks), completion_tokens=meta.get("completion_tokens", 0),
                   spec_verify_ct=meta.get("spec_verify_ct"), error=None)
    except Exception as e:
        rec.update(error=repr(e)[:300], output_ids=[], completion_tokens=0, spec_verify_ct=None)
    finally:
        rec["t_end"] = time.time()
        if progress is not None:
            progress.set()
    return rec


async def all_set(events, timeout_s=30):
    """Wait until every event is set, at most timeout_s."""
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout_s)
    except asyncio.TimeoutError:
        pass


class Run:
    def __init__(self, s, servers, prompts, plan, out):
        self.s, self.servers, self.prompts, self.plan, self.out = s, servers, prompts, plan, out
        self.records = []
        self.windows = {srv.label: [] for srv in servers}
        self.raw = {"jit": {}, "log_after_healthy": {}, "phases_done": []}

    def rec(self, srv, phase, idx, crossing=None, **kw):
        # a request cut short by the budget keeps these: counted as failed, never as output
        r = {"server": srv.label, "phase": phase, "crossing": crossing, "idx": idx, "output_ids": [],
             "completion_tokens": 0, "spec_verify_ct": None, "arrivals": [], "counts": [], "t_start": None,
             "t_end": None, "error": "not finished", **kw}
        self.records.append(r)
        return r

    def prompt(self, idx):
        return self.prompts[idx % len(self.prompts)]

    def flush(self):
        with open(os.path.join(self.out, "records.jsonl"), "w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")

    async def sequential(self, srv, phase, idxs, max_tokens, stream=False, crossing=None, **kw):
        for i in idxs:
            await request(self.s, srv, self.rec(srv, phase, i, crossing, **kw), self.prompt(i), max_tokens, stream)

    def ab_groups(self, live):
        """Per worker the live servers of its A/B rounds: (dyn, stock, negative control), the stock
        one in the middle; a group needs its stock server and one other."""
        by = {srv.label: srv for srv in live}
        out = []
        for d, st, nc in WORKERS.values():
            g = [by[x] for x in (d, st, nc) if x in by]
            if st in by and len(g) >= 2:
                out.append(g)
        return out

    async def ab_rounds(self, name, live, reserve_s):
        """The c=1 A/B phase `name`: per round and worker group, each server decodes the round's
        prompts at c=1, one server at a time, in mirrored order (A B C C B A; the next round C B A
        A B C): a drift common to the group cancels to first order in each round's ratios."""
        p = self.plan
        groups = self.ab_groups(live)
        for r in range(p.ab_rounds):
            if left() - reserve_s < 3:
                say(f"budget: {name} stopped after {r} rounds")
                break
            idxs = [(r * p.ab_prompts + k) % p.before_n for k in range(p.ab_prompts)]
            for g in groups:
                order = g if r % 2 == 0 else g[::-1]
                for v, srv in enumerate(order + order[::-1]):
                    await self.sequential(srv, name, idxs, p.ab_tokens, round=r, visit=v)

    async def concurrent(self, srv, phase, idxs, conc, max_tokens):
        sem = asyncio.Semaphore(conc)

        async def one(i):
            async with sem:
                await request(self.s, srv, self.rec(srv, phase, i), self.prompt(i), max_tokens)

        await asyncio.gather(*(one(i) for i in idxs))

    def start_spans(self, srv, phase, idxs, c):
        """Streamed spanning requests (span_tokens each), started now: their tasks and, per request,
        an event set once it has streamed span_lead tokens (or ended)."""
        p, tasks, started = self.plan, [], []
        for i in idxs:
            started.append(asyncio.Event())
            rec = self.rec(srv, phase, i, c, lead=p.span_lead)
            tasks.append(asyncio.ensure_future(request(self.s, srv, rec, self.prompt(i), p.span_tokens,
                                                       stream=True, progress=started[-1])))
        return tasks, started

    async def profile_at_burst_end(self, srv, c, since):
        """Ask srv for a torch profile once one of crossing c's burst requests is profile_lead
        tokens from its end (polled every 2 ms; given up when the burst ends first). The burst's
        records are among those appended from index `since` on (the crossing's start: every
        server's crossing runs at once, so a few dozen, not the run's whole list on the event
        loop that times the streams). Kept in raw["profiles"]: when it was asked after the burst
        began, and any error."""
        p = self.plan
        out = self.raw.setdefault("profiles", {}).setdefault(srv.label, {})
        entry = out[str(c)] = {"asked_at_s": None, "error": None,
                               "output_dir": os.path.join(p.profile_dir, srv.label, f"crossing-{c}")}
        t0 = time.time()
        burst = []
        while True:
            if len(burst) < p.burst:
                burst = [r for r in self.records[since:]
                         if r["server"] == srv.label and r["phase"] == "burst" and r["crossing"] == c]
            if any(r["counts"] and r["counts"][-1] >= p.burst_tokens - p.profile_lead for r in burst):
                break
            if (burst and all(r["t_end"] is not None for r in burst)) or time.time() - t0 > 60:
                entry["error"] = "the burst ended before the profile was asked"
                return
            await asyncio.sleep(0.002)
        entry["asked_at_s"] = round(time.time() - t0, 3)
        try:
            async with self.s.post(srv.base + "/start_profile", json={
                    "output_dir": entry["output_dir"], "num_steps": p.profile_steps,
                    "activities": ["CPU", "GPU"], "with_stack": False}) as r:
                if r.status != 200:
                    entry["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
        except Exception as exc:  # noqa: BLE001 - kept as evidence; the crossing goes on
            entry["error"] = repr(exc)[:300]

    async def crossing(self, srv, c):
        p = self.plan
        first = p.burst_base(c)
        tasks, started = self.start_spans(srv, "span", range(first - p.span_n, first), c)
        await all_set(started)
        if srv.label == p.profile_label and c in p.profile_crossings:
            tasks.append(asyncio.ensure_future(self.profile_at_burst_end(srv, c, len(self.records))))
        w = {"crossing": c, "burst_t0": time.time()}
        if p.late_n:
            streaming = [asyncio.Event() for _ in range(p.burst)]
            burst = asyncio.ensure_future(self.burst(srv, "burst", c, streaming))
            await all_set(streaming)   # the burst holds drafting off: the late ones are prefilled plain
            late = range(first + p.burst, first + p.burst + p.late_n)
            tasks += self.start_spans(srv, "late_span", late, c)[0]
            await burst
        else:
            await self.burst(srv, "burst", c)
        w["burst_t1"] = time.time()
        await asyncio.gather(*tasks)
        w["resume_t1"] = time.time()
        self.windows[srv.label].append(w)

    async def burst(self, srv, phase, c, streaming=None):
        """streaming: one event per request, set once it has streamed span_lead tokens."""
        p, first = self.plan, self.plan.burst_base(c)
        lead = {"lead": p.span_lead} if streaming else {}
        await asyncio.gather(*(request(self.s, srv, self.rec(srv, phase, first + k, c, **lead), self.prompt(first + k),
                                       p.burst_tokens, stream=True, progress=streaming[k] if streaming else None)
                               for k in range(p.burst)))

    async def control(self, baseline, reserve_s):
        """The baseline's burst prompts of the first crossings again: one by one at c=1, then
        (if the budget allows) in the same burst shape, each while the budget lasts."""
        p = self.plan
        done = [w["crossing"] for w in self.windows.get(baseline.label, [])]
        cs = done[:max(1, -(-p.control_n // p.burst))]
        for c in cs:
            for i in range(p.burst_base(c), p.burst_base(c) + p.burst):
                if left() - reserve_s < 3:
                    say("budget: c=1 control cut short")
                    return
                await request(self.s, baseline, self.rec(baseline, "burst_c1", i, c), self.prompt(i),
                              p.burst_tokens, stream=True)
        self.flush()
        for c in cs:
            if left() - reserve_s < 5:
                say("budget: burst-shape control cut short")
                break
            await self.burst(baseline, "burst_again", c)

    async def phase(self, name, fn, live, one_at_a_time=False, whole=False):
        """fn(srv) for every live server (at once, or one at a time); whole: fn() once."""
        t = time.time()
        if whole:
            await fn()
        elif one_at_a_time:
            for srv in live:
                await fn(srv)
        else:
            await asyncio.gather(*(fn(srv) for srv in live))
        self.raw["phases_done"].append([name, round(time.time() - t, 2)])
        say(f"phase {name}: {time.time() - t:.1f} s ({left():.0f} s left)")
        self.flush()
        return time.time() - t

    async def protocol(self, reserve_s=40):
        p, live = self.plan, [srv for srv in self.servers if srv.alive()]
        before = range(p.before_n)
        # the c=1 phases run one server at a time: their tok/s is the c=1 throughput before and
        # after the crossings, which seven servers decoding at once on one GPU blurred (2-tails)
        await self.phase("before", lambda srv: self.sequential(srv, "before", before, p.before_tokens), live,
                         one_at_a_time=True)
        # the goal's c=1 measure: A/B rounds (dyn against stock); the crossings leave room for its
        # second half
        ab_s = await self.phase("ab_before", lambda: self.ab_rounds("ab_before", live, reserve_s / 2), live,
                                whole=True)
        await self.phase("spec_eq", lambda srv: self.concurrent(
            srv, "spec_eq", range(p.before_n, p.before_n + p.eq_n), p.eq_conc, p.eq_tokens), live)
        for srv in live:
            self.raw["jit"][srv.label] = {"healthy": jit_snapshot(srv)}
            self.raw["log_after_healthy"][srv.label] = {"from_line": len(srv.read_log().splitlines())}
        # a crossing takes about as long as the slowest one so far; stop before the reserve
        longest = 0.0
        for c in range(1, p.crossings + 1):
            if left() - reserve_s - 1.2 * ab_s < max(longest * 1.5, 5):
                say(f"budget: stopping after {c - 1} crossings")
                break
            t = time.time()
            await self.phase(f"crossing {c}", lambda srv: self.crossing(srv, c), live)
            longest = max(longest, time.time() - t)
            if c == 1:
                for srv in live:
                    self.raw["jit"][srv.label]["after_first_crossing"] = jit_snapshot(srv)
                    lines = srv.read_log().splitlines()
                    k = self.raw["log_after_healthy"][srv.label]["from_line"]
                    self.raw["log_after_healthy"][srv.label]["lines"] = [
                        l for l in lines[k:] if not any(x in l for x in (
                            "Decode batch", "Prefill batch", "POST /generate", "GET /health"))][:40]
        if left() > reserve_s / 2:
            await self.phase("ab_after", lambda: self.ab_rounds("ab_after", live, reserve_s / 2), live, whole=True)
        if left() > reserve_s / 2:
            await self.phase("after", lambda srv: self.sequential(srv, "after", before, p.before_tokens), live,
                             one_at_a_time=True)
        base = [srv for srv in live if srv.label == "baseline"]
        if base and left() > reserve_s / 2:
            await self.phase("control", lambda srv: self.control(srv, reserve_s / 2), base)
        for srv in live:
            snap = self.raw["jit"].get(srv.label, {})
            if "healthy" in snap:
                snap["new_after_healthy"] = an.new_entries(snap["healthy"], snap.get("after_first_crossing", []))
                snap["new_after_healthy_end"] = an.new_entries(snap["healthy"], jit_snapshot(srv))

    async def margins(self, baseline, mismatches, limit=256):
        """The baseline's top-2 logprob margin at each mismatch's first differing position."""
        for m in mismatches[:limit]:
            if left() < 8:
                break
            rec = {}
            ids = list(m["prompt_ids"]) + list(m["common_prefix"])
            b = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                 "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
            try:
                async with self.s.post(baseline.base + "/generate", json=b) as r:
                    j = await r.json()
                top = j["meta_info"]["output_top_logprobs"][0]
                rec = {"margin": an.margin_from_top_logprobs(top),
                       "baseline_top2": [[round(float(t[0]), 5), t[1]] for t in top[:2]]}
            except Exception as e:
                rec = {"margin_error": repr(e)[:200]}
            m.update(rec)


def jit_snapshot(srv):
    """Files under the server's TRITON_CACHE_DIR and the FlashInfer JIT cache (relative names)."""
    names = []
    for tag, root in (("triton", getattr(srv, "triton_dir", None)),
                      ("flashinfer", os.path.expanduser("~/.cache/flashinfer"))):
        if root and os.path.isdir(root):
            for d, _, files in os.walk(root):
                names += [f"{tag}:{os.path.relpath(os.path.join(d, f), root)}" for f in files]
    return sorted(names)


def read_logs(run):
    """Each server's log lines, read once per use (summarize reads them again after the margins ran)."""
    return {srv.label: srv.read_log().splitlines() for srv in run.servers}


def per_worker(run, by, logs):
    return {w: an.worker_summary(by[d], by.get("baseline", []), by.get(st, []), by.get(nc),
                                 log=logs.get(d), nc_log=logs.get(nc) if nc in by else None,
                                 windows=run.windows.get(d), nc_windows=run.windows.get(nc),
                                 stock_log=logs.get(st),
                                 third="reference" if w in THIRD_IS_REFERENCE else "control")
            for w, (d, st, nc) in WORKERS.items() if d in by}


def summarize(run, pair_report, threshold, tp=1):
    """(summary.json, first_crossing.json) from a finished run."""
    by = {}
    for r in run.records:
        by.setdefault(r["server"], []).append(r)
    base = by.get("baseline", [])
    logs = read_logs(run)
    per = per_worker(run, by, logs)
    stock_eq = {w: an.greedy_equality(by.get(stock, []), base, {"before", "spec_eq", "after"})
                for w, (_, stock, _) in WORKERS.items() if stock in by}
    v = per.get("v2", {})
    summary = {
        "simulated": False,
        "pair": {k: pair_report.get(k) for k in ("size", "seed", "vocab", "corpus", "device")}
        | {"arch": pair_report.get("arch", "llama"),  # train_pair.py --arch; reports before it: llama
           "target_steps": pair_report.get("target", {}).get("steps"),
           "draft_heldout_top1_per_position": pair_report.get("draft", {}).get("heldout_top1_per_position"),
           "torch_simulated_accept_len": pair_report.get("simulated_accept_len", {}).get("mean"),
           "train_seconds": pair_report.get("seconds_total")},
        "target_loss": {"train": pair_report.get("target", {}).get("train_loss"),
                        "heldout": pair_report.get("target", {}).get("heldout_loss")},
        "threshold": threshold,
        "hysteresis": f"patch default max(1, {threshold} // 4) = {max(1, threshold // 4)}",
        "prompts": len({tuple(r["prompt_ids"]) for r in run.records if r.get("prompt_ids")}),
        "crossings": len(an.crossings(by.get(WORKERS["v2"][0], []))),
        **{k: v.get(k) for k in ("accept_len_before", "accept_len_after_resume", "after_over_before",
                                 "negative_control_after_over_before",
                                 "greedy_equal_plain_vs_baseline", "greedy_equal_spec_vs_stock")},
        "per_worker": {w: {k: (x if k != "mismatches" else
                               {n: [an.strip_mismatch(m) for m in ms] for n, ms in x.items()})
                           for k, x in d.items()} for w, d in per.items()},
        "stale_draft": {w: {k: d.get(k) for k in (
            "tail_over_stock", "tail_over_stock_median", "negative_control_tail_over_stock",
            "negative_control_tail_over_stock_median", "verdict", "late_tail_over_stock",
            "late_tail_over_stock_median", "negative_control_late_tail_over_stock",
            "negative_control_late_tail_over_stock_median")} for w, d in per.items()},
        "equality_control": {n: {"equal": e["equal"], "of": e["of"], "fraction": e["fraction"],
                                 "mismatches": [an.strip_mismatch(m) for m in e["mismatches"]]}
                             for n, e in an.baseline_control(base).items()},
        "stock_vs_baseline": {w: {"equal": e["equal"], "of": e["of"], "fraction": e["fraction"]}
                              for w, e in stock_eq.items()},
        "accept_len_by_server": {lab: an.ratio(an.accept_len([r for r in rs if r["phase"] in
                                                              ("before", "spec_eq")]), 1)
                                 for lab, rs in by.items()},
        "errors": {lab: sum(1 for r in rs if r.get("error")) for lab, rs in by.items()},
        # c=1, issue #24's goal: per worker c1_after_over_before (A/B, see accept_analysis.ab_summary)
        "c1_after_over_before": {w: d.get("c1_after_over_before") for w, d in per.items()},
        "c1_goal_met": {w: d.get("c1_goal_met") for w, d in per.items()},
        "c1_goal_verdict": {w: d.get("c1_goal_verdict") for w, d in per.items()},
        # the servers' own view: median decode step (ms) at c=1 per phase, from their logs
        "c1_step_ms": {lab: {n: x["median_step_ms"] for n, x in an.c1_step_ms(logs[lab], by[lab]).items()}
                       for lab in logs if lab in by},
        "transitions": {lab: an.log_transitions(lines) for lab, lines in logs.items()},
        # whether the patch knew the negative control's debug switch shows in its start-up lines
        "startup_lines": {lab: [l.strip()[-240:] for l in lines
                                if "Dynamic speculation disable" in l and not an.SWITCH_LINE.search(l)][:4]
                          for lab, lines in logs.items() if "dyn" in lab},
    }
    runs = []
    for srv in run.servers:
        if srv.label == "baseline" or srv.label not in by:
            continue
        gaps = an.stall_gaps(by[srv.label], run.windows[srv.label])
        st = an.stall_summary(gaps, tp=tp, server=srv.label,
                              median_step_ms=an.median_gap_ms([r for r in by[srv.label]
                                                               if r["phase"] == "span"]))
        st["burst_completion_spread_ms"] = an.burst_completion_spread_ms(by[srv.label], run.windows[srv.label])
        st["jit_new_after_healthy"] = run.raw["jit"].get(srv.label, {}).get("new_after_healthy")
        st["log_after_healthy"] = run.raw["log_after_healthy"].get(srv.label, {}).get("lines")
        runs.append(st)
    first = {"runs": runs, "note": "gaps are client-side inter-chunk gaps of streamed /generate requests; "
                                   "eagle3-v2 (stock) is the reference for the switches; baseline_burst_end "
                                   "is the baseline's resume-window gaps, a burst's end with no switch in it"}
    if "baseline" in by and run.windows.get("baseline"):
        first["baseline_burst_end"] = an.burst_end_reference(by["baseline"], run.windows["baseline"])
    return summary, first


def all_mismatches(summary_per, control):
    return ([m for d in summary_per.values() for ms in d["mismatches"].values() for m in ms]
            + [m for e in control.values() for m in e["mismatches"]])


async def measure(s, servers, prompts, plan, out, pair_report, reserve_s=20):
    """The protocol on running servers, the margins, and both summaries written to out."""
    run = Run(s, servers, prompts, plan, out)
    try:
        await asyncio.wait_for(run.protocol(reserve_s), timeout=max(10, left() - reserve_s / 2))
    except asyncio.TimeoutError:
        say("budget: protocol cut short")
    run.flush()
    by = {}
    for r in run.records:
        by.setdefault(r["server"], []).append(r)
    base = next((srv for srv in servers if srv.label == "baseline"), None)
    per = per_worker(run, by, read_logs(run))
    mism = all_mismatches(per, an.baseline_control(by.get("baseline", [])))
    if base is not None and base.alive() and mism:
        await run.margins(base, mism)
    margins = {an.mismatch_key(m): m for m in mism if "margin" in m or "margin_error" in m}
    summary, first = summarize(run, pair_report, plan.threshold)
    def with_margins(ms):
        for m in ms:
            m.update({k: v for k, v in margins.get(an.mismatch_key(m), {}).items()
                      if k in ("margin", "baseline_top2", "margin_error")})
            m["margin_class"] = an.margin_class(m.get("margin"))
        return an.margin_counts(ms)

    summary["margin_classes_note"] = (f"tie: margin 0; bf16_step: 0 < margin <= {an.BF16_STEP} (one bf16 "
                                      "step of a logit with |logit| < 32); larger; unknown: not measured")
    for w, d in summary["per_worker"].items():
        d["margin_classes"] = {n: with_margins(ms) for n, ms in d["mismatches"].items()}
        allm = [m for ms in d["mismatches"].values() for m in ms]
        d["mismatches_with_margin_below_1e-2"] = an.margin_counts(allm)["below_1e-2"]
        d["mismatches_total"] = len(allm)
    for e in summary["equality_control"].values():
        e["margin_classes"] = with_margins(e["mismatches"])
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "first_crossing.json"), "w") as f:
        json.dump(first, f, indent=1)
    with open(os.path.join(out, "accept_raw.json"), "w") as f:
        json.dump({"windows": run.windows, **run.raw}, f, indent=1)
    return summary, first


def stop_all(servers, grace_s=6.0):
    """SIGTERM to every server at once, SIGKILL to those still up after grace_s (one after
    another, Server.stop could take 10 s each out of the budget)."""
    import signal
    for srv in servers:
        if srv.proc is not None and srv.proc.poll() is None:
            try:
                os.killpg(srv.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    t = time.time()
    while time.time() - t < grace_s and any(srv.proc is not None and srv.proc.poll() is None for srv in servers):
        time.sleep(0.25)
    for srv in servers:
        if srv.proc is None:
            continue
        try:
            os.killpg(srv.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        srv.proc.wait()
        srv.log.close()


def make_servers(labels, threshold, mem, pair):
    import shapes_device
    group = {"name": "acc", "index": 0, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
             "mem": mem, "kv_tokens": 32768, "max_running": 64}
    servers = []
    for k, label in enumerate(labels):
        profile, env = SERVERS[label]
        tdir = f"/tmp/triton-{label}"
        spec = {"profile": profile, "label": label, "pair": pair,
                "env": dict(env, TRITON_CACHE_DIR=tdir), "flags": ["--decode-log-interval", "1"]}
        srv = shapes_device.Server(group, spec, k, threshold)
        srv.triton_dir = tdir
        servers.append(srv)
    return servers


async def main():
    global BUDGET
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--threshold", type=int, default=8)
    ap.add_argument("--crossings", type=int, default=10)
    ap.add_argument("--models", default="/tmp/models")
    ap.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                    help=f"labels, of {', '.join(SERVERS)}")
    ap.add_argument("--mem", type=float, default=0.09)
    ap.add_argument("--span-tokens", type=int, default=384)
    ap.add_argument("--burst-tokens", type=int, default=128)
    ap.add_argument("--control-n", type=int, default=64)
    ap.add_argument("--late-spans", type=int, default=0,
                    help="spanning requests per crossing that arrive while drafting is off (default 0)")
    ap.add_argument("--profile-resume", default=None, metavar="LABEL",
                    help="a torch profile across the resumes of crossings 1 and 2 on this server "
                         "(its stall figures are then taken with the profiler on)")
    ap.add_argument("--profile-crossings", default="1,2", metavar="N,N",
                    help="with --profile-resume: which crossings' resumes to profile (default 1,2; "
                         "later ones, e.g. 3,4,5, catch a long resume that is not the first)")
    # the A/B c=1 rounds: Plan's defaults (~67 s, Plan's comment)
    ab = {k: v.default for k, v in inspect.signature(Plan).parameters.items() if k.startswith("ab_")}
    ap.add_argument("--c1-rounds", type=int, default=ab["ab_rounds"])
    ap.add_argument("--c1-prompts", type=int, default=ab["ab_prompts"])
    ap.add_argument("--c1-tokens", type=int, default=ab["ab_tokens"])
    a = ap.parse_args()
    span_n = inspect.signature(Plan).parameters["span_n"].default
    resume_at = a.threshold - max(1, a.threshold // 4)   # the patch's default hysteresis
    if a.late_spans and span_n + a.late_spans > resume_at:
        ap.error(f"--late-spans {a.late_spans}: {span_n} spanning + {a.late_spans} late requests stay above the "
                 f"resume point {resume_at} (threshold {a.threshold}) after the burst, so their tails would "
                 f"be plain steps; at most {max(0, resume_at - span_n)}")
    if a.profile_resume and (a.profile_resume not in a.servers.split(",") or "-dyn" not in a.profile_resume):
        ap.error(f"--profile-resume {a.profile_resume}: not one of the dyn servers of --servers {a.servers}")
    try:
        profile_crossings = tuple(int(c) for c in a.profile_crossings.split(","))
    except ValueError:
        profile_crossings = ()
    if not profile_crossings or not all(1 <= c <= a.crossings for c in profile_crossings):
        ap.error(f"--profile-crossings {a.profile_crossings}: crossing numbers from 1 to --crossings "
                 f"{a.crossings}, comma-separated")
    BUDGET = a.budget_s
    import shapes_device
    shapes_device.BUDGET = a.budget_s
    os.makedirs(a.out, exist_ok=True)
    heldout = json.load(open(os.path.join(a.models, "heldout.json")))
    report = json.load(open(os.path.join(a.models, "train_report.json")))
    servers = make_servers(a.servers.split(","), a.threshold, a.mem, "trained")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        try:
            await shapes_device.start_servers(servers, False, 2)
            health = await shapes_device.wait_up(s, servers, min(240, left() - 60))
            live = [srv for srv in servers if health.get(srv.name) is not None]
            plan = Plan(a.threshold, a.crossings, span_tokens=a.span_tokens, burst_tokens=a.burst_tokens,
                        control_n=a.control_n, ab_rounds=a.c1_rounds, ab_prompts=a.c1_prompts, ab_tokens=a.c1_tokens,
                        late_n=a.late_spans, profile_label=a.profile_resume,
                        profile_crossings=profile_crossings)
            summary, first = await measure(s, live, heldout["prompts"], plan, a.out, report)
            say("summary:", json.dumps({k: summary.get(k) for k in (
                "accept_len_before", "accept_len_after_resume", "after_over_before",
                "negative_control_after_over_before", "greedy_equal_plain_vs_baseline",
                "greedy_equal_spec_vs_stock")}))
            for w, d in summary["per_worker"].items():
                say(w, json.dumps({k: d.get(k) for k in (
                    "accept_len_before", "after_over_before", "negative_control_after_over_before",
                    "c1_dyn_over_stock_before", "c1_dyn_over_stock_before_spread", "c1_dyn_over_stock_after",
                    "c1_dyn_over_stock_after_spread", "c1_after_over_before", "c1_goal_met",
                    "c1_goal_verdict", "negative_control_c1_after_over_before", "c1_step_dyn_over_stock_before",
                    "c1_step_dyn_over_stock_after", "c1_raw_tok_s_before", "c1_raw_tok_s_after",
                    "equality_counts", "mismatches_total",
                    "mismatches_with_margin_below_1e-2")}))
            for w, d in summary["stale_draft"].items():
                say("stale draft", w, json.dumps(d))
            for n, e in summary["equality_control"].items():
                say("control", n, json.dumps({k: e[k] for k in ("equal", "of", "fraction", "margin_classes")}))
            for w, d in summary["per_worker"].items():
                say("margins", w, json.dumps(d["margin_classes"]))
            say("c=1 step ms:", json.dumps(summary["c1_step_ms"]))
            say("transitions:", json.dumps(summary["transitions"]))
            for r in first["runs"]:
                say("stall", r["server"], json.dumps({k: r[k] for k in (
                    "first_crossing_max_gap_ms", "later_crossings_max_gap_ms_median",
                    "first_resume_max_gap_ms", "later_resumes_max_gap_ms_median", "median_step_ms",
                    "resume_max_gap_ms", "resume_max_gap_end_ms")}))
                say("  jit new after healthy:", (r["jit_new_after_healthy"] or [])[:12])
        finally:
            stop_all(servers)
            scans = {srv.label: srv.scan_log() for srv in servers}
            with open(os.path.join(a.out, "logs_scan.json"), "w") as f:
                json.dump(scans, f, indent=1)
            for lab, sc in scans.items():
                say(f"log {lab}: {sc['error_lines']} error lines; first={sc['first_errors'][:2]}")


if __name__ == "__main__":
    asyncio.run(main())

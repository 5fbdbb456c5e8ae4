"""threshold=auto's controller against the best fixed threshold on the simulated server, with and
without prefill churn (issue #29; CPU only, about 10 s).

The controller is the file 0003-dyn-disable-auto.patch adds (read from the 0.5.11 diff, no wheel
needed); the simulated servers are tests/dyn/test_auto.py's: `Server` (step-time model, noise,
overlap-scheduler timing) and `ChurnServer` (a prefill joins the running batch every 6 steps and
makes the next speculative step EXTRA ms dearer, the shape of what the first GPU run showed).
The protocol is gpu/run_auto.sh's: one auto server through c = 1, 4, 16, 32, 64 and a bursty load
(48 <-> 2 running every 3 s), each level 10 s to settle and 40 s measured, against a fresh server
per fixed threshold (speculate while bs <= N, N = 1..64). Prints auto / best fixed per level.
With --resume-ms the first speculative step after plain ones costs that much more
(test_auto.CostlyResume: a rebuild or a compile at the resume; the bursty trace's probes on
one H200 cost 110-150 ms of switches each), and each row runs twice: the controller as it is
(its probe windows measure the switches) and with the measurement off (a probe's switches
counted as one speculative step, the model before).

    .venv/bin/python benchmarks/bench_auto_controller.py [--extra-ms 0,20,40] [--accept 2.5,1.8]
    .venv/bin/python benchmarks/bench_auto_controller.py --resume-ms 0,50,100 --accept 1.6,2.5
    .venv/bin/python benchmarks/bench_auto_controller.py --host-cost   # host time per step
    .venv/bin/python benchmarks/bench_auto_controller.py --acc-mix 2.5,1.6 --acc-mix-c 16
    .venv/bin/python benchmarks/bench_auto_controller.py --acc-mix 2.14,1.46 --acc-mix-c 4 --seeds 8
    .venv/bin/python benchmarks/bench_auto_controller.py --stagger
    .venv/bin/python benchmarks/bench_auto_controller.py --turnover --seeds 4
    .venv/bin/python benchmarks/bench_auto_controller.py --waves
    .venv/bin/python benchmarks/bench_auto_controller.py --charge   # about a minute
    .venv/bin/python benchmarks/bench_auto_controller.py --charge --spec-sizes
    .venv/bin/python benchmarks/bench_auto_controller.py --charge --spec-sizes --return-ms 15
    .venv/bin/python benchmarks/bench_auto_controller.py --probed --spec-sizes --return-ms 15 --seeds 8
    .venv/bin/python benchmarks/bench_auto_controller.py --deferred --seeds 3

--stagger: rare long prefills while speculating (test_auto.StaggerServer: requests replaced one at a
time, a prefill before a speculative step with probability p; plain keeps a wave together) at 16
running requests, from a fresh server over short and long windows, with the wall step times
clipped at CLIP_WALL (the controller) and at 3x (the controller before): auto / the better side.

--deferred: gpu/README row 2f's loads on test_auto.DeferredServer (the native path's defer, request by
request: a request that arrives beside plain steps accepts DIP less for its first 8 speculative steps):
64 running, then 32, where speculation pays for requests with their draft context; auto reading the
deferred requests raw and corrected by the measured ratio, against the better fixed side at 32.

--acc-mix: gpu/auto_device.py's acc-mix level on the simulated server (the acceptance changes between
phases of fixed work at one concurrency, so the crossover moves; gpu/README row 1r): auto against
speculating and plain throughout (at one concurrency every fixed threshold is one of the two), per
phase length in tokens (the GPU row's phase: 20 waves of 16 requests x 96 tokens = 30,720).
`--acc-mix 2.14,1.46 --acc-mix-c 4` sets the model's gains at 1.38 / 0.94, the GPU's at four requests
(docs/evidence/auto-threshold/14-acc-mix-oracle: a 7,680-token phase); `--seeds N` gives medians.

--turnover: acceptance phases on test_auto.TurnoverServer, a closed loop of 5 requests whose running
count dips into the bucket below at every turnover (the replacement comes back two steps later, its
prefill inside the busy batch), equal output lengths and lengths drawn +-50 %, a resume costing the
model's 2 ms more and 8 ms more (the GPU's probes measured 1-8 ms of switches at four requests), with
short visits following the bucket they come from (SHORT_RUN) and without (each bucket on its own, the
controller before): auto against the better side throughout and against an oracle taking the faster
side per phase, and the steps that followed a neighbour.

--waves: 64 requests on the turnover server with a 12-ms prefill forward (the GPU's host-bound pair:
an eager launch worth several decode steps), equal output lengths and lengths drawn +-50 %: auto,
plain throughout and speculating throughout, with the prefill forwards inside a busy batch per 100
decode steps. With equal lengths plain finishes its requests together and admits them after idle
time, so it never pays a forward in a busy batch; a probe's speculative steps finish requests
apart, and the waves never come back (docs/evidence/auto-threshold/17-own-native).

--charge: the turnover server at 8-64 requests, a prefill forward of 4 or 12 ms, equal lengths and
lengths drawn +-50 %: speculating throughout against plain, auto with busy-batch prefills charged to
the side that finished the requests they admit, and auto deciding on the wall step times alone (the
controller before), each against the better side; and the gain auto's bucket reads, by the charged
model (T) or by the wall step times where a side is not charged yet (W), per seed.

--spec-sizes: the buckets a speculative SGLang 0.5.11 server captures (1-8 one apart, 10-32 two apart,
40-64 four apart) instead of the model's coarser ones, so that a turnover dips into the bucket below
as on the GPU (with --charge, --waves, --turnover or the default tables).

--probed: is the side a bucket probes read dear by the controller's own noise? On the GPU the probed
side's decided step cost, over what its fixed server delivers, sat above the run side's in 49 of 68
bucket-levels, median 1.13 (`gpu/auto_summary.py costcheck`, `probed_over_run`;
docs/evidence/auto-threshold/23-big16-charge-check). Here a probe's steps cost what steady ones do, so
what the same ratio reads is the estimates' noise and the selection it makes (a bucket runs the side its
noise favours): the turnover server at 16 / 32 / 64 requests, lengths drawn +-50 %, 12-ms prefill
forwards, at probe budgets 0.005 (the default), 0.01 (the most SGLANG_SPEC_DISABLE_AUTO_PROBE_BUDGET
takes) and 0.05 (the model only), over --seeds seeds (starting at 5): the median and range of
probed_over_run (the gain auto's bucket reads against speculating / plain throughout), how many seeds
ended running each side, and auto against the better side.

--return-ms: the turnover server's finished requests come back that many ms of its clock later
instead of two steps later, so replacements that arrive while a prefill forward runs meet in the
next one and waves broken by speculation can re-form (every turnover-server table: --charge,
--waves, --turnover).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH = os.path.join(ROOT, "patchsets", "dyn-disable", "0.5.11", "0003-dyn-disable-auto.patch")
NEW_FILE = "diff --git a/sglang/srt/speculative/dyn_disable_auto.py"


def load_controller():
    """dyn_disable_auto.py as the patch adds it: the '+' lines of its new-file diff."""
    text = open(PATCH).read()
    start = text.index(NEW_FILE)
    end = text.find("\ndiff --git ", start + 1)
    body = text[start:] if end < 0 else text[start:end]
    hunk = body[body.index("\n@@ ") + 1:]
    source = "".join(line[1:] + "\n" for line in hunk.splitlines()[1:])
    path = os.path.join(tempfile.mkdtemp(), "dyn_disable_auto.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("dyn_disable_auto_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def ratios(auto, sim, accept, extra_s):
    if extra_s:
        return sim.auto_over_best_fixed(
            lambda: sim.ChurnServer(auto, accept=accept, seed=5, every=6, extra=extra_s))
    return sim.auto_over_best_fixed(lambda: sim.Server(auto, accept=accept, seed=5))


def resume_ratios(auto, sim, accept, resume_s, measure):
    """auto / best fixed per level on servers whose resumes cost resume_s more."""
    saved = auto.AutoSwitch._close_window
    if not measure:
        auto.AutoSwitch._close_window = lambda self, window, now: None
    try:
        return sim.auto_over_best_fixed(lambda: sim.CostlyResume(auto, resume=resume_s, accept=accept, seed=5))
    finally:
        auto.AutoSwitch._close_window = saved


def acc_mix_rates(auto, sim, phases, c, phase_tokens, cycles=4, seed=5):
    """tok/s of auto, of speculating throughout, of plain throughout and of an oracle that knows
    each phase's side, over `cycles` times the phases (each `phase_tokens` tokens at acceptance
    phases[k], c requests running), after one untimed cycle (the GPU run's servers have run levels
    before this one). decide(acc): None (the controller decides) or the side for that phase."""
    def run(decide):
        server = sim.Server(auto, accept=phases[0], seed=seed)
        return sim.rate(sim.phase_times(server, phases, phase_tokens, cycles, decide, bs=c))

    def oracle(acc):
        return sim.true_gain(acc, sim.bucket(c)) > 1.0

    return run(lambda acc: None), run(lambda acc: True), run(lambda acc: False), run(oracle)


def acc_mix_table(auto, sim, phases, c, seeds=1):
    """One row per phase length; with seeds > 1, each figure the median over seeds 5, 6, ...
    (where a phase edge falls against the probe interval moves a short phase's figure by a few %)."""
    gains = ", ".join(f"{a:g}: {sim.true_gain(a, sim.bucket(c)):.2f}" for a in phases)
    print(f"acceptance phases {phases} at c={c} (the model's true gain of speculation there: {gains})"
          + (f", medians over {seeds} seeds" if seeds > 1 else ""))
    print("| tokens per phase | auto tok/s | speculating | plain | oracle | auto / best of the two | auto / oracle |")
    print("|---|---|---|---|---|---|---|")
    for tokens in (8000, 30720, 120000):
        runs = [acc_mix_rates(auto, sim, phases, c, tokens, seed=5 + k) for k in range(seeds)]
        got, spec, plain, ideal = (statistics.median(r[i] for r in runs) for i in range(4))
        over_best = statistics.median(r[0] / max(r[1], r[2]) for r in runs)
        over_oracle = statistics.median(r[0] / r[3] for r in runs)
        print(f"| {tokens} | {got:.0f} | {spec:.0f} | {plain:.0f} | {ideal:.0f} | {over_best:.3f} | "
              f"{over_oracle:.3f} |", flush=True)


def turnover_table(auto, sim, phases=(2.33, 1.59), c=5, tokens=8000, seeds=4):
    gains = ", ".join(f"{a:g}: {sim.true_gain(a, sim.bucket(c)):.2f}" for a in phases)
    print(f"acceptance phases {list(phases)} at c={c} on the turnover server, {tokens} tokens a phase "
          f"(quiet gain at bucket {sim.bucket(c)}: {gains}), medians over {seeds} seeds")
    print("| output lengths | a resume's extra | short visits | auto / better side | auto / oracle | steps that followed |")
    print("|---|---|---|---|---|---|")
    rate = sim.rate
    short_run, resync = auto.SHORT_RUN, sim.RESYNC_S
    try:
        for spread, sim.RESYNC_S in ((0.0, resync), (0.5, resync), (0.0, 8e-3), (0.5, 8e-3)):
            for follow in (True, False):
                auto.SHORT_RUN = short_run if follow else 0
                cells = []
                for seed in range(5, 5 + seeds):
                    make = lambda: sim.TurnoverServer(auto, c=c, spread=spread, accept=phases[0], seed=seed)  # noqa: E731
                    server = make()
                    got = sim.phase_times(server, phases, tokens)
                    spec = sim.phase_times(make(), phases, tokens, decide=lambda acc: True)
                    plain = sim.phase_times(make(), phases, tokens, decide=lambda acc: False)
                    oracle = sum(k for k, _ in spec) / sum(min(a[1], b[1]) for a, b in zip(spec, plain))
                    cells.append((rate(got) / max(rate(spec), rate(plain)), rate(got) / oracle,
                                  server.switch.follow_steps))
                med = [statistics.median(cell[i] for cell in cells) for i in range(3)]
                lengths = "equal" if spread == 0 else f"+-{spread:.0%}"
                how = f"follow (SHORT_RUN {short_run})" if follow else "on their own"
                print(f"| {lengths} | {sim.RESYNC_S * 1e3:g} ms | {how} | {med[0]:.3f} | {med[1]:.3f} | "
                      f"{med[2]:.0f} |", flush=True)
    finally:
        auto.SHORT_RUN, sim.RESYNC_S = short_run, resync


def waves_table(auto, sim, c=64, accept=2.5, prefill_s=12e-3, steps=6000):
    print(f"{c} requests on the turnover server, accept {accept}, a prefill forward {prefill_s * 1e3:g} ms "
          f"(+{sim.TurnoverServer.PREFILL_B * 1e3:g} ms a request, x{sim.TurnoverServer.DRAFT_X:g} while speculating)")
    print("| output lengths | server | tok/s | / plain | prefill forwards in a busy batch per 100 steps | probe steps |")
    print("|---|---|---|---|---|---|")
    saved = sim.TurnoverServer.PREFILL_A
    sim.TurnoverServer.PREFILL_A = prefill_s
    try:
        for spread in (0.0, 0.5):
            rows = []
            for name, decide in (("plain", False), ("speculating", True), ("auto", None)):
                server = sim.TurnoverServer(auto, c=c, spread=spread, accept=accept, seed=5)
                for _ in range(steps // 2):
                    server.step(decide=decide)
                f0, s0, t0, k0 = server.forwards, server.steps, sum(server.time.values()), server.tokens
                for _ in range(steps):
                    server.step(decide=decide)
                rate = (server.tokens - k0) / (sum(server.time.values()) - t0)
                probes = server.switch.probe_steps if decide is None else "-"
                rows.append((name, rate, 100 * (server.forwards - f0) / (server.steps - s0), probes))
            lengths = "equal" if spread == 0 else f"+-{spread:.0%}"
            for name, rate, forwards, probes in rows:
                print(f"| {lengths} | {name} | {rate:.0f} | {rate / rows[0][1]:.3f} | {forwards:.1f} | {probes} |",
                      flush=True)
    finally:
        sim.TurnoverServer.PREFILL_A = saved


def charge_table(auto, sim, seeds=(5, 6, 7)):
    def run(c, spread, decide, seed):
        server = sim.TurnoverServer(auto, c=c, spread=spread, accept=2.5, seed=seed)
        return sim.steady_rate(server, decide), server

    print(f"the turnover server, accept 2.5, medians over seeds {list(seeds)}")
    print("| c | prefill forward | output lengths | speculating / plain | auto charged / better side | "
          "auto on wall steps / better side | gain read by seed |")
    print("|---|---|---|---|---|---|---|")
    saved_prefill, turn_min = sim.TurnoverServer.PREFILL_A, auto.TURN_MIN
    try:
        for c in (8, 16, 32, 64):
            for sim.TurnoverServer.PREFILL_A in (4e-3, 12e-3):
                for spread in (0.0, 0.5):
                    cells = []
                    for seed in seeds:
                        plain, spec = run(c, spread, False, seed)[0], run(c, spread, True, seed)[0]
                        charged, server = run(c, spread, None, seed)
                        auto.TURN_MIN = 10 ** 9
                        wall = run(c, spread, None, seed)[0]
                        auto.TURN_MIN = turn_min
                        b = server.switch.buckets[sim.bucket(c)]
                        best = max(plain, spec)
                        read = ("T" if b.turnover_per_step() else "W") + f"{b.gain() or 0:.2f}"
                        cells.append((spec / plain, charged / best, wall / best, read))
                    med = [statistics.median(cell[i] for cell in cells) for i in range(3)]
                    lengths = "equal" if spread == 0 else f"+-{spread:.0%}"
                    print(f"| {c} | {sim.TurnoverServer.PREFILL_A * 1e3:g} ms | {lengths} | {med[0]:.3f} | "
                          f"{med[1]:.3f} | {med[2]:.3f} | {' '.join(cell[3] for cell in cells)} |", flush=True)
    finally:
        sim.TurnoverServer.PREFILL_A, auto.TURN_MIN = saved_prefill, turn_min


def probed_table(auto, sim, seeds=8, budgets=(0.005, 0.01, 0.05)):
    """The GPU's statistic itself: gpu/auto_summary.py's cost_check on the controller's /server_info
    state, with the two sides run throughout standing in for the fixed servers (fixed-1 plain at
    these loads, fixed-c speculating)."""
    sys.path.insert(0, os.path.join(ROOT, "gpu"))
    from auto_summary import cost_check

    saved = sim.TurnoverServer.PREFILL_A
    sim.TurnoverServer.PREFILL_A = 12e-3

    def run(c, decide, seed, budget):
        server = sim.TurnoverServer(auto, c=c, spread=0.5, accept=2.5, seed=seed, budget=budget)
        return sim.steady_rate(server, decide), server

    print(f"the turnover server, accept 2.5, lengths +-50 %, 12-ms forwards, seeds 5-{4 + seeds}")
    print("| c | probe budget | speculating / plain | probed over run: median (range) | "
          "seeds running spec / plain | auto / better side |")
    print("|---|---|---|---|---|---|")
    try:
        for c in (16, 32, 64):
            for budget in budgets:
                truths, ratios, on_spec, autos = [], [], 0, []
                for seed in range(5, 5 + seeds):
                    plain, spec = run(c, False, seed, budget)[0], run(c, True, seed, budget)[0]
                    rate, server = run(c, None, seed, budget)
                    truths.append(spec / plain)
                    autos.append(rate / max(plain, spec))
                    part = {"levels": {str(c): {"fixed": {"1": plain, str(c): spec}, "always_speculating": [c]}}}
                    [row] = cost_check(part, [{"after": f"c={c}", "state": server.switch.as_dict()}])
                    if "probed_over_run" not in row:
                        continue
                    on_spec += row["runs_on"] == "spec"
                    ratios.append(row["probed_over_run"])
                spread = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
                print(f"| {c} | {budget:g} | {statistics.median(truths):.3f} | {spread} | "
                      f"{on_spec} / {len(ratios) - on_spec} | {statistics.median(autos):.3f} |", flush=True)
    finally:
        sim.TurnoverServer.PREFILL_A = saved


def stagger_table(auto, sim, size=16):
    print(f"rare long prefills while speculating, {size} running (quiet gain {sim.true_gain(2.5, size):.2f})")
    print("| p | prefill ms | wall clip | 3 s | 10 s | 40 s | side after 40 s |")
    print("|---|---|---|---|---|---|---|")
    def level(p, prefill, seconds, decide=None):
        server = sim.StaggerServer(auto, p=p, prefill=prefill, accept=2.5, seed=4)
        return server, sim.tokens_per_s(server, seconds, lambda t: size, decide=decide)

    wall_clip = auto.CLIP_WALL
    try:
        for p, prefill in ((0.1, 80e-3), (0.2, 40e-3), (0.3, 25e-3)):
            for clip in (wall_clip, auto.CLIP):
                auto.CLIP_WALL = clip
                cells = []
                for seconds in (3, 10, 40):
                    best = max(level(p, prefill, seconds, lambda bs, s=s: s)[1] for s in (True, False))
                    server, got = level(p, prefill, seconds)
                    cells.append(f"{got / best:.3f}")
                side = "spec" if server.switch.buckets[sim.bucket(size)].applied_speculate else "plain"
                print(f"| {p:g} | {prefill * 1e3:g} | {clip:g}x | {' | '.join(cells)} | {side} |", flush=True)
    finally:
        auto.CLIP_WALL = wall_clip


def deferred_table(auto, sim, seeds=1, settle_s=60.0, measure_s=240.0):
    """gpu/README row 2f's protocol on test_auto.DeferredServer: 64 requests first (plain pays there),
    then 32 (speculation pays for requests with their draft context), the bucket of 32 first seen
    from a plain neighbour; deferred requests accept `dip` less for their first 8 speculative steps.
    auto reading them raw and corrected, against the better fixed side at 32."""
    import statistics

    print("| dip | true gain at 32 (full / deferred) | raw: auto / best, side | corrected: auto / best, side, ratio |")
    print("|---|---|---|---|")

    def rate_at_32(server, side=None):
        decide = None if side is None else (lambda bs: side)
        sim.tokens_per_s(server, settle_s, lambda t: 32, decide)
        return sim.tokens_per_s(server, measure_s, lambda t: 32, decide)

    for dip in (0.0, 0.25, 0.5):
        cells = []
        for setting in ("raw", "correct"):
            got, sides, ratios = [], [], []
            for seed in range(5, 5 + seeds):
                best = max(rate_at_32(sim.DeferredServer(auto, dip=dip, accept=2.5, seed=seed), s) for s in (True, False))
                server = sim.DeferredServer(auto, dip=dip, accept=2.5, seed=seed)
                server.switch.auto = auto.AutoConfig(deferred_accept=setting)
                server.run(64, 6000)
                got.append(rate_at_32(server) / best)
                sides.append("spec" if server.switch.buckets[32].applied_speculate else "plain")
                ratios.append(server.switch.as_dict()["deferred_accept"]["ratio"])
            cell = f"{statistics.median(got):.3f}, {'/'.join(sorted(set(sides)))}"
            if setting == "correct":
                known = [r for r in ratios if r is not None]
                cell += f", {statistics.median(known):.3f}" if known else ", none"
            cells.append(cell)
        gains = f"{sim.true_gain(2.5, 32):.2f} / {sim.true_gain(2.5 - dip, 32):.2f}"
        print(f"| {dip:g} | {gains} | {' | '.join(cells)} |", flush=True)


def host_cost(auto, steps=20000):
    """Host time of the controller per decode step (decide, then the step's accept lengths), by
    batch size: the scheduler thread pays it every step, speculative or plain."""
    import time
    import types

    print("| batch size | controller host time per step |")
    print("|---|---|")
    for bs in (1, 4, 16, 64):
        switch = auto.AutoSwitch(types.SimpleNamespace(threshold=0, hysteresis=0), auto.AutoConfig())
        spec, plain = [2] * bs, [1] * bs
        for _ in range(3000):   # past the first estimates and probes
            switch.observe_accept(bs, spec if switch.decide(bs) else plain)
        t0 = time.perf_counter()
        for _ in range(steps):
            switch.observe_accept(bs, spec if switch.decide(bs) else plain)
        print(f"| {bs} | {(time.perf_counter() - t0) / steps * 1e6:.1f} us |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--extra-ms", default="0,20,40", help="churn: extra ms of the speculative step after a prefill (0: no churn)")
    ap.add_argument("--accept", default="2.5,1.8", help="simulated accept lengths")
    ap.add_argument("--host-cost", action="store_true", help="only the controller's host time per step")
    ap.add_argument("--acc-mix", default=None, help='acceptance phases at one concurrency, e.g. "2.5,1.6"')
    ap.add_argument("--acc-mix-c", type=int, default=16, help="the acc-mix load's concurrency")
    ap.add_argument("--seeds", type=int, default=1, help="acc-mix, --turnover, --probed: medians over this many seeds")
    ap.add_argument("--waves", action="store_true",
                    help="64 requests with dear prefill forwards: equal output lengths keep plain in waves")
    ap.add_argument("--charge", action="store_true",
                    help="busy-batch prefills charged to the side that caused them, against the wall steps")
    ap.add_argument("--turnover", action="store_true",
                    help="acceptance phases with turnovers into the bucket below, short visits following or not")
    ap.add_argument("--probed", action="store_true",
                    help="the probed side's price error from the estimates' noise alone, at three probe budgets")
    ap.add_argument("--stagger", action="store_true",
                    help="rare long prefills while speculating, the wall clip at CLIP_WALL and at 3x")
    ap.add_argument("--spec-sizes", action="store_true",
                    help="the buckets a speculative server captures (1-8, 10-32 by 2, 40-64 by 4)")
    ap.add_argument("--return-ms", type=float, default=None,
                    help="the turnover server's client round trip in ms of its clock (default: 2 steps)")
    ap.add_argument("--deferred", action="store_true",
                    help="row 2f's loads (64, then 32) with deferred requests accepting less at a resume, raw and corrected")
    ap.add_argument("--resume-ms", default=None,
                    help="costly resumes instead of churn: extra ms of the first speculative step after plain ones")
    a = ap.parse_args()
    if a.host_cost:
        host_cost(load_controller())
        return
    sys.path.insert(0, ROOT)
    from tests.dyn import test_auto as sim

    auto = load_controller()
    if a.spec_sizes:
        sim.SIZES[:] = sim.SPEC_SIZES
    if a.return_ms is not None:
        sim.TurnoverServer.RETURN_S = a.return_ms / 1e3
    if a.stagger:
        stagger_table(auto, sim)
        return
    if a.probed:
        probed_table(auto, sim, seeds=a.seeds)
        return
    if a.turnover:
        turnover_table(auto, sim, seeds=a.seeds)
        return
    if a.waves:
        waves_table(auto, sim)
        return
    if a.charge:
        charge_table(auto, sim)
        return
    if a.deferred:
        deferred_table(auto, sim, seeds=a.seeds)
        return
    if a.acc_mix:
        acc_mix_table(auto, sim, [float(x) for x in a.acc_mix.split(",")], a.acc_mix_c, a.seeds)
        return
    if a.resume_ms is not None:
        print("| resume (extra ms) | accept | switches | c=1 | c=4 | c=16 | c=32 | c=64 | bursty |")
        print("|---|---|---|---|---|---|---|---|---|")
        for resume in (float(x) for x in a.resume_ms.split(",")):
            for accept in (float(x) for x in a.accept.split(",")):
                for measure in (True, False):
                    r = resume_ratios(auto, sim, accept, resume / 1e3, measure)
                    cells = " | ".join(f"{v:.3f}" for v in r.values())
                    how = "measured" if measure else "one spec step"
                    print(f"| {resume:g} | {accept:g} | {how} | {cells} |", flush=True)
        return
    print("| churn (extra ms) | accept | c=1 | c=4 | c=16 | c=32 | c=64 | bursty |")
    print("|---|---|---|---|---|---|---|---|")
    for extra in (float(x) for x in a.extra_ms.split(",")):
        for accept in (float(x) for x in a.accept.split(",")):
            r = ratios(auto, sim, accept, extra / 1e3)
            cells = " | ".join(f"{v:.3f}" for v in r.values())
            print(f"| {extra:g} | {accept:g} | {cells} |", flush=True)


if __name__ == "__main__":
    main()

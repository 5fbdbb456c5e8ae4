"""The answer to "where does EAGLE-3 stop paying off, and what threshold should dyn-disable use?"

From the baseline and eagle3 curves (output tok/s per level): the ratio eagle3/baseline at every
level; the crossover is where that ratio falls through 1, interpolated linearly in log2
(concurrency) between the two levels around it. The dyn-disable patch stops drafting when the
running decode requests exceed SGLANG_SPEC_DISABLE_THRESHOLD, so the recommended threshold is
the largest whole concurrency still below the crossover: floor(crossover), at least 1.
For eagle3-dyn: its output tok/s over the better of baseline and eagle3 at each level
(1.0 = it gets the best of both).

Above its threshold eagle3-dyn runs plain steps, and those reach baseline only where the plain
step costs what a baseline step costs. When the run measured eagle3-dyn at levels of at least
PLAIN_LEVEL_FACTOR times its threshold (the records carry the threshold), its output there over
baseline is the plain-step share (the median over those levels); switching pays once eagle3
falls below that share of baseline, not below baseline itself. So the crossover is taken against
min(1, share): for the v1 worker, whose plain steps run without the overlap scheduler (about 0.5x
of baseline on the Kimi-K2.5 shape), that is a much higher threshold than baseline's crossover,
and it is the one that keeps eagle3-dyn at or above stock eagle3 at every level.

The speculative reference is a profile pair: `eagle3` with `eagle3-dyn` (v1 worker) or
`eagle3-v2` with `eagle3-v2-dyn` (v2 worker); `recommend_all` answers for every pair whose
speculative profile the run measured (the v2 worker's crossover differs from v1's).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from toolkit.bench.outputs import median_by_level

METRIC = "output_throughput"
PAIRS = (("eagle3", "eagle3-dyn"), ("eagle3-v2", "eagle3-v2-dyn"))
PLAIN_LEVEL_FACTOR = 2   # levels >= this x the dyn threshold: (nearly) every step is plain


@dataclass
class LevelComparison:
    concurrency: int
    baseline: float | None
    eagle3: float | None            # the speculative reference (Recommendation.speculative)
    eagle3_dyn: float | None        # its dyn-disable profile (Recommendation.dynamic)
    eagle3_over_baseline: float | None
    dyn_over_best: float | None


@dataclass
class Recommendation:
    verdict: str                   # crossover | eagle3-always-wins | eagle3-never-wins | not-enough-data
    crossover_concurrency: float | None
    threshold: int | None
    text: str
    metric: str = METRIC
    levels: list[LevelComparison] = field(default_factory=list)
    speculative: str | None = "eagle3"     # None: the pair's speculative profile was not measured
    dynamic: str | None = "eagle3-dyn"     # None: its dyn-disable profile was not measured
    measured: list[str] = field(default_factory=list)   # every profile the records hold
    plain_share: float | None = None   # the dyn profile's plain steps over baseline, when measured
    break_even: float = 1.0            # the eagle3/baseline ratio the crossover is taken at

    def to_dict(self) -> dict:
        return asdict(self)


def _curve(levels: list[dict], profile: str) -> dict[int, float]:
    """concurrency -> metric for one profile, from one record per level (`median_by_level`)."""
    curve: dict[int, float] = {}
    for record in levels:
        value = record.get("metrics", {}).get(METRIC)
        if record.get("profile") == profile and value is not None and record["metrics"].get("completed"):
            curve[int(record["concurrency"])] = float(value)
    return curve


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def crossover(levels: list[int], ratios: list[float], at: float = 1.0) -> float | None:
    """First concurrency where ratio (eagle3/baseline) reaches `at` after being above it."""
    for i in range(1, len(levels)):
        before, after = ratios[i - 1], ratios[i]
        if before > at >= after:
            x0, x1 = math.log2(levels[i - 1]), math.log2(levels[i])
            x = x0 + (before - at) / (before - after) * (x1 - x0)
            return 2 ** x
    return None


def dyn_threshold(records: list[dict], profile: str) -> int | None:
    """The threshold the dyn profile's server ran with (its records' server.dyn_disable); None
    for a server with threshold=auto, which has no one level above which every step is plain."""
    for record in records:
        dyn = record.get("server", {}).get("dyn_disable")
        if record.get("profile") == profile and isinstance(dyn, dict) and dyn.get("threshold"):
            return None if dyn["threshold"] == "auto" else int(dyn["threshold"])
    return None


def plain_step_share(base: dict[int, float], dyn: dict[int, float],
                     threshold: int | None) -> tuple[float | None, list[int]]:
    """Median dyn/baseline over the levels >= PLAIN_LEVEL_FACTOR x threshold, and those levels."""
    if threshold is None:
        return None, []
    levels = [c for c in sorted(dyn) if c in base and c >= PLAIN_LEVEL_FACTOR * threshold]
    if not levels:
        return None, []
    return statistics.median(dyn[c] / base[c] for c in levels), levels


def recommend(records: list[dict], *, baseline: str = "baseline", eagle3: str = "eagle3",
              eagle3_dyn: str = "eagle3-dyn") -> Recommendation:
    levels = median_by_level(records)   # the median where a level ran several times (--repeat)
    base, spec, dyn = _curve(levels, baseline), _curve(levels, eagle3), _curve(levels, eagle3_dyn)
    all_levels = sorted(set(base) | set(spec) | set(dyn))
    table = []
    for c in all_levels:
        b, e, d = base.get(c), spec.get(c), dyn.get(c)
        best = max(v for v in (b, e) if v is not None) if (b is not None or e is not None) else None
        table.append(LevelComparison(c, b, e, d, _ratio(e, b), _ratio(d, best)))
    shared = [c for c in all_levels if c in base and c in spec]
    measured = sorted({str(r.get("profile")) for r in records})
    names = {"speculative": eagle3 if eagle3 in measured else None,
             "dynamic": eagle3_dyn if eagle3_dyn in measured else None, "measured": measured}
    reference = f"baseline/{eagle3}" if spec else "baseline"
    if len(shared) < 1:
        text = (f"need both '{baseline}' and '{eagle3}' at one or more common concurrency levels "
                f"to place a threshold")
        return Recommendation("not-enough-data", None, None, text + _dyn_summary(table, eagle3_dyn, reference),
                              levels=table, **names)
    ratios = [spec[c] / base[c] for c in shared]
    threshold_run = dyn_threshold(records, eagle3_dyn)
    share, plain_levels = plain_step_share(base, dyn, threshold_run)
    at = min(1.0, share) if share is not None else 1.0
    names.update(plain_share=share, break_even=at)
    against = ("baseline" if at == 1.0 else
               f"{at:.2f} of baseline, what {eagle3_dyn}'s plain steps reached at concurrency "
               f"{', '.join(map(str, plain_levels))} (its threshold there: {threshold_run})")
    point = crossover(shared, ratios, at)
    if point is not None:
        threshold = max(1, math.floor(point))
        text = (f"{eagle3} stops paying off at about concurrency {point:.1f} (output tok/s, {eagle3} vs "
                f"{against}; interpolated between {max(c for c in shared if c < point)} and "
                f"{min(c for c in shared if c >= point)}); recommended dyn-disable threshold: {threshold} "
                f"(SGLANG_SPEC_DISABLE_THRESHOLD={threshold}: drafting stops above {threshold} running requests)")
        verdict = "crossover" if ratios[0] > 1.0 else "eagle3-never-wins"
        if verdict == "eagle3-never-wins":
            text = (f"{eagle3} does not beat baseline even at concurrency {shared[0]} (ratio "
                    f"{ratios[0]:.2f}): baseline is the faster server. If you keep {eagle3_dyn}: " + text)
    elif all(r > at for r in ratios):
        point, threshold = None, None
        text = (f"{eagle3} wins at every measured level up to concurrency {shared[-1]} "
                f"(ratio {ratios[-1]:.2f} there, against {against}): no crossover measured; a threshold "
                f"of at least {shared[-1]} keeps it on everywhere measured; measure higher levels to place it")
        verdict = "eagle3-always-wins"
    elif ratios[0] <= at:
        point, threshold = None, None
        text = (f"{eagle3} does not beat {against} even at concurrency {shared[0]} "
                f"(ratio {ratios[0]:.2f}): use baseline; no dyn-disable threshold helps")
        verdict = "eagle3-never-wins"
    else:
        point, threshold = None, None
        text = f"the {eagle3}/baseline ratio never falls through {at:.2f} between measured levels"
        verdict = "not-enough-data"
    return Recommendation(verdict, point, threshold, text + _dyn_summary(table, eagle3_dyn, reference),
                          levels=table, **names)


def _dyn_summary(table: list[LevelComparison], eagle3_dyn: str, reference: str) -> str:
    """'. DYN reaches a-b of the better of baseline/EAGLE3 across levels', or '' without figures."""
    ratios = [row.dyn_over_best for row in table if row.dyn_over_best is not None]
    if not ratios:
        return ""
    best = "the better of " + reference if "/" in reference else reference
    return f". {eagle3_dyn} reaches {min(ratios):.2f}-{max(ratios):.2f} of {best} across levels"


def recommend_all(records: list[dict], *, baseline: str = "baseline") -> list[Recommendation]:
    """One recommendation per speculative pair the run measured either side of (eagle3 first);
    at least one."""
    measured = {record.get("profile") for record in records}
    pairs = [pair for pair in PAIRS if measured & set(pair)]
    if not pairs:
        names = sorted(str(p) for p in measured)
        text = (f"no speculative profile was measured (only {', '.join(names)}): a dyn-disable threshold "
                f"needs '{baseline}' and an EAGLE-3 profile measured at the same levels")
        return [Recommendation("not-enough-data", None, None, text, speculative=None, dynamic=None,
                               measured=names)]
    return [recommend(records, baseline=baseline, eagle3=spec, eagle3_dyn=dyn) for spec, dyn in pairs]

"""The answer to "where does EAGLE-3 stop paying off, and what threshold should dyn-disable use?"

From the baseline and eagle3 curves (output tok/s per level): the ratio eagle3/baseline at every
level; the crossover is where that ratio falls through 1, interpolated linearly in log2
(concurrency) between the two levels around it. The dyn-disable patch stops drafting when the
running decode requests exceed SGLANG_SPEC_DISABLE_THRESHOLD, so the recommended threshold is
the largest whole concurrency still below the crossover: floor(crossover), at least 1.
For eagle3-dyn: its output tok/s over the better of baseline and eagle3 at each level
(1.0 = it gets the best of both).

The speculative reference is a profile pair: `eagle3` with `eagle3-dyn` (v1 worker) or
`eagle3-v2` with `eagle3-v2-dyn` (v2 worker); `recommend_all` answers for every pair whose
speculative profile the run measured (the v2 worker's crossover differs from v1's).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .outputs import median_by_level

METRIC = "output_throughput"
PAIRS = (("eagle3", "eagle3-dyn"), ("eagle3-v2", "eagle3-v2-dyn"))


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


def crossover(levels: list[int], ratios: list[float]) -> float | None:
    """First concurrency where ratio (eagle3/baseline) reaches 1 after being above it."""
    for i in range(1, len(levels)):
        before, after = ratios[i - 1], ratios[i]
        if before > 1.0 >= after:
            x0, x1 = math.log2(levels[i - 1]), math.log2(levels[i])
            x = x0 + (before - 1.0) / (before - after) * (x1 - x0)
            return 2 ** x
    return None


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
    point = crossover(shared, ratios)
    if point is not None:
        threshold = max(1, math.floor(point))
        text = (f"{eagle3} stops paying off at about concurrency {point:.1f} (output tok/s, {eagle3} vs "
                f"baseline, interpolated between {max(c for c in shared if c < point)} and "
                f"{min(c for c in shared if c >= point)}); recommended dyn-disable threshold: {threshold} "
                f"(SGLANG_SPEC_DISABLE_THRESHOLD={threshold}: drafting stops above {threshold} running requests)")
        verdict = "crossover"
    elif all(r > 1.0 for r in ratios):
        point, threshold = None, None
        text = (f"{eagle3} wins at every measured level up to concurrency {shared[-1]} "
                f"(ratio {ratios[-1]:.2f} there): no crossover measured; a threshold of at least "
                f"{shared[-1]} keeps it on everywhere measured; measure higher levels to place it")
        verdict = "eagle3-always-wins"
    elif ratios[0] <= 1.0:
        point, threshold = None, None
        text = (f"{eagle3} does not beat baseline even at concurrency {shared[0]} "
                f"(ratio {ratios[0]:.2f}): use baseline; no dyn-disable threshold helps")
        verdict = "eagle3-never-wins"
    else:
        point, threshold = None, None
        text = f"the {eagle3}/baseline ratio never falls through 1 between measured levels"
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

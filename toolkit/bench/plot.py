"""The bench PNG: total output tok/s and per-request output tok/s against concurrency.

One line per profile (per run and profile when comparing runs), log2 x axis at the measured
levels, axes with units, a legend, and the EAGLE-3 crossover marked where there is one.
"""
from __future__ import annotations

from pathlib import Path

from toolkit.bench.outputs import median_by_level


def _series(records: list[dict], label_of) -> dict[str, list[tuple[int, float | None, float | None]]]:
    series: dict[str, dict[int, tuple[float | None, float | None]]] = {}
    for record in median_by_level(records, key=lambda r: (label_of(r), int(r["concurrency"]))):
        metrics = record.get("metrics", {})
        if not metrics.get("completed"):
            continue
        series.setdefault(label_of(record), {})[int(record["concurrency"])] = (
            metrics.get("output_throughput"), metrics.get("mean_request_output_throughput_tok_s"))
    return {label: [(c, *values[c]) for c in sorted(values)] for label, values in series.items()}


def plot_throughput(records: list[dict], path: Path, *, title: str | None = None,
                    crossover: float | None = None, label_of=None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    label_of = label_of or (lambda record: record["profile"])
    series = _series(records, label_of)
    levels = sorted({c for points in series.values() for c, _, _ in points}) or [1]
    figure, (total_ax, per_request_ax) = plt.subplots(1, 2, figsize=(13, 5.2))
    for label, points in series.items():
        xs = [c for c, _, _ in points]
        total_ax.plot(xs, [t for _, t, _ in points], marker="o", label=label)
        per_request_ax.plot(xs, [p for _, _, p in points], marker="o", label=label)
    for ax, ylabel, heading in (
            (total_ax, "output throughput, all requests (tokens/s)", "Total output throughput"),
            (per_request_ax, "output speed per request (tokens/s)", "Per-request output speed (mean)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(levels))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(c) for c in levels])
        ax.set_xlabel("concurrency (requests in flight, log2 scale)")
        ax.set_ylabel(ylabel)
        ax.set_title(heading)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="major", alpha=0.3)
        if crossover is not None:
            ax.axvline(crossover, color="grey", linestyle="--", linewidth=1,
                       label=f"eagle3/baseline crossover ≈ {crossover:.1f}")
        ax.legend()
    figure.suptitle(title or "Bench: throughput against concurrency")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

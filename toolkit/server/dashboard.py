"""The Grafana dashboard of dashboards/sglang-dyn-disable.json drawn into a PNG from a scraped
`/metrics` time series (JSONL, `toolkit.server.scrape`; `invoke server watch --record FILE` or
gpu/scrape_metrics.py writes one), so docs can show the panels filled from a real run without
a Grafana.

Each panel of the dashboard has a recipe here, keyed by its title, that computes what its
PromQL computes from the samples (`increase(x[1m])`: the counter's rise over the last minute of
samples, counter resets handled as Prometheus does; `rate`: that rise per second); panels are
laid out by the dashboard's own `gridPos`.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from toolkit.core import paths
from toolkit.server import scrape

DASHBOARD = paths.PROJECT_ROOT / "dashboards" / "sglang-dyn-disable.json"
WINDOW_S = 60.0
D = scrape.DYN_PREFIX


class DashboardError(ValueError):
    pass


class Series:
    """The samples of a scrape as arrays over time (NaN where a scrape lacks a key)."""

    def __init__(self, snapshots: list[scrape.Snapshot]):
        if not snapshots:
            raise DashboardError("the scrape holds no samples")
        self.t0 = snapshots[0].t
        self.t = np.array([s.t - self.t0 for s in snapshots])
        self._snapshots = snapshots

    def __call__(self, key: str) -> np.ndarray:
        return np.array([np.nan if s.get(key) is None else s.values[key] for s in self._snapshots])

    def has(self, key: str) -> bool:
        return any(s.get(key) is not None for s in self._snapshots)

    def increase(self, key: str, window: float = WINDOW_S, per: float | None = None) -> np.ndarray:
        """The counter's rise over the trailing window at each sample (scaled to `per` seconds
        when given: a rate); NaN where the window holds one sample."""
        v = self(key)
        steps = np.diff(v, prepend=v[:1])
        steps = np.where(steps < 0, v, steps)        # a reset: the counter started again from 0
        total = np.nancumsum(np.nan_to_num(steps))
        out = np.full(len(v), np.nan)
        start = 0
        for i, now in enumerate(self.t):
            while self.t[start] < now - window:
                start += 1
            span = now - self.t[start]
            if span > 0 and not np.isnan(v[i]):
                rise = total[i] - total[start]
                out[i] = rise / span * per if per else rise
        return out


Line = tuple[str, np.ndarray, dict]        # label, values, plot style


def _running(s: Series) -> list[Line]:
    lines = [("running", s(scrape.RUNNING), {}), ("queued", s(scrape.QUEUED), {"alpha": 0.6})]
    if s.has(D + "threshold"):
        lines.append(("threshold", s(D + "threshold"), {"linestyle": "--", "color": "red"}))
        lines.append(("resume at", s(D + "threshold") - s(D + "hysteresis"), {"linestyle": ":", "color": "green"}))
    return lines


def _drafting(s: Series) -> list[Line]:
    return [("drafting", s(D + "drafting"), {"drawstyle": "steps-post"})]


def _switches(s: Series) -> list[Line]:
    # 60 * rate(x[1m]): the rise over the trailing minute per minute of samples it spans (in a
    # scrape's first minute, since its start), so a run shorter than a minute shows a rate too
    return [("off", s.increase(D + "switches_off_total", per=60.0), {}),
            ("on", s.increase(D + "switches_on_total", per=60.0), {"linestyle": "--"})]


def _plain_share(s: Series) -> list[Line]:
    plain = s.increase(D + "plain_steps_total")
    spec = s.increase(D + "spec_steps_total")
    with np.errstate(invalid="ignore", divide="ignore"):
        return [("plain share", plain / (plain + spec), {})]


def _accept(s: Series) -> list[Line]:
    return [("accept length", s(scrape.ACCEPT_LENGTH), {})]


def _tokens(s: Series) -> list[Line]:
    return [("output tok/s", s.increase(scrape.GENERATION_TOKENS, per=1.0), {}),
            ("gen_throughput", s(scrape.GEN_THROUGHPUT), {"alpha": 0.6})]


# panel title -> (recipe, the metrics its PromQL reads: the test keeps both sides in step)
RECIPES: dict[str, tuple[Callable[[Series], list[Line]], set[str]]] = {
    "Running requests vs threshold": (_running, {scrape.RUNNING, scrape.QUEUED, D + "threshold", D + "hysteresis"}),
    "Speculation on/off": (_drafting, {D + "drafting"}),
    "Switches per minute": (_switches, {D + "switches_off_total", D + "switches_on_total"}),
    "Plain-step share": (_plain_share, {D + "plain_steps_total", D + "spec_steps_total"}),
    "Accept length": (_accept, {scrape.ACCEPT_LENGTH}),
    "Output tokens/s": (_tokens, {scrape.GENERATION_TOKENS, scrape.GEN_THROUGHPUT}),
}


def load(path: Path = DASHBOARD) -> dict:
    data = json.loads(Path(path).read_text())
    missing = [p.get("title") for p in data.get("panels", []) if p.get("title") not in RECIPES]
    if missing:
        raise DashboardError(f"no renderer recipe for panel(s) {missing}")
    return data


def render(scrape_path: Path, out: Path, *, dashboard: Path = DASHBOARD, host: str | None = None,
           title: str | None = None) -> Path:
    """Draw every panel of the dashboard from the scrape into `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.gridspec import GridSpec

    data = load(dashboard)
    series = Series(scrape.read_series(Path(scrape_path), host=host))
    panels = data["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(16, rows * 0.45 + 1), layout="constrained")
    grid = GridSpec(rows, 24, figure=fig)
    for panel in panels:
        pos = panel["gridPos"]
        ax = fig.add_subplot(grid[pos["y"]:pos["y"] + pos["h"], pos["x"]:pos["x"] + pos["w"]])
        recipe, _ = RECIPES[panel["title"]]
        drawn = 0
        for label, values, style in recipe(series):
            if np.all(np.isnan(values)):
                continue
            ax.plot(series.t, values, label=label, linewidth=1.5, **style)
            drawn += 1
        ax.set_title(panel["title"], fontsize=10, loc="left")
        defaults = panel.get("fieldConfig", {}).get("defaults", {})
        if "min" in defaults or "max" in defaults:
            low, high = defaults.get("min"), defaults.get("max")
            ax.set_ylim(low if low is not None else ax.get_ylim()[0],
                        (high * 1.05 if high else high) if high is not None else ax.get_ylim()[1])
        if not drawn:
            ax.text(0.5, 0.5, "not in this scrape", ha="center", va="center", transform=ax.transAxes,
                    color="grey")
        else:
            ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds", fontsize=7)
    start = datetime.fromtimestamp(series.t0, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    fig.suptitle(title or f"{data['title']}: {Path(scrape_path).name}, {len(series.t)} scrapes from {start}",
                 fontsize=12)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return out

"""Where a bench run goes: `results.jsonl` (one record per profile x level, appended and flushed
as each level finishes), `results.csv` (the same, flat), and reading runs back for `compare`."""
from __future__ import annotations

import csv
import json
import os
import statistics
from pathlib import Path

from toolkit.bench.metrics import LATENCY_METRICS, PERCENTILES

JSONL_NAME = "results.jsonl"
CSV_NAME = "results.csv"
PLOT_NAME = "throughput.png"
RECOMMENDATION_NAME = "recommendation.json"

_STATS = ["mean"] + [name for name, _ in PERCENTILES]
CSV_METRICS = (["completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
                "mean_input_tokens", "mean_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput"]
               + [f"{stat}_{m}_ms" for m in LATENCY_METRICS for stat in _STATS]
               + [f"{stat}_request_output_throughput_tok_s" for stat in _STATS]
               + ["mean_events_per_request", "mean_arrivals_per_request", "mean_tokens_per_arrival",
                  "coalesced_event_share", "held_back_streams", "held_back_replacement_share"])
CSV_COLUMNS = (["run_id", "time", "profile", "concurrency", "repeat", "requests", "dataset", "output_len",
                "input_len", "seed", "server_kind", "attention_backend", "tp_size", "architecture",
                "speculative_algorithm", "dyn_threshold", "dyn_hysteresis", "avg_spec_accept_length",
                "accept_length_before_first_level", "accept_length_after_level", "simulated_accept_length",
                "stopped_early"]
               + CSV_METRICS)

# Decimal places per CSV column (the JSONL keeps full precision): enough to compare runs, no
# float noise. Columns not named here are written as they are (integers, text).
_CSV_DECIMALS = {"duration_s": 3, "request_throughput": 3, "output_throughput": 1, "total_token_throughput": 1,
                 "mean_input_tokens": 1, "mean_output_tokens": 1, "avg_spec_accept_length": 3,
                 "accept_length_before_first_level": 3, "accept_length_after_level": 3,
                 "mean_events_per_request": 1, "mean_arrivals_per_request": 1, "mean_tokens_per_arrival": 2,
                 "coalesced_event_share": 3, "held_back_replacement_share": 3,
                 **{f"{stat}_{m}_ms": 2 for m in LATENCY_METRICS for stat in _STATS},
                 **{f"{stat}_request_output_throughput_tok_s": 2 for stat in _STATS}}


class OutputError(ValueError):
    pass


class RunWriter:
    """The files of one run. The folder is made with the first write: a run that finishes no
    level leaves nothing behind."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.jsonl = self.out_dir / JSONL_NAME
        self.csv = self.out_dir / CSV_NAME
        self.plot = self.out_dir / PLOT_NAME
        self.recommendation = self.out_dir / RECOMMENDATION_NAME

    def check_new(self) -> None:
        """Refuse a folder that already holds a run (appending would mix two runs)."""
        if self.jsonl.exists():
            raise OutputError(f"{self.out_dir} already holds a bench run ({JSONL_NAME}); "
                              f"give a new --out folder or move that one away")
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise OutputError(f"--out {self.out_dir} is a file, not a folder")

    def append(self, record: dict) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.jsonl, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def write_csv(self, records: list[dict]) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_csv(records, self.csv)
        return self.csv

    def write_recommendation(self, data: dict) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.recommendation.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        return self.recommendation


def csv_row(record: dict) -> dict:
    params = record.get("params", {})
    server = record.get("server", {})
    metrics = record.get("metrics", {})
    dyn = server.get("dyn_disable") if isinstance(server.get("dyn_disable"), dict) else {}
    accept = server.get("accept_length") if isinstance(server.get("accept_length"), dict) else {}
    row = {"run_id": record.get("run_id"), "time": record.get("time"), "profile": record.get("profile"),
           "concurrency": record.get("concurrency"), "repeat": record.get("repeat", 0),
           "requests": record.get("requests"),
           "dataset": params.get("dataset"), "output_len": params.get("output_len"),
           "input_len": params.get("input_len"), "seed": params.get("seed"),
           "server_kind": server.get("kind"), "attention_backend": server.get("attention_backend"),
           "tp_size": server.get("tp_size"), "architecture": server.get("architecture"),
           "speculative_algorithm": server.get("speculative_algorithm"),
           "dyn_threshold": dyn.get("threshold"), "dyn_hysteresis": dyn.get("hysteresis"),
           "avg_spec_accept_length": server.get("avg_spec_accept_length"),
           "accept_length_before_first_level": accept.get("before_first_level"),
           "accept_length_after_level": accept.get("after_level"),
           "simulated_accept_length": accept.get("simulated"),
           "stopped_early": record.get("stopped_early")}
    row.update({name: metrics.get(name) for name in CSV_METRICS})
    return {name: _rounded(name, value) for name, value in row.items()}


def _rounded(column: str, value):
    places = _CSV_DECIMALS.get(column)
    if places is None or not isinstance(value, float):
        return value
    return round(value, places)


def write_csv(records: list[dict], path: Path) -> None:
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for record in records:
            writer.writerow({k: ("" if v is None else v) for k, v in csv_row(record).items()})
    tmp.replace(path)


def load_records(path: Path) -> list[dict]:
    """Records of one run: a results.jsonl file or a run folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / JSONL_NAME
    if not path.is_file():
        raise OutputError(f"{path}: no such file (give a results.jsonl or a bench output folder)")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            # A run killed mid-write leaves at most a torn last line; keep everything before it.
            if number == len(path.read_text(encoding="utf-8").splitlines()):
                break
            raise OutputError(f"{path}:{number}: not a JSON line") from None
        if not (isinstance(record, dict) and "profile" in record and "concurrency" in record
                and isinstance(record.get("metrics"), dict)):
            raise OutputError(f"{path}:{number}: not a bench record (needs profile, concurrency, metrics)")
        records.append(record)
    if not records:
        raise OutputError(f"{path}: holds no bench records")
    return records


def median_by_level(records: list[dict], key=None) -> list[dict]:
    """One record per (profile, concurrency) -- or per `key(record)` -- in first-seen order.

    Levels run once stay as they are. For a level run several times (`--repeat`), numeric
    metrics become the median over the runs that completed requests, `metrics["repeats"]`
    counts those runs and `metrics["output_throughput_range"]` gives [min, max]."""
    key = key or (lambda record: (record["profile"], int(record["concurrency"])))
    groups: dict = {}
    for record in records:
        groups.setdefault(key(record), []).append(record)
    merged = []
    for group in groups.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        runs = [r for r in group if r.get("metrics", {}).get("completed")] or group
        metrics = dict(runs[-1]["metrics"])
        for name in metrics:
            values = [r["metrics"].get(name) for r in runs]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                metrics[name] = statistics.median(values)
        throughputs = [r["metrics"].get("output_throughput") for r in runs
                       if r["metrics"].get("output_throughput") is not None]
        metrics["repeats"] = len(runs)
        if throughputs:
            metrics["output_throughput_range"] = [min(throughputs), max(throughputs)]
        merged.append({**runs[-1], "metrics": metrics})
    return merged

"""`invoke bench compare`: earlier runs side by side, one column per run and profile."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from toolkit.bench.outputs import load_records, median_by_level

# (metric key, heading) shown by compare, one table each.
COMPARED = (("output_throughput", "output tok/s"),
            ("mean_request_output_throughput_tok_s", "per-request tok/s (mean)"),
            ("median_ttft_ms", "TTFT p50 (ms)"),
            ("median_tpot_ms", "TPOT p50 (ms)"))


@dataclass
class Comparison:
    columns: list[str]                       # "<run label>:<profile>"
    levels: list[int]
    tables: dict[str, list[list]] = field(default_factory=dict)   # heading -> rows [c, v1, v2...]
    records: list[dict] = field(default_factory=list)              # with "_label" set

    def to_dict(self) -> dict:
        return {"columns": self.columns, "levels": self.levels, "tables": self.tables}


def run_label(path: Path, record: dict, taken: set[str]) -> str:
    path = Path(path)
    label = path.name if path.is_dir() else (path.parent.name or path.stem)
    return label if label not in taken else f"{label}#{len(taken) + 1}"


def compare(paths: list[Path]) -> Comparison:
    records: list[dict] = []
    labels: set[str] = set()
    for path in paths:
        loaded = load_records(path)
        label = run_label(path, loaded[0], labels)
        labels.add(label)
        for record in loaded:
            records.append({**record, "_label": f"{label}:{record['profile']}"})
    columns: list[str] = []
    for record in records:
        if record["_label"] not in columns:
            columns.append(record["_label"])
    levels = sorted({int(r["concurrency"]) for r in records})
    cells = {(r["_label"], int(r["concurrency"])): r["metrics"]
             for r in median_by_level(records, key=lambda r: (r["_label"], int(r["concurrency"])))}
    comparison = Comparison(columns, levels, records=records)
    for key, heading in COMPARED:
        rows = []
        for c in levels:
            row = [c]
            for column in columns:
                value = cells.get((column, c), {}).get(key)
                row.append(None if value is None else round(float(value), 2))
            rows.append(row)
        comparison.tables[heading] = rows
    return comparison

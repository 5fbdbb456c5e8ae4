"""The JSON file of figures that the benchmarks write (`--record FILE` / `--save FILE`)."""
import json
from pathlib import Path


def write(path: str, figures: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(figures, indent=2) + "\n")
    print(f"recorded: {path}")

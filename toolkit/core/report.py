"""Console output shared by all commands: tables, per-host result rows, JSON.

Engine code returns plain data; the command layer hands it here to print (HTTPie's
`output/` split). Rich renders the tables; with `--json` nothing but JSON is printed.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

def _width(stream) -> int | None:
    # Logs and pipes get wide tables instead of rich's 80-column default; a terminal keeps its own.
    return None if stream.isatty() else 160


console = Console(highlight=False, soft_wrap=True, width=_width(sys.stdout))
err_console = Console(stderr=True, highlight=False, soft_wrap=True, width=_width(sys.stderr))

STATUS_STYLE = {"ok": "green", "changed": "yellow", "failed": "red", "skipped": "dim",
                "pristine": "green", "patched": "cyan", "drifted": "red", "missing": "red",
                "pass": "green", "fail": "red", "would change": "yellow"}


def styled(status: str) -> str:
    style = STATUS_STYLE.get(status)
    return f"[{style}]{status}[/{style}]" if style else status


def table(title: str | None, columns: Iterable[str], rows: Iterable[Iterable[Any]],
          status_column: int | None = None) -> None:
    t = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        t.add_column(column)
    for row in rows:
        cells = ["" if c is None else str(c) for c in row]
        if status_column is not None:
            cells[status_column] = styled(cells[status_column])
        t.add_row(*cells)
    console.print(t)


def line(text: str = "") -> None:
    console.print(text, markup=False)


def note(text: str) -> None:
    """Progress and remarks go to stderr so stdout stays clean for --json."""
    err_console.print(text, markup=False)


def error(text: str) -> None:
    err_console.print(f"[red]error:[/red] {escape(text)}")


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()

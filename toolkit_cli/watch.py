"""`invoke server watch`: the live table (rich Live) over `toolkit.server.watch`."""
from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from invoke.exceptions import Exit
from rich.live import Live
from rich.table import Table

from toolkit.core import report
from toolkit.server import watch as engine

from toolkit_cli.common import fail, hosts_or_exit

COLUMNS = ["host", "state", "profile", "patches", "run/queue", "drafting", "since", "switches off/on",
           "accept len", "gen tok/s", "KV use", "ranks", "note"]
STATE_STYLE = {"up": "green", "down": "red", "unreachable": "red", "no server": "dim"}


def _num(value, digits=0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _clock(t) -> str:
    return "-" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M:%SZ")


def _ago(now: float, then) -> str:
    if then is None:
        return "-"
    seconds = max(0, int(now - then))
    return f"{_clock(then)} ({seconds // 60}m{seconds % 60:02d}s)" if seconds >= 60 else f"{_clock(then)} ({seconds}s)"


def row(view: engine.HostView) -> list[str]:
    dyn = view.dyn or {}
    drafting = "-" if not dyn else ("on" if dyn.get("speculating") else "off") + f" (>{dyn.get('threshold')})"
    switches = "-" if not dyn or dyn.get("switches_off") is None else f"{dyn['switches_off']}/{dyn['switches_on']}"
    ranks = "-"
    if view.ranks:
        gone = [f"TP{r}" for r, v in view.ranks.items() if v != "ok"]
        ranks = f"{len(view.ranks) - len(gone)}/{len(view.ranks)} ok" + (f", gone: {','.join(gone)}" if gone else "")
    running = "-" if view.running is None else f"{_num(view.running)}/{_num(view.queued)}"
    usage = "-" if view.token_usage is None else f"{view.token_usage:.0%}"
    return [view.host, view.state, view.profile or "-", ",".join(view.patch_stack) or "-", running, drafting,
            _ago(view.t, dyn.get("since")) if dyn else "-", switches, _num(view.accept_length, 2),
            _num(view.gen_throughput, 1), usage, ranks, view.problem]


def table(views: list[engine.HostView], caption: str = "") -> Table:
    t = Table(title=None, caption=caption or None, caption_justify="left")
    for column in COLUMNS:
        t.add_column(column, overflow="fold")
    for view in views:
        cells = row(view)
        style = STATE_STYLE.get(view.state)
        if style:
            cells[1] = f"[{style}]{cells[1]}[/{style}]"
        if view.dyn and view.dyn.get("speculating") is False:
            cells[5] = f"[yellow]{cells[5]}[/yellow]"
        t.add_row(*cells)
    return t


def _record(path: Path | None, views: list[engine.HostView], several: bool) -> None:
    if path is None:
        return
    for view in views:
        if view.snapshot is not None:
            line = view.snapshot.to_json()
            if several:
                line["host"] = view.host
            with open(path, "a") as handle:
                handle.write(json.dumps(line, sort_keys=True) + "\n")


def watch(host_spec, interval: float, once: bool, polls: int | None, json_: bool, record: str | None) -> None:
    hosts = hosts_or_exit(host_spec)
    if interval <= 0:
        fail("--interval takes seconds > 0", code=2)
    if polls is not None and polls < 1:
        fail("--polls takes an integer >= 1", code=2)
    record_path = Path(record) if record else None
    several = len(hosts) > 1
    if once:
        views = engine.poll_once(hosts)
        _record(record_path, views, several)
        if json_:
            report.emit_json([v.to_json() for v in views])
        else:
            report.console.print(table(views))
        if any(v.state != "up" for v in views):
            raise Exit(code=1)
        return
    watches = [engine.HostWatch(h) for h in hosts]
    pool = ThreadPoolExecutor(max_workers=min(16, len(watches)))
    done = 0
    live = None
    try:
        if not json_:
            live = Live(table([]), console=report.console, auto_refresh=False, transient=False)
            live.start()
        while polls is None or done < polls:
            views = list(pool.map(lambda w: w.poll(), watches))
            done += 1
            _record(record_path, views, several)
            if json_:
                sys.stdout.write(json.dumps([v.to_json() for v in views], sort_keys=True, default=str) + "\n")
                sys.stdout.flush()
            else:
                live.update(table(views, f"poll {done}, every {interval:g}s; Ctrl-C leaves"), refresh=True)
            if polls is not None and done >= polls:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
        # a poll still running (Ctrl-C during it) ends by its own timeouts before its connection is
        # closed: closing an SSH transport under a worker thread could leave it, and the exit, waiting
        pool.shutdown(wait=True, cancel_futures=True)
        for w in watches:
            w.close()
    report.note(f"watch ended after {done} poll(s)")


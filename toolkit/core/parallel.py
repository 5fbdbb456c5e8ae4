"""Run one engine function on several hosts at once, one outcome per host."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from toolkit.core.inventory import Host


@dataclass
class HostOutcome:
    host: Host
    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def for_each_host(hosts: list[Host], action: Callable[[Host], Any],
                  on_interrupt: Callable[[], None] | None = None) -> list[HostOutcome]:
    """Call `action(host)` for every host in parallel; exceptions become failed outcomes.

    Only the main thread sees Ctrl-C: `on_interrupt()` runs there at once, before waiting for the
    workers (so it can tell them to stop), then the KeyboardInterrupt goes on to the caller."""

    def one(host: Host) -> HostOutcome:
        try:
            return HostOutcome(host, value=action(host))
        except Exception as exc:  # reported per host, never lost
            return HostOutcome(host, error=exc)

    if len(hosts) == 1:
        return [one(hosts[0])]
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        try:
            return list(pool.map(one, hosts))
        except KeyboardInterrupt:
            if on_interrupt is not None:
                on_interrupt()
            raise

"""How much of a bench level ran without drafting: the dyn-disable switch read before and after
the level, from SGLang's `/metrics` (the dyn-disable metrics patch) or, without metrics, from
`/server_info`'s `dyn_spec_disable`. A record gets `dyn_disable_level` only when the server
exposes the switch:

    {"source": "metrics", "before": {...}, "after": {...}, "switches_off": 3, "switches_on": 3,
     "spec_steps": 120, "plain_steps": 880, "forced_spec_steps": 0, "plain_step_share": 0.88}

`before`/`after` hold the switch's counters and state; the other keys are the change over the
level (`plain_step_share`: plain / (spec + plain) decode steps). A restart in between (counters
going down) leaves the change out and keeps the two readings.
"""
from __future__ import annotations

from toolkit.server import scrape
from toolkit.check.client import ClientError, OpenAIClient


async def reading(base_url: str) -> dict | None:
    """The switch's state now, with its source; None when the server exposes none."""
    async with OpenAIClient(base_url, timeout=30.0, max_connections=2) as client:
        try:
            snapshot = await scrape.read(client)
        except (ClientError, scrape.ScrapeError):
            snapshot = None
        state = snapshot.dyn_state() if snapshot is not None else None
        if state is not None:
            return {"source": "metrics", **state}
        try:
            state = scrape.dyn_from_server_info(await client.server_info())
        except ClientError:
            state = None
        return {"source": "server_info", **state} if state is not None else None


def level_entry(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    keep = ("speculating", "threshold", "hysteresis", *scrape.DYN_COUNTERS)
    entry = {"source": after["source"], "before": {k: before.get(k) for k in keep},
             "after": {k: after.get(k) for k in keep}}
    entry.update(scrape.level_change(before, after) or {})
    return entry

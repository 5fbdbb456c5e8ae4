"""SGLang's Prometheus `/metrics`, read: what `server watch`, `bench` records and the dashboard
renderer take from a running server.

`parse(text)` flattens an exposition into `{key: value}`: one key per sample, the sample's name
plus the labels that are not SGLang's standard ones (`sglang:cuda_graph_passes_total{mode="decode_none"}`);
histogram buckets and `_created` samples are left out, and so are ranks other than TP rank 0
where a server exports every scheduler's metrics. `Snapshot` is one such reading with its time;
`dyn_state` takes the dyn-disable patch's state from it (the `sglang:spec_dyn_disable_*`
metrics of patchsets/dyn-disable/<release>/0002-dyn-disable-metrics.patch), or from `/server_info`
where the server does not export metrics (`dyn_from_server_info`). A time series is a JSONL
file, one `Snapshot.to_json()` per line.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

DYN_PREFIX = "sglang:spec_dyn_disable_"
DYN_COUNTERS = ("spec_steps", "plain_steps", "forced_spec_steps", "switches_off", "switches_on")
# labels SGLang puts on every scheduler/tokenizer metric; other labels make separate keys. 0.5.11
# labels a few scheduler gauges (num_retracted_reqs, num_paused_reqs) with the process's `pid`,
# which would give them a new key at every server start
STANDARD_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank", "priority", "pid"}

RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
GEN_THROUGHPUT = "sglang:gen_throughput"
TOKEN_USAGE = "sglang:token_usage"
ACCEPT_LENGTH = "sglang:spec_accept_length"
GENERATION_TOKENS = "sglang:generation_tokens_total"


class ScrapeError(ValueError):
    """A body that is not Prometheus text."""


def _key(name: str, labels: dict) -> str:
    extra = {k: v for k, v in labels.items() if k not in STANDARD_LABELS
             or (k == "priority" and v not in ("", None))}
    if not extra:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(extra.items())) + "}"


def parse(text: str) -> dict[str, float]:
    """The samples of an exposition as {key: value} (see the module's doc)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, labels = sample.name, sample.labels
                if name.endswith(("_bucket", "_created")):
                    continue
                if labels.get("tp_rank", "0") != "0":
                    continue
                values[_key(name, labels)] = float(sample.value)
    except (ValueError, TypeError) as exc:
        raise ScrapeError(f"not Prometheus text: {exc}") from None
    return values


def _number(value):
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


@dataclass
class Snapshot:
    t: float                                  # unix time of the reading
    values: dict[str, float] = field(default_factory=dict)

    def get(self, key: str) -> float | None:
        return _number(self.values.get(key))

    @property
    def running(self) -> float | None:
        return self.get(RUNNING)

    @property
    def queued(self) -> float | None:
        return self.get(QUEUED)

    @property
    def gen_throughput(self) -> float | None:
        return self.get(GEN_THROUGHPUT)

    @property
    def token_usage(self) -> float | None:
        return self.get(TOKEN_USAGE)

    @property
    def accept_length(self) -> float | None:
        return self.get(ACCEPT_LENGTH)

    def dyn_state(self) -> dict | None:
        """The dyn-disable switch as the metrics show it; None when the server exports none."""
        if self.get(DYN_PREFIX + "threshold") is None:
            return None
        state = {"threshold": int(self.values[DYN_PREFIX + "threshold"]),
                 "hysteresis": _int(self.get(DYN_PREFIX + "hysteresis")),
                 "speculating": None if self.get(DYN_PREFIX + "drafting") is None
                 else bool(self.values[DYN_PREFIX + "drafting"]),
                 "since": self.get(DYN_PREFIX + "state_since_timestamp_seconds")}
        for name in DYN_COUNTERS:
            state[name] = _int(self.get(f"{DYN_PREFIX}{name}_total"))
        return state

    def to_json(self) -> dict:
        return {"t": self.t, "values": self.values}

    @classmethod
    def from_json(cls, data: dict) -> "Snapshot":
        return cls(float(data["t"]), {str(k): float(v) for k, v in (data.get("values") or {}).items()})


def _int(value):
    return None if value is None else int(value)


def dyn_from_server_info(info: dict | None) -> dict | None:
    """`internal_states[0].dyn_spec_disable` of SGLang's /server_info in `dyn_state`'s shape."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    dyn = states[0].get("dyn_spec_disable") if isinstance(states, list) and states and isinstance(states[0], dict) else None
    if not isinstance(dyn, dict) or dyn.get("threshold") is None:
        return None
    state = {"threshold": dyn.get("threshold"), "hysteresis": dyn.get("hysteresis"),
             "speculating": dyn.get("speculating"), "since": None}
    for name in DYN_COUNTERS:
        state[name] = dyn.get(name)
    return state


def level_change(before: dict | None, after: dict | None) -> dict | None:
    """What the switch did between two `dyn_state`s: switches and steps in between, and the
    share of decode steps that ran without drafting. None without both readings; counters
    that went down (a server restart in between) give None too."""
    if not before or not after:
        return None
    delta = {}
    for name in DYN_COUNTERS:
        if before.get(name) is None or after.get(name) is None or after[name] < before[name]:
            return None
        delta[name] = after[name] - before[name]
    steps = delta["spec_steps"] + delta["plain_steps"]
    delta["plain_step_share"] = round(delta["plain_steps"] / steps, 4) if steps else None
    return delta


def read_series(path: Path, host: str | None = None) -> list[Snapshot]:
    """A JSONL time series (one Snapshot per line, with a "host" key where several hosts were
    recorded into one file), oldest first; `host` keeps that host's lines only."""
    out, hosts = [], set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            hosts.add(data.get("host"))
            if host is None or data.get("host") == host:
                out.append(Snapshot.from_json(data))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ScrapeError(f"{path}:{number}: not a scrape line ({exc})") from None
    if host is None and len(hosts) > 1:
        raise ScrapeError(f"{path} holds scrapes of several hosts ({', '.join(sorted(map(str, hosts)))}): name one")
    return sorted(out, key=lambda s: s.t)


def append_series(path: Path, snapshot: Snapshot) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(snapshot.to_json(), sort_keys=True) + "\n")


async def read(client) -> Snapshot | None:
    """GET /metrics through an `OpenAIClient`; None where the server has none (SGLang started
    without --enable-metrics, transformers serve). ClientError when the server does not answer."""
    text = await client.get_text("/metrics", timeout=30.0)
    if text is None:
        return None
    return Snapshot(time.time(), parse(text))

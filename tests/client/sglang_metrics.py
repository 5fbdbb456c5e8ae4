"""`/metrics` bodies for the fake servers, made from the real one: the body SGLang 0.5.11 served at
the end of the H200 run of gpu/run_metrics.sh (docs/evidence/metrics/metrics-final.txt: TP=1,
`--enable-metrics`, the dyn-disable patchset with its metrics patch), with the values a test
needs written into its samples.

`capture()` is that body as it came. `metrics_text(...)` keeps its HELP/TYPE lines, labels,
histograms and every other family, and sets the TP-rank-0 samples of the metrics the readers
read; `dyn=None` takes the `sglang:spec_dyn_disable_*` families out (a server without the patch);
`tp_ranks` adds, after each rank-0 sample, a copy per other rank with 1000 times the value (the
run had TP=1; other ranks' numbers must not leak into rank 0's).
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

CAPTURE = Path(__file__).resolve().parents[2] / "docs" / "evidence" / "metrics" / "metrics-final.txt"
DYN_PREFIX = "sglang:spec_dyn_disable_"
DYN_GAUGES = ("drafting", "threshold", "hysteresis", "state_since_timestamp_seconds")
DYN_COUNTERS = ("spec_steps", "plain_steps", "forced_spec_steps", "switches_off", "switches_on")
# metric name -> metrics_text's keyword: what watch, bench and the dashboard read
READ = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "queued",
    "sglang:gen_throughput": "gen_throughput",
    "sglang:token_usage": "token_usage",
    "sglang:spec_accept_length": "accept_length",
    "sglang:generation_tokens_total": "generation_tokens",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")


@lru_cache(maxsize=1)
def capture() -> str:
    return CAPTURE.read_text()


def _dyn_values(dyn: dict) -> dict[str, float]:
    values = {DYN_PREFIX + "drafting": 1 if dyn.get("speculating", True) else 0,
              DYN_PREFIX + "threshold": dyn["threshold"], DYN_PREFIX + "hysteresis": dyn["hysteresis"],
              DYN_PREFIX + "state_since_timestamp_seconds": dyn.get("since", 0)}
    values.update({f"{DYN_PREFIX}{name}_total": dyn.get(name, 0) for name in DYN_COUNTERS})
    return values


def metrics_text(*, running=None, queued=None, gen_throughput=None, token_usage=None, accept_length=None,
                 generation_tokens=None, dyn: dict | None = None, tp_ranks=(0,)) -> str:
    """The captured body with these values (None: the capture's own) in rank 0's samples."""
    given = {"running": running, "queued": queued, "gen_throughput": gen_throughput,
             "token_usage": token_usage, "accept_length": accept_length, "generation_tokens": generation_tokens}
    values = {name: given[key] for name, key in READ.items() if given[key] is not None}
    if dyn is not None:
        values.update(_dyn_values(dyn))
    out = []
    for line in capture().splitlines():
        if dyn is None and DYN_PREFIX in line:
            continue
        match = _SAMPLE.match(line)
        if not match:
            out.append(line)
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        rank0 = 'tp_rank="0"' in labels
        if name in values and (rank0 or "tp_rank=" not in labels):
            value = float(values[name])
        out.append(f"{name}{labels} {value!r}")
        if rank0:
            for r in tp_ranks:
                if r != 0:
                    other = labels.replace('tp_rank="0"', 'tp_rank="%d"' % r)
                    out.append(f"{name}{other} {value * 1000!r}")
    return "\n".join(out) + "\n"

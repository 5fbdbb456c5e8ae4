"""A `/metrics` body shaped like SGLang 0.5.11's with `--enable-metrics` (and the dyn-disable
metrics patch when `dyn` is given), written by prometheus_client as SGLang's server writes it.

Metric names, label names and help strings are SGLang's (sglang/srt/observability/
metrics_collector.py in the wheel: `test_fixture_names_are_sglang_s` checks the names against
it). Ranks other than 0 get other numbers, so a reader that mixes ranks up shows it.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SCHEDULER_GAUGES = {
    "sglang:num_running_reqs": ("The number of running requests.", "running"),
    "sglang:num_queue_reqs": ("The number of requests in the waiting queue.", "queued"),
    "sglang:gen_throughput": ("The generation throughput (token/s).", "gen_throughput"),
    "sglang:token_usage": ("The token usage.", "token_usage"),
    "sglang:cache_hit_rate": ("The prefix cache hit rate.", None),
    "sglang:spec_accept_length": ("Mean acceptance length of speculative decoding (accepted drafts + bonus token "
                                  "per forward).", "accept_length"),
}
DYN_GAUGES = ("drafting", "threshold", "hysteresis", "state_since_timestamp_seconds")
DYN_COUNTERS = ("spec_steps", "plain_steps", "forced_spec_steps", "switches_off", "switches_on")


def metrics_text(*, running=0, queued=0, gen_throughput=0.0, token_usage=0.0, accept_length=0.0,
                 generation_tokens=0, dyn: dict | None = None, tp_ranks=(0,), model="kimi") -> str:
    registry = CollectorRegistry()
    names = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
    values = {"running": running, "queued": queued, "gen_throughput": gen_throughput,
              "token_usage": token_usage, "accept_length": accept_length}
    gauges = {name: Gauge(name, doc, names, registry=registry) for name, (doc, _) in SCHEDULER_GAUGES.items()}
    passes = Counter("sglang:cuda_graph_passes_total", "Total number of forward passes categorized by CUDA graph.",
                     names + ["mode"], registry=registry)
    dyn_gauges = dyn_counters = {}
    if dyn is not None:
        dyn_gauges = {f: Gauge(f"sglang:spec_dyn_disable_{f}", f"dyn {f}.", names, registry=registry)
                      for f in DYN_GAUGES}
        dyn_counters = {f: Counter(f"sglang:spec_dyn_disable_{f}_total", f"dyn {f}.", names, registry=registry)
                        for f in DYN_COUNTERS}
    for rank in tp_ranks:
        scale = 1 if rank == 0 else 1000      # other ranks' numbers must not leak into rank 0's
        labels = {"model_name": model, "engine_type": "unified", "tp_rank": str(rank), "pp_rank": "0",
                  "moe_ep_rank": "0"}
        for name, (_, key) in SCHEDULER_GAUGES.items():
            gauges[name].labels(**labels).set((values[key] if key else 0.5) * scale)
        passes.labels(**labels, mode="decode_cuda_graph").inc(10 * scale)
        passes.labels(**labels, mode="decode_none").inc(1 * scale)
        if dyn is not None:
            dyn_gauges["drafting"].labels(**labels).set(1 if dyn.get("speculating", True) else 0)
            for f in ("threshold", "hysteresis"):
                dyn_gauges[f].labels(**labels).set(dyn[f])
            dyn_gauges["state_since_timestamp_seconds"].labels(**labels).set(dyn.get("since", 0))
            for f in DYN_COUNTERS:
                dyn_counters[f].labels(**labels).inc(dyn.get(f, 0) * scale)
    tokens = Counter("sglang:generation_tokens_total", "Number of generation tokens processed.", ["model_name"],
                     registry=registry)
    tokens.labels(model_name=model).inc(generation_tokens)
    ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                     ["model_name"], buckets=(0.1, 0.5, 1.0), registry=registry)
    ttft.labels(model_name=model).observe(0.3)
    return generate_latest(registry).decode()

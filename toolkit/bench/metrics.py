"""Per-level metrics, computed the way sglang.bench_serving and `vllm bench serve` compute them.

- TTFT: request start to the first chunk that carries content (or reasoning).
- ITL: every gap between consecutive content chunks, pooled over requests (a chunk may carry
  several tokens, e.g. with speculative decoding; both peers measure it the same way).
- TPOT: per request (e2e latency - TTFT) / (output tokens - 1), for requests with > 1 token.
- E2E latency (`e2el`): request start to the end of the stream.
- Token counts: the server's `usage` (prompt_tokens / completion_tokens). A completed request
  whose server sent no usage counts as failed: a guess would make the throughput unfalsifiable.
- Throughput: totals divided by the level's wall time (first request sent to last finished).
- Per-request output tok/s: completion tokens / e2e latency of that request (what one user
  sees, queueing and prefill included).
Percentiles interpolate linearly between order statistics (numpy's default).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from ..client import RequestRecord

PERCENTILES = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _summary(prefix: str, values: Sequence[float], scale: float, unit: str) -> dict:
    out = {f"mean_{prefix}_{unit}": _scaled(mean(values), scale)}
    for name, q in PERCENTILES:
        out[f"{name}_{prefix}_{unit}"] = _scaled(percentile(values, q), scale)
    return out


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def usable(record: RequestRecord) -> bool:
    return record.ok and record.completion_tokens is not None


def failure_reason(record: RequestRecord) -> str:
    if not record.ok:
        return record.error or "failed"
    return "server sent no usage (token counts unknown)"


def compute(records: Iterable[RequestRecord], duration_s: float) -> dict:
    """The metrics of one level from its request records and its wall time in seconds."""
    records = list(records)
    good = [r for r in records if usable(r)]
    bad = [r for r in records if not usable(r)]
    input_tokens = sum(r.prompt_tokens or 0 for r in good)
    output_tokens = sum(r.completion_tokens for r in good)
    ttfts = [r.ttft for r in good if r.ttft is not None]
    e2els = [r.latency for r in good if r.latency is not None]
    tpots = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in good
             if r.completion_tokens > 1 and r.latency is not None and r.ttft is not None]
    itls = [gap for r in good for gap in r.itl]
    per_request_tps = [r.completion_tokens / r.latency for r in good if r.latency]
    def rate(amount: float) -> float | None:
        return amount / duration_s if duration_s > 0 else None

    errors: dict[str, int] = {}
    for r in bad:
        reason = failure_reason(r)
        errors[reason] = errors.get(reason, 0) + 1
    metrics = {
        "completed": len(good),
        "failed": len(bad),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": rate(len(good)),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        **_summary("ttft", ttfts, 1000.0, "ms"),
        **_summary("tpot", tpots, 1000.0, "ms"),
        **_summary("itl", itls, 1000.0, "ms"),
        **_summary("e2el", e2els, 1000.0, "ms"),
        **_summary("request_output_throughput", per_request_tps, 1.0, "tok_s"),
        "errors": errors,
    }
    return metrics

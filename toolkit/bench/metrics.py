"""Per-level metrics, computed the way sglang.bench_serving and `vllm bench serve` compute them.

- TTFT: request start to the first arrival of content (or reasoning).
- ITL: every gap between consecutive arrivals of content, pooled over requests. An arrival is
  what one network read brought (toolkit/check/client.py): events that came together reach a
  streaming user together, so they make one arrival and no zero gap; an arrival (and an event)
  may carry several tokens, e.g. with speculative decoding. sglang.bench_serving and `vllm
  bench serve` time every event as their parser reaches it, which turns events that arrived
  together into gaps of a few microseconds.
- Stream shape: content events and arrivals per request, tokens per arrival, the share of
  content events that arrived together with another (`coalesced_event_share`), and how many
  streams were held back (`held_back_streams`: most of the answer in one arrival, see
  `RequestRecord.held_back`); such a stream's ITL is one gap the size of the whole decode.
  `held_back_replacement_share` is the share of U+FFFD in their text: high means the server
  held back bytes that are not valid UTF-8 (random-weight output), near 0 means something else.
- TPOT: per request (e2e latency - TTFT) / (output tokens - 1), for requests with > 1 token.
- E2E latency (`e2el`): request start to the end of the stream.
- Token counts: the server's `usage` (prompt_tokens / completion_tokens). A completed request
  whose server sent no usage counts as failed: a guess would make the throughput unfalsifiable.
- Input length: `mean_input_tokens` is the mean `usage.prompt_tokens` of the completed requests
  (what was actually sent, chat template included).
- Throughput: totals divided by the level's wall time (first request sent to last finished).
- Per-request output tok/s: completion tokens / e2e latency of that request (what one user
  sees, queueing and prefill included).
Percentiles interpolate linearly between order statistics (numpy's default).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from toolkit.check.client import RequestRecord

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
    streamed = [r for r in good if r.arrivals]
    held = [r for r in streamed if r.held_back]
    events = sum(r.chunks for r in streamed)
    arrivals = sum(len(r.arrivals) for r in streamed)
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
        "mean_input_tokens": input_tokens / len(good) if good else None,
        "mean_output_tokens": output_tokens / len(good) if good else None,
        "request_throughput": rate(len(good)),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        **_summary("ttft", ttfts, 1000.0, "ms"),
        **_summary("tpot", tpots, 1000.0, "ms"),
        **_summary("itl", itls, 1000.0, "ms"),
        **_summary("e2el", e2els, 1000.0, "ms"),
        **_summary("request_output_throughput", per_request_tps, 1.0, "tok_s"),
        "mean_events_per_request": events / len(streamed) if streamed else None,
        "mean_arrivals_per_request": arrivals / len(streamed) if streamed else None,
        "mean_tokens_per_arrival": (sum(r.completion_tokens for r in streamed) / arrivals
                                    if arrivals else None),
        "coalesced_event_share": (events - arrivals) / events if events else None,
        "held_back_streams": len(held),
        # the share of U+FFFD (undecodable bytes) in the held-back answers: near 0 means the
        # hold-back is not the server waiting for complete UTF-8 characters
        "held_back_replacement_share": (sum(r.replacement_chars for r in held)
                                        / max(1, sum(len(r.text) for r in held)) if held else None),
        "errors": errors,
    }
    return metrics

"""Synthetic prompts land on the requested length by the server's own count (usage.prompt_tokens).

The real check runs against the real CPU server (`transformers serve`, the tiny reference
model's byte-level BPE tokenizer, where words cost 1 to 6 tokens each); the composition is also
checked on made-up word costs.
"""
from __future__ import annotations

import random

import pytest

from toolkit.bench.prompts import (LEAD_WORD, PromptSource, SyntheticCalibration, calibration_prompts,
                                   compose)
from toolkit.bench.runner import BenchOptions, RunningServer, run_level, run_sweep


def test_compose_adds_word_costs_up_to_the_exact_count():
    costs = {"alpha": 5.0, "beta": 4.0, "to": 1.0, "kernel": 3.0}
    calibration = SyntheticCalibration(base_tokens=20, word_tokens=costs)
    rng = random.Random(3)
    for target in (21, 22, 64, 257, 1000):
        words = compose(target, calibration, rng).split(" ")
        assert words[0] == LEAD_WORD
        assert 20 + sum(costs[w] for w in words[1:]) == target
    # without a one-token word the count lands within one token of the target
    coarse = SyntheticCalibration(base_tokens=10, word_tokens={"alpha": 2.0, "beta": 3.0})
    for target in range(12, 40):
        words = compose(target, coarse, rng).split(" ")[1:]
        assert target - 1 <= 10 + sum(coarse.word_tokens[w] for w in words) <= target
    # prompts differ from each other (no shared prefix for a radix cache beyond the lead word)
    prompts = {compose(64, calibration, rng) for _ in range(20)}
    assert len(prompts) == 20


def test_fit_reads_word_costs_from_the_counts():
    base = 22
    counts = {word: base + 8 * cost for word, cost in (("alpha", 5), ("to", 1), ("it", 2))}
    fitted = SyntheticCalibration.fit(base, counts)
    assert fitted.word_tokens == {"alpha": 5.0, "to": 1.0, "it": 2.0}
    assert set(calibration_prompts()) >= {"", "alpha", "to"}
    with pytest.raises(ValueError, match="no word adds prompt tokens"):
        SyntheticCalibration.fit(base, {"alpha": base, "to": base})


@pytest.mark.parametrize("input_len", [64, 300])
def test_synthetic_prompts_hit_the_length_on_the_real_cpu_server(cpu_server, input_len):
    options = BenchOptions(concurrency=[4], requests=8, warmup=1,
                           prompts=PromptSource(dataset="synthetic", input_len=input_len, output_len=4))
    records = []
    result = run_sweep(["cpu-ref"], options, RunningServer(cpu_server.base_url), on_level=records.append)
    assert not result.errors, result.errors
    calibration = records[0]["params"]["calibration"]
    assert all(abs(m - input_len) <= 0.02 * input_len for m in calibration["check"]["measured"])
    metrics = records[0]["metrics"]
    assert metrics["completed"] == 8
    assert abs(metrics["mean_input_tokens"] - input_len) <= 0.02 * input_len
    # every request, not only the mean, by the server's count
    level = run_level(cpu_server.base_url, options.prompts.requests(16, seed=5), 4)
    counts = [r.prompt_tokens for r in level.records]
    assert all(r.ok for r in level.records) and all(abs(c - input_len) <= 0.02 * input_len for c in counts), counts


def test_an_input_length_below_the_chat_template_is_refused(cpu_server):
    options = BenchOptions(concurrency=[1], requests=1, warmup=0,
                           prompts=PromptSource(dataset="synthetic", input_len=3, output_len=4))
    records = []
    result = run_sweep(["cpu-ref"], options, RunningServer(cpu_server.base_url), on_level=records.append)
    assert records == [] and len(result.errors) == 1
    assert "--input-len 3 is shorter than the chat template" in result.errors[0]

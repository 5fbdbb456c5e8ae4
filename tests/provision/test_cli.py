"""The commands as a user types them: `invoke facts`, `invoke provision`, `invoke wheelhouse build`."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import invoke


@pytest.fixture
def staged_inventory(staged_site, tmp_path, monkeypatch):
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(f'[staged]\ntransport = "local"\npython = "{staged_site.python}"\n'
                         f'pythonpath = "{staged_site.pythonpath}"\nstack = "gpu"\n')
    monkeypatch.setenv("TOOLKIT_INVENTORY", str(inventory))
    return "staged"


def cli(*args: str) -> subprocess.CompletedProcess:
    return invoke(*args, columns=200)


def test_facts_json_and_table(staged_inventory, fake_gpu):
    done = cli("facts", "--host", staged_inventory, "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)["staged"]
    assert found["gpus"][0]["name"] == "NVIDIA H200" and found["driver"] == "580.95.05"
    assert found["packages"]["torch"]["version"] == "2.11.0+cu130"
    table = cli("facts", "--host", staged_inventory)
    assert table.returncode == 0, table.stderr
    assert "NVIDIA H200, capability 9.0" in table.stdout and "CUDA 13.0" in table.stdout
    assert "sglang-kernel" in table.stdout and "missing" in table.stdout


def test_provision_dry_run_prints_what_would_change(staged_inventory, fake_gpu):
    done = cli("provision", "--host", staged_inventory, "--dry-run")     # stack from the inventory: gpu
    assert done.returncode == 0, done.stderr
    assert "stack gpu (dry run: nothing changed)" in done.stdout
    assert "flashinfer-cubin missing -> 0.6.8.post1" in done.stdout
    assert "4 would change" in done.stdout


def test_provision_refuses_an_old_driver_with_exit_1(staged_inventory, fake_gpu):
    fake_gpu(driver="535.104.05")
    done = cli("provision", "--host", staged_inventory)
    assert done.returncode == 1
    assert "driver 535.104.05 is older than 580" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("args, message", [
    (("provision", "--stack", "nope", "--host", "local"), "no stack 'nope'"),
    (("provision", "--wheelhouse", "/nonexistent-wheelhouse", "--host", "local"), "has no manifest.json"),
    (("wheelhouse", "frobnicate"), "usage: invoke wheelhouse build"),
    (("provision", "--host", "nosuchhost"), "unknown host 'nosuchhost'"),
])
def test_bad_input_is_a_clear_error_with_exit_2(args, message):
    done = cli(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr


def test_wheelhouse_build_refuses_a_python_the_stack_cannot_run(tmp_path):
    done = cli("wheelhouse", "build", "--stack", "gpu", "--python", "3.8", "--out", str(tmp_path / "wh"))
    assert done.returncode == 1 and "needs Python >= 3.10" in done.stderr
    assert not (tmp_path / "wh").exists()

"""The `gpu` stack on hosts shaped like the GPU machine, faked on the CPU: a system Python with
torch plus a trimmed site dir on PYTHONPATH, and a stand-in nvidia-smi (the only mock: there is
no GPU here). Also the refusals: no GPU, a failing nvidia-smi, an old driver, an old Python."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from toolkit import facts, provision, stack
from toolkit.provision import ProvisionError

from .conftest import pip_env


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_facts_read_a_trimmed_site_over_a_system_python(staged_site, fake_gpu):
    fake_gpu(gpus=2)
    found = facts.gather(staged_site, stack.load("gpu"))
    assert found.round_trips == 1
    assert [g["name"] for g in found.gpus] == ["NVIDIA H200", "NVIDIA H200"]
    assert found.gpus[0]["capability"] == "9.0" and found.gpus[0]["memory_total_mib"] == 143771
    assert found.driver == "580.95.05" and found.driver_major == 580 and found.raw["cuda"] == "13.0"
    assert found.version("torch") == "2.11.0+cu130"
    assert found.version("sglang") == "0.5.11"                      # PYTHONPATH first, as an import would
    assert found.packages["sglang"]["location"] == staged_site.pythonpath
    assert found.version("flashinfer_python") == "0.6.8.post1"
    assert found.version("sglang-kernel") is None and found.version("flashinfer-cubin") is None
    assert found.nvcc["path"] is None and not found.nvcc["runs"]
    assert found.raw["venv"]["path"] is None


def test_gpu_dry_run_on_the_staged_site_says_exactly_what_is_missing(staged_site, fake_gpu):
    fake_gpu()
    before = tree(Path(staged_site.pythonpath))
    result = provision.provision(staged_site, stack.load("gpu"), dry_run=True)
    steps = {s.name: s for s in result.steps}
    assert steps["venv"].status == "ok" and "PYTHONPATH=" in steps["venv"].detail
    assert steps["sglang"].status == "ok"
    assert steps["flashinfer"].status == "would change"
    assert steps["flashinfer"].detail == "flashinfer-cubin missing -> 0.6.8.post1"
    assert steps["sglang-kernel"].detail == "sglang-kernel missing -> 0.4.2"
    assert steps["torch"].detail == "cuda-toolkit missing -> 13.0.2"      # torch itself is fine
    assert "nvidia-cuda-nvcc missing -> 13.0.88" in steps["cuda-compiler"].detail
    assert result.round_trips == 1 and result.log is None
    assert tree(Path(staged_site.pythonpath)) == before                   # nothing written, no .toolkit


def test_old_driver_is_refused_before_anything_is_installed(staged_site, fake_gpu):
    fake_gpu(driver="550.54.15")
    with pytest.raises(ProvisionError, match="driver 550.54.15 is older than 580") as info:
        provision.provision(staged_site, stack.load("gpu"))
    assert "Nothing was installed" in str(info.value)
    assert not (Path(staged_site.pythonpath) / ".toolkit").exists()


def test_no_nvidia_smi_means_no_gpu(staged_site, no_gpu):
    found = facts.gather(staged_site, stack.load("gpu"))
    assert found.gpus == [] and found.raw["error"] == "nvidia-smi not found"
    with pytest.raises(ProvisionError, match="needs an NVIDIA GPU.*nvidia-smi not found.*--stack cpu-ref"):
        provision.provision(staged_site, stack.load("gpu"))
    # the CPU stack does not need one: its dry run goes through
    assert provision.provision(staged_site, stack.load("cpu-ref"), dry_run=True).changed > 0


def test_nvidia_smi_without_a_driver_is_refused(staged_site, fake_gpu):
    fake_gpu(smi_fail=1)
    found = facts.gather(staged_site, stack.load("gpu"))
    assert found.gpus == [] and "couldn't communicate with the NVIDIA driver" in found.raw["error"]
    with pytest.raises(ProvisionError, match="needs an NVIDIA GPU"):
        provision.provision(staged_site, stack.load("gpu"))


def test_python_older_than_the_stack_needs_is_a_clear_error(staged_site, tmp_path):
    future = dataclasses.replace(stack.load("cpu-ref"), python="3.99")
    with pytest.raises(ProvisionError, match=r"Python 3\.\d+\.\d+; stack cpu-ref needs >= 3.99"):
        provision.provision(staged_site, future, dry_run=True)
    fresh = dataclasses.replace(staged_site, python=None, pythonpath=None, venv=str(tmp_path / "new" / "venv"))
    with pytest.raises(ProvisionError, match=r"python3 on the host is 3\.\d+\.\d+; stack cpu-ref needs Python >= 3.99"):
        provision.provision(fresh, future)
    assert not (tmp_path / "new").exists()


def test_facts_of_a_missing_venv(tmp_path, no_gpu):
    host = dataclasses.replace(_local(), venv=str(tmp_path / "absent"))
    found = facts.gather(host, stack.load("cpu-ref"))
    assert not found.venv_exists and found.packages == {}
    assert found.raw["python"]["error"] == "venv does not exist"
    assert found.raw["disk"]["free_bytes"] > 0 and found.raw["disk"]["path"] == str(tmp_path)
    assert "g++" in found.raw["commands"]                    # the stack's system command is looked up


def _local():
    from toolkit.inventory import Host
    return Host(name="local-test", transport="local", stack="cpu-ref")


def test_too_little_disk_is_refused_before_installing(tmp_path, no_gpu):
    host = dataclasses.replace(_local(), venv=str(tmp_path / "new" / "venv"))
    greedy = dataclasses.replace(stack.load("cpu-ref"), min_free_gb=10.0 ** 9)
    with pytest.raises(ProvisionError, match=r"GiB free at .*needs about 1e\+09 GiB.*nothing was installed"):
        provision.provision(host, greedy)
    assert not (tmp_path / "new").exists()
    preview = provision.provision(host, greedy, dry_run=True)       # the dry run shows the plan and says so
    assert preview.changed and any("a real run would stop here" in n for n in preview.notes)


@pytest.mark.slow
def test_a_trimmed_site_gets_only_its_missing_pins(staged_site, tmp_path, no_gpu):
    """Real pip (the index) into the bare site folder; the 'system' Python's packages stay as they are."""
    import sys
    site = Path(staged_site.pythonpath)
    host = dataclasses.replace(staged_site, python=sys.executable)   # a Python that has pip
    small = dataclasses.replace(stack.load("cpu-ref"), steps=(stack.load("cpu-ref").step("flashinfer"),
                                                               stack.load("cpu-ref").step("sglang")))
    result = provision.provision(host, small, env=pip_env())
    steps = {s.name: s for s in result.steps}
    assert steps["sglang"].status == "ok"                                  # already in the trimmed site
    assert steps["flashinfer"].status == "ok"
    # now one the site lacks: sglang removed, so only sglang is fetched into the folder
    for dist in site.glob("sglang-*.dist-info"):
        (dist / "METADATA").unlink()
        dist.rmdir()
    again = provision.provision(host, small, env=pip_env())
    assert {s.name: s.status for s in again.steps}["sglang"] == "changed", again.steps
    assert (site / "sglang" / "__init__.py").exists()
    assert facts.gather(host, small).packages["sglang"]["location"] == str(site)
    log = Path(again.log).read_text()
    assert "--target" in log and "--no-deps" in log and "flashinfer" not in log.split("$")[-1]


def test_an_inherited_pythonpath_does_not_leak_into_the_target(staged_site, tmp_path, monkeypatch, no_gpu):
    """In local mode the toolkit's own PYTHONPATH is in the environment; facts must not see it."""
    from .conftest import write_dist
    control = tmp_path / "control-side"
    write_dist(control, "sglang-kernel", "0.4.2")
    monkeypatch.setenv("PYTHONPATH", str(control))
    found = facts.gather(staged_site, stack.load("gpu"))
    assert found.version("sglang-kernel") is None and found.version("sglang") == "0.5.11"
    assert str(control) not in found.raw["python"]["site_dirs"]

"""The `gpu` stack on hosts shaped like the GPU machine, faked on the CPU: a system Python with
torch plus a trimmed site dir on PYTHONPATH, and a stand-in nvidia-smi (the only mock: there is
no GPU here). Also the refusals: no GPU, a failing nvidia-smi, an old driver, an old Python."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from toolkit.provision import facts, provision, stack
from toolkit.provision.provision import ProvisionError

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
    from toolkit.core.inventory import Host
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


# -- torch's CUDA build: PyPI's default Linux torch wheel is a CUDA 13.0 build whose version
# carries no `+cu130` label; only torch/version.py says which build it is (as on the H200 image).

def _install_fake_torch(host, version: str, version_py: str | None) -> Path:
    """Replace the staged system site's torch by `version`, with `version_py` as torch/version.py
    (None: no such file), plus the cuda-toolkit the torch step also pins."""
    from .conftest import write_dist
    site = next(Path(host.python).parent.parent.glob("lib/python*/site-packages"))
    for dist in site.glob("torch-*.dist-info"):
        for file in dist.iterdir():
            file.unlink()
        dist.rmdir()
    write_dist(site, "torch", version)
    write_dist(site, "cuda-toolkit", "13.0.2")
    if version_py is not None:
        (site / "torch").mkdir()
        (site / "torch" / "version.py").write_text(version_py)
    return site


# the shapes torch writes: 2.x with annotations, older releases without
CUDA_13_VERSION_PY = ("from typing import Optional\n\n__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip']\n"
                      "__version__ = '2.11.0'\ndebug = False\ncuda: Optional[str] = '13.0'\n"
                      "git_version = '0123abc'\nhip: Optional[str] = None\nxpu: Optional[str] = None\n")
CUDA_12_8_VERSION_PY = "__version__ = '2.11.0'\ndebug = False\ncuda = '12.8'\nhip = None\n"
CPU_VERSION_PY = "__version__ = '2.11.0+cpu'\ndebug = False\ncuda: Optional[str] = None\nhip: Optional[str] = None\n"


def test_an_unlabelled_cuda_13_torch_satisfies_the_cu130_pin(staged_site, fake_gpu):
    fake_gpu()
    _install_fake_torch(staged_site, "2.11.0", CUDA_13_VERSION_PY)
    gpu = stack.load("gpu")
    found = facts.gather(staged_site, gpu)
    torch = found.packages["torch"]
    assert torch["version"] == "2.11.0" and torch["cuda"] == "13.0" and torch["cuda_known"]
    assert ("torch build", "CUDA 13.0 build") in found.summary_rows()
    result = provision.provision(staged_site, gpu, dry_run=True)
    steps = {s.name: s for s in result.steps}
    assert steps["torch"].status == "ok", steps["torch"]
    assert steps["torch"].detail == "torch 2.11.0 (CUDA 13.0 build), cuda-toolkit 13.0.2"
    # the step the host runs under its lock checks the same way: nothing to do, no pip call
    only_torch = dataclasses.replace(gpu, steps=(gpu.step("torch"),))
    planned = provision.PlannedStep("torch", "pip", True, "", step=gpu.step("torch"))
    log = Path(staged_site.pythonpath) / "provision-test.log"
    with staged_site.connect() as transport:
        answer = provision.run_step(transport, provision._step_args(staged_site, only_torch, planned, str(log),
                                                                    None, 60))
    assert answer["status"] == "ok" and answer["detail"] == "all pins match", answer
    assert not log.exists()


@pytest.mark.parametrize("version, version_py, installed", [
    ("2.11.0", CUDA_12_8_VERSION_PY, "torch 2.11.0 (CUDA 12.8 build)"),
    ("2.11.0+cpu", CPU_VERSION_PY, "torch 2.11.0+cpu"),
    ("2.11.0", CPU_VERSION_PY, "torch 2.11.0 (no CUDA build (cuda = None))"),
    ("2.11.0", None, "torch 2.11.0 (CUDA build unknown: no {site}/torch/version.py)"),
    ("2.11.0", "__version__ = '2.11.0'\n", "torch 2.11.0 (CUDA build unknown: no cuda = line in {site}/torch/version.py)"),
], ids=["cuda-12.8", "cpu-label", "cpu-unlabelled", "no-version-py", "no-cuda-line"])
def test_a_torch_of_another_or_unknown_build_would_change(staged_site, fake_gpu, version, version_py, installed):
    fake_gpu()
    site = _install_fake_torch(staged_site, version, version_py)
    installed = installed.format(site=site)
    gpu = stack.load("gpu")
    steps = {s.name: s for s in provision.provision(staged_site, gpu, dry_run=True).steps}
    assert steps["torch"].status == "would change"
    assert steps["torch"].detail == f"{installed} -> 2.11.0+cu130"
    # the host side's own check (run again under the lock before pip) agrees, word for word
    from toolkit.hostside import provision_step
    interpreter, wrong = provision_step._mismatches({
        "python": staged_site.python, "pythonpath": staged_site.pythonpath,
        "pins": [{"name": p.name, "version": p.version} for p in gpu.step("torch").pins]})
    assert [(pin["name"], have) for pin, have in wrong] == [("torch", installed)]


def test_facts_table_agrees_with_provision_on_an_unlabelled_cuda_torch(staged_site, fake_gpu, tmp_path):
    """`invoke facts` (the command, not only the engine) shows the CUDA 13 torch as ok, as provision does."""
    from tests.helpers import invoke

    fake_gpu()
    _install_fake_torch(staged_site, "2.11.0", CUDA_13_VERSION_PY)
    inventory = tmp_path / "staged.toml"
    inventory.write_text(f'[staged]\ntransport = "local"\npython = "{staged_site.python}"\n'
                         f'pythonpath = "{staged_site.pythonpath}"\nstack = "gpu"\n')
    done = invoke("facts", "--host", "staged", env={"TOOLKIT_INVENTORY": str(inventory)})
    torch_row = next(line for line in done.stdout.splitlines() if "│ torch " in line and "2.11.0+cu130" in line)
    assert "│ ok " in torch_row, done.stdout

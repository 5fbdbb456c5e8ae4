"""The commands a user types: `invoke patch apply sm120` shows, per host, which sm120 features its
server will run, and `invoke server start` says it again before starting. The host is this
machine (local transport) with a venv holding the real SGLang 0.5.11 wheel (`--no-deps`) and the
real FlashInfer 0.6.8.post1 jit/comm.py; its GPUs are the stand-in nvidia-smi's 8x RTX PRO 6000
without P2P (tests/data/nvidia-smi/interconnect/). On the gpu-0.5.23 stack (SGLang 0.5.23,
FlashInfer 0.7.2, sgl-deep-gemm 0.2.3.post2) with P2P between every pair, the fusion is predicted on."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.patch.conftest import _private_copy, base_venv, host_venv, sglang_wheel, site  # noqa: F401  (fixtures)
from tests.patch.conftest import newest_base_venv, newest_wheel  # noqa: F401  (fixtures)
from tests.helpers import invoke
from toolkit.patch import wheels

SMI = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi" / "interconnect"


def install_flashinfer_comm(site: Path) -> None:  # noqa: F811
    """The two files the facts read of FlashInfer: jit/comm.py (from the real wheel) and its METADATA."""
    wheel = wheels.pristine("flashinfer-python", "0.6.8.post1")
    target = site / "flashinfer" / "jit" / "comm.py"
    target.parent.mkdir(parents=True)
    target.write_bytes(wheel.read("flashinfer/jit/comm.py"))
    dist = site / "flashinfer_python-0.6.8.post1.dist-info"
    dist.mkdir()
    dist.joinpath("METADATA").write_bytes(wheel.read("flashinfer_python-0.6.8.post1.dist-info/METADATA"))


def test_apply_and_start_show_the_features_of_the_host(host_venv, site, tmp_path):  # noqa: F811
    install_flashinfer_comm(site)
    smi = tmp_path / "smi"
    shutil.copytree(SMI, smi)
    model = tmp_path / "model"
    model.mkdir()
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(f'[ws]\ntransport = "local"\nvenv = "{host_venv}"\n'
                         f'[ws.server]\ntp_size = 8\nmodel = "{model}"\nnvidia_smi = "{tmp_path}/no-nvidia-smi"\n')
    env = dict(os.environ, TOOLKIT_INVENTORY=str(inventory), FAKE_SMI_SCENARIO="rtxpro6000x8-nop2p",
               PATH=f"{smi}{os.pathsep}{os.environ['PATH']}")

    # sm120 not applied: a start says nothing about its gates
    before = invoke("server", "start", "baseline", "--host", "ws", "--timeout", "30", "--skip-patch-check", env=env)
    assert "sm120" not in before.stderr

    applied = invoke("patch", "apply", "sm120", "--host", "ws", env=env)
    assert applied.returncode == 0, applied.stderr
    out = " ".join(applied.stdout.split())          # rich folds long cells
    assert "ws: sm120 features for TP 8 on GPU 0,1,2,3,4,5,6,7" in out
    assert "FlashInfer 0.6.8.post1 has no SM120 build of the fusion kernel" in out
    assert "no P2P access: GPU 0-7 (every pair)" in out
    assert "no deep_gemm module is installed" in out

    started = invoke("server", "start", "baseline", "--host", "ws", "--timeout", "30", env=env)
    assert started.returncode != 0                      # no torch in this venv: it cannot serve
    notes = started.stderr
    told = notes.index("ws: will log: sm120: torch symm-mem two-shot: off (no P2P access: GPU 0-7 (every pair)")
    assert told < notes.index("starting baseline")        # said before the start, not after a crash
    assert "ws: will log: sm120: FlashInfer all-reduce fusion: off (FlashInfer 0.6.8.post1" in notes


def install_site_files(site: Path, package: str, version: str, files: tuple[str, ...]) -> None:  # noqa: F811
    """Files of a real wheel, as that package's install would lay them out (facts read nothing else)."""
    wheel = wheels.pristine(package, version)
    for name in files + (f"{wheel.dist_info}/METADATA",):
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(wheel.read(name))


@pytest.fixture
def newest_site(newest_base_venv, tmp_path):  # noqa: F811
    copy = _private_copy(newest_base_venv, tmp_path / "venv")
    yield copy, next(copy.glob("lib/python*/site-packages"))
    shutil.rmtree(copy, ignore_errors=True)


def test_apply_predicts_the_fusion_on_with_the_0523_stack(newest_site, tmp_path):
    """A 12.0 host with P2P between every pair (no P2P atomics) on the gpu-0.5.23 stack: SGLang 0.5.23
    (the real wheel), FlashInfer 0.7.2's jit/comm.py (majors [9, 10, 12]) and sgl-deep-gemm
    0.2.3.post2's deep_gemm (the SM120 entry point), both from their pinned wheels. `invoke patch apply
    sm120` applies the 0.5.23 diff and predicts fusion on, symm-mem off, DeepGEMM on."""
    venv, site = newest_site  # noqa: F811
    install_site_files(site, "flashinfer-python", "0.7.2", ("flashinfer/jit/comm.py",))
    install_site_files(site, "sgl-deep-gemm", "0.2.3.post2", ("deep_gemm/__init__.py",))
    smi = tmp_path / "smi"
    shutil.copytree(SMI, smi)
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(f'[ws]\ntransport = "local"\nvenv = "{venv}"\n[ws.server]\ntp_size = 8\n')
    env = dict(os.environ, TOOLKIT_INVENTORY=str(inventory), FAKE_SMI_SCENARIO="rtxpro6000x8-p2p",
               PATH=f"{smi}{os.pathsep}{os.environ['PATH']}")
    applied = invoke("patch", "apply", "sm120", "--host", "ws", env=env)
    assert applied.returncode == 0, applied.stderr
    out = " ".join(applied.stdout.split())
    assert "ws: sm120 features for TP 8 on GPU 0,1,2,3,4,5,6,7" in out
    assert "FlashInfer 0.7.2 builds trtllm_comm for SM12x; P2P between all 8 GPUs" in out
    assert "no native P2P atomics: GPU 0-7 (every pair)" in out
    assert "deep_gemm has m_grouped_fp8_fp4_gemm_nt_contiguous (the SM120 branch), capability 12.0" in out
    states = [line.split("│")[2].strip() for line in applied.stdout.splitlines() if line.count("│") >= 3
              and any(t in line for t in ("FlashInfer all-reduce", "torch symm-mem", "DeepGEMM"))]
    assert states == ["on", "off", "on"], applied.stdout
    patched = (site / "sglang/srt/arg_groups/model_hook.py").read_text()
    assert "sm120_gates.server_start(cfg, logger)" in patched

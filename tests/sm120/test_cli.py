"""The commands a user types: `invoke patch apply sm120` shows, per host, which sm120 features its
server will run, and `invoke server start` says it again before starting. The host is this
machine (local transport) with a venv holding the real SGLang 0.5.11 wheel (`--no-deps`) and the
real FlashInfer 0.6.8.post1 jit/comm.py; its GPUs are the stand-in nvidia-smi's 8x RTX PRO 6000
without P2P (tests/data/nvidia-smi/interconnect/)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.patch.conftest import base_venv, host_venv, sglang_wheel, site  # noqa: F401  (fixtures)
from toolkit import wheels
from toolkit.paths import PROJECT_ROOT

SMI = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi" / "interconnect"


def install_flashinfer_comm(site: Path) -> None:
    """The two files the facts read of FlashInfer: jit/comm.py (from the real wheel) and its METADATA."""
    wheel = wheels.pristine("flashinfer-python", "0.6.8.post1")
    target = site / "flashinfer" / "jit" / "comm.py"
    target.parent.mkdir(parents=True)
    target.write_bytes(wheel.read("flashinfer/jit/comm.py"))
    dist = site / "flashinfer_python-0.6.8.post1.dist-info"
    dist.mkdir()
    dist.joinpath("METADATA").write_bytes(wheel.read("flashinfer_python-0.6.8.post1.dist-info/METADATA"))


def invoke(args, env, timeout=600):
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


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
    before = invoke(["server", "start", "baseline", "--host", "ws", "--timeout", "30", "--skip-patch-check"], env)
    assert "sm120" not in before.stderr

    applied = invoke(["patch", "apply", "sm120", "--host", "ws"], env)
    assert applied.returncode == 0, applied.stderr
    out = " ".join(applied.stdout.split())          # rich folds long cells
    assert "ws: sm120 features for TP 8 on GPU 0,1,2,3,4,5,6,7" in out
    assert "FlashInfer 0.6.8.post1 has no SM120 build of the fusion kernel" in out
    assert "no P2P access: GPU 0-7 (every pair)" in out
    assert "no deep_gemm module is installed" in out

    started = invoke(["server", "start", "baseline", "--host", "ws", "--timeout", "30"], env)
    assert started.returncode != 0                      # no torch in this venv: it cannot serve
    notes = started.stderr
    told = notes.index("ws: will log: sm120: torch symm-mem two-shot: off (no P2P access: GPU 0-7 (every pair)")
    assert told < notes.index("starting baseline")        # said before the start, not after a crash
    assert "ws: will log: sm120: FlashInfer all-reduce fusion: off (FlashInfer 0.6.8.post1" in notes

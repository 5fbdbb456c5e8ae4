"""`invoke facts` reports how a host's GPUs reach each other: P2P (read/write/atomics) per pair,
NVLink, PCIe links, multicast. No GPU here: a stand-in nvidia-smi prints stored outputs
(tests/data/nvidia-smi/interconnect/, in the real tool's format); the facts round trip itself is real
(hostside/facts.py run by the local transport, one round trip)."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import invoke
from toolkit.provision import facts
from toolkit.hostside import facts as hostside
from toolkit.core.inventory import Host

DATA = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi" / "interconnect"


@pytest.fixture
def smi(monkeypatch, tmp_path):
    """Put the stand-in nvidia-smi first on PATH; returns a function choosing the scenario."""
    folder = tmp_path / "smi"
    shutil.copytree(DATA, folder)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")

    def scenario(name):
        monkeypatch.setenv("FAKE_SMI_SCENARIO", name)
        return folder / name
    return scenario


def local_host() -> Host:
    return Host(name="local-ic", transport="local", python=sys.executable)


def test_two_h200_with_nvlink(smi):
    smi("h200x2-nvlink")
    found = facts.gather(local_host())
    ic = found.interconnect
    assert found.round_trips == 1 and [g["capability"] for g in found.gpus] == ["9.0", "9.0"]
    assert ic["pairs"]["0-1"] == {"read": "OK", "write": "OK", "atomics": "OK", "nvlink": "OK", "link": "NV18"}
    assert ic["nvlink"] is True and ic["gpus"]["1"]["nvlink_links"] == 18
    assert ic["gpus"]["0"]["pcie"] == {"gen": 5, "gen_max": 5, "width": 16, "width_max": 16}
    assert ic["gpus"]["0"]["fabric"] == "Completed/Success"
    assert ic["multicast"] is None and "fabric Completed/Success" in ic["multicast_why"]
    rows = dict(found.summary_rows())
    assert rows["nvlink"] == "18 links on GPU 0-1 (NV18 between pairs)"
    assert rows["p2p read/write"] == "OK between every pair of GPU 0-1"
    assert rows["multicast"].startswith("unknown (NVLink present")


def test_eight_rtx_pro_6000_without_p2p(smi):
    smi("rtxpro6000x8-nop2p")
    found = facts.gather(local_host())
    ic = found.interconnect
    assert ic["pairs"]["0-1"]["read"] == "NS" and ic["pairs"]["3-4"]["read"] == "CNS"
    assert ic["pairs"]["0-7"]["link"] == "SYS" and ic["pairs"]["0-3"]["link"] == "NODE"
    assert ic["nvlink"] is False and ic["multicast"] is False
    assert {g["nvlink_links"] for g in ic["gpus"].values()} == {0}
    assert ic["gpus"]["7"]["pcie"] == {"gen": 1, "gen_max": 5, "width": 16, "width_max": 16}
    rows = dict(found.summary_rows())
    assert rows["nvlink"] == "none (PCIe only)"
    assert rows["p2p read/write"].startswith("CNS: 0<->4") and "NS: 0<->1" in rows["p2p read/write"]
    assert rows["multicast"] == "no (no NVLink: CUDA multicast objects need NVLink)"
    assert rows["pcie"] == "gen 1 x16 now, gen 5 x16 max on GPU 0-7"


def test_eight_rtx_pro_6000_with_p2p(smi):
    smi("rtxpro6000x8-p2p")
    rows = dict(facts.gather(local_host()).summary_rows())
    assert rows["p2p read/write"] == "OK between every pair of GPU 0-7"
    assert rows["p2p atomics"] == "NS between every pair of GPU 0-7"


def test_a_command_the_driver_lacks_leaves_that_part_unknown(smi):
    folder = smi("h200x2-nvlink")
    (folder / "p2p-a.txt").unlink()                   # an nvidia-smi without `topo -p2p a`
    ic = facts.gather(local_host()).interconnect
    assert ic["pairs"]["0-1"]["atomics"] is None and ic["pairs"]["0-1"]["read"] == "OK"
    assert any(e.startswith("topo -p2p a: exit 2") for e in ic["errors"])


def test_no_gpu_says_none(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    found = facts.gather(local_host())
    assert "interconnect" not in found.raw and ("interconnect", "none (no GPU)") in found.summary_rows()


def test_the_matrix_parser_reads_the_space_separated_layout_too():
    """`nvidia-smi topo -m` on 8-GPU NVSwitch boards pads with spaces, NIC columns in between."""
    text = ("        GPU0    GPU1    GPU2    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
            "GPU0     X      NV18    NV18    PIX     0-23,96-119     0               N/A\n"
            "GPU1    NV18     X      NV18    NODE    0-23,96-119     0               N/A\n"
            "GPU2    NV18    NV18     X      SYS     24-47,120-143   1               N/A\n"
            "NIC0    PIX     NODE    SYS      X\n\nLegend:\n\n  X    = Self\n")
    cells = hostside.parse_gpu_matrix(text)
    assert cells[(0, 1)] == "NV18" and cells[(2, 0)] == "NV18" and cells[(1, 1)] == "X"
    assert len(cells) == 9                                # the NIC row and column are left out


def test_flashinfer_and_deep_gemm_files_are_read_as_text(tmp_path):
    site = tmp_path / "site"
    (site / "flashinfer" / "jit").mkdir(parents=True)
    (site / "flashinfer" / "jit" / "comm.py").write_text(
        "def gen_trtllm_comm_module() -> JitSpec:\n    nvcc_flags = ctx.get_nvcc_flags_list(\n"
        "        supported_major_versions=[9, 10, 12]\n    )\n\n\ndef gen_vllm_comm_module():\n"
        "    supported_major_versions=[7]\n")
    (site / "deep_gemm").mkdir()
    (site / "deep_gemm" / "__init__.py").write_text("fp8_gemm_nt = _wrap_op('fp8_gemm_nt')\n")
    found = hostside.kernel_facts([str(site)])
    assert found["flashinfer_trtllm_comm_majors"] == [9, 10, 12]
    assert found["deep_gemm"] == {"present": True, "sm120_entry_point": False,
                                  "path": str(site / "deep_gemm" / "__init__.py")}


def test_invoke_facts_prints_the_interconnect_and_json_carries_it(smi, tmp_path):
    smi("rtxpro6000x8-nop2p")
    inventory = tmp_path / "hosts.toml"
    inventory.write_text(f'[ic]\ntransport = "local"\npython = "{sys.executable}"\nstack = "gpu"\n')
    env = dict(os.environ, TOOLKIT_INVENTORY=str(inventory))
    table = invoke("facts", "--host", "ic", env=env)
    assert table.returncode == 0, table.stderr
    assert "none (PCIe only)" in table.stdout and "no (no NVLink" in table.stdout
    done = invoke("facts", "--host", "ic", "--json", env=env)
    data = json.loads(done.stdout)["ic"]
    assert data["interconnect"]["pairs"]["0-4"]["read"] == "CNS"
    assert data["gpus"][0]["capability"] == "12.0"

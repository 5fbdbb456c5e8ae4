"""Fixtures for the sm120 gates: the patched SGLang files (the real wheel files of every release
sm120 has a diff for, 0.5.11, 0.5.17 and 0.5.23, with that release's patch applied), the shared table of
cases, and two ways to feed a case to the rule: as `invoke facts` would report the host, and as
the patched server's runtime probes see it.

The runtime side is faked (no SM120 GPU exists here): a `torch`, a `cuda.bindings.driver`, a
`pynvml` and a `deep_gemm` module stand in, and a FlashInfer "install" on sys.path holds a
jit/comm.py and a dist-info, the two things the probe reads.
"""
from __future__ import annotations

import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from tests.dyn.conftest import load_by_path, touched_paths
from toolkit.provision import facts as facts_engine
from toolkit.patch import patchhooks, patchsets, wheels

REPO = Path(__file__).resolve().parents[2]
RELEASES = ("0.5.11", "0.5.17", "0.5.23")   # every release patchsets/sm120/ has a diff for
CASES = tomllib.loads((Path(__file__).parent / "gate_cases.toml").read_text())["case"]
RULE = "sglang/srt/sm120_gates.py"
ENTRY = "m_grouped_fp8_fp4_gemm_nt_contiguous"


def patch_for(release: str) -> Path:
    return REPO / "patchsets" / "sm120" / release / "0001-sm120-blackwell-workstation.patch"


# Unpatched files of a release that the call-site tests load beside the patched ones (0.5.23 keeps
# the declaration stash and its read views out of overrides.py).
BESIDE = {"0.5.23": ("sglang/srt/arg_groups/model_override_base.py",)}


def tree_for(root: Path, release: str) -> Path:
    """The pristine files of SGLang `release` that its sm120 patch touches (from the real wheel,
    checked against RECORD), and those of BESIDE, under root, with that patch applied by git."""
    wheel, patch = wheels.pristine("sglang", release), patch_for(release)
    for path in [p for p, is_new in touched_paths(patch.read_text()) if not is_new] + list(BESIDE.get(release, ())):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(wheel.read(path))
    done = subprocess.run(["git", "apply", "-p1", str(patch)], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, f"{patch}: {done.stderr}"
    return root


@pytest.fixture(scope="session", params=RELEASES)
def release(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def patched_tree(tmp_path_factory, release) -> Path:
    return tree_for(tmp_path_factory.mktemp(f"sm120-patched-{release}"), release)


@pytest.fixture(scope="session")
def patched_rule(patched_tree):
    """sglang/srt/sm120_gates.py of the patched tree, imported by path (standard library only)."""
    return load_by_path(f"sm120_gates_patched_{patched_tree.name}", patched_tree / RULE)


def pair_set(spec, gpus: int) -> set[tuple[int, int]] | None:
    """The unordered pairs that HAVE the property; None for unknown."""
    every = {(a, b) for a in range(gpus) for b in range(gpus) if a < b}
    if spec == "all":
        return every
    if spec == "none":
        return set()
    if spec == "unknown":
        return None
    missing = {tuple(sorted(int(x) for x in p.split("-"))) for p in spec}
    return every - missing


def has(pairs, a, b) -> bool | None:
    return None if pairs is None else (min(a, b), max(a, b)) in pairs


def case_env(case) -> dict:
    return dict(case.get("env", {}))


# -- the facts side: what hostside/facts.py would have reported ---------------------------------

def facts_for(case) -> facts_engine.Facts:
    n = case["gpus"]
    p2p, atomics, nvlink = (pair_set(case[k], n) for k in ("p2p", "atomics", "nvlink"))
    word = {True: "OK", False: "NS", None: None}
    pairs = {}
    for a in range(n):
        for b in range(n):
            if a != b:
                pairs[f"{a}-{b}"] = {"read": word[has(p2p, a, b)], "write": word[has(p2p, a, b)],
                                     "atomics": word[has(atomics, a, b)], "nvlink": word[has(nvlink, a, b)],
                                     "link": "NV18" if has(nvlink, a, b) else "NODE"}
    packages = {"sglang-kernel": {"version": "0.4.2", "location": "/site"}}
    if case["flashinfer"]:
        packages["flashinfer-python"] = {"version": case["flashinfer"], "location": "/site"}
    dg = case["deep_gemm"]
    raw = {"gpus": [{"index": i, "name": "GPU", "capability": case["capability"], "memory_used_mib": 0,
                     "memory_total_mib": 1} for i in range(n)],
           "interconnect": {"pairs": pairs, "gpus": {}, "nvlink": bool(nvlink), "multicast": None},
           "kernels": {"flashinfer_trtllm_comm_majors": None if case["majors"] == "unreadable" else case["majors"],
                       "deep_gemm": {"present": dg != "none", "sm120_entry_point": dg == "sm120-branch"}},
           "packages": packages, "patch_state": {"stack": ["sm120"]}}
    return facts_engine.Facts(host="case", raw=raw)


# -- the runtime side: fake probes for the patched module ----------------------------------------

COMM_PY = '''def gen_trtllm_mnnvl_comm_module() -> JitSpec:
    return gen_jit_spec("trtllm_mnnvl_comm", [])


def gen_trtllm_comm_module() -> JitSpec:
    nvcc_flags = current_compilation_context.get_nvcc_flags_list(
        supported_major_versions={majors}
    )
    return gen_jit_spec("trtllm_comm", [], extra_cuda_cflags=nvcc_flags)


def gen_vllm_comm_module() -> JitSpec:
    return gen_jit_spec("vllm_comm", [])
'''


class FakeMachine:
    """Installs stand-ins for what the rule's runtime_inputs probes, shaped like `case`."""

    def __init__(self, case, root: Path, monkeypatch):
        self.case, self.n = case, case["gpus"]
        self.p2p, self.atomics, self.nvlink = (pair_set(case[k], self.n) for k in ("p2p", "atomics", "nvlink"))
        self.monkeypatch = monkeypatch
        major, minor = (int(x) for x in case["capability"].split("."))
        monkeypatch.setitem(sys.modules, "torch", self._torch(major, minor))
        driver = self._driver()
        cuda, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
        cuda.bindings, bindings.driver = bindings, driver
        for name, module in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.driver", driver),
                             ("pynvml", self._nvml())):
            monkeypatch.setitem(sys.modules, name, module)
        if case["deep_gemm"] == "none":
            monkeypatch.setitem(sys.modules, "deep_gemm", None)   # import deep_gemm -> ImportError
        else:
            deep_gemm = types.ModuleType("deep_gemm")
            deep_gemm.fp8_gemm_nt = lambda *a: None
            if case["deep_gemm"] == "sm120-branch":
                setattr(deep_gemm, ENTRY, lambda *a: None)
            monkeypatch.setitem(sys.modules, "deep_gemm", deep_gemm)
        self._flashinfer(root)
        for key, value in case_env(case).items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def _torch(self, major, minor):
        torch = types.ModuleType("torch")
        torch.cuda = types.SimpleNamespace(
            device_count=lambda: self.n,
            get_device_capability=lambda device=None: (major, minor),
            can_device_access_peer=self._access)
        return torch

    def _access(self, a, b):
        value = has(self.p2p, a, b)
        if value is None:
            raise RuntimeError("CUDA error: peer access query failed")
        return value

    def _driver(self):
        driver = types.ModuleType("cuda.bindings.driver")
        ok, bad = "CUDA_SUCCESS", "CUDA_ERROR_NOT_SUPPORTED"
        driver.CUresult = types.SimpleNamespace(CUDA_SUCCESS=ok)
        driver.CUdevice_P2PAttribute = types.SimpleNamespace(CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED="atomics")
        driver.CUdevice_attribute = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED="multicast")
        driver.cuInit = lambda flags: (ok,)

        def p2p_attribute(attribute, a, b):
            value = has(self.atomics, a, b)
            return (bad, 0) if value is None else (ok, int(value))
        driver.cuDeviceGetP2PAttribute = p2p_attribute
        driver.cuDeviceGetAttribute = lambda attribute, device: (ok, int(bool(self.nvlink)))
        return driver

    def _nvml(self):
        nvml = types.ModuleType("pynvml")
        nvml.NVML_P2P_CAPS_INDEX_NVLINK, nvml.NVML_P2P_STATUS_OK, nvml.NVML_P2P_STATUS_NOT_SUPPORTED = 3, 0, 5
        nvml.nvmlInit = lambda: None
        nvml.nvmlDeviceGetHandleByIndex = lambda index: index
        nvml.nvmlDeviceGetP2PStatus = lambda a, b, caps: 0 if has(self.nvlink, a, b) else 5
        return nvml

    def _flashinfer(self, root: Path):
        if not self.case["flashinfer"]:
            return
        package = root / "flashinfer"
        (package / "jit").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        majors = self.case["majors"]
        text = COMM_PY.format(majors=majors) if majors != "unreadable" else "def gen_vllm_comm_module():\n    pass\n"
        (package / "jit" / "comm.py").write_text(text)
        dist = root / f"flashinfer_python-{self.case['flashinfer']}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {self.case['flashinfer']}\n")
        self.monkeypatch.syspath_prepend(str(root))


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    def install(case):
        return FakeMachine(case, tmp_path / "site", monkeypatch)
    return install


def rule():
    """The rule module the sm120 hook runs: the file the patch adds, loaded out of its diff."""
    return patchhooks.HookContext("sm120", patchsets.load_all()).added_module(RULE)


def predict(found, tp_size=None, env=None):
    """The sm120 hook's prediction, called as the engine calls it."""
    [prediction] = patchhooks.predict(found, ["sm120"], tp_size, env)
    return prediction

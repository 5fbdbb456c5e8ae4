"""The patched SGLang call sites, run on the CPU with the real patched files (0.5.11 + sm120):
server start (flags and the one-line-per-feature log), torch symm-mem's communicator (two-shot
without multicast, and never a rendezvous without peer access), the DeepGEMM configurer.
What cannot run here is faked: the GPU answers (capability, peer access, multicast) and
torch's symmetric-memory allocator; torch itself is the real CPU build."""
from __future__ import annotations

import logging
import sys
import types

import pytest

from tests.dyn.conftest import load_by_path

from .conftest import CASES

SYMM = "sglang/srt/distributed/device_communicators/torch_symm_mem.py"
UTILS = "sglang/srt/distributed/device_communicators/all_reduce_utils.py"
CONFIGURER = "sglang/srt/layers/deep_gemm_wrapper/configurer.py"


def case(name_start):
    return next(c for c in CASES if c["name"].startswith(name_start))


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def logger_with_lines(name):
    log, handler = logging.getLogger(name), Lines()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return log, handler


# -- server start ---------------------------------------------------------------------------------

def server_args(**flags):
    base = dict(tp_size=8, nnodes=1, base_gpu_id=0, gpu_id_step=1, enable_flashinfer_allreduce_fusion=True,
                enable_torch_symm_mem=True)
    base.update(flags)
    return types.SimpleNamespace(**base)


def test_server_start_on_the_reference_host_turns_both_flags_off(patched_rule, fake_machine):
    fake_machine(case("reference host"))
    log, seen = logger_with_lines("sm120-test-start")
    args = server_args()
    decisions = patched_rule.server_start(args, log)
    patched_rule.apply_to_server_args(args, decisions, log)
    assert not args.enable_flashinfer_allreduce_fusion and not args.enable_torch_symm_mem
    assert all(text.startswith("sm120: ") for text in seen.lines)
    probes, decisions, turned_off = seen.lines[0], seen.lines[1:4], seen.lines[4:]
    assert probes.startswith("sm120: probes: capability 12.0, GPU 0-7; P2P access no (GPU 0-7 (every pair))")
    assert "multicast no; FlashInfer 0.6.8.post1 (trtllm_comm majors [9, 10]); deep_gemm yes (SM120 entry point no)" \
        in probes
    assert [text.split(":")[1].strip() for text in decisions] == [
        "FlashInfer all-reduce fusion", "torch symm-mem two-shot", "DeepGEMM"]
    assert [text.split(":")[1].strip() for text in turned_off] == [
        "--enable-flashinfer-allreduce-fusion turned off", "--enable-torch-symm-mem turned off"]


def test_server_start_forced_on_the_h200_sets_the_flags(patched_rule, fake_machine):
    fake_machine(case("the H200 machine with every gate forced on"))
    log, seen = logger_with_lines("sm120-test-forced")
    args = server_args(tp_size=2, enable_flashinfer_allreduce_fusion=False, enable_torch_symm_mem=False)
    patched_rule.apply_to_server_args(args, patched_rule.server_start(args, log), log)
    assert args.enable_flashinfer_allreduce_fusion and args.enable_torch_symm_mem
    # forced: the probes run on capability 9 too, so a GPU run shows what they read there
    assert seen.lines[0].startswith("sm120: probes: capability 9.0, GPU 0-1; P2P access yes; P2P atomics yes;"
                                    " NVLink yes; multicast yes")
    assert "forced by SGLANG_SM120_FORCE_SYMM_MEM_TWO_SHOT=on" in seen.lines[2]


def test_server_start_without_a_gpu_says_so(patched_rule, fake_machine, monkeypatch):
    fake_machine(case("reference host"))
    sys.modules["torch"].cuda.device_count = lambda: 0
    log, seen = logger_with_lines("sm120-test-nogpu")
    args = server_args()
    patched_rule.apply_to_server_args(args, patched_rule.server_start(args, log), log)
    assert seen.lines[:3] == [f"sm120: {t}: off (no NVIDIA GPU)" for t in
                              ("FlashInfer all-reduce fusion", "torch symm-mem two-shot", "DeepGEMM")]


def test_stock_capability_leaves_the_flags_alone(patched_rule, fake_machine):
    fake_machine(case("the H200 machine (capability 9.0"))
    log, seen = logger_with_lines("sm120-test-stock")
    args = server_args(tp_size=2, enable_torch_symm_mem=False)
    patched_rule.apply_to_server_args(args, patched_rule.server_start(args, log), log)
    assert args.enable_flashinfer_allreduce_fusion is True and args.enable_torch_symm_mem is False
    assert len(seen.lines) == 3 and all(" stock (capability 9.0 is not 12.x" in text for text in seen.lines)


# -- torch symm-mem -------------------------------------------------------------------------------

@pytest.fixture
def symm_module(patched_tree, patched_rule, monkeypatch):
    """torch_symm_mem.py of the patched tree with the real CPU torch and stand-ins for the rest of
    sglang; torch's symmetric-memory allocator is replaced by a recorder."""
    import torch  # noqa: F401  (the real CPU build)
    sglang, srt = types.ModuleType("sglang"), types.ModuleType("sglang.srt")
    srt.sm120_gates = patched_rule
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_cuda, utils.is_hip = (lambda: True), (lambda: False)
    for name, module in (("sglang", sglang), ("sglang.srt", srt), ("sglang.srt.sm120_gates", patched_rule),
                         ("sglang.srt.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed.device_communicators.all_reduce_utils",
                        load_by_path("sm120_all_reduce_utils", patched_tree / UTILS))
    module = load_by_path("sm120_torch_symm_mem", patched_tree / SYMM)
    monkeypatch.delenv("SGLANG_SM120_FORCE_SYMM_MEM_TWO_SHOT", raising=False)
    return module


class FakeSymmMem:
    def __init__(self, multicast_ptr):
        self.multicast_ptr, self.rendezvous_calls = multicast_ptr, 0

    def empty(self, numel, device, dtype):
        import torch
        return torch.empty(4, dtype=dtype)

    def rendezvous(self, buffer, group_name):
        self.rendezvous_calls += 1
        return types.SimpleNamespace(multicast_ptr=self.multicast_ptr)


def make_communicator(module, monkeypatch, *, capability, world, peer_access=True, multicast_ptr=0, rank=0):
    import torch
    import torch.distributed as dist
    fake = FakeSymmMem(multicast_ptr)
    monkeypatch.setattr(module, "torch_symm_mem", fake)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (capability, 0))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: peer_access)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)

    def gather(out, obj, group=None):
        out[:] = list(range(world))
    monkeypatch.setattr(dist, "all_gather_object", gather)
    group = types.SimpleNamespace(group_name="tp")
    return module.TorchSymmMemCommunicator(group, 0), fake


def test_capability_12_keeps_the_communicator_without_multicast(symm_module, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    comm, fake = make_communicator(symm_module, monkeypatch, capability=12, world=2)
    assert not comm.disabled and not comm._uses_multimem() and fake.rendezvous_calls == 1
    assert comm.max_size == 32 * 1024 * 1024
    assert ("sm120: torch symm-mem two-shot: communicator up (world size 2, multicast no, kernel two-shot,"
            " up to 32 MiB)") in caplog.messages


def test_no_rendezvous_without_peer_access(symm_module, monkeypatch, caplog):
    """rendezvous() crashes PCIe boxes without P2P (vLLM #33274): it must not be reached."""
    comm, fake = make_communicator(symm_module, monkeypatch, capability=12, world=2, peer_access=False)
    assert comm.disabled and fake.rendezvous_calls == 0
    assert any("sm120: torch symm-mem two-shot: off on this group (no P2P access: GPU 0<->1)" in m
               for m in caplog.messages)


def test_capability_9_keeps_the_stock_rule(symm_module, monkeypatch):
    comm, fake = make_communicator(symm_module, monkeypatch, capability=9, world=2)
    assert comm.disabled and fake.rendezvous_calls == 1          # stock: no multicast -> off
    comm, _ = make_communicator(symm_module, monkeypatch, capability=9, world=4, multicast_ptr=0xBEEF)
    assert not comm.disabled and comm._uses_multimem()             # stock multimem path unchanged


def test_forced_two_shot_on_capability_9_never_picks_multimem_without_multicast(symm_module, monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_FORCE_SYMM_MEM_TWO_SHOT", "on")
    comm, _ = make_communicator(symm_module, monkeypatch, capability=9, world=4)
    assert not comm.disabled and not comm._uses_multimem()


def test_forced_off_on_capability_12_is_the_stock_rule(symm_module, monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_FORCE_SYMM_MEM_TWO_SHOT", "off")
    comm, _ = make_communicator(symm_module, monkeypatch, capability=12, world=2)
    assert comm.disabled


# -- DeepGEMM configurer --------------------------------------------------------------------------

def load_configurer(patched_tree, patched_rule, monkeypatch, *, sm, deep_gemm, env=None):
    import torch
    for key in ("SGLANG_SM120_FORCE_DEEP_GEMM", "SGLANG_ENABLE_JIT_DEEPGEMM"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (sm // 10, sm % 10))
    if deep_gemm is None:
        monkeypatch.setitem(sys.modules, "deep_gemm", None)
    else:
        module = types.ModuleType("deep_gemm")
        for name in deep_gemm:
            setattr(module, name, lambda *a: None)
        monkeypatch.setitem(sys.modules, "deep_gemm", module)
    import os
    utils = types.ModuleType("sglang.srt.utils")
    utils.get_device_sm, utils.is_cuda, utils.is_musa = (lambda: sm), (lambda: True), (lambda: False)
    utils.is_blackwell_supported = lambda: sm // 10 in (10, 11, 12)
    environ = types.ModuleType("sglang.srt.environ")
    flag = types.SimpleNamespace(get=lambda: os.environ.get("SGLANG_ENABLE_JIT_DEEPGEMM", "1") not in ("0", "false"))
    environ.envs = types.SimpleNamespace(SGLANG_ENABLE_JIT_DEEPGEMM=flag)
    srt = types.ModuleType("sglang.srt")
    srt.sm120_gates = patched_rule
    for name, module in (("sglang", types.ModuleType("sglang")), ("sglang.srt", srt), ("sglang.srt.utils", utils),
                         ("sglang.srt.environ", environ), ("sglang.srt.sm120_gates", patched_rule)):
        monkeypatch.setitem(sys.modules, name, module)
    return load_by_path(f"sm120_configurer_{sm}", patched_tree / CONFIGURER)


SGLANG_KERNEL_DEEP_GEMM = ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous")
SM120_DEEP_GEMM = SGLANG_KERNEL_DEEP_GEMM + ("m_grouped_fp8_fp4_gemm_nt_contiguous",)


@pytest.mark.parametrize("sm, deep_gemm, env, enabled, blackwell, ue8m0", [
    (120, SGLANG_KERNEL_DEEP_GEMM, {}, False, False, False),     # the pinned stack on the reference host
    (121, SGLANG_KERNEL_DEEP_GEMM, {}, False, False, False),     # SM121: the same (stock 0.5.11 said yes)
    (120, SM120_DEEP_GEMM, {}, True, False, True),               # upstream's rule: the SM120 branch
    (121, SM120_DEEP_GEMM, {}, True, False, True),
    (122, SM120_DEEP_GEMM, {}, False, False, False),             # other 12.x: off
    (120, SM120_DEEP_GEMM, {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}, False, False, False),
    (120, None, {}, False, False, False),
    (90, SGLANG_KERNEL_DEEP_GEMM, {}, True, False, False),       # H200: stock
    (100, SGLANG_KERNEL_DEEP_GEMM, {}, True, True, True),        # B200: stock
    (90, SGLANG_KERNEL_DEEP_GEMM, {"SGLANG_SM120_FORCE_DEEP_GEMM": "off"}, False, False, False),
    (120, SGLANG_KERNEL_DEEP_GEMM, {"SGLANG_SM120_FORCE_DEEP_GEMM": "on"}, True, False, True),
], ids=["120-kernel", "121-kernel", "120-branch", "121-branch", "122-branch", "120-env-off", "120-none",
        "90-stock", "100-stock", "90-forced-off", "120-forced-on"])
def test_deep_gemm_configurer(patched_tree, patched_rule, monkeypatch, sm, deep_gemm, env, enabled, blackwell,
                              ue8m0):
    configurer = load_configurer(patched_tree, patched_rule, monkeypatch, sm=sm, deep_gemm=deep_gemm, env=env)
    assert (configurer.ENABLE_JIT_DEEPGEMM, configurer.DEEPGEMM_BLACKWELL, configurer.DEEPGEMM_SCALE_UE8M0) == \
        (enabled, blackwell, ue8m0)

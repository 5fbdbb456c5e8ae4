"""The patched SGLang call sites, run on the CPU with the real patched files of every release sm120
has a diff for (0.5.11, 0.5.17 and 0.5.23, each from its own wheel): server start (the gate's
lines, the flags it turns off or forces on, the fusion auto-enable and the enforce-disable around
it), torch symm-mem's communicator (two-shot without multicast, and never a rendezvous without peer
access), the DeepGEMM configurer, and from 0.5.17 on FlashInfer's fusion backend resolution (on
0.5.23 also the workspace preflight and the per-batch fusion check).
What cannot run here is faked: the GPU answers (capability, peer access, multicast), torch's
symmetric-memory allocator and the parts of sglang these files import; torch itself is the real
CPU build."""
from __future__ import annotations

import ast
import logging
import sys
import types
from pathlib import Path

import pytest

from tests.dyn.conftest import load_by_path

from .conftest import CASES, tree_for

SYMM = "sglang/srt/distributed/device_communicators/torch_symm_mem.py"
UTILS = "sglang/srt/distributed/device_communicators/all_reduce_utils.py"
CONFIGURER = "sglang/srt/layers/deep_gemm_wrapper/configurer.py"
SERVER_ARGS = "sglang/srt/server_args.py"
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
OVERRIDE_BASE = "sglang/srt/arg_groups/model_override_base.py"
MODEL_HOOK = "sglang/srt/arg_groups/model_hook.py"
FUSION = "sglang/srt/layers/flashinfer_comm_fusion.py"
ADD_NORM = "sglang/srt/layers/layer_boundary/residual/add_norm.py"


def case(name_start):
    return next(c for c in CASES if c["name"].startswith(name_start))


def imported_names(path: Path, module: str) -> list[str]:
    """The names a file imports from `module` at its top level."""
    return [alias.name for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ImportFrom) and node.module == module for alias in node.names]


def stub(name: str, names=(), **attrs) -> types.ModuleType:
    """A stand-in module: every name in `names` answers False unless `attrs` gives it."""
    module = types.ModuleType(name)
    for each in names:
        setattr(module, each, lambda *a, **k: False)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def install(monkeypatch, *modules: types.ModuleType) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module.__name__, module)


# -- server start ---------------------------------------------------------------------------------

def _gate_onwards(body: list) -> list:
    first = next(i for i, node in enumerate(body) if isinstance(node, ast.ImportFrom)
                 and node.module == "sglang.srt" and [a.name for a in node.names] == ["sm120_gates"])
    return body[first:]


def _compiled(path: Path, arg: str, body: list):
    function = ast.FunctionDef(name="call_site", args=ast.arguments(posonlyargs=[], args=[ast.arg(arg)],
                                                                   kwonlyargs=[], kw_defaults=[], defaults=[]),
                               body=body, decorator_list=[], returns=None, type_params=[])
    module = ast.Module(body=[function], type_ignores=[])
    return compile(ast.fix_missing_locations(module), str(path), "exec")


def method_tail(path: Path, cls: str, method: str):
    """The statements of cls.method from the sm120 gate's import to the method's end, compiled as
    `call_site(self)`: in 0.5.11 and 0.5.17 the gate and the flag handling it wraps (0.5.11: the
    auto-enable, the gate's flags, the enforce-disable; 0.5.17: the symm-mem flag and the three
    resolution passes) end ServerArgs._handle_model_specific_adjustments."""
    tree = ast.parse(path.read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    body = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method).body
    return _compiled(path, "self", _gate_onwards(body))


def function_tail(path: Path, name: str):
    """The same for a module-level function (0.5.23 moved that method's body to
    arg_groups/model_hook.handle_model_specific_adjustments), compiled as `call_site(server_args)`
    with the function's own first statement, `cfg = resolving_view(server_args)`, in front."""
    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name).body
    assert ast.unparse(body[0]) == "cfg = resolving_view(server_args)", ast.unparse(body[0])
    return _compiled(path, "server_args", [body[0], *_gate_onwards(body)])


class FakePlatform:
    """runtime_context.get_platform() of 0.5.23: the SM families, from the test's choice (sm90/sm100)
    and the fake torch's capability (12.x)."""

    def __init__(self, sm: dict):
        self.sm = sm

    @property
    def is_sm90(self):
        return self.sm["sm90"]

    @property
    def is_sm100(self):
        return self.sm["sm100"]

    @property
    def is_sm120(self):
        return sys.modules["torch"].cuda.get_device_capability()[0] == 12

    @property
    def is_blackwell(self):
        return self.is_sm100 or self.is_sm120


def _no_context():
    raise ValueError("no runtime context published")


def load_overrides_0523(tree: Path, monkeypatch, platform: FakePlatform):
    """0.5.23's arg_groups/overrides.py and model_override_base.py (the resolution passes, the
    declaration stash and its views), real, with stand-ins for the rest of sglang."""
    utils_names = (imported_names(tree / OVERRIDES, "sglang.srt.utils.common")
                   + imported_names(tree / OVERRIDE_BASE, "sglang.srt.utils.common"))
    arg_groups = stub("sglang.srt.arg_groups")
    install(monkeypatch, arg_groups, stub("sglang.srt.utils"), stub("sglang.srt.utils.common", utils_names),
            stub("sglang.srt.arg_groups.arg_utils", ("field_names", "resolvable_fields"), is_record=lambda x: False,
                 with_fallback=lambda cls, field, value: value),
            stub("sglang.srt.arg_groups.prefill_buffer_ceiling", ("prefill_buffer_ceiling_of",)),
            stub("sglang.srt.arg_groups.model_overrides"),
            stub("sglang.srt.platforms", current_platform=types.SimpleNamespace()),
            stub("sglang.srt.runtime_context", ("num_dp_ranks_of",), get_platform=lambda: platform,
                 attn_dp_enabled_of=lambda cfg: False, get_context=_no_context),
            stub("sglang.srt.environ", envs=types.SimpleNamespace()),
            stub("sglang.srt.model_executor"),
            stub("sglang.srt.model_executor.cuda_graph_config", Backend=types.SimpleNamespace()),
            stub("sglang.srt.configs"), stub("sglang.srt.configs.model_config", ModelConfig=None))
    base = load_by_path("sglang.srt.arg_groups.model_override_base", tree / OVERRIDE_BASE)
    monkeypatch.setitem(sys.modules, base.__name__, base)
    arg_groups.model_override_base = base
    overrides = load_by_path("sglang.srt.arg_groups.overrides", tree / OVERRIDES)
    monkeypatch.setitem(sys.modules, overrides.__name__, overrides)
    return overrides


# The flag a user sets to ask for the fusion, per release (0.5.17 renamed it; its deprecated
# --enable-flashinfer-allreduce-fusion becomes backend "auto" before this call site).
FUSION_FLAG = {"0.5.11": "--enable-flashinfer-allreduce-fusion", "0.5.17": "--flashinfer-allreduce-fusion-backend",
               "0.5.23": "--flashinfer-allreduce-fusion-backend"}


class ServerStart:
    """Runs the patched server-start call site of one release on a stand-in ServerArgs."""

    def __init__(self, release, tree, rule, monkeypatch):
        self.release, self.tree, self.rule = release, tree, rule
        srt = stub("sglang.srt", sm120_gates=rule)
        install(monkeypatch, stub("sglang"), srt, stub("sglang.srt.sm120_gates"))
        monkeypatch.setitem(sys.modules, "sglang.srt.sm120_gates", rule)
        self.sm = {"sm90": False, "sm100": False}
        self.overrides = None
        if release == "0.5.23":
            self.overrides = load_overrides_0523(tree, monkeypatch, FakePlatform(self.sm))
            names = ("resolving_view", "declare_resolution", "run_post_process_pass",
                     "_flashinfer_allreduce_fusion_auto_enable", "_sm120_allreduce_fusion_gate",
                     "_enforce_disable_allreduce_fusion")
            namespace = {"logger": logging.getLogger(f"sm120-model-hook-{release}"),
                         **{name: getattr(self.overrides, name) for name in names}}
            exec(function_tail(tree / MODEL_HOOK, "handle_model_specific_adjustments"), namespace)
            self.namespace = namespace
            return
        if release != "0.5.11":
            path = tree / OVERRIDES
            common = stub("sglang.srt.utils.common", imported_names(path, "sglang.srt.utils.common"),
                          is_sm90_supported=lambda: self.sm["sm90"], is_sm100_supported=lambda: self.sm["sm100"])
            install(monkeypatch, stub("sglang.srt.utils"), common, stub("sglang.srt.arg_groups"),
                    stub("sglang.srt.arg_groups.arg_utils", resolvable_fields=lambda cls: frozenset()),
                    stub("sglang.srt.environ", envs=types.SimpleNamespace()),
                    stub("sglang.srt.model_executor"), stub("sglang.srt.model_executor.cuda_graph_config",
                                                             Backend=types.SimpleNamespace()))
            self.overrides = load_by_path(f"sm120_overrides_{release}", path)
            monkeypatch.setitem(sys.modules, "sglang.srt.arg_groups.overrides", self.overrides)
        namespace = {"logger": logging.getLogger(f"sm120-server-args-{release}"),
                     "is_sm90_supported": lambda: self.sm["sm90"], "is_sm100_supported": lambda: self.sm["sm100"],
                     "is_h20_device": False}
        if self.overrides:
            namespace["run_post_process_pass"] = self.overrides.run_post_process_pass
        exec(method_tail(tree / SERVER_ARGS, "ServerArgs", "_handle_model_specific_adjustments"), namespace)
        self.namespace = namespace

    def __call__(self, *, arch="LlamaForCausalLM", fusion=False, symm=False, enforce_disable=False, sm=None, **flags):
        """Start with the user's flags; returns the flags the server then runs with:
        (fusion backend or True/False, enable_torch_symm_mem)."""
        self.sm.update(sm90=sm == 90, sm100=sm == 100)
        args = types.SimpleNamespace(tp_size=8, nnodes=1, base_gpu_id=0, gpu_id_step=1, enable_dp_attention=False,
                                     moe_a2a_backend="none", enable_torch_symm_mem=symm,
                                     enforce_disable_flashinfer_allreduce_fusion=enforce_disable)
        hf_config = types.SimpleNamespace(architectures=[arch])
        args.get_model_config = lambda: types.SimpleNamespace(hf_config=hf_config)
        args._model_config = types.SimpleNamespace(hf_config=hf_config, dtype=None)   # 0.5.23's memo
        args.disable_custom_all_reduce, args.attn_cp_size = False, 1
        for key, value in flags.items():
            setattr(args, key, value)
        if self.release == "0.5.11":
            args.enable_flashinfer_allreduce_fusion = bool(fusion)
        else:
            args.enable_flashinfer_allreduce_fusion = False   # the deprecated flag, mapped before this point
            args.flashinfer_allreduce_fusion_backend = "auto" if fusion is True else (fusion or None)
            args._resolved_overrides = []
        self.namespace["model_arch"] = arch
        self.namespace["call_site"](args)
        if self.release == "0.5.11":
            return args.enable_flashinfer_allreduce_fusion, args.enable_torch_symm_mem
        if self.release == "0.5.23":
            # what the published config reads: the last declaration over the raw input
            resolved = self.overrides.resolved_view(args)
            return resolved.flashinfer_allreduce_fusion_backend, resolved.enable_torch_symm_mem
        self.overrides.materialize_declarations(args)
        return args.flashinfer_allreduce_fusion_backend, args.enable_torch_symm_mem


@pytest.fixture
def server_start(release, patched_tree, patched_rule, monkeypatch):
    return ServerStart(release, patched_tree, patched_rule, monkeypatch)


def sm120_lines(caplog):
    return [m for m in caplog.messages if m.startswith("sm120: ")]


def fusion_on(value) -> bool:
    return value not in (False, None)


def test_server_start_on_the_reference_host_turns_both_flags_off(server_start, fake_machine, release, caplog):
    caplog.set_level(logging.INFO)
    fake_machine(case("reference host"))
    fusion, symm = server_start(fusion=True, symm=True, arch="KimiK25ForConditionalGeneration")
    assert not fusion_on(fusion) and symm is False
    seen = sm120_lines(caplog)
    probes, decisions, turned_off = seen[0], seen[1:4], seen[4:]
    assert probes.startswith("sm120: probes: capability 12.0, GPU 0-7; P2P access no (GPU 0-7 (every pair))")
    assert "multicast no; FlashInfer 0.6.8.post1 (trtllm_comm majors [9, 10]); deep_gemm yes (SM120 entry point no)" \
        in probes
    assert [text.split(":")[1].strip() for text in decisions] == [
        "FlashInfer all-reduce fusion", "torch symm-mem two-shot", "DeepGEMM"]
    assert sorted(text.split(":")[1].strip() for text in turned_off) == sorted([
        f"{FUSION_FLAG[release]} turned off", "--enable-torch-symm-mem turned off"])
    assert all("no P2P access: GPU 0-7 (every pair)" in text or "has no SM120 build" in text for text in turned_off)


def test_server_start_forced_on_the_h200_sets_the_flags(server_start, fake_machine, release, caplog):
    caplog.set_level(logging.INFO)
    fake_machine(case("the H200 machine with every gate forced on"))
    fusion, symm = server_start(tp_size=2, sm=90)
    assert fusion == (True if release == "0.5.11" else "auto") and symm is True
    seen = sm120_lines(caplog)
    # forced: the probes run on capability 9 too, so a GPU run shows what they read there
    assert seen[0].startswith("sm120: probes: capability 9.0, GPU 0-1; P2P access yes; P2P atomics yes;"
                              " NVLink yes; multicast yes")
    assert "forced by SGLANG_SM120_FORCE_SYMM_MEM_TWO_SHOT=on" in seen[2]


def test_enforce_disable_still_wins_over_a_forced_fusion(server_start, fake_machine):
    fake_machine(case("the H200 machine with every gate forced on"))
    fusion, symm = server_start(tp_size=2, sm=90, enforce_disable=True)
    assert not fusion_on(fusion) and symm is True


def test_server_start_without_a_gpu_says_so(server_start, fake_machine, caplog):
    caplog.set_level(logging.INFO)
    fake_machine(case("reference host"))
    sys.modules["torch"].cuda.device_count = lambda: 0
    fusion, symm = server_start(fusion=True, symm=True)
    assert sm120_lines(caplog)[:3] == [f"sm120: {t}: off (no NVIDIA GPU)" for t in
                                       ("FlashInfer all-reduce fusion", "torch symm-mem two-shot", "DeepGEMM")]
    assert not fusion_on(fusion) and symm is False


def test_stock_capability_leaves_the_flags_alone(server_start, fake_machine, release, caplog):
    caplog.set_level(logging.INFO)
    fake_machine(case("the H200 machine (capability 9.0"))
    fusion, symm = server_start(tp_size=2, sm=90, fusion="trtllm" if release != "0.5.11" else True)
    assert fusion == ("trtllm" if release != "0.5.11" else True) and symm is False
    seen = sm120_lines(caplog)
    assert len(seen) == 3 and all(" stock (capability 9.0 is not 12.x" in text for text in seen)
    # SGLang's own auto-enable still decides on capability 9
    fusion, _ = server_start(tp_size=2, sm=90, arch="Qwen3MoeForCausalLM")
    assert fusion == (True if release == "0.5.11" else "auto")


@pytest.mark.parametrize("arch, auto", [("Qwen3MoeForCausalLM", True), ("LlamaForCausalLM", False)])
def test_gate_on_auto_enables_the_fusion_for_the_models_upstream_lists(server_start, fake_machine, release, arch,
                                                                      auto):
    """Capability 12 with a FlashInfer that builds trtllm_comm for 12 and P2P: the gate says on, and the
    auto-enable takes SM12x as it takes SM90/SM10X (stock 0.5.11 and 0.5.17 never do on 12.x)."""
    fake_machine(case("2x RTX PRO 6000 with P2P and atomics, a FlashInfer with an SM12x"))
    fusion, symm = server_start(tp_size=2, arch=arch)
    assert fusion == ((True if release == "0.5.11" else "auto") if auto else (False if release == "0.5.11" else None))
    assert symm is False          # on, not forced: the user's flag stays as it was


# -- torch symm-mem -------------------------------------------------------------------------------

@pytest.fixture
def symm_module(release, patched_tree, patched_rule, monkeypatch):
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
    off = types.SimpleNamespace(get=lambda: False)   # 0.5.17: the Inkling buffer sizes stay off
    install(monkeypatch, stub("sglang.srt.environ", envs=types.SimpleNamespace(
        SGLANG_OPT_USE_INKLING_CUSTOM_AR=off, SGLANG_OPT_USE_INKLING_FUSED_AR_SCONV=off)),
        stub("sglang.srt.runtime_context", get_exec=lambda: None))
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed.device_communicators.all_reduce_utils",
                        load_by_path(f"sm120_all_reduce_utils_{release}", patched_tree / UTILS))
    module = load_by_path(f"sm120_torch_symm_mem_{release}", patched_tree / SYMM)
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
    utils.is_sm100_supported = lambda: sm // 10 == 10                 # 0.5.17's DEEPGEMM_BLACKWELL test
    environ = types.ModuleType("sglang.srt.environ")
    flag = types.SimpleNamespace(get=lambda: os.environ.get("SGLANG_ENABLE_JIT_DEEPGEMM", "1") not in ("0", "false"))
    environ.envs = types.SimpleNamespace(SGLANG_ENABLE_JIT_DEEPGEMM=flag)
    srt = types.ModuleType("sglang.srt")
    srt.sm120_gates = patched_rule
    runtime = stub("sglang.srt.runtime_context",                         # 0.5.23's platform facts
                   get_platform=lambda: types.SimpleNamespace(is_sm100=sm // 10 == 10))
    for name, module in (("sglang", types.ModuleType("sglang")), ("sglang.srt", srt), ("sglang.srt.utils", utils),
                         ("sglang.srt.environ", environ), ("sglang.srt.sm120_gates", patched_rule),
                         ("sglang.srt.runtime_context", runtime)):
        monkeypatch.setitem(sys.modules, name, module)
    return load_by_path(f"sm120_configurer_{patched_tree.name}_{sm}", patched_tree / CONFIGURER)


SGLANG_KERNEL_DEEP_GEMM = ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous")
SM120_DEEP_GEMM = SGLANG_KERNEL_DEEP_GEMM + ("m_grouped_fp8_fp4_gemm_nt_contiguous",)


@pytest.mark.parametrize("sm, deep_gemm, env, enabled, blackwell, ue8m0", [
    (120, SGLANG_KERNEL_DEEP_GEMM, {}, False, False, False),     # the pinned stack on the reference host
    (121, SGLANG_KERNEL_DEEP_GEMM, {}, False, False, False),     # SM121: the same (stock 0.5.11/0.5.17: yes)
    (120, SM120_DEEP_GEMM, {}, True, False, True),               # upstream's rule (stock 0.5.17: no)
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


# -- FlashInfer fusion backend (0.5.17: the backend is resolved per SM when the workspace is made) --

@pytest.fixture(scope="module")
def tree_0517(tmp_path_factory):
    return tree_for(tmp_path_factory.mktemp("sm120-0.5.17-fusion"), "0.5.17")


@pytest.fixture
def fusion_module(tree_0517, monkeypatch):
    """0.5.17's patched layers/flashinfer_comm_fusion.py, without FlashInfer (so no workspace code runs
    at import), the real CPU torch."""
    path = tree_0517 / FUSION
    install(monkeypatch, stub("sglang"), stub("sglang.srt"),
            stub("sglang.srt.distributed", imported_names(path, "sglang.srt.distributed")),
            stub("sglang.srt.distributed.parallel_state", imported_names(path, "sglang.srt.distributed.parallel_state")),
            stub("sglang.srt.runtime_context", imported_names(path, "sglang.srt.runtime_context")),
            stub("sglang.srt.utils", imported_names(path, "sglang.srt.utils")),
            stub("sglang.srt.utils.custom_op", register_custom_op=lambda *a, **k: (lambda f: f)))
    return load_by_path("sm120_flashinfer_comm_fusion_0517", path)


@pytest.mark.parametrize("sm, backend, multi_node, resolved", [
    (120, "auto", False, "trtllm"),       # the gate's "on" (or a force): the single-node IPC workspace
    (120, "trtllm", False, "trtllm"),
    (120, "mnnvl", False, "single node only"),
    (120, "auto", True, "single node only"),
    (90, "auto", False, "trtllm"),        # stock
    (100, "auto", False, "mnnvl"),        # stock
    (100, "auto", True, "mnnvl"),         # stock
    (90, "auto", True, "does not support multi-node"),
    (80, "auto", False, "requires SM90 or SM10X"),
], ids=["120-auto", "120-trtllm", "120-mnnvl", "120-multi-node", "90-auto", "100-auto", "100-multi-node",
        "90-multi-node", "80"])
def test_fusion_backend_resolution(fusion_module, monkeypatch, sm, backend, multi_node, resolved):
    """Stock 0.5.17 raises "requires SM90 or SM10X" on 12.x when the workspace is made, so a fusion the
    gate lets through would stop the server there; with the patch 12.x gets the trtllm backend."""
    for major, name in ((9, "is_sm90_supported"), (10, "is_sm100_supported"), (12, "is_sm120_supported")):
        monkeypatch.setattr(fusion_module, name, lambda major=major: sm // 10 == major)
    server_args = types.SimpleNamespace(flashinfer_allreduce_fusion_backend=backend, nnodes=2 if multi_node else 1)
    if resolved in ("trtllm", "mnnvl"):
        assert fusion_module.resolve_flashinfer_allreduce_fusion_backend(server_args) == resolved
    else:
        with pytest.raises(ValueError, match=resolved):
            fusion_module.resolve_flashinfer_allreduce_fusion_backend(server_args)
    server_args.flashinfer_allreduce_fusion_backend = None   # the gate said off: nothing is resolved
    assert fusion_module.resolve_flashinfer_allreduce_fusion_backend(server_args) is None


# -- 0.5.23: the backend, the workspace preflight and the per-batch check all read get_platform() --

@pytest.fixture(scope="module")
def tree_0523(tmp_path_factory):
    return tree_for(tmp_path_factory.mktemp("sm120-0.5.23-fusion"), "0.5.23")


class Fusion0523:
    """0.5.23's patched flashinfer_comm_fusion.py without FlashInfer (so no workspace code runs at
    import), the real CPU torch; the platform, the published backend and the node count are set per
    test."""

    def __init__(self, tree, monkeypatch, sm):
        self.platform = types.SimpleNamespace(is_sm90=sm // 10 == 9, is_sm100=sm // 10 == 10,
                                              is_sm120=sm // 10 == 12)
        self.comm = types.SimpleNamespace(flashinfer_allreduce_fusion_backend=None)
        self.parallel = types.SimpleNamespace(nnodes=1)
        path = tree / FUSION
        install(monkeypatch, stub("sglang"), stub("sglang.srt"), stub("sglang.srt.distributed"),
                stub("sglang.srt.distributed.device_communicators"),
                stub("sglang.srt.distributed.device_communicators.custom_all_reduce_utils",
                     imported_names(path, "sglang.srt.distributed.device_communicators.custom_all_reduce_utils")),
                stub("sglang.srt.distributed.parallel_state", imported_names(path, "sglang.srt.distributed.parallel_state")),
                stub("sglang.srt.runtime_context", imported_names(path, "sglang.srt.runtime_context"),
                     get_platform=lambda: self.platform, get_parallel=lambda: self.parallel,
                     get_exec=lambda: types.SimpleNamespace(comm=self.comm)),
                stub("sglang.srt.utils", imported_names(path, "sglang.srt.utils"),
                     ceil_align=lambda x, a: (x + a - 1) // a * a),
                stub("sglang.srt.utils.custom_op", register_custom_op=lambda *a, **k: (lambda f: f)))
        self.module = load_by_path(f"sm120_flashinfer_comm_fusion_0523_{sm}", path)


@pytest.mark.parametrize("sm, backend, multi_node, resolved", [
    (120, "auto", False, "trtllm"),       # the gate's "on" (or a force): the single-node IPC workspace
    (120, "trtllm", False, "trtllm"),
    (120, "mnnvl", False, "single node only"),
    (120, "cutedsl", False, "single node only"),
    (120, "auto", True, "single node only"),
    (90, "auto", False, "trtllm"),        # stock from here on
    (100, "auto", False, "mnnvl"),
    (100, "cutedsl", False, "cutedsl"),
    (90, "cutedsl", False, "requires a Blackwell system"),
    (90, "auto", True, "does not support multi-node"),
    (80, "auto", False, "requires SM90 or SM10X"),
], ids=["120-auto", "120-trtllm", "120-mnnvl", "120-cutedsl", "120-multi-node", "90-auto", "100-auto",
        "100-cutedsl", "90-cutedsl", "90-multi-node", "80"])
def test_fusion_backend_resolution_0523(tree_0523, monkeypatch, sm, backend, multi_node, resolved):
    """0.5.23 resolves the published backend (exec.comm) and node count (parallel); stock raises
    "requires SM90 or SM10X" on 12.x when the workspace is made."""
    fusion = Fusion0523(tree_0523, monkeypatch, sm)
    fusion.comm.flashinfer_allreduce_fusion_backend, fusion.parallel.nnodes = backend, 2 if multi_node else 1
    if resolved in ("trtllm", "mnnvl", "cutedsl"):
        assert fusion.module.resolve_flashinfer_allreduce_fusion_backend() == resolved
    else:
        with pytest.raises(ValueError, match=resolved):
            fusion.module.resolve_flashinfer_allreduce_fusion_backend()
    fusion.comm.flashinfer_allreduce_fusion_backend = None   # the gate said off: nothing is resolved
    assert fusion.module.resolve_flashinfer_allreduce_fusion_backend() is None


class FakeCudaDriver:
    """The cuda.bindings.driver calls of the workspace preflight, for a GPU without multicast: the
    multicast granularity query fails as the driver answers there (CUDA_ERROR_NOT_SUPPORTED)."""
    MIB2 = 2 << 20

    def __init__(self):
        self.CUresult = types.SimpleNamespace(CUDA_SUCCESS="ok")
        self.CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)
        self.CUmulticastGranularity_flags = types.SimpleNamespace(CU_MULTICAST_GRANULARITY_RECOMMENDED=1)
        self.CUmulticastObjectProp = types.SimpleNamespace
        self.multicast_queries, self.created, self.released = 0, [], 0

    def cuMemGetAllocationGranularity(self, prop, flags):
        return "ok", self.MIB2

    def cuMulticastGetGranularity(self, prop, flags):
        self.multicast_queries += 1
        return "CUDA_ERROR_NOT_SUPPORTED", 0

    def cuMemCreate(self, size, prop, flags):
        self.created.append(size)
        return "ok", len(self.created)

    def cuMemRelease(self, handle):
        self.released += 1


@pytest.mark.parametrize("sm, proceeds", [(120, True), (90, False)])
def test_workspace_preflight_without_multicast(tree_0523, monkeypatch, caplog, sm, proceeds):
    """The trtllm workspace is not multicast, but 0.5.23's preflight sizes it with the multicast
    granularity; on a GPU without multicast that query fails and the preflight skips the fusion
    (a warning, no error). Patched, 12.x sizes the three buffers by the allocation granularity
    alone and proceeds; capability 9 keeps the stock query (an H200 has multicast)."""
    import torch
    import torch.distributed as dist
    fusion = Fusion0523(tree_0523, monkeypatch, sm)
    driver = FakeCudaDriver()
    monkeypatch.setattr(fusion.module, "get_cuda_driver_bindings", lambda: driver)
    monkeypatch.setattr(fusion.module, "_make_flashinfer_workspace_allocation_prop", lambda d: types.SimpleNamespace(
        requestedHandleTypes="posix-fd"))
    monkeypatch.setattr(dist, "all_reduce", lambda flag, op=None, group=None: None)   # one rank's vote
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    ok = fusion.module._preflight_check_workspace_memory(world_size=2, max_token_num=2048, hidden_dim=4096,
                                                         dtype=torch.bfloat16, cpu_group=object())
    assert ok is proceeds
    if proceeds:
        assert driver.multicast_queries == 0 and len(driver.created) == 3 == driver.released
        assert all(size % FakeCudaDriver.MIB2 == 0 for size in driver.created)
    else:
        assert driver.multicast_queries == 1 and driver.created == []
        assert any("preflight probe failed" in m and "Skipping allreduce fusion" in m for m in caplog.messages)


@pytest.mark.parametrize("sm, backend, applies", [
    (120, "auto", True), (120, None, False), (90, "auto", True), (80, "auto", False)])
def test_the_per_batch_fusion_check_takes_sm12x(tree_0523, monkeypatch, sm, backend, applies):
    """layer_boundary/residual/add_norm.flashinfer_ar_fusion_applies (0.5.17's communicator
    apply_flashinfer_allreduce_fusion): stock 0.5.23 never fuses on 12.x, whatever the backend."""
    path = tree_0523 / ADD_NORM
    platform = types.SimpleNamespace(is_sm90=sm // 10 == 9, is_sm100=sm // 10 == 10, is_sm120=sm // 10 == 12)
    comm = types.SimpleNamespace(flashinfer_allreduce_fusion_backend=backend)
    modules = [stub("sglang"), stub("sglang.srt"), stub("sglang.srt.layers"),
               stub("sglang.srt.layers.layer_boundary"), stub("sglang.srt.layers.quantization"),
               stub("sglang.srt.model_executor"),
               stub("sglang.srt.layers.layer_boundary.residual", LayerResidualOps=types.SimpleNamespace),
               stub("sglang.srt.runtime_context", imported_names(path, "sglang.srt.runtime_context"),
                    get_platform=lambda: platform, get_exec=lambda: types.SimpleNamespace(comm=comm)),
               stub("sglang.srt.utils", imported_names(path, "sglang.srt.utils"), is_cuda=lambda: True,
                    is_flashinfer_available=lambda: True)]
    for module in ("sglang.srt.layers.dp_attention", "sglang.srt.layers.flashinfer_comm_fusion",
                   "sglang.srt.layers.layer_boundary.adapters.attention", "sglang.srt.layers.quantization.fp8_utils",
                   "sglang.srt.model_executor.forward_batch_info"):
        modules.append(stub(module, imported_names(path, module)))
    install(monkeypatch, *modules)
    add_norm = load_by_path(f"sm120_add_norm_0523_{sm}", path)
    assert add_norm.flashinfer_ar_fusion_applies(64) is applies
    assert add_norm.flashinfer_ar_fusion_applies(add_norm.FUSE_ALLREDUCE_MAX_BATCH_SIZE + 1) is False

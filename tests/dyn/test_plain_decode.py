"""The plain step of the patched workers, run on the CPU, on the patched files of every release
dyn-disable has a diff for (0.5.11 and 0.5.17, each from its own wheel): what both share runs on
both (tests parametrized by `release`); what only one has (0.5.11: the one-node verify input and
ModelWorkerBatch; 0.5.17: the ScheduleBatch decode view, the publish of the new lengths, the
plain backend in the seq_lens_cpu decision) runs on that one.

A plain step's target forward is a DECODE forward on a second instance of the server's own
attention backend with DECODE CUDA graphs, built as for a server without speculation; the v2
worker keeps only the draft's KV cache current while plain and computes the draft's hidden state
and top-k once, when drafting resumes. The functions here are the patched wheel files' own
(dyn_disable_runtime.py loaded whole; the workers' methods extracted and executed), run with
CPU torch. Stand-ins replace what needs a GPU server: the model runner, SGLang's CudaGraphRunner
base class, ForwardBatch, the triton cache-location kernel (a torch reference), the sampling
kernel and the draft model's layer objects (small real torch modules with the same attribute
names). What they cannot show (CUDA graphs replaying, the real kernels) ran on the H200s:
docs/evidence/dyn-disable-4/README.md."""
from __future__ import annotations

import ast
import dataclasses
import logging
import sys
import tomllib
import types
from contextlib import nullcontext

import pytest

from tests.dyn.conftest import (PATCHSET, tree_with, V2_RELEASES, function_source, load_by_path, method_source,
                                public_attrs, stub_modules)
from toolkit.patch import wheels


def only(*releases):
    """Run a test on these releases' patched files (the `release` fixture, indirectly)."""
    return pytest.mark.parametrize("release", list(releases), indirect=True)

torch = pytest.importorskip("torch")

RUNTIME = "sglang/srt/speculative/dyn_disable_runtime.py"
POLICY = "sglang/srt/speculative/dyn_disable.py"
WORKER_V2 = "sglang/srt/speculative/eagle_worker_v2.py"
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
OVERLAP_UTILS = "sglang/srt/managers/overlap_utils.py"
# where the model runner keeps its DECODE graph runner
GRAPH_ATTR = {"0.5.11": "graph_runner", "0.5.17": "decode_cuda_graph_runner", "0.5.23": "decode_cuda_graph_runner"}
# what a worker's step gets: 0.5.11 a ModelWorkerBatch, 0.5.17 the ScheduleBatch itself
BATCH_CLASS = {"0.5.11": "ModelWorkerBatch", "0.5.17": "ScheduleBatch", "0.5.23": "ScheduleBatch"}
FORWARD_BATCH_INFO = "sglang/srt/model_executor/forward_batch_info.py"
GIB = 1 << 30


class ModeName(str):
    """A forward mode as SGLang's code asks it (is_idle()), equal to its name for the tests."""

    def is_idle(self):
        return self == "IDLE"


class Mode:
    DECODE = ModeName("DECODE")
    TARGET_VERIFY = ModeName("TARGET_VERIFY")
    DRAFT_EXTEND_V2 = ModeName("DRAFT_EXTEND_V2")
    IDLE = ModeName("IDLE")


class Capture:
    NULL, LAST, FULL = 0, 1, 2


class Algo:
    NONE = "NONE"
    EAGLE3 = "EAGLE3"


class VerifyInput:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class Result:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class StockGraphRunner:
    """Stands for SGLang's CudaGraphRunner: captures in __init__, choosing its mode from the
    model runner's speculative algorithm at that moment, as the real one does."""

    def __init__(self, model_runner, *, attn_backend=None):
        self.model_runner = model_runner
        self.attn_backend = attn_backend
        self.algorithm_at_init = model_runner.spec_algorithm
        self.capture_forward_mode = Mode.DECODE if model_runner.spec_algorithm == Algo.NONE else Mode.TARGET_VERIFY
        self.capture_hidden_mode = Capture.NULL
        self.capture_bs = [1, 2, 4, 8]
        self.max_bs = 8
        if model_runner.oom_at_capture:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        self.capture()

    def capture(self):
        self.hidden_mode_at_capture = self.capture_hidden_mode


class ForwardBatch:
    built = []

    @classmethod
    def init_new(cls, batch, model_runner, **kwargs):
        # what the batch holds at this moment (0.5.17 builds from a ScheduleBatch it restores after)
        seen = types.SimpleNamespace(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)})
        fb = types.SimpleNamespace(batch=seen, attn_backend=model_runner.attn_backend, kwargs=kwargs)
        cls.built.append(fb)
        return fb


# what 0.5.23's runtime_context.attention_backends() answers: the published (prefill, decode) pair
PUBLISHED = types.SimpleNamespace(attention_backends=("triton", "triton"))


def runtime_stubs(release, policy) -> dict:
    """The sglang modules dyn_disable_runtime.py of `release` imports, as stand-ins."""
    stubs = {
        "sglang.srt.model_executor.forward_batch_info": dict(
            CaptureHiddenMode=Capture, ForwardBatch=ForwardBatch, ForwardMode=Mode),
        "sglang.srt.speculative.dyn_disable": public_attrs(policy),  # the real policy module
        "sglang.srt.speculative.spec_info": dict(SpeculativeAlgorithm=Algo),
        "sglang.srt.managers.utils": dict(GenerationBatchResult=Result),
    }
    if release == "0.5.11":
        stubs["sglang.srt.speculative.eagle_info"] = dict(EagleVerifyInput=VerifyInput)
        stubs["sglang.srt.model_executor.cuda_graph_runner"] = dict(CudaGraphRunner=StockGraphRunner)
    else:
        stubs["sglang.srt.model_executor.runner.decode_cuda_graph_runner"] = dict(
            DecodeCudaGraphRunner=StockGraphRunner)
    if release == "0.5.23":
        # 0.5.23 reads the TP group from the runtime context, not from the model runner
        stubs["sglang.srt.runtime_context"] = dict(get_parallel=lambda: types.SimpleNamespace(tp_group=TP.group),
                                                   attention_backends=lambda: PUBLISHED.attention_backends)
        # and asks the model config whether the target is a hybrid linear-attention model
        stubs["sglang.srt.configs.hybrid_arch"] = dict(
            mambaish_config=lambda model_config: getattr(model_config, "linear_attention", None))
    return stubs


@pytest.fixture(scope="module")
def policy(release_tree, release):
    return load_by_path(f"dyn_disable_policy_for_runtime_{release.replace('.', '_')}", release_tree / POLICY)


@pytest.fixture(scope="module")
def runtime(release_tree, release, policy):
    with stub_modules(runtime_stubs(release, policy)):
        yield load_by_path(f"dyn_disable_runtime_under_test_{release.replace('.', '_')}",
                           release_tree / RUNTIME)


# --- the decode batch ---------------------------------------------------------------------

def batch_class(release):
    """A dataclass with exactly the fields of the batch a worker's step gets in `release` (read
    from its wheel: 0.5.11's ModelWorkerBatch, 0.5.17's ScheduleBatch), so what the patch
    replaces or sets meets the real field set."""
    tree = ast.parse(wheels.pristine("sglang", release).read(SCHEDULE_BATCH))
    name = BATCH_CLASS[release]
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    names = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert {"forward_mode", "seq_lens", "seq_lens_cpu", "spec_info"} <= set(names)
    return dataclasses.make_dataclass(name, [(n, object, dataclasses.field(default=None)) for n in names])


def verify_batch(release):
    seq_lens = torch.tensor([5, 9, 17])
    fields = dict(forward_mode=Mode.TARGET_VERIFY, input_ids=torch.tensor([11, 12, 13]),
                  req_pool_indices=torch.tensor([2, 0, 1]), seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
                  seq_lens_sum=31, out_cache_loc=torch.tensor([40, 41, 42]), spec_info=object(),
                  capture_hidden_mode=Capture.NULL, sampling_info=object())
    if release != "0.5.11":
        del fields["capture_hidden_mode"]  # a ForwardBatch argument on 0.5.17, not a batch field
        fields["orig_seq_lens"] = seq_lens.to(torch.int32)
    return batch_class(release)(**fields)


def decode_of(runtime, release, batch):
    """What the plain step's decode forward is built from: 0.5.11 a new ModelWorkerBatch;
    0.5.17 the ScheduleBatch itself, changed for the length of a block."""
    if release == "0.5.11":
        return runtime.as_decode_batch(batch)
    with runtime.decode_view(batch) as viewed:
        return types.SimpleNamespace(**{f.name: getattr(viewed, f.name) for f in dataclasses.fields(viewed)})


def test_the_decode_batch_counts_the_new_token_and_carries_no_spec_info(runtime, release):
    batch = verify_batch(release)
    spec_info = batch.spec_info
    decode = decode_of(runtime, release, batch)
    assert decode.forward_mode == Mode.DECODE and decode.spec_info is None
    assert decode.seq_lens.tolist() == [6, 10, 18] and decode.seq_lens_cpu.tolist() == [6, 10, 18]
    assert decode.orig_seq_lens.tolist() == [6, 10, 18] and decode.seq_lens_sum == 34
    for kept in ("input_ids", "out_cache_loc", "req_pool_indices", "sampling_info"):
        assert getattr(decode, kept) is getattr(batch, kept)
    # the verify batch itself is (again) as it was
    assert batch.seq_lens.tolist() == [5, 9, 17] and batch.forward_mode == Mode.TARGET_VERIFY
    assert batch.seq_lens_cpu.tolist() == [5, 9, 17] and batch.seq_lens_sum == 31
    assert batch.spec_info is spec_info


@only("0.5.11")
def test_the_0511_decode_batch_captures_full_hidden_states(runtime, release):
    assert runtime.as_decode_batch(verify_batch(release)).capture_hidden_mode == Capture.FULL


@only(*V2_RELEASES)
def test_the_0517_decode_view_is_restored_when_the_forward_fails(runtime, release):
    batch = verify_batch(release)
    with pytest.raises(RuntimeError, match="boom"):
        with runtime.decode_view(batch):
            raise RuntimeError("boom")
    assert batch.forward_mode == Mode.TARGET_VERIFY and batch.seq_lens.tolist() == [5, 9, 17]
    assert batch.orig_seq_lens.dtype == torch.int32 and batch.spec_info is not None


def test_decode_positions_are_the_positions_the_token_would_verify_at(runtime, release, tmp_path):
    """SGLang's own decode positions (clamp_position of seq_lens) for the decode batch equal
    the one-token verify's positions (seq_lens), i.e. the token keeps its place."""
    namespace = {"torch": torch}
    if release == "0.5.23":  # the torch path of the clamp_position fused op
        source = tmp_path / "clamp_position.py"
        source.write_bytes(wheels.pristine("sglang", release).read("sglang/kernels/ops/attention/clamp_position.py"))
        exec(method_source(source, "ClampPositionOp", "forward_native"), namespace)
        clamp = lambda seq_lens: namespace["forward_native"](None, seq_lens)  # noqa: E731
    else:
        source = tmp_path / "forward_batch_info.py"
        source.write_bytes(wheels.pristine("sglang", release).read(FORWARD_BATCH_INFO))
        exec(function_source(source, "_clamp_position_native"), namespace)
        clamp = namespace["_clamp_position_native"]
    batch = verify_batch(release)
    decode = decode_of(runtime, release, batch)
    assert clamp(decode.seq_lens).tolist() == batch.seq_lens.tolist()
    if release == "0.5.11":
        verify = runtime.build_trivial_verify_input(batch.input_ids, batch.seq_lens, batch.seq_lens_cpu, 31)
        assert verify.positions.tolist() == batch.seq_lens.tolist()


def test_missing_host_lengths_stay_missing(runtime, release):
    batch = dataclasses.replace(verify_batch(release), seq_lens_cpu=None, seq_lens_sum=None)
    decode = decode_of(runtime, release, batch)
    assert decode.seq_lens_cpu is None and decode.seq_lens_sum is None


# --- what the patch refuses -----------------------------------------------------------------

def target_runner(release, **hybrid_configs):
    """A target model runner with these hybrid configs: attributes of the runner on 0.5.11 and
    0.5.17; on 0.5.23 what hybrid_arch.mambaish_config finds in its model config (one answer for
    every kind of hybrid: the real function is the union of the same checks)."""
    if release != "0.5.23":
        return types.SimpleNamespace(**hybrid_configs)
    found = next((c for c in hybrid_configs.values() if c is not None), None)
    return types.SimpleNamespace(model_config=types.SimpleNamespace(linear_attention=found))


@pytest.mark.parametrize("args, runner_attrs, words", [
    ({"enable_dp_attention": True}, {}, "DP attention"),
    ({"speculative_adaptive": True}, {}, "--speculative-adaptive"),
    ({"enable_two_batch_overlap": True}, {}, "two-batch overlap"),
    ({"enable_pdmux": True}, {}, "PD multiplexing"),
    ({"pp_size": 2}, {}, "pipeline parallelism"),
    ({"enable_lora": True}, {}, "LoRA"),
    ({}, {"hybrid_gdn_config": object()}, "hybrid linear-attention"),
    ({}, {"mamba2_config": object()}, "hybrid linear-attention"),
    ({}, {"hybrid_lightning_config": object()}, "hybrid linear-attention"),
    ({}, {"kimi_linear_config": object()}, "hybrid linear-attention"),
    ({}, {"mambaish_config": object()}, "hybrid linear-attention"),
])
def test_unsupported_servers_are_refused_with_the_reason(runtime, release, monkeypatch, caplog, args, runner_attrs,
                                                         words):
    server_args = types.SimpleNamespace(**args)
    runner = target_runner(release, **runner_attrs)
    assert words in runtime.unsupported_reason(server_args, runner)
    assert_refused(runtime, server_args, runner, words, monkeypatch, caplog)


def assert_refused(runtime, server_args, runner, words, monkeypatch, caplog):
    """make_switch gives no switch, and logs why on the line `invoke server start` stops waiting on
    (the one the patchset names under [logs] refuse)."""
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_THRESHOLD", "8")
    with caplog.at_level(logging.WARNING):
        assert runtime.make_switch(server_args, "EAGLEWorkerV2", runner) is None
    assert words in caplog.text and "speculation stays always on" in caplog.text
    refuse = tomllib.loads((PATCHSET / "patchset.toml").read_text())["logs"]["refuse"]
    assert any(record.getMessage().startswith(tuple(refuse)) for record in caplog.records)


def test_a_dense_or_mla_target_without_those_features_is_served(runtime, release, monkeypatch, caplog):
    runner = target_runner(release, hybrid_gdn_config=None, mamba2_config=None, mambaish_config=None)
    server_args = types.SimpleNamespace(pp_size=1, enable_lora=False)
    assert runtime.unsupported_reason(server_args, runner) is None
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_THRESHOLD", "8")
    with caplog.at_level(logging.INFO):
        switch = runtime.make_switch(server_args, "EAGLEWorkerV2", runner)
    assert switch.config.threshold == 8
    assert "Dynamic speculation disable enabled: threshold=8 hysteresis=2" in caplog.text


@only("0.5.17", "0.5.23")
@pytest.mark.parametrize("args, words", [
    ({"speculative_eagle_topk": 4}, "--speculative-eagle-topk > 1"),
    ({"speculative_use_rejection_sampling": True}, "--speculative-use-rejection-sampling"),
    ({"speculative_adaptive": True}, "decides drafting per batch size too"),
])
def test_0517_refuses_a_tree_config_rejection_sampling_and_adaptive_mode(runtime, release, monkeypatch,
                                                                          caplog, args, words):
    """0.5.17 has no v1 worker: a tree configuration (topk > 1), which 0.5.11 served with the v1
    worker, is refused like every other unsupported case (speculation stays on, the start fails
    on the [logs] refuse line); so are rejection sampling and upstream's adaptive mode."""
    server_args = types.SimpleNamespace(pp_size=1, enable_lora=False, **args)
    assert_refused(runtime, server_args, None, words, monkeypatch, caplog)
    assert runtime.unsupported_reason(types.SimpleNamespace(speculative_eagle_topk=1)) is None


@only("0.5.11")
def test_0511_serves_a_tree_config_with_its_v1_worker(runtime, release):
    assert runtime.unsupported_reason(types.SimpleNamespace(speculative_eagle_topk=4)) is None


# --- building the plain decode path ---------------------------------------------------------

class FakeDevice:
    def __init__(self, free_before, free_after):
        self.readings = [free_before, free_after]

    def synchronize(self):
        pass

    def mem_get_info(self):
        free = self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]
        return free, 100 * GIB


def model_runner(release, graphs=True, oom=False):
    runner = types.SimpleNamespace(
        device="fake", spec_algorithm=Algo.EAGLE3, init_new_workspace=False,
        oom_at_capture=oom, backends=[])
    setattr(runner, GRAPH_ATTR[release], object() if graphs else None)

    def get_backend(init_new_workspace=False):
        runner.init_new_workspace = init_new_workspace
        backend = types.SimpleNamespace(algorithm_at_init=runner.spec_algorithm,
                                        new_workspace=init_new_workspace)
        runner.backends.append(backend)
        return backend

    runner._get_attention_backend = get_backend
    return runner


def test_the_plain_path_is_built_as_a_non_speculative_server_builds_it(runtime, release, monkeypatch):
    monkeypatch.setattr(torch, "get_device_module", lambda device: FakeDevice(10 * GIB, 9.5 * GIB))
    runner = model_runner(release)
    state = runtime.build_plain_decode_state(runner)
    backend, graphs = state.attn_backend, state.graph_runner
    assert backend.algorithm_at_init == Algo.NONE and backend.new_workspace is True
    assert graphs.algorithm_at_init == Algo.NONE and graphs.capture_forward_mode == Mode.DECODE
    assert graphs.attn_backend is backend
    # the target's hidden states come back from the decode graphs (the draft extend needs them)
    assert graphs.hidden_mode_at_capture == Capture.FULL
    # the server itself is left speculative, its own workspace flag as it was
    assert runner.spec_algorithm == Algo.EAGLE3 and runner.init_new_workspace is False
    assert state.extra_memory_gib == pytest.approx(0.5)
    assert state.graphs_note == "CUDA graphs for batch sizes 1..8"
    line = runtime.plain_decode_message(state, "KV cache only")
    assert line.startswith("Dynamic speculation disable: plain step is a decode forward on SimpleNamespace")
    assert "extra GPU memory 0.50 GiB" in line


def test_a_server_without_cuda_graphs_gets_an_eager_plain_path(runtime, release, monkeypatch):
    monkeypatch.setattr(torch, "get_device_module", lambda device: FakeDevice(GIB, GIB))
    state = runtime.build_plain_decode_state(model_runner(release, graphs=False))
    assert state.graph_runner is None and "no CUDA graphs" in state.graphs_note


def test_out_of_memory_while_capturing_says_what_to_change(runtime, release, monkeypatch):
    monkeypatch.setattr(torch, "get_device_module", lambda device: FakeDevice(GIB, GIB))
    runner = model_runner(release, oom=True)
    with pytest.raises(RuntimeError, match="lower --mem-fraction-static"):
        runtime.build_plain_decode_state(runner)
    assert runner.spec_algorithm == Algo.EAGLE3 and runner.init_new_workspace is False


def model_output(logits="logits"):
    return types.SimpleNamespace(logits_output=logits, can_run_graph=True, expert_distribution_metrics=None,
                                 routed_experts_output=None, indexer_topk_output=None)


def plain_forward(runtime, release, target, state, batch, sample=False):
    """runtime.plain_decode_forward; on 0.5.17 it also returns the ForwardBatch (the scheduler
    keeps it alive for two iterations, as it keeps a verify's)."""
    out = runtime.plain_decode_forward(target, state, batch, sample=sample)
    if release == "0.5.11":
        return out
    result, forward_batch = out
    assert forward_batch is ForwardBatch.built[-1]
    return result


def test_the_forward_swaps_in_the_plain_backend_and_graphs_only_for_its_duration(runtime, release):
    stock_backend, stock_graphs = object(), object()
    graph_attr = GRAPH_ATTR[release]
    seen = {}

    def forward(fb):
        seen["graph_runner"] = getattr(runner, graph_attr)
        return model_output()

    runner = types.SimpleNamespace(attn_backend=stock_backend, forward=forward, **{graph_attr: stock_graphs})
    state = runtime.PlainDecodeState("plain-backend", "plain-graphs", "", 0.0)
    ForwardBatch.built.clear()
    batch = verify_batch(release)
    out = plain_forward(runtime, release, types.SimpleNamespace(model_runner=runner), state, batch)
    built = ForwardBatch.built[0]
    assert built.attn_backend == "plain-backend"
    assert built.batch.forward_mode == Mode.DECODE and built.batch.seq_lens.tolist() == [6, 10, 18]
    if release != "0.5.11":  # the target's hidden states come back from the decode forward
        assert built.kwargs == {"capture_hidden_mode": Capture.FULL, "return_hidden_states_before_norm": False}
        assert batch.forward_mode == Mode.TARGET_VERIFY and batch.seq_lens.tolist() == [5, 9, 17]
    assert seen["graph_runner"] == "plain-graphs"
    assert out.logits_output == "logits" and out.can_run_cuda_graph is True
    assert runner.attn_backend is stock_backend and getattr(runner, graph_attr) is stock_graphs
    assert not hasattr(out, "next_token_ids")  # v1 samples in its own verify


def test_the_v2_plain_step_samples_with_the_targets_own_sampler_on_the_decode_batch(runtime, release):
    sampled = []

    def sample(logits_output, forward_batch):
        sampled.append((logits_output, forward_batch.batch.forward_mode, forward_batch.attn_backend))
        return torch.tensor([7, 8])

    runner = types.SimpleNamespace(attn_backend="stock", sample=sample, forward=lambda fb: model_output(),
                                   **{GRAPH_ATTR[release]: "stock-graphs"})
    state = runtime.PlainDecodeState("plain-backend", "plain-graphs", "", 0.0)
    out = plain_forward(runtime, release, types.SimpleNamespace(model_runner=runner), state,
                        verify_batch(release), sample=True)
    # the sampler a server without speculation runs, on the same DECODE forward batch
    assert sampled == [("logits", Mode.DECODE, "plain-backend")]
    assert out.next_token_ids.tolist() == [7, 8]


def test_request_slots_are_the_slots_of_each_requests_position(runtime):
    req_to_token = (torch.arange(4 * 32).view(4, 32) + 1000).to(torch.int32)  # SGLang keeps int32
    rows, positions = torch.tensor([2, 0, 3]), torch.tensor([5, 31, 0])
    slots = runtime.request_slots(req_to_token, rows, positions)
    assert slots.dtype == torch.int64
    assert slots.tolist() == assign_slots(rows, req_to_token, positions, positions + 1, 3, 1, "cpu").tolist()


# --- the draft's KV-only update ---------------------------------------------------------------

H, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 4


class RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(positions, q, k):
    """A neox-style rotary embedding that works in place, like SGLang's kernel."""
    def rotate(x):
        x3 = x.view(x.shape[0], -1, HEAD_DIM)
        half = HEAD_DIM // 2
        angle = positions[:, None, None].float() * (torch.arange(half) + 1).float() / 10
        a, b = x3[..., :half].clone(), x3[..., half:].clone()
        x3[..., :half] = a * torch.cos(angle) - b * torch.sin(angle)
        x3[..., half:] = b * torch.cos(angle) + a * torch.sin(angle)
    rotate(q)
    rotate(k)
    return q, k


class KVPool:
    def __init__(self, slots, kv_heads=KV_HEADS):
        self.k = torch.zeros(slots, kv_heads, HEAD_DIM)
        self.v = torch.zeros(slots, kv_heads, HEAD_DIM)

    def set_kv_buffer(self, layer, loc, k, v, k_scale=None, v_scale=None):
        assert layer.layer_id == 0
        self.k[loc] = k
        self.v[loc] = v


def eagle3_draft(release, name="LlamaForCausalLMEagle3", qkv_bias=False, dtype=torch.float32, layers=1,
                 norms=False):
    """A draft runner with LlamaForCausalLMEagle3's attribute layout of `release` and real (small)
    layers: 0.5.11 keeps its one decoder layer as model.midlayer, 0.5.17 its layers in
    model.layers, with the optional input_norm (norm_before_fc) and per-chunk fc_norm."""
    torch.manual_seed(0)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    attn = torch.nn.Module()
    attn.qkv_proj = torch.nn.Linear(2 * H, q_size + 2 * kv_size, bias=qkv_bias).to(dtype)
    attn.q_size, attn.kv_size, attn.rotary_emb = q_size, kv_size, rope
    attn.attn = types.SimpleNamespace(layer_id=0, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS,
                                      qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, k_scale=None, v_scale=None)
    layer = torch.nn.Module()
    layer.self_attn, layer.input_layernorm, layer.hidden_norm = attn, RMSNorm(H), RMSNorm(H)
    inner = torch.nn.Module()
    inner.embed_tokens, inner.fc = torch.nn.Embedding(64, H), torch.nn.Linear(3 * H, H, bias=False)
    if release == "0.5.11":
        inner.midlayer = layer
    else:
        inner.layers = torch.nn.ModuleList([layer] + [torch.nn.Module() for _ in range(layers - 1)])
        inner.num_aux_hidden_states = 3
        inner.input_norm = RMSNorm(3 * H) if norms else None
        inner.fc_norm = torch.nn.ModuleList([RMSNorm(H) for _ in range(3)]) if norms else None
    model = type(name, (torch.nn.Module,), {})()
    model.model = inner
    return types.SimpleNamespace(model=model, token_to_kv_pool=KVPool(32))


def draft_input(draft, target_hidden):
    """The draft's input hidden state as its model prepares it (0.5.17: input_norm over the whole,
    then fc_norm per aux chunk, then fc)."""
    inner = draft.model.model
    if getattr(inner, "input_norm", None) is not None:
        target_hidden = inner.input_norm(target_hidden)
    if getattr(inner, "fc_norm", None) is not None:
        target_hidden = torch.cat([n(c) for n, c in zip(inner.fc_norm, target_hidden.chunk(3, dim=-1))], dim=-1)
    return inner.fc(target_hidden)


def draft_layer(draft):
    inner = draft.model.model
    return inner.midlayer if hasattr(inner, "midlayer") else inner.layers[0]


def full_layer_kv(draft, tokens, target_hidden, positions):
    """K and V as the draft layer's own attention computes them (the reference)."""
    inner = draft.model.model
    layer = draft_layer(draft)
    attn = layer.self_attn
    x = torch.cat([layer.input_layernorm(inner.embed_tokens(tokens)),
                   layer.hidden_norm(draft_input(draft, target_hidden))], dim=-1)
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = rope(positions, q.clone(), k.clone())
    return k.view(-1, KV_HEADS, HEAD_DIM), v.reshape(-1, KV_HEADS, HEAD_DIM)


def test_kv_only_update_writes_exactly_the_kv_the_layer_would_write(runtime, release, norms=False):
    draft = eagle3_draft(release, norms=norms)
    tokens, positions = torch.tensor([3, 7, 9]), torch.tensor([5, 11, 2])
    target_hidden = torch.randn(3, 3 * H)
    loc = torch.tensor([20, 4, 13])
    with torch.no_grad():
        hidden = runtime.draft_kv_only_extend(draft, tokens, target_hidden, positions, loc)
        reference = eagle3_draft(release, norms=norms)  # the same weights (seeded), untouched by the update
        k_ref, v_ref = full_layer_kv(reference, tokens, target_hidden, positions)
        assert torch.allclose(hidden, draft_input(reference, target_hidden))
    pool = draft.token_to_kv_pool
    assert torch.allclose(pool.k[loc], k_ref, atol=1e-6) and torch.allclose(pool.v[loc], v_ref, atol=1e-6)
    untouched = [i for i in range(32) if i not in loc.tolist()]
    assert pool.k[untouched].abs().sum() == 0 and pool.v[untouched].abs().sum() == 0


def tp_shard(draft, rank, tp):
    """The draft as TP rank `rank` of `tp` holds it: QKVParallelLinear keeps the rank's query heads,
    then its key heads, then its value heads, and the attention's sizes and head counts are the
    rank's own."""
    attn = draft_layer(draft).self_attn
    q, k, v = attn.qkv_proj.weight.data.split([attn.q_size, attn.kv_size, attn.kv_size])
    part = lambda w: w.chunk(tp)[rank]  # noqa: E731 - whole heads per rank, in order
    attn.qkv_proj.weight.data = torch.cat([part(q), part(k), part(v)])
    attn.q_size, attn.kv_size = attn.q_size // tp, attn.kv_size // tp
    attn.attn.tp_k_head_num = attn.attn.tp_v_head_num = KV_HEADS // tp
    draft.token_to_kv_pool = KVPool(32, KV_HEADS // tp)
    return draft


def test_kv_only_update_at_tp_2_writes_each_ranks_own_kv_heads(runtime, release):
    """At TP > 1 each rank writes the K/V of its own KV heads, taken from its shard of the fused
    QKV weight: together the ranks write what the whole layer computes."""
    tokens, positions = torch.tensor([3, 7, 9]), torch.tensor([5, 11, 2])
    target_hidden = torch.randn(3, 3 * H, generator=torch.Generator().manual_seed(7))
    loc = torch.tensor([20, 4, 13])
    with torch.no_grad():
        k_ref, v_ref = full_layer_kv(eagle3_draft(release), tokens, target_hidden, positions)
        for rank in range(2):
            draft = tp_shard(eagle3_draft(release), rank, 2)
            runtime.draft_kv_only_extend(draft, tokens, target_hidden, positions, loc)
            pool, heads = draft.token_to_kv_pool, slice(rank * KV_HEADS // 2, (rank + 1) * KV_HEADS // 2)
            assert torch.allclose(pool.k[loc], k_ref[:, heads], atol=1e-6)
            assert torch.allclose(pool.v[loc], v_ref[:, heads], atol=1e-6)


@only(*V2_RELEASES)
def test_0517_kv_only_update_normalizes_the_target_hidden_states_as_the_draft_does(runtime, release):
    """0.5.17's EAGLE-3 draft may normalize the target's hidden states before fc (norm_before_fc:
    input_norm; fc_norm: per aux chunk); the KV-only update must write the K/V of that input."""
    test_kv_only_update_writes_exactly_the_kv_the_layer_would_write(runtime, release, norms=True)
    plain = eagle3_draft(release, norms=False)
    normed = eagle3_draft(release, norms=True)
    target_hidden = torch.randn(2, 3 * H) * 5
    with torch.no_grad():
        a = runtime.draft_kv_only_extend(plain, torch.tensor([1, 2]), target_hidden, torch.tensor([3, 4]),
                                         torch.tensor([0, 1]))
        b = runtime.draft_kv_only_extend(normed, torch.tensor([1, 2]), target_hidden, torch.tensor([3, 4]),
                                         torch.tensor([0, 1]))
    assert not torch.allclose(a, b)  # the norms change the draft's input


class ReplayingGraph:
    """Stands for a captured CUDA graph: replay() re-runs what was captured, reading the same
    static buffers (what the real graph does with its recorded kernels)."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.fn())


def kv_only_graphs(runtime, draft, capture_bs=(1, 2, 4)):
    """runtime.DraftKVOnlyGraphs with its capture replaced by ReplayingGraph (no CUDA here)."""
    graphs = object.__new__(runtime.DraftKVOnlyGraphs)
    graphs.draft_runner, graphs.capture_bs = draft, sorted(capture_bs)
    max_bs = graphs.capture_bs[-1]
    graphs.tokens = torch.zeros(max_bs, dtype=torch.int64)
    graphs.hidden = torch.zeros(max_bs, 3 * H)
    graphs.positions = torch.zeros(max_bs, dtype=torch.int64)
    graphs.slots = torch.zeros(max_bs, dtype=torch.int64)
    graphs.graphs, graphs.outputs = {}, {}
    for bs in graphs.capture_bs:
        graph = ReplayingGraph(lambda bs=bs: graphs._run_static(bs))
        graph.out = torch.zeros(bs, H)
        graphs.graphs[bs], graphs.outputs[bs] = graph, graph.out
    return graphs


@pytest.mark.parametrize("bs, graph_bs", [(3, 4), (4, 4), (1, 1)])
def test_kv_only_graphs_write_what_the_eager_update_writes_and_pad_into_slot_0(runtime, release, bs, graph_bs):
    tokens, positions = torch.tensor([3, 7, 9, 1])[:bs].to(torch.int32), torch.tensor([5, 11, 2, 8])[:bs]
    target_hidden = torch.randn(bs, 3 * H, generator=torch.Generator().manual_seed(bs))
    loc = torch.tensor([20, 4, 13, 6])[:bs]
    eager = eagle3_draft(release)
    with torch.no_grad():
        expected = runtime.draft_kv_only_extend(eager, tokens, target_hidden, positions, loc)
        draft = eagle3_draft(release)
        graphs = kv_only_graphs(runtime, draft)
        graphs.slots.fill_(17)  # left over from an earlier, larger batch
        out = graphs.run(tokens, target_hidden, positions, loc)
    assert graphs.graphs[graph_bs].replays == 1
    # a padded batch may round in the last bits unlike the unpadded one (another matmul shape)
    assert torch.allclose(out, expected, atol=1e-6) and out.shape == (bs, H)
    pool, ref = draft.token_to_kv_pool, eager.token_to_kv_pool
    assert torch.allclose(pool.k[loc], ref.k[loc], atol=1e-6) and torch.allclose(pool.v[loc], ref.v[loc], atol=1e-6)
    written = {0} if graph_bs > bs else set()
    untouched = [i for i in range(32) if i not in set(loc.tolist()) | written]
    assert pool.k[untouched].abs().sum() == 0  # padding rows went to slot 0, not to stale slot 17
    # the result is the caller's: the next replay does not change it
    kept = out.clone()
    with torch.no_grad():
        graphs.run(tokens.flip(0), target_hidden.flip(0), positions, loc)
    assert torch.equal(out, kept)


def test_kv_only_graphs_run_eagerly_above_the_largest_captured_batch(runtime, release):
    draft = eagle3_draft(release)
    graphs = kv_only_graphs(runtime, draft, capture_bs=(1, 2))
    with torch.no_grad():
        out = graphs.run(torch.tensor([3, 7, 9]), torch.randn(3, 3 * H), torch.tensor([5, 11, 2]),
                         torch.tensor([20, 4, 13]))
    assert out.shape == (3, H) and all(g.replays == 0 for g in graphs.graphs.values())
    assert draft.token_to_kv_pool.k[[20, 4, 13]].abs().sum() > 0


def test_kv_only_graphs_are_captured_for_the_plain_graphs_batch_sizes_and_counted_in_memory(runtime, release, monkeypatch):
    monkeypatch.setattr(torch, "get_device_module", lambda device: FakeDevice(10 * GIB, 9.75 * GIB))
    built = []

    class Graphs:
        def __init__(self, draft_runner, capture_bs, hidden_in):
            built.append((capture_bs, hidden_in))
            self.capture_bs = sorted(capture_bs)

    monkeypatch.setattr(runtime, "DraftKVOnlyGraphs", Graphs)
    draft = eagle3_draft(release)
    draft.device = "fake"
    state = runtime.PlainDecodeState("backend", types.SimpleNamespace(capture_bs=[1, 2, 4, 8]), "", 0.5)
    graphs, note = runtime.build_draft_kv_only_graphs(draft, state)
    assert built == [([1, 2, 4, 8], 3 * H)]  # the draft's fc input: the target's 3 hidden states
    assert note == "CUDA graphs for batch sizes 1..8"
    assert state.extra_memory_gib == pytest.approx(0.75)  # the plain path's 0.5 + the graphs' 0.25


def test_kv_only_update_stays_eager_without_graphs_or_when_capture_fails(runtime, release, monkeypatch, caplog):
    monkeypatch.setattr(torch, "get_device_module", lambda device: FakeDevice(GIB, GIB))
    draft = eagle3_draft(release)
    draft.device = "fake"
    set_draft_tp(draft, FakeTPGroup(1))
    no_graphs = runtime.PlainDecodeState("backend", None, "no CUDA graphs", 0.1)
    assert runtime.build_draft_kv_only_graphs(draft, no_graphs) == (
        None, "eager (the server runs without CUDA graphs)")

    def capture_fails(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runtime, "DraftKVOnlyGraphs", capture_fails)
    state = runtime.PlainDecodeState("backend", types.SimpleNamespace(capture_bs=[1, 2]), "", 0.1)
    with caplog.at_level(logging.WARNING):
        graphs, note = runtime.build_draft_kv_only_graphs(draft, state)
    assert graphs is None and note == "eager (graph capture failed: RuntimeError)"
    assert "not captured" in caplog.text and "stream is capturing" in caplog.text
    assert state.extra_memory_gib == pytest.approx(0.1)


def test_at_tp_above_1_a_failed_kv_only_capture_stops_the_server_instead_of_one_rank_going_eager(
        runtime, release, monkeypatch):
    """The KV-only graphs hold the draft embedding's all-reduce padded to the graph's batch size: a
    rank that went eager alone would all-reduce another shape than its peers, or leave them at a
    capture barrier. At TP > 1 a failure on any rank is fatal (SGLang then stops every rank)."""
    monkeypatch.setattr(torch, "get_device_module", lambda device: FakeDevice(GIB, GIB))
    draft = eagle3_draft(release)
    draft.device = "fake"
    set_draft_tp(draft, FakeTPGroup(2))

    def capture_fails(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(runtime, "DraftKVOnlyGraphs", capture_fails)
    state = runtime.PlainDecodeState("backend", types.SimpleNamespace(capture_bs=[1, 2]), "", 0.1)
    with pytest.raises(RuntimeError, match="every rank must take the same path") as raised:
        runtime.build_draft_kv_only_graphs(draft, state)
    assert "SGLANG_SPEC_DISABLE_DRAFT_KV_ONLY=0" in str(raised.value)
    assert isinstance(raised.value.__cause__, torch.cuda.OutOfMemoryError)


def test_kv_only_update_takes_an_fc_output_as_it_is(runtime, release):
    draft = eagle3_draft(release)
    fc_hidden = torch.randn(2, H)
    with torch.no_grad():
        out = runtime.draft_kv_only_extend(draft, torch.tensor([1, 2]), fc_hidden, torch.tensor([3, 4]),
                                           torch.tensor([0, 1]))
    assert out is fc_hidden


@pytest.mark.parametrize("draft, words", [
    (lambda release: eagle3_draft(release, name="DeepseekV3ForCausalLMNextN"), "DeepseekV3ForCausalLMNextN draft"),
    (lambda release: eagle3_draft(release, qkv_bias=True), "QKV bias"),
])
def test_kv_only_update_is_refused_for_drafts_it_does_not_know(runtime, release, draft, words):
    assert words in runtime.draft_kv_only_reason(draft(release))


def test_kv_only_update_is_refused_for_quantized_weights(runtime, release):
    draft = eagle3_draft(release)
    attn = draft_layer(draft).self_attn
    attn.qkv_proj.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    assert runtime.draft_kv_only_reason(draft) == "a quantized draft"
    assert runtime.draft_kv_only_reason(eagle3_draft(release)) is None


# --- the v2 worker's plain step and resume, executed -------------------------------------------

@only(*V2_RELEASES)
def test_0517_kv_only_update_is_refused_for_a_draft_of_several_layers(runtime, release):
    """SGLang 0.5.17's EAGLE-3 draft may have several layers; only the first one's K/V follow from
    its input alone, so such a draft runs the one-token extend instead."""
    assert runtime.draft_kv_only_reason(eagle3_draft(release, layers=2)) == (
        "a draft of 2 layers (only a one-layer draft's K/V follow from its input alone)")
    assert runtime.draft_kv_only_reason(eagle3_draft(release, layers=1)) is None


def assign_slots(req_pool_indices, req_to_token, start_offset, end_offset, batch_size, draft_token_num, device):
    """Torch reference of SGLang's assign_extend_cache_locs_func."""
    out = [req_to_token[r, s:e] for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist())]
    return torch.cat(out).to(torch.int64)


class DraftInput:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def fake_draft_forward(fb, skip_attn_backend_init=False):
    """Stands for the draft runner's forward: top-1 token 5 and hidden state 7.0 for every request."""
    bs = fb.hidden.shape[0]
    logits = torch.zeros(bs, 8)
    logits[:, 5] = 1.0
    return types.SimpleNamespace(logits_output=types.SimpleNamespace(
        next_token_logits=logits, hidden_states=torch.full((bs, 2), 7.0)))


def fake_runtime_calls(calls, **result_fields):
    """Stand-ins for dyn_disable_runtime's plain_decode_forward (logits whose argmax is the input
    id % 8, hidden states 0, 1, ... of width "3H" = 6) and draft_kv_only_extend (fc() of hidden
    size 2); both log their inputs into `calls`."""

    def plain_decode_forward(target_worker, state, batch, sample=False):
        calls.append(("target", batch.input_ids.tolist(), batch.out_cache_loc.tolist(), sample))
        logits = torch.full((len(batch.seq_lens), 8), -1.0)
        logits[torch.arange(len(batch.seq_lens)), batch.input_ids % 8] = 1.0
        hidden = torch.arange(len(batch.seq_lens) * 6, dtype=torch.float32).view(-1, 6)
        result = Result(logits_output=types.SimpleNamespace(next_token_logits=logits, hidden_states=hidden),
                        can_run_cuda_graph=True, routed_experts_output=None, **result_fields)
        if sample:  # the target's own sampler (greedy here)
            result.next_token_ids = torch.argmax(logits, dim=-1)
        return result

    def draft_kv_only_extend(draft_runner, tokens, target_hidden, positions, out_cache_loc):
        calls.append(("kv_only", tokens.tolist(), positions.tolist(), out_cache_loc.tolist()))
        return target_hidden[:, :2] * 10
    return plain_decode_forward, draft_kv_only_extend


@pytest.fixture()
def worker_v2(release_tree, runtime, policy, tp_group, monkeypatch):
    """EAGLEWorkerV2's patched plain-step methods on a stand-in worker."""
    calls = []
    runtime_stub = types.ModuleType("sglang.srt.speculative.dyn_disable_runtime")

    plain_decode_forward, draft_kv_only_extend = fake_runtime_calls(calls)

    runtime_stub.__dict__.update(plain_decode_forward=plain_decode_forward,
                                 request_slots=runtime.request_slots,
                                 draft_kv_only_extend=draft_kv_only_extend,
                                 force_spec_reason=runtime.force_spec_reason,
                                 sync_sampled_tokens=runtime.sync_sampled_tokens)
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.dyn_disable_runtime", runtime_stub)
    monkeypatch.setattr(sys.modules["sglang.srt.speculative"], "dyn_disable_runtime", runtime_stub, raising=False)

    # 0.5.11's real EagleDraftInputV2Mixin.prepare_for_extend_to_fill_draft_kvcache (it rewrites the
    # batch it is given), over a stand-in ForwardBatch.init_new that logs the draft extend it gets
    runners = []

    class DraftExtendForwardBatch:
        @staticmethod
        def init_new(batch, draft_runner):
            calls.append(("draft_extend", batch.input_ids.tolist(), batch.extend_prefix_lens,
                          batch.out_cache_loc.tolist(), runners[-1]))
            assert batch.forward_mode == Mode.DRAFT_EXTEND_V2 and batch.extend_seq_lens == [1] * len(batch.seq_lens)
            return types.SimpleNamespace(spec_info=batch.spec_info, hidden=batch.spec_info.hidden_states)

    prepare_ns = {"ForwardBatch": DraftExtendForwardBatch, "ForwardMode": Mode, "CaptureHiddenMode": Capture}
    exec(compile("from __future__ import annotations\n" + method_source(
        release_tree / "sglang/srt/speculative/eagle_info_v2.py", "EagleDraftInputV2Mixin",
        "prepare_for_extend_to_fill_draft_kvcache"), "eagle_info_v2.py", "exec"), prepare_ns)

    class PrepareExtend:
        def __init__(self, **fields):
            self.__dict__.update(fields)

        def prepare_for_extend_to_fill_draft_kvcache(self, batch, predict, n, draft_runner, runner):
            runners.append(runner)
            return prepare_ns["prepare_for_extend_to_fill_draft_kvcache"](self, batch, predict, n, draft_runner,
                                                                          runner)

    namespace = {
        "torch": torch, "dataclasses": dataclasses, "assign_extend_cache_locs_func": assign_slots,
        "EagleDraftInput": lambda **kw: PrepareExtend(**kw) if "hidden_states" in kw else DraftInput(**kw),
        "GenerationBatchResult": Result, "maybe_detect_nan": lambda *a: None,
        "fast_topk": lambda p, k, dim: torch.topk(p, k, dim=dim),
        "speculative_moe_backend_context": nullcontext, "speculative_moe_a2a_backend_context": nullcontext,
        "logger": logging.getLogger("eagle_worker_v2_under_test"),
    }
    names = ("_dyn_decide", "_forward_plain_decode", "_dyn_resync_draft", "_dyn_one_token_draft_extend")
    for name in names:
        source = method_source(release_tree / WORKER_V2, "EAGLEWorkerV2", name)
        exec(compile("from __future__ import annotations\n" + source, WORKER_V2, "exec"), namespace)
    req_to_token = torch.arange(4 * 32).view(4, 32) + 1000  # slot of (request row, position)
    worker = types.SimpleNamespace(
        device="cpu", speculative_num_draft_tokens=4, _dyn_plain_state="state", _dyn_draft_kv_only=True,
        _dyn_kv_only_graphs=None, _dyn_debug_skip_draft_kv=False,
        _dyn_resync_pending=False, _dyn_draft_extend_runner="one-token-graphs", target_worker="target",
        dyn_disable=policy.SpecSwitch(policy.config_from_env({policy.THRESHOLD_ENV: "2"})),
        req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        draft_worker=types.SimpleNamespace(draft_runner=types.SimpleNamespace(
            tp_group=None, forward=fake_draft_forward,
            attn_backend=types.SimpleNamespace(init_forward_metadata=lambda fb: None)),
            draft_tp_context=lambda group: nullcontext(), topk=1))
    for name in names:
        setattr(worker, name, types.MethodType(namespace[name], worker))
    return worker, calls


def with_stale_draft_state(spec):
    """The draft state after plain steps: requests 0 and 2 went plain (top-k probability -1: their
    hidden state and top-k are stale), request 1 was prefilled since (its state is complete)."""
    spec.topk_p = torch.tensor([[-1.0], [0.9], [-1.0]])
    spec.topk_index = torch.tensor([[0], [42], [0]])
    spec.hidden_states = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    return spec


def assert_stale_requests_resynced(predict, seq_lens, locs, spec):
    """The one-token draft extend of a resume from with_stale_draft_state, as both releases run it."""
    assert predict == [3, 4, 5]
    assert seq_lens == [5, 9, 17]  # the last position again: its KV is rewritten, not a new one
    assert locs == [1000 + 2 * 32 + 5, 0, 1000 + 1 * 32 + 17]  # the fresh request writes the pad slot
    assert spec.topk_index.tolist() == [[5], [42], [5]]  # request 1 keeps its own top-k

def sampling(greedy=True, **fields):
    """The SamplingBatchInfo fields the plain step and the decision read."""
    return types.SimpleNamespace(**{"is_all_greedy": greedy, "has_custom_logit_processor": False,
                                    "need_min_p_sampling": False, **fields})


def decode_batch(seq_lens=(5, 9, 17), verified=(11, 12, 13), **flags):
    seq_lens = torch.tensor(seq_lens)
    spec = DraftInput(verified_id=torch.tensor(verified, dtype=torch.int32),
                      topk_p=torch.rand(len(seq_lens), 1), topk_index=torch.zeros(len(seq_lens), 1, dtype=torch.int64),
                      hidden_states=torch.zeros(len(seq_lens), 2))
    fields = dict(forward_mode=Mode.DECODE, req_pool_indices=torch.tensor([2, 0, 1]), seq_lens=seq_lens,
                  seq_lens_cpu=seq_lens.clone(), seq_lens_sum=int(seq_lens.sum()), spec_info=spec,
                  return_logprob=False, has_grammar=False, sampling_info=sampling())
    fields.update(flags)
    return batch_class("0.5.11")(**fields)


class FakeTPGroup:
    """Stands for SGLang's GroupCoordinator of one rank of `world_size`: broadcast(src=0) writes
    what rank 0 holds (`rank0`) into the tensor, in place, as the real collective does."""

    def __init__(self, world_size, rank0=None):
        self.world_size, self.rank0, self.broadcasts = world_size, rank0, []

    def broadcast(self, tensor, src=0):
        self.broadcasts.append(src)
        tensor.copy_(self.rank0)
        return tensor


# the TP group 0.5.23's get_parallel() answers with (the runtime stubs read it at each call)
TP = types.SimpleNamespace(group=None)


def set_draft_tp(draft, group):
    """The draft's TP group where each release reads it: the draft model runner (0.5.11, 0.5.17)
    or the runtime context (0.5.23)."""
    draft.tp_group = TP.group = group


@pytest.fixture(autouse=True)
def one_rank_runtime_context():
    TP.group = FakeTPGroup(1)
    yield
    TP.group = None


@pytest.fixture()
def tp_group(monkeypatch):
    """sglang.srt.distributed.get_tp_group (0.5.23: get_parallel().tp_group) for the code under
    test: one rank unless a test sets `.group` to another FakeTPGroup."""
    holder = TP
    module = types.ModuleType("sglang.srt.distributed")
    module.get_tp_group = lambda: holder.group
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", module)
    return holder


@pytest.fixture()
def cpu_streams(monkeypatch):
    """Streams and events of the plain step, as no-ops (CPU torch has none)."""
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    monkeypatch.setattr(torch, "get_device_module", lambda device: types.SimpleNamespace(
        current_stream=lambda: None, Event=lambda: types.SimpleNamespace(record=lambda: None)))


@only("0.5.11")
def test_plain_step_decodes_the_last_token_in_its_reserved_slot(release, worker_v2, cpu_streams):
    worker, calls = worker_v2
    batch = decode_batch()
    incoming = batch.spec_info
    result = worker._forward_plain_decode(batch)
    slots = [1000 + 2 * 32 + 5, 1000 + 0 * 32 + 9, 1000 + 1 * 32 + 17]  # req_to_token[row, seq_len]
    assert calls[0] == ("target", [11, 12, 13], slots, True)  # sampled by the target's sampler
    # outputs laid out as a verify of 4 tokens with only the root accepted
    assert result.next_token_ids.tolist() == [3, 0, 0, 0, 4, 0, 0, 0, 5, 0, 0, 0]
    assert result.next_token_ids.dtype == torch.int32
    assert result.accept_lens.tolist() == [1, 1, 1] and result.accept_lens.dtype == torch.int32
    # no request asked for hidden states: none go back to the scheduler (it copies them to the host)
    assert result.logits_output.hidden_states is None
    nxt = result.next_draft_input
    assert nxt.dyn_plain_step is True and nxt.verified_id.tolist() == [3, 4, 5]
    assert nxt.new_seq_lens.tolist() == [6, 10, 18]
    # the draft writes its KV for the new position (its positions are the token's) in the same slots
    assert calls[1] == ("kv_only", [3, 4, 5], [5, 9, 17], slots)
    assert len(calls) == 2  # no full draft extend while plain
    assert (nxt.topk_p == -1).all() and nxt.topk_p.shape == incoming.topk_p.shape
    assert nxt.topk_index.dtype == incoming.topk_index.dtype and worker._dyn_resync_pending is True


REQ = types.SimpleNamespace


def v2_batch(release, **flags):
    return decode_batch(**flags) if release == "0.5.11" else schedule_batch(release=release, **flags)


@pytest.mark.parametrize("flags, reason", [
    (dict(return_logprob=True), "logprobs"),
    (dict(has_grammar=True), "a grammar"),
    (dict(reqs=[REQ(return_hidden_states=False), REQ(return_hidden_states=True)]), "hidden states"),
    (dict(return_hidden_states=True), "hidden states"),  # 0.5.17's ScheduleBatch flag
    (dict(sampling_info=sampling(greedy=True, has_custom_logit_processor=True)), "a custom logit processor"),
    (dict(sampling_info=sampling(greedy=False, need_min_p_sampling=True)), "min_p"),
])
def test_steps_whose_requests_the_plain_path_would_treat_differently_keep_speculating(release, runtime, v2_worker,
                                                                                    flags, reason):
    """Above the threshold such a batch speculates without moving the switch, so the request is
    sampled (and laid out) the same at any load: the speculative verify ignores custom logit
    processors and min_p, which the target's sampler of a plain step would apply; a plain step
    returns no per-request hidden states."""
    worker, _ = v2_worker
    if "return_hidden_states" in flags and release == "0.5.11":
        # 0.5.11's ModelWorkerBatch has no batch-wide flag; its ScheduleBatch, which the native
        # plain path asks each step, has one that covers its requests
        scheduled = types.SimpleNamespace(return_logprob=False, has_grammar=False, sampling_info=sampling(),
                                          reqs=[REQ(return_hidden_states=False)], **flags)
        assert runtime.force_spec_reason(scheduled) == reason
        scheduled.return_hidden_states = False
        assert runtime.force_spec_reason(scheduled) is None
        return
    batch = v2_batch(release, **flags)
    assert runtime.force_spec_reason(batch) == reason
    assert worker._dyn_decide(v2_batch(release)) is False  # 3 > threshold 2: plain
    assert worker._dyn_decide(batch) is True
    assert worker.dyn_disable.speculating is False and worker.dyn_disable.forced_spec_steps == 1
    assert worker._dyn_decide(v2_batch(release)) is False


def test_min_p_of_greedy_requests_and_plain_requests_do_not_force_speculation(release, runtime):
    greedy_min_p = sampling(greedy=True, need_min_p_sampling=True)
    assert runtime.force_spec_reason(v2_batch(release, sampling_info=greedy_min_p)) is None
    assert runtime.force_spec_reason(v2_batch(release, reqs=[REQ(return_hidden_states=False)])) is None


@pytest.mark.parametrize("greedy, world_size, synced", [(False, 2, True), (True, 2, False), (False, 1, False)])
def test_non_greedy_plain_steps_take_rank_0s_tokens_at_tp_above_1(release, runtime, v2_worker, cpu_streams, tp_group,
                                                                   greedy, world_size, synced):
    """The target's sampler syncs ranks only with SYNC_TOKEN_IDS_ACROSS_TP or grammars; the plain
    step broadcasts rank 0's tokens when sampling is not greedy, as the stock verify does, so no
    rank can finish a request the others keep."""
    worker, calls = v2_worker
    tp_group.group = FakeTPGroup(world_size, rank0=torch.tensor([50, 51, 52]))
    batch = v2_batch(release, sampling_info=sampling(greedy=greedy))
    result = worker._forward_plain_decode(batch)
    expected = [50, 51, 52] if synced else [3, 4, 5]  # this rank's own argmax otherwise
    assert result.next_draft_input.__dict__.get("verified_id", result.next_draft_input.__dict__.get(
        "bonus_tokens")).tolist() == expected
    assert result.next_token_ids.view(3, 4)[:, 0].tolist() == expected
    assert tp_group.group.broadcasts == ([0] if synced else [])
    kv = [c for c in calls if c[0] == "kv_only"]
    assert kv[0][1] == expected  # the draft writes the K/V of the tokens every rank keeps


@only("0.5.11")
def test_without_kv_only_the_plain_step_runs_the_one_token_draft_extend(release, worker_v2, cpu_streams):
    worker, calls = worker_v2
    worker._dyn_draft_kv_only = False
    worker._dyn_draft_extend_runner = None  # no graphs: eager
    result = worker._forward_plain_decode(decode_batch())
    kinds = [c[0] for c in calls]
    assert kinds == ["target", "draft_extend"] and worker._dyn_resync_pending is False
    assert calls[1][1] == [3, 4, 5] and calls[1][2] == [5, 9, 17]
    assert result.next_draft_input.topk_index.tolist() == [[5], [5], [5]]


def plain_step_on_a_real_draft_layer(runtime, release, worker, skip, kv_only):
    """One v2 plain step of `worker` (worker_v2 / worker_0517) with the debug switch `skip`, whose
    draft is a real (small) EAGLE-3 layer writing into a KV pool and whose target hidden states
    have the draft's fc width; returns (result, the draft's KV pool, the draft, target hidden)."""
    stub = sys.modules["sglang.srt.speculative.dyn_disable_runtime"]
    target_hidden = torch.randn(3, 3 * H, generator=torch.Generator().manual_seed(3))
    target_forward = stub.plain_decode_forward

    def plain_decode_forward(*args, **kwargs):
        out = target_forward(*args, **kwargs)
        result = out[0] if isinstance(out, tuple) else out
        result.logits_output.hidden_states = target_hidden.clone()
        return out

    stub.plain_decode_forward = plain_decode_forward
    stub.draft_kv_only_extend = runtime.draft_kv_only_extend
    stub.draft_input_hidden = runtime.draft_input_hidden
    draft = eagle3_draft(release)
    draft.token_to_kv_pool = KVPool(1200)  # req_to_token's slots are 1000 + row * 32 + position
    draft.tp_group, draft.forward = None, fake_draft_forward
    worker.draft_worker.draft_runner = draft
    worker._dyn_debug_skip_draft_kv, worker._dyn_draft_kv_only = skip, kv_only
    batch = decode_batch() if release == "0.5.11" else schedule_batch(release=release)
    with torch.no_grad():
        result = worker._forward_plain_decode(batch)
    return result, draft.token_to_kv_pool, draft, target_hidden


@pytest.fixture()
def v2_worker(release, request):
    """The v2 worker stand-in of `release` (worker_v2 on 0.5.11, worker_0517 on 0.5.17 and 0.5.23)."""
    return request.getfixturevalue("worker_v2" if release == "0.5.11" else "worker_0517")


@pytest.mark.parametrize("kv_only", [True, False])
def test_debug_switch_leaves_the_draft_kv_cache_unwritten_in_plain_steps(release, runtime, v2_worker, cpu_streams,
                                                                         kv_only):
    """SGLANG_SPEC_DISABLE_DEBUG_SKIP_DRAFT_KV=1, the negative control: the plain step writes no
    draft K/V (neither the KV-only update nor the one-token extend) and leaves the draft state
    marked for the resume, whose input is what the draft's forward makes of the target hidden
    states (fc, and 0.5.17's optional norms)."""
    worker, calls = v2_worker
    result, pool, draft, target_hidden = plain_step_on_a_real_draft_layer(runtime, release, worker, True, kv_only)
    assert pool.k.abs().sum() == 0 and pool.v.abs().sum() == 0
    assert [c[0] for c in calls if c[0] != "publish"] == ["target"]
    nxt = result.next_draft_input
    assert (nxt.topk_p == -1).all() and worker._dyn_resync_pending is True
    with torch.no_grad():
        assert torch.allclose(nxt.hidden_states, draft_input(draft, target_hidden))


def test_without_the_debug_switch_the_same_plain_step_writes_the_draft_kv(release, runtime, v2_worker, cpu_streams):
    worker, calls = v2_worker
    _, pool, _, _ = plain_step_on_a_real_draft_layer(runtime, release, worker, False, True)
    slots = [1000 + 2 * 32 + 5, 1000 + 0 * 32 + 9, 1000 + 1 * 32 + 17]
    assert (pool.k[slots].abs().sum(dim=(1, 2)) > 0).all() and pool.k.abs().sum() == pool.k[slots].abs().sum()


def test_the_debug_switch_is_read_at_start_and_said_loudly(runtime, monkeypatch, caplog):
    monkeypatch.delenv("SGLANG_SPEC_DISABLE_DEBUG_SKIP_DRAFT_KV", raising=False)
    with caplog.at_level(logging.INFO):
        assert runtime.debug_skip_draft_kv("EAGLEWorkerV2") is False
    assert caplog.records == []
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_DEBUG_SKIP_DRAFT_KV", "1")
    with caplog.at_level(logging.INFO):
        assert runtime.debug_skip_draft_kv("EAGLEWorkerV2") is True
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        "Dynamic speculation disable: DEBUG SGLANG_SPEC_DISABLE_DEBUG_SKIP_DRAFT_KV=1 [EAGLEWorkerV2]: plain steps "
        "do NOT write the draft's KV cache")
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_DEBUG_SKIP_DRAFT_KV", "on")
    with pytest.raises(ValueError, match="SGLANG_SPEC_DISABLE_DEBUG_SKIP_DRAFT_KV='on' must be 0 or 1"):
        runtime.debug_skip_draft_kv("EAGLEWorkerV2")


def test_the_draft_input_hidden_state_is_fc_for_eagle3_and_as_is_otherwise(runtime, release):
    draft = eagle3_draft(release, norms=release != "0.5.11")  # 0.5.17's draft may normalize before fc
    target_hidden = torch.randn(2, 3 * H) * 5
    with torch.no_grad():
        assert torch.allclose(runtime.draft_input_hidden(draft, target_hidden), draft_input(draft, target_hidden))
    already = torch.randn(2, H)
    assert runtime.draft_input_hidden(draft, already) is already


@only("0.5.11")
def test_resume_recomputes_the_draft_state_of_the_requests_that_went_plain(release, worker_v2):
    worker, calls = worker_v2
    worker._dyn_resync_pending = True
    # after plain steps seq_lens count the last token; request 1 was prefilled since (topk valid)
    batch = decode_batch(seq_lens=(6, 10, 18), verified=(3, 4, 5))
    spec = with_stale_draft_state(batch.spec_info)
    worker._dyn_resync_draft(batch)
    kind, predict, seq_lens, locs, runner = calls[0]
    assert kind == "draft_extend" and runner is None  # eager, once
    assert_stale_requests_resynced(predict, seq_lens, locs, spec)
    assert spec.topk_p[1].item() == pytest.approx(0.9) and (spec.topk_p[[0, 2]] > 0).all()
    assert spec.hidden_states.tolist() == [[7.0, 7.0], [2.0, 2.0], [7.0, 7.0]]
    assert worker._dyn_resync_pending is False
    assert batch.seq_lens.tolist() == [6, 10, 18]  # the step's own batch is untouched


WORKER_V1 = "sglang/srt/speculative/eagle_worker.py"


@only("0.5.11")
@pytest.mark.parametrize("skip", [False, True])
def test_v1_debug_switch_sends_the_drafts_kv_of_a_plain_step_to_the_padding_slot(release, release_tree, monkeypatch,
                                                                               skip):
    """v1's plain step (EAGLEWorker._forward_plain_decode, executed): its draft extend after the
    decode writes its K/V to the slots of the accepted tokens; with the debug switch it still runs
    (the next step drafts from its hidden state and top-k) but writes to the padding slot 0, and
    the batch gets its own slots back afterwards."""
    log = []
    runtime_stub = types.ModuleType("sglang.srt.speculative.dyn_disable_runtime")
    runtime_stub.build_trivial_verify_input = lambda *args: "one-node tree"
    runtime_stub.plain_decode_forward = lambda *args: "decode"
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.dyn_disable_runtime", runtime_stub)
    monkeypatch.setattr(sys.modules["sglang.srt.speculative"], "dyn_disable_runtime", runtime_stub, raising=False)
    namespace = {"torch": torch, "EagleDraftInput": DraftInput, "GenerationBatchResult": Result,
                 "speculative_moe_backend_context": nullcontext, "speculative_moe_a2a_backend_context": nullcontext}
    source = method_source(release_tree / WORKER_V1, "EAGLEWorker", "_forward_plain_decode")
    exec(compile("from __future__ import annotations\n" + source, WORKER_V1, "exec"), namespace)
    accepted = torch.tensor([105, 209, 317])

    def verify(batch, spec_info, target_forward=None):
        assert spec_info == "one-node tree" and target_forward(batch) == "decode"
        batch.out_cache_loc = accepted.clone()  # the stock verify leaves the accepted tokens' slots here
        batch.spec_info = DraftInput(verified_id=torch.tensor([3, 4, 5]))
        out = types.SimpleNamespace(verified_id=torch.tensor([3, 4, 5]), num_accepted_drafts_per_req_cpu=[0, 0, 0])
        return "logits", out, None, True

    worker = types.SimpleNamespace(
        verify=verify, target_worker="target", _dyn_plain_state="state", _dyn_debug_skip_draft_kv=skip,
        draft_model_runner=types.SimpleNamespace(tp_group=None), draft_tp_context=lambda group: nullcontext(),
        forward_draft_extend_after_decode=lambda batch: log.append(batch.out_cache_loc.tolist()))
    batch = types.SimpleNamespace(
        maybe_evict_swa=lambda: None, reqs=[types.SimpleNamespace(decode_batch_idx=0) for _ in range(3)],
        spec_info=DraftInput(verified_id=torch.tensor([11, 12, 13])), seq_lens=torch.tensor([5, 9, 17]),
        seq_lens_cpu=torch.tensor([5, 9, 17]), out_cache_loc=None,
        sampling_info=types.SimpleNamespace(penalizer_orchestrator=types.SimpleNamespace(is_required=False)))
    result = namespace["_forward_plain_decode"](worker, batch)
    assert log == ([[0, 0, 0]] if skip else [[105, 209, 317]])  # the one draft extend, and where it writes
    assert batch.out_cache_loc.tolist() == [105, 209, 317]
    assert result.next_token_ids.tolist() == [3, 4, 5]


@only("0.5.11")
def test_v1_steps_with_hidden_state_requests_keep_speculating(release, release_tree, policy):
    """v1's plain step (a one-node verify) returns no hidden states, so a batch with a request that
    asked for them speculates above the threshold too, without moving the switch."""
    namespace = {"logger": logging.getLogger("eagle_worker_under_test")}
    exec(method_source(release_tree / WORKER_V1, "EAGLEWorker", "_dyn_decide"), namespace)
    worker = types.SimpleNamespace(dyn_disable=policy.SpecSwitch(policy.config_from_env({policy.THRESHOLD_ENV: "2"})))

    def batch(hidden):
        return types.SimpleNamespace(batch_size=lambda: 3, return_hidden_states=hidden)

    decide = namespace["_dyn_decide"]
    assert decide(worker, batch(False)) is False
    assert decide(worker, batch(True)) is True and worker.dyn_disable.forced_spec_steps == 1
    assert worker.dyn_disable.speculating is False


# --- the plain path's memory, kept out of the KV cache (issue #33 item 4; 0.5.11) -------------

KV_CACHE_MIXIN = "sglang/srt/model_executor/model_runner_kv_cache_mixin.py"


class EagleAlgo:
    def __init__(self, eagle=True):
        self.eagle = eagle

    def is_eagle(self):
        return self.eagle


def pool_runner(draft=False, eagle=True, **server_args):
    args = dict(attention_backend="triton", decode_attention_backend=None, enable_dp_attention=False)
    args.update(server_args)
    return types.SimpleNamespace(is_draft_worker=draft, spec_algorithm=EagleAlgo(eagle),
                                 server_args=types.SimpleNamespace(**args), mem_fraction_static=0.9,
                                 device="cuda", gpu_id=0, mambaish_config=None)


@pytest.fixture()
def flashinfer_env(monkeypatch):
    module = types.ModuleType("sglang.srt.environ")
    module.envs = types.SimpleNamespace(SGLANG_FLASHINFER_WORKSPACE_SIZE=types.SimpleNamespace(get=lambda: GIB // 4))
    monkeypatch.setitem(sys.modules, "sglang.srt.environ", module)


@only("0.5.11")
@pytest.mark.parametrize("runner, env, expected", [
    (pool_runner(), {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.5),
    (pool_runner(attention_backend="flashinfer"), {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.75),  # + workspace
    (pool_runner(), {"SGLANG_SPEC_DISABLE_THRESHOLD": "8", "SGLANG_SPEC_DISABLE_RESERVE_GIB": "1.5"}, 1.5),
    (pool_runner(), {}, 0.0),  # patch inert
    (pool_runner(draft=True), {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.0),  # the draft sizes no cache of its own
    (pool_runner(eagle=False), {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.0),
    (pool_runner(enable_dp_attention=True), {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.0),  # refused anyway
])
def test_the_plain_path_reserve_is_kept_only_where_dyn_disable_will_run(release, runtime, monkeypatch, flashinfer_env,
                                                                        runner, env, expected):
    for name in ("SGLANG_SPEC_DISABLE_THRESHOLD", "SGLANG_SPEC_DISABLE_RESERVE_GIB"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert runtime.plain_path_reserve_gib(runner) == pytest.approx(expected)


def _patch_modules_for_kv_sizing(monkeypatch, threshold, policy, runtime):
    """The environment and the patch's modules the KV-cache sizing method imports."""
    monkeypatch.delenv("SGLANG_SPEC_DISABLE_RESERVE_GIB", raising=False)
    if threshold is None:
        monkeypatch.delenv("SGLANG_SPEC_DISABLE_THRESHOLD", raising=False)
    else:
        monkeypatch.setenv("SGLANG_SPEC_DISABLE_THRESHOLD", threshold)
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.dyn_disable", policy)
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.dyn_disable_runtime", runtime)


@only("0.5.11")
@pytest.mark.parametrize("threshold, rest_gib", [(None, 42.0), ("8", 41.5)])
def test_the_kv_cache_is_sized_without_the_plain_paths_reserve(release, release_tree, runtime, policy, monkeypatch,
                                                               threshold, rest_gib):
    """ModelRunner._profile_available_bytes (0.5.11's, executed): what the KV cache may take is the
    free memory after the weights minus SGLang's activation headroom and, with dyn-disable on,
    minus the plain path's reserve, recorded on the runner for the start-up line."""
    _patch_modules_for_kv_sizing(monkeypatch, threshold, policy, runtime)
    namespace = {"get_available_gpu_memory": lambda *a, **k: 50.0,
                 "get_world_group": lambda: types.SimpleNamespace(world_size=1, cpu_group=None)}
    exec(method_source(release_tree / KV_CACHE_MIXIN, "ModelRunnerKVCacheMixin", "_profile_available_bytes"),
         namespace)
    runner = pool_runner()
    available = namespace["_profile_available_bytes"](runner, 80.0)  # headroom: 80 * (1 - 0.9) = 8 GiB
    assert available == int(rest_gib * GIB)
    assert runner.dyn_disable_reserved_gib == pytest.approx(50.0 - 8.0 - rest_gib)


@pytest.mark.parametrize("extra, words", [
    (0.36, "extra GPU memory 0.36 GiB (0.50 GiB kept out of the KV cache for it)"),
    (0.85, "extra GPU memory 0.85 GiB (0.50 GiB kept out of the KV cache for it); 0.35 GiB more than that came "
           "out of SGLang's activation headroom: start with SGLANG_SPEC_DISABLE_RESERVE_GIB=0.85"),
    # a neighbour on the GPU freed memory while it was measured (seen in a lab call with five servers)
    (-13.58, "extra GPU memory -13.58 GiB (0.50 GiB kept out of the KV cache for it); below zero because "
             "another process on this GPU freed memory while it was measured, so it is not the plain path's "
             "figure"),
])
def test_the_start_up_line_says_what_the_plain_path_took_against_the_reserve(release, runtime, extra, words):
    state = runtime.PlainDecodeState("backend", None, "no CUDA graphs", extra, reserved_gib=0.5)
    assert runtime.plain_decode_message(state, "note").endswith(words)


# 0.5.17 and 0.5.23 size the KV cache in KVCacheConfigurator._profile_available_bytes; the patch
# calls plain_path_reserve_gib with the configurator and records the reserve on it (a new field)

KV_CACHE_CONFIGURATOR = "sglang/srt/mem_cache/kv_cache_configurator.py"


def pool_configurator(release, draft=False, eagle=True, post_capture=False, hybrid=None, **server_args):
    """The KVCacheConfigurator fields plain_path_reserve_gib and _profile_available_bytes read."""
    args = dict(attention_backend="triton", decode_attention_backend=None, enable_dp_attention=False)
    args.update(server_args)
    if release == "0.5.23":  # the published pair, not ServerArgs' raw fields (None for "auto")
        PUBLISHED.attention_backends = (args["attention_backend"], args["decode_attention_backend"] or
                                        args["attention_backend"])
        args["attention_backend"] = args["decode_attention_backend"] = None
    return types.SimpleNamespace(
        is_draft_worker=draft, spec_algorithm=EagleAlgo(eagle), server_args=types.SimpleNamespace(**args),
        post_capture_kv_active=post_capture, device="cuda", gpu_id=0, mambaish_config=hybrid,
        hybrid_gdn_config=None, model_config=types.SimpleNamespace(linear_attention=hybrid, is_multimodal=False),
        dyn_disable_reserved_gib=0.0)


@only(*V2_RELEASES)
@pytest.mark.parametrize("kwargs, env, expected", [
    ({}, {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.5),
    ({"attention_backend": "flashinfer"}, {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.75),  # + workspace
    ({"attention_backend": "fa3", "decode_attention_backend": "flashinfer"}, {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"},
     0.75),
    ({}, {"SGLANG_SPEC_DISABLE_THRESHOLD": "8", "SGLANG_SPEC_DISABLE_RESERVE_GIB": "1.5"}, 1.5),
    ({}, {}, 0.0),  # patch inert
    ({"draft": True}, {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.0),  # the draft's pool follows the target's
    ({"eagle": False}, {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.0),
    ({"enable_dp_attention": True}, {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.0),  # refused anyway
    ({"hybrid": object()}, {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.0),  # refused anyway
    # SGLANG_ENABLE_POST_CAPTURE_KV_SIZING: the pool is sized after every graph, the plain path's included
    ({"post_capture": True}, {"SGLANG_SPEC_DISABLE_THRESHOLD": "8"}, 0.0),
])
def test_v2_releases_keep_the_reserve_only_where_dyn_disable_will_run(release, runtime, monkeypatch, flashinfer_env,
                                                                      kwargs, env, expected):
    for name in ("SGLANG_SPEC_DISABLE_THRESHOLD", "SGLANG_SPEC_DISABLE_RESERVE_GIB"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert runtime.plain_path_reserve_gib(pool_configurator(release, **kwargs)) == pytest.approx(expected)


def profile_available_bytes_namespace(release, free_gib):
    """What KVCacheConfigurator._profile_available_bytes of 0.5.17 / 0.5.23 reads around it: free
    GPU memory, --mem-fraction-static 0.9, no multimodal reservation, no mamba, no PD."""
    import math
    schedule = types.SimpleNamespace(mem_fraction_static=0.9, prefill_max_requests=None, max_mamba_cache_size=None)
    namespace = {"math": math, "gc": types.SimpleNamespace(collect=lambda: 0),
                 "get_available_gpu_memory": lambda *a, **k: free_gib, "get_schedule": lambda: schedule,
                 "get_world_group": lambda: types.SimpleNamespace(world_size=1, cpu_group=None)}
    if release == "0.5.23":
        namespace.update(
            get_parallel=lambda: types.SimpleNamespace(launch_world_size=1,
                                                       world_group=types.SimpleNamespace(cpu_group=None)),
            get_exec=lambda: types.SimpleNamespace(graph=types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(
                prefill=types.SimpleNamespace(full_prefill_max_req=None, backend="full")))),
            get_disagg=lambda: types.SimpleNamespace(disaggregation_mode="null"), Backend=types.SimpleNamespace(FULL="full"),
            mm_runtime_reservation_gb=lambda **k: 0.0, get_mm=lambda: types.SimpleNamespace(mm_feature_transport=None))
    return namespace


@only(*V2_RELEASES)
@pytest.mark.parametrize("threshold, rest_gib", [(None, 42.0), ("8", 41.5)])
def test_v2_releases_size_the_kv_cache_without_the_plain_paths_reserve(release, release_tree, runtime, policy,
                                                                        monkeypatch, threshold, rest_gib):
    """KVCacheConfigurator._profile_available_bytes (the release's patched method, executed): what
    the KV cache may take is the free memory after the weights minus SGLang's activation headroom
    and, with dyn-disable on, minus the plain path's reserve, recorded on the configurator, where
    build_plain_decode_state finds it for the start-up line."""
    _patch_modules_for_kv_sizing(monkeypatch, threshold, policy, runtime)
    namespace = profile_available_bytes_namespace(release, free_gib=50.0)
    exec(method_source(release_tree / KV_CACHE_CONFIGURATOR, "KVCacheConfigurator", "_profile_available_bytes"),
         namespace)
    configurator = pool_configurator(release)
    available = namespace["_profile_available_bytes"](configurator, 80.0)  # headroom: 80 * (1 - 0.9) = 8 GiB
    assert available == int(rest_gib * GIB)
    assert configurator.dyn_disable_reserved_gib == pytest.approx(50.0 - 8.0 - rest_gib)


@only(*V2_RELEASES)
def test_v2_releases_declare_the_reserve_a_field_of_the_configurator(release, release_tree):
    """KVCacheConfigurator is a dataclass with slots: an attribute it does not declare cannot be set,
    so the patch declares dyn_disable_reserved_gib (default 0: the draft's configurator, a stock
    server)."""
    tree = ast.parse((release_tree / KV_CACHE_CONFIGURATOR).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "KVCacheConfigurator")
    assert "slots=True" in ast.unparse(cls.decorator_list[0])
    declared = {n.target.id: n.value for n in cls.body if isinstance(n, ast.AnnAssign)}
    assert ast.literal_eval(declared["dyn_disable_reserved_gib"]) == 0.0


@only(*V2_RELEASES)
def test_v2_releases_start_up_line_reads_the_reserve_from_the_configurator(release, runtime, monkeypatch):
    monkeypatch.setattr(torch, "get_device_module", lambda device: FakeDevice(10 * GIB, 9.2 * GIB))
    runner = model_runner(release)
    runner.kv_cache_configurator = types.SimpleNamespace(dyn_disable_reserved_gib=0.5)
    state = runtime.build_plain_decode_state(runner)
    assert state.reserved_gib == 0.5
    assert runtime.plain_decode_message(state, "note").endswith(
        "extra GPU memory 0.80 GiB (0.50 GiB kept out of the KV cache for it); 0.30 GiB more than that came out "
        "of SGLang's activation headroom: start with SGLANG_SPEC_DISABLE_RESERVE_GIB=0.80")


# --- the start-up warm-up (issue #25 part 1: the first crossing stalled ~7 s) ------------------

SAMPLING_BATCH_INFO = "sglang/srt/sampling/sampling_batch_info.py"


def wheel_dataclass(release, path, name):
    """`name` of `release`'s wheel file `path` as a keyword-only dataclass with the real field list,
    the real required fields (no default in the source) required, so a caller that leaves one out
    or passes one that does not exist fails here as it would on the GPU."""
    tree = ast.parse(wheels.pristine("sglang", release).read(path))
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    fields = [(n.target.id, object) if n.value is None else (n.target.id, object, dataclasses.field(default=None))
              for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return dataclasses.make_dataclass(name, fields, kw_only=True)


@pytest.fixture()
def real_batch_classes(release, monkeypatch):
    """The batch class of a worker's step (0.5.11's ModelWorkerBatch, 0.5.17's ScheduleBatch) and
    SamplingBatchInfo for the warm-up, with their real fields (wheel_dataclass)."""
    batch_name = BATCH_CLASS[release]
    classes = {batch_name: wheel_dataclass(release, SCHEDULE_BATCH, batch_name),
               "SamplingBatchInfo": wheel_dataclass(release, SAMPLING_BATCH_INFO, "SamplingBatchInfo")}
    for module, name in (("sglang.srt.managers.schedule_batch", batch_name),
                         ("sglang.srt.sampling.sampling_batch_info", "SamplingBatchInfo")):
        parts = module.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]),
                                sys.modules.get(".".join(parts[:i])) or types.ModuleType(".".join(parts[:i])))
        stub = types.ModuleType(module)
        setattr(stub, name, classes[name])
        monkeypatch.setitem(sys.modules, module, stub)
    return classes


def test_the_warmup_batch_fills_every_required_field_of_the_real_classes(release, runtime, real_batch_classes):
    batch = runtime.warmup_decode_batch(3, "cpu", 64, spec_info="spec", spec_algorithm=Algo.EAGLE3)
    assert isinstance(batch, real_batch_classes[BATCH_CLASS[release]])
    assert batch.forward_mode == Mode.DECODE and batch.seq_lens.tolist() == [runtime.WARMUP_SEQ_LEN] * 3
    assert batch.req_pool_indices.tolist() == [0, 0, 0] and batch.seq_lens_sum == 3 * runtime.WARMUP_SEQ_LEN
    assert batch.sampling_info.is_all_greedy is True and batch.sampling_info.vocab_size == 64
    assert batch.spec_info == "spec" and batch.reqs == [] and batch.return_logprob is False
    if release != "0.5.11":  # the resume's prepare_for_draft_extend reads batch.model_config.vocab_size
        model_config = types.SimpleNamespace(vocab_size=64)
        batch = runtime.warmup_decode_batch(3, "cpu", 64, "spec", Algo.EAGLE3, model_config)
        assert batch.model_config is model_config


@pytest.mark.parametrize("kv_only", [True, False])
def test_the_warmup_runs_a_plain_step_and_a_resume_at_every_plain_graph_size(
        release, runtime, v2_worker, cpu_streams, real_batch_classes, release_tree, monkeypatch, kv_only):
    """EAGLEWorkerV2._dyn_warm_up (executed) runs the worker's own _forward_plain_decode, then (when
    the plain step leaves the draft to be resynced, as the KV-only update does) its own
    _dyn_resync_draft on the next step's batch, once per batch size of the plain DECODE graphs:
    what the first plain step and the first resume run, before the server reports ready. Every
    KV slot it touches is the padding slot 0 (request row 0 of a fresh req_to_token). (0.5.17's and
    0.5.23's then run the speculative step too, here a stand-in: see the next test.)"""
    worker, calls = v2_worker
    worker._dyn_draft_kv_only = kv_only
    worker._dyn_draft_extend_runner = None
    worker.topk = 1
    worker.req_to_token_pool.req_to_token = torch.zeros(4, 32, dtype=torch.int64)  # before any request
    model_config = types.SimpleNamespace(vocab_size=64)
    worker.target_worker = worker._target_worker = types.SimpleNamespace(
        model_config=model_config, model_runner=types.SimpleNamespace(spec_algorithm=Algo.EAGLE3,
                                                                      model_config=model_config))
    worker._dyn_plain_state = runtime.PlainDecodeState(
        "backend", types.SimpleNamespace(capture_bs=[1, 2, 4, 8]), "graphs", 0.25)
    sys.modules["sglang.srt.speculative.dyn_disable_runtime"].__dict__.update(
        warmup_batch_sizes=runtime.warmup_batch_sizes, warmup_decode_batch=runtime.warmup_decode_batch)
    spec_steps, assigned = [], []
    if release != "0.5.11":  # 0.5.11's is in 0004
        sys.modules["sglang.srt.speculative.dyn_disable_runtime"].__dict__.update(
            spec_warmup_batch_sizes=runtime.spec_warmup_batch_sizes,
            warm_up_req_to_token_assign=lambda *args: runtime.warm_up_req_to_token_assign(
                *args, assign=lambda *launch: assigned.append(launch[5])))
        worker.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=1)
        worker.draft_worker.cuda_graph_runner = None
        worker._dyn_spec_step = lambda batch: spec_steps.append(len(batch.seq_lens))
    monkeypatch.setattr(torch, "get_device_module", lambda device: types.SimpleNamespace(
        current_stream=lambda: None, Event=lambda: types.SimpleNamespace(record=lambda: None),
        synchronize=lambda: None, mem_get_info=FakeDevice(10 * GIB, 9.9 * GIB).mem_get_info))
    namespace = {"torch": torch, "dataclasses": dataclasses, "EagleDraftInput": DraftInput}
    exec(compile("from __future__ import annotations\n"
                 + method_source(release_tree / WORKER_V2, "EAGLEWorkerV2", "_dyn_warm_up"), WORKER_V2, "exec"),
         namespace)
    namespace["_dyn_warm_up"](worker)
    steps = [c for c in calls if c[0] == "target"]
    assert [len(c[1]) for c in steps] == [1, 2, 4, 8]  # one plain step per graph batch size
    assert all(slot == 0 for c in steps for slot in c[2]) and all(c[3] for c in steps)  # slot 0; sampled
    extends = [c for c in calls if c[0] == "draft_extend"]
    if kv_only:  # the resume after each: the eager one-token draft extend over the last position
        assert [c[0] for c in calls] == ["target", "kv_only", "draft_extend"] * 4
        eager = [c[4] is None for c in extends] if release == "0.5.11" else [c[4:6] == (1, None) for c in extends]
        assert [len(c[1]) for c in extends] == [1, 2, 4, 8] and all(eager)
        assert all(c[2] == [runtime.WARMUP_SEQ_LEN] * len(c[2]) for c in extends)  # the plain step's position
    else:  # the one-token draft extend is in the plain step; there is no resume to warm
        assert [c[0] for c in calls] == ["target", "draft_extend"] * 4
    assert all(slot == 0 for c in extends for slot in c[3])
    assert worker._dyn_resync_pending is False  # the first real step does not resync a dummy batch
    state = worker._dyn_plain_state
    assert state.extra_memory_gib == pytest.approx(0.35)  # the plain path's 0.25 + the warm-up's 0.1
    plain_note = "plain step and resume warmed up at start for batch sizes 1..8 (4 sizes); "
    if release == "0.5.11":
        assert state.warmup_note == plain_note
    else:
        assert spec_steps == [1, 2, 4, 8] and state.warmup_note.startswith(plain_note)
        assert assigned == [1, 1, 2, 2, 4, 4, 8, 8]  # the scheduler's req_to_token kernel (next test file)
    assert "warmed up at start" in runtime.plain_decode_message(state, "note")


@pytest.fixture(scope="module")
def stack_tree_0511(tmp_path_factory):
    """0.5.11's files with the whole dyn-disable stack (0001-0004) applied: 0004 adds the
    speculative step to the warm-up."""
    return tree_with(tmp_path_factory.mktemp("dyn-stack-0.5.11"),
                     [PATCHSET / "0.5.11" / p for p in ("0001-dyn-disable.patch", "0002-dyn-disable-metrics.patch",
                                                        "0003-dyn-disable-auto.patch",
                                                        "0004-dyn-disable-native-plain.patch")])


@pytest.fixture()
def spec_warmup_tree(release, request):
    """The patched files whose v2 worker warms the speculative step up at start: 0.5.11's whole
    stack (0004 adds it there), 0.5.17's and 0.5.23's 0001."""
    return request.getfixturevalue("stack_tree_0511" if release == "0.5.11" else "release_tree")


def spec_warmup_sizes_function(tree):
    namespace = {}
    exec(compile(function_source(tree / RUNTIME, "spec_warmup_batch_sizes"), RUNTIME, "exec"), namespace)
    return namespace["spec_warmup_batch_sizes"]


def test_the_speculative_step_is_warmed_at_the_sizes_both_graph_runners_run(release, spec_warmup_tree):
    sizes_for = spec_warmup_sizes_function(spec_warmup_tree)
    graphs = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 256, 512]
    draft, verify = types.SimpleNamespace(max_bs=48), types.SimpleNamespace(max_bs=160)
    sizes = sizes_for(graphs, draft, verify)
    assert sizes == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48]  # eager beyond the draft's graphs: left out
    # every power of two a batch of up to 48 requests rounds to (the constexprs of the step's
    # kernels) is among them, and so are sizes of each kind triton specializes an int on
    pow2 = lambda bs: 1 << (bs - 1).bit_length()  # noqa: E731 (sglang's next_power_of_2)
    assert {pow2(bs) for bs in range(1, 49)} == {pow2(bs) for bs in sizes}
    assert 1 in sizes and any(bs % 16 == 0 for bs in sizes) and any(bs > 1 and bs % 16 for bs in sizes)
    assert sizes_for(graphs, None, verify) == [bs for bs in graphs if bs <= 160]  # a one-step draft: no graphs
    assert sizes_for([1, 3, 16], None, None) == [1, 3, 16]                        # no CUDA graphs at all


@pytest.mark.parametrize("kv_only", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_the_stacks_warmup_adds_a_speculative_step_per_size_after_the_plain_path_is_counted(
        release, runtime, v2_worker, cpu_streams, real_batch_classes, spec_warmup_tree, monkeypatch, caplog,
        kv_only, fails):
    """With 0004 on 0.5.11 (0001 on 0.5.17 and 0.5.23), EAGLEWorkerV2._dyn_warm_up (executed, with
    _dyn_spec_step) also runs the stock speculative step (draft, verify, draft extend) over each
    resumed warm-up batch the draft's and the target's graphs run: the first speculative step at
    each batch size compiled the step's kernels outside its graphs (0.4 s at the first resume, 0.6 s
    on stock). The step gets the resume's draft state (no rebuild mark left), one token past the
    plain step, in request row 0 (on 0.5.17 and 0.5.23 with the pools a live batch carries, whose
    allocator the step only reads). Its memory is reported apart from the plain path's extra memory
    (stock's own activations). A failing speculative step leaves a warning and a server that
    starts, as before the change."""
    worker, calls = v2_worker
    worker._dyn_draft_kv_only = kv_only
    worker._dyn_draft_extend_runner = None
    worker.topk = 1
    worker.plan_stream = None
    worker.speculative_num_steps = 3
    worker.req_to_token_pool.req_to_token = torch.zeros(4, 32, dtype=torch.int64)  # before any request
    # the allocator as far as the step may use it (any alloc or free would fail the step)
    worker.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=1)
    model_config = types.SimpleNamespace(vocab_size=64)
    worker.target_worker = worker._target_worker = types.SimpleNamespace(
        model_config=model_config, model_runner=types.SimpleNamespace(
            spec_algorithm=Algo.EAGLE3, model_config=model_config,
            **{GRAPH_ATTR[release]: types.SimpleNamespace(max_bs=16)}))
    worker._dyn_plain_state = runtime.PlainDecodeState(
        "backend", types.SimpleNamespace(capture_bs=[1, 2, 4, 8, 16]), "graphs", 0.25)

    def draft(batch):
        if fails and len(batch.seq_lens) == 4:
            raise RuntimeError("no verify graph for 4")
        spec = batch.spec_info
        token = spec.verified_id if release == "0.5.11" else spec.bonus_tokens
        seen = types.SimpleNamespace(  # the batch as the step gets it
            seq_lens=batch.seq_lens.tolist(), seq_lens_cpu=batch.seq_lens_cpu.tolist(),
            seq_lens_sum=batch.seq_lens_sum, rows=batch.req_pool_indices.tolist(),
            orig_seq_lens=getattr(batch, "orig_seq_lens", None),
            multimodal_inputs=getattr(batch, "multimodal_inputs", None), pools=(
                getattr(batch, "req_to_token_pool", None), getattr(batch, "token_to_kv_pool_allocator", None)))
        calls.append(("spec_draft", len(batch.seq_lens), seen, spec.topk_p.min().item(), token.tolist(),
                      spec.topk_index.tolist(), spec.hidden_states.tolist()))
        return types.SimpleNamespace(is_verify_input=lambda: True, kv_loc_plan=None)

    def verify(batch, **kwargs):  # 0.5.17's and 0.5.23's take the grammar barrier (and 0.5.23 PP's tensors)
        calls.append(("spec_verify", len(batch.seq_lens), kwargs))
        return Result(accept_lens=torch.ones(len(batch.seq_lens), dtype=torch.int32), new_seq_lens=None)

    worker.draft_worker.draft = draft
    worker.draft_worker.cuda_graph_runner = types.SimpleNamespace(max_bs=8)
    worker.draft_worker._draft_extend_for_decode = lambda batch, out, **kw: calls.append(
        ("spec_extend", len(batch.seq_lens)))
    worker.verify = verify
    # 0.5.23's step first asks whether the scheduler pre-built a verify input (PP): a draft input is not one
    monkeypatch.setattr(DraftInput, "is_verify_input", lambda self: False, raising=False)
    assigned = []

    def assign(*launch):  # the scheduler's req_to_token kernel (tests/dyn/test_req_to_token_warmup.py)
        if fails:
            raise RuntimeError("triton: out of resources")
        assigned.append(launch[5])

    runtime_part = {"torch": torch}
    exec(compile(function_source(spec_warmup_tree / RUNTIME, "warm_up_req_to_token_assign"), RUNTIME, "exec"),
         runtime_part)
    sys.modules["sglang.srt.speculative.dyn_disable_runtime"].__dict__.update(
        warmup_batch_sizes=runtime.warmup_batch_sizes, warmup_decode_batch=runtime.warmup_decode_batch,
        spec_warmup_batch_sizes=spec_warmup_sizes_function(spec_warmup_tree),
        warm_up_req_to_token_assign=lambda *args: runtime_part["warm_up_req_to_token_assign"](*args, assign=assign))
    free = iter([10 * GIB, 9.9 * GIB, 9.7 * GIB])  # before, after the plain path, after the speculative steps
    monkeypatch.setattr(torch, "get_device_module", lambda device: types.SimpleNamespace(
        current_stream=lambda: None, Event=lambda: types.SimpleNamespace(record=lambda: None),
        synchronize=lambda: None, mem_get_info=lambda: (next(free), 100 * GIB)))
    namespace = {"torch": torch, "dataclasses": dataclasses, "EagleDraftInput": DraftInput,
                 "speculative_moe_backend_context": nullcontext, "speculative_moe_a2a_backend_context": nullcontext,
                 "logger": logging.getLogger("eagle_worker_v2_under_test"),
                 # 0.5.17's and 0.5.23's speculative step
                 "spec_stage_span": lambda name: nullcontext(), "draft_tp_context": draft_tp_context,
                 "get_parallel": lambda: types.SimpleNamespace(pp_size=1),
                 "envs": types.SimpleNamespace(SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=types.SimpleNamespace(
                     get=lambda: False))}
    for name in ("_dyn_warm_up", "_dyn_spec_step"):
        exec(compile("from __future__ import annotations\n"
                     + method_source(spec_warmup_tree / WORKER_V2, "EAGLEWorkerV2", name), WORKER_V2, "exec"),
             namespace)
    worker._dyn_spec_step = types.MethodType(namespace["_dyn_spec_step"], worker)
    with caplog.at_level(logging.WARNING):
        namespace["_dyn_warm_up"](worker)

    kinds = [c[0] for c in calls]
    plain_part = kinds[:kinds.index("spec_draft")] if "spec_draft" in kinds else kinds
    assert plain_part.count("target") == 5  # every plain graph size, before any speculative step
    drafts = [c for c in calls if c[0] == "spec_draft"]
    state = worker._dyn_plain_state
    assert state.extra_memory_gib == pytest.approx(0.35)  # the plain path's 0.25 + its warm-up's 0.1 only
    assert worker._dyn_resync_pending is False
    if fails:  # each part that fails leaves a warning and a server that starts
        assert [c[1] for c in drafts] == [1, 2]
        kernel, step = caplog.records
        assert kernel.levelno == step.levelno == logging.WARNING
        assert "req_to_token kernel did not compile at start (RuntimeError: triton: out of resources)" \
            in kernel.getMessage()
        assert "RuntimeError: no verify graph for 4" in step.getMessage()
        assert state.warmup_note.endswith("req_to_token assignment not warmed up (see the warning); "
                                          "speculative step not warmed up (see the warning); ")
        return
    assert caplog.records == []
    assert assigned == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16]  # every plain size's power of two, both alignments
    assert kinds[len(plain_part):] == ["spec_draft", "spec_verify", "spec_extend"] * 4
    assert [c[1] for c in drafts] == [1, 2, 4, 8]  # 16 is past the draft's graphs
    for _, bs, seen, min_topk_p, token, topk_index, hidden in drafts:
        lens = [runtime.WARMUP_SEQ_LEN + 1] * bs
        assert seen.seq_lens == seen.seq_lens_cpu == lens and seen.seq_lens_sum == sum(lens)
        assert seen.rows == [0] * bs
        assert min_topk_p >= 0  # the resume's draft state, not the plain step's rebuild mark
        assert token == [0] * bs  # the plain step's token (the dummy logits' argmax of id 0)
        assert topk_index == [[5]] * bs and hidden == [[7.0, 7.0]] * bs  # the draft's, as the resume left it
        if release != "0.5.11":  # the ScheduleBatch's original lengths agree, and it carries the live pools
            assert seen.orig_seq_lens.tolist() == lens
            assert seen.pools[0] is worker.req_to_token_pool
            assert seen.pools[1] is worker.token_to_kv_pool_allocator
        if release == "0.5.23":  # text-only requests, as a live batch lists them (an mrope target's step reads it)
            assert seen.multimodal_inputs == [None] * bs
    if release != "0.5.11":  # no grammar barrier (nor PP's tensors): a step of greedy dummies
        assert all(c[2] == {"grammar_barrier": None, **({"pp_proxy_tensors": None} if release == "0.5.23" else {})}
                   for c in calls if c[0] == "spec_verify")
    assert state.warmup_note == ("plain step and resume warmed up at start for batch sizes 1..16 (5 sizes); "
                                 "the scheduler's req_to_token assignment compiled for batch sizes up to 16 "
                                 "(5 powers of two); "
                                 "speculative step warmed up for batch sizes 1..8 (4 sizes, 0.20 GiB of SGLang's "
                                 "own activation memory taken at start); ")


@only("0.5.11")
def test_v1_warms_the_targets_plain_decode_at_every_plain_graph_size(release, runtime, real_batch_classes,
                                                                     monkeypatch):
    seen = []
    monkeypatch.setattr(runtime, "plain_decode_forward", lambda target, state, batch, sample=False: seen.append(
        (target, state, len(batch.seq_lens), batch.req_pool_indices.tolist(), sample)))
    monkeypatch.setattr(torch, "get_device_module", lambda device: FakeDevice(GIB, GIB))
    target = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=64),
                                   model_runner=types.SimpleNamespace(device="cpu", spec_algorithm=Algo.EAGLE3))
    state = runtime.PlainDecodeState("backend", types.SimpleNamespace(capture_bs=[4, 1, 2]), "graphs", 0.2)
    runtime.warm_up_plain_decode(target, state)
    assert [(bs, rows) for _, _, bs, rows, _ in seen] == [(1, [0]), (2, [0, 0]), (4, [0] * 4)]
    assert all(t is target and s is state for t, s, *_ in seen)
    assert state.warmup_note.startswith("the target's plain decode warmed up at start for batch sizes 1..4")


@only("0.5.11")
def test_without_graphs_the_warmup_covers_each_kind_of_size_triton_compiles_apart(release, runtime):
    state = runtime.PlainDecodeState("backend", None, "no CUDA graphs", 0.1)
    sizes = runtime.warmup_batch_sizes(state)
    assert 1 in sizes and any(bs % 16 == 0 for bs in sizes) and any(bs > 1 and bs % 16 for bs in sizes)


@pytest.fixture()
def future_map_module(tmp_path):
    """0.5.11's real overlap_utils.py (FutureMap, untouched by the patch) from the wheel, loaded on
    the CPU with its two GPU probes stood in."""
    path = tmp_path / "overlap_utils.py"
    path.write_bytes(wheels.pristine("sglang", "0.5.11").read(OVERLAP_UTILS))
    with stub_modules({"sglang.srt.speculative.spec_utils": dict(spec_need_hidden_states=lambda: True),
                       "sglang.srt.utils": dict(is_cuda=lambda: False, is_hip=lambda: False)}):
        yield load_by_path("overlap_utils_0511_under_test", path)


@only("0.5.11")
def test_the_plain_steps_stale_marker_round_trips_through_the_real_future_map(release, worker_v2, cpu_streams,
                                                                              future_map_module):
    """The overlap scheduler hands a step's draft state to the next step through FutureMap
    (store_to_map, then resolve_future): the plain step's top-k probability -1 must come out as
    stored, so the resume recomputes exactly the requests that went plain and keeps the state of
    a request whose future was stored by a speculative step or a prefill."""
    worker, calls = worker_v2
    future_map = future_map_module.FutureMap(8, 0, 64, "cpu", spec_algo=types.SimpleNamespace(is_none=lambda: False))
    # a speculative step's draft state first (it sizes the map's buffers), for one request
    prefilled = future_map.alloc_future_indices(1)
    future_map.store_to_map(prefilled, Result(next_draft_input=DraftInput(
        topk_p=torch.tensor([[0.9]]), topk_index=torch.tensor([[42]]), verified_id=torch.tensor([4], dtype=torch.int32),
        new_seq_lens=torch.tensor([10]), hidden_states=torch.tensor([[2.0, 2.0]]))))
    plain = future_map.alloc_future_indices(3)
    result = worker._forward_plain_decode(decode_batch())
    future_map.store_to_map(plain, result)
    # the next step: requests 0 and 2 from the plain step, request 1 from the speculative one
    indices = torch.stack([plain.indices[0], prefilled.indices[0], plain.indices[2]])
    batch = decode_batch(seq_lens=(6, 10, 18), verified=(0, 0, 0))
    batch.spec_info = DraftInput(future_indices=types.SimpleNamespace(indices=indices))
    future_map.resolve_future(batch)
    spec = batch.spec_info
    assert spec.topk_p.tolist() == [[-1.0], [pytest.approx(0.9)], [-1.0]]
    assert spec.verified_id.tolist() == [3, 4, 5] and spec.new_seq_lens.tolist() == [6, 10, 18]
    calls.clear()
    worker._dyn_resync_draft(batch)
    (kind, predict, seq_lens, locs, runner), = calls
    assert locs == [1000 + 2 * 32 + 5, 0, 1000 + 1 * 32 + 17]  # the speculative request's write goes to slot 0
    assert spec.topk_index.tolist() == [[5], [42], [5]] and spec.hidden_states[1].tolist() == [2.0, 2.0]


class RoutingVerify:
    kv_loc_plan = "the verify's KV location plan"  # 0.5.23 hands it to the draft extend

    def is_verify_input(self):
        return True


class RoutingDraftInput(DraftInput):
    def is_verify_input(self):  # 0.5.23 asks: a verify input the scheduler pre-built for PP
        return False


def routing_worker(log, dyn, decisions, verify, plain, **fields):
    """A stand-in EAGLEWorkerV2 for the routing tests: each call forward_batch_generation makes is
    logged; a plain step marks the draft for a resync, as the real one does."""
    w = types.SimpleNamespace(dyn_disable=dyn, _dyn_resync_pending=False, **fields)
    w.draft_worker = types.SimpleNamespace(
        draft_runner=types.SimpleNamespace(tp_group=None), draft_tp_context=lambda g: nullcontext(),
        parallel_layout=DRAFT_LAYOUT, draft=lambda b: log.append("draft") or RoutingVerify(),
        _draft_extend_for_decode=lambda b, out, **kw: log.append("draft_extend"))
    w.verify = verify

    def plain_step(*args):
        log.append("plain")
        plain(*args)
        w._dyn_resync_pending = True
        return "plain-result"

    w._forward_plain_decode = plain_step
    w._dyn_resync_draft = lambda b: log.append("resync") or setattr(w, "_dyn_resync_pending", False)
    w._dyn_decide = lambda b: decisions.pop(0)
    return w


@only("0.5.11")
@pytest.mark.parametrize("stack", [False, True], ids=["0001", "0001-0004"])
def test_forward_batch_generation_routes_plain_resume_and_stock_steps(release, release_tree, stack_tree_0511,
                                                                      stack):
    """The decode branch of the patched forward_batch_generation, executed: without the switch
    it is the stock draft/verify/extend; with it, plain steps and the resume run in order. With
    the whole stack the speculative step is the worker's _dyn_spec_step (0004 moved it there
    unchanged, for the native path and the warm-up): the same calls in the same order."""
    tree = stack_tree_0511 if stack else release_tree
    names = ["forward_batch_generation"] + (["_dyn_spec_step"] if stack else [])
    namespace = {"torch": torch, "CaptureHiddenMode": Capture, "EagleDraftInput": DraftInput,
                 "speculative_moe_backend_context": nullcontext,
                 "speculative_moe_a2a_backend_context": nullcontext}
    for name in names:
        exec(compile("from __future__ import annotations\n" + method_source(tree / WORKER_V2, "EAGLEWorkerV2", name),
                     WORKER_V2, "exec"), namespace)
    log = []

    def worker(dyn, decisions):
        verify = lambda b: log.append("verify") or "spec-result"  # noqa: E731
        w = routing_worker(log, dyn, decisions, verify, plain=lambda b: None, plan_stream=None)
        if stack:
            w._dyn_spec_step = types.MethodType(namespace["_dyn_spec_step"], w)
        return w

    batch = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False),
                                  is_extend_in_batch=False, spec_info=DraftInput())
    stock = worker(None, [])
    assert namespace["forward_batch_generation"](stock, batch) == "spec-result"
    assert log == ["draft", "verify", "draft_extend"]
    log.clear()
    dyn = worker(object(), [True, False, False, True, True])
    results = [namespace["forward_batch_generation"](dyn, batch) for _ in range(5)]
    assert results == ["spec-result", "plain-result", "plain-result", "spec-result", "spec-result"]
    assert log == ["draft", "verify", "draft_extend", "plain", "plain",
                   "resync", "draft", "verify", "draft_extend", "draft", "verify", "draft_extend"]


# --- SGLang 0.5.17: the v2 worker's plain step and resume, executed ----------------------------

class ExtendInput:
    """Stands for 0.5.17's EagleDraftExtendInput (a dataclass of keyword fields)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


@pytest.fixture()
def worker_0517(release_tree, runtime, policy, tp_group, monkeypatch):
    """EAGLEWorkerV2's patched plain-step methods of 0.5.17 (or 0.5.23) on a stand-in worker; the
    ScheduleBatch has that release's real field set. 0.5.23 enters the draft's TP placement with
    spec_utils.draft_tp_context(the draft worker's parallel_layout), checked here."""
    calls = []
    runtime_stub = types.ModuleType("sglang.srt.speculative.dyn_disable_runtime")

    target_forward, draft_kv_only_extend = fake_runtime_calls(calls, indexer_topk_output=None)

    def plain_decode_forward(*args, **kwargs):  # 0.5.17's also returns the decode ForwardBatch
        return target_forward(*args, **kwargs), "decode-forward-batch"

    runtime_stub.__dict__.update(plain_decode_forward=plain_decode_forward, request_slots=runtime.request_slots,
                                 draft_kv_only_extend=draft_kv_only_extend, saved_fields=runtime.saved_fields,
                                 DRAFT_EXTEND_FIELDS=runtime.DRAFT_EXTEND_FIELDS,
                                 force_spec_reason=runtime.force_spec_reason,
                                 sync_sampled_tokens=runtime.sync_sampled_tokens)
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.dyn_disable_runtime", runtime_stub)
    monkeypatch.setattr(sys.modules["sglang.srt.speculative"], "dyn_disable_runtime", runtime_stub, raising=False)

    def prepare_for_draft_extend(extend_input, batch, predict, num_draft_tokens, draft_model_runner,
                                 cuda_graph_runner, *, return_hidden_states_before_norm):
        """Stands for 0.5.17's prepare_for_draft_extend: it rewrites the ScheduleBatch as the real one does,
        and reads the batch's model_config for its out-of-range probe (an argument, read even with the
        probe off)."""
        assert batch.model_config.vocab_size > 0
        calls.append(("draft_extend", predict.tolist(), batch.seq_lens.tolist(), batch.out_cache_loc.tolist(),
                      num_draft_tokens, cuda_graph_runner, extend_input.num_accept_tokens.tolist()))
        batch.spec_info, batch.input_ids, batch.forward_mode = extend_input, predict, "DRAFT_EXTEND_V2"
        batch.prefix_lens, batch.extend_lens = batch.seq_lens.tolist(), [num_draft_tokens] * len(batch.seq_lens)
        batch.extend_num_tokens = num_draft_tokens * len(batch.seq_lens)
        return types.SimpleNamespace(spec_info=extend_input, hidden=extend_input.hidden_states)

    namespace = {
        "torch": torch, "logger": logging.getLogger("eagle_worker_v2_under_test"),
        "EagleDraftInput": DraftInput, "EagleDraftExtendInput": ExtendInput, "GenerationBatchResult": Result,
        "prepare_for_draft_extend": prepare_for_draft_extend, "maybe_detect_nan": lambda *a: None,
        "fast_topk": lambda p, k, dim: torch.topk(p, k, dim=dim), "_is_hip": False,
        "speculative_moe_backend_context": nullcontext, "speculative_moe_a2a_backend_context": nullcontext,
        "draft_tp_context": draft_tp_context,
    }
    names = ("_dyn_decide", "_forward_plain_decode", "_dyn_draft_topk", "_dyn_draft_extend_one_token",
             "_dyn_resync_draft", "_dyn_one_token_draft_extend")
    for name in names:
        source = method_source(release_tree / WORKER_V2, "EAGLEWorkerV2", name)
        exec(compile("from __future__ import annotations\n" + source, WORKER_V2, "exec"), namespace)
    req_to_token = torch.arange(4 * 32).view(4, 32) + 1000  # slot of (request row, position)
    worker = types.SimpleNamespace(
        device="cpu", topk=1, speculative_num_draft_tokens=4, _dyn_plain_state="state", _dyn_draft_kv_only=True,
        _dyn_kv_only_graphs=None, _dyn_debug_skip_draft_kv=False, _dyn_resync_pending=False, target_worker="target",
        dyn_disable=policy.SpecSwitch(policy.config_from_env({policy.THRESHOLD_ENV: "2"})),
        req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        draft_worker=types.SimpleNamespace(draft_runner=types.SimpleNamespace(tp_group=None, forward=fake_draft_forward),
                                           draft_tp_context=lambda group: nullcontext(), topk=1,
                                           parallel_layout=DRAFT_LAYOUT))
    for name in names:
        setattr(worker, name, types.MethodType(namespace[name], worker))
    return worker, calls


DRAFT_LAYOUT = "the draft's parallel layout"


def draft_tp_context(layout):
    """0.5.23's spec_utils.draft_tp_context: the draft's TP placement, entered from its layout."""
    assert layout == DRAFT_LAYOUT
    return nullcontext()


def schedule_batch(seq_lens=(5, 9, 17), bonus=(11, 12, 13), release="0.5.17", **flags):
    seq_lens = torch.tensor(seq_lens)
    spec = DraftInput(bonus_tokens=torch.tensor(bonus, dtype=torch.int32),
                      topk_p=torch.ones(len(seq_lens), 1), topk_index=torch.zeros(len(seq_lens), 1, dtype=torch.int64),
                      hidden_states=torch.zeros(len(seq_lens), 2))
    fields = dict(forward_mode=Mode.DECODE, req_pool_indices=torch.tensor([2, 0, 1]), seq_lens=seq_lens,
                  seq_lens_cpu=seq_lens.clone(), seq_lens_sum=int(seq_lens.sum()), spec_info=spec,
                  return_logprob=False, has_grammar=False, return_hidden_states=False, sampling_info=sampling(),
                  model_config=types.SimpleNamespace(vocab_size=8))
    fields.update(flags)
    return batch_class(release)(**fields)


@only(*V2_RELEASES)
def test_0517_plain_step_publishes_the_new_lengths_before_the_draft_update(release, worker_0517, cpu_streams):
    worker, calls = worker_0517
    batch = schedule_batch(release=release)
    incoming = batch.spec_info
    result = worker._forward_plain_decode(batch, lambda lens: calls.append(("publish", lens.tolist())))
    slots = [1000 + 2 * 32 + 5, 1000 + 0 * 32 + 9, 1000 + 1 * 32 + 17]  # req_to_token[row, seq_len]
    assert calls[0] == ("target", [11, 12, 13], slots, True)  # the bonus tokens, sampled by the target
    # the schedule stream's next resolve waits for this publish: after the target, before the draft
    assert calls[1] == ("publish", [6, 10, 18])
    assert calls[2] == ("kv_only", [3, 4, 5], [5, 9, 17], slots) and len(calls) == 3
    assert result.next_token_ids.tolist() == [3, 0, 0, 0, 4, 0, 0, 0, 5, 0, 0, 0]
    assert result.accept_lens.tolist() == [1, 1, 1] and result.new_seq_lens.tolist() == [6, 10, 18]
    assert result.speculative_num_draft_tokens == 4 and result.extra_keep_alive_refs == ["decode-forward-batch"]
    assert result.logits_output.hidden_states is None  # nothing for the scheduler to copy to the host
    nxt = result.next_draft_input
    assert nxt.bonus_tokens.tolist() == [3, 4, 5] and nxt.bonus_tokens.dtype == torch.int32
    assert (nxt.topk_p == -1).all() and nxt.topk_p.shape == incoming.topk_p.shape
    assert worker._dyn_resync_pending is True


@only(*V2_RELEASES)
def test_0517_without_kv_only_the_plain_step_runs_a_one_token_draft_extend_and_restores_the_batch(
        release, worker_0517, cpu_streams):
    worker, calls = worker_0517
    worker._dyn_draft_kv_only = False
    batch = schedule_batch(release=release)
    spec = batch.spec_info
    result = worker._forward_plain_decode(batch)
    kind, predict, seq_lens, locs, n, runner, accepted = calls[1]
    assert kind == "draft_extend" and predict == [3, 4, 5] and seq_lens == [5, 9, 17]
    assert n == 1 and runner is None and accepted == [1, 1, 1]  # one token, eager
    assert locs == [1000 + 2 * 32 + 5, 1000 + 0 * 32 + 9, 1000 + 1 * 32 + 17]
    assert result.next_draft_input.topk_index.tolist() == [[5], [5], [5]]
    assert result.next_draft_input.hidden_states.tolist() == [[7.0, 7.0]] * 3
    # prepare_for_draft_extend rewrote the batch; the plain step puts it back
    assert batch.spec_info is spec and batch.forward_mode == Mode.DECODE and batch.prefix_lens is None
    assert worker._dyn_resync_pending is False


@only(*V2_RELEASES)
def test_0517_resume_recomputes_the_stale_draft_state_and_leaves_the_batch_as_it_was(release, worker_0517):
    worker, calls = worker_0517
    worker._dyn_resync_pending = True
    batch = schedule_batch(seq_lens=(6, 10, 18), bonus=(3, 4, 5), release=release)
    spec = with_stale_draft_state(batch.spec_info)
    worker._dyn_resync_draft(batch)
    kind, predict, seq_lens, locs, n, runner, _ = calls[0]
    assert kind == "draft_extend" and n == 1 and runner is None
    assert_stale_requests_resynced(predict, seq_lens, locs, spec)
    assert spec.topk_p.tolist() == [[1.0], [pytest.approx(0.9)], [1.0]]  # topk 1: as upstream, p = 1
    assert spec.hidden_states.tolist() == [[7.0, 7.0], [2.0, 2.0], [7.0, 7.0]]
    assert worker._dyn_resync_pending is False
    # the speculative step goes on with the batch it had
    assert batch.spec_info is spec and batch.seq_lens.tolist() == [6, 10, 18]
    assert batch.seq_lens_cpu.tolist() == [6, 10, 18] and batch.seq_lens_sum == 34
    assert batch.forward_mode == Mode.DECODE and batch.input_ids is None and batch.out_cache_loc is None


@only(*V2_RELEASES)
def test_0517_forward_batch_generation_routes_plain_resume_and_stock_steps(release, release_tree):
    """The decode branch of the patched forward_batch_generation (0.5.17, 0.5.23), executed: without
    the switch it is the stock draft/verify/publish/extend; with it, plain steps (handed the publish
    callback) and the resume run in order, after 0.5.23's adaptive hook (activate_step_by_batch).
    Every speculative step is the worker's _dyn_spec_step (the stock step moved there unchanged, for
    the start-up warm-up too), handed the publish callback, the grammar barrier (and 0.5.23's PP
    tensors). Each step gets a fresh draft input, as the scheduler hands the worker the previous
    step's next_draft_input (a verify input left on the batch is 0.5.23's pre-built PP verify)."""
    namespace = {"torch": torch, "CaptureHiddenMode": Capture, "spec_stage_span": lambda name: nullcontext(),
                 "draft_tp_context": draft_tp_context, "get_parallel": lambda: types.SimpleNamespace(pp_size=1),
                 "envs": types.SimpleNamespace(SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=types.SimpleNamespace(
                     get=lambda: False)),
                 "speculative_moe_backend_context": nullcontext,
                 "speculative_moe_a2a_backend_context": nullcontext}
    for name in ("forward_batch_generation", "_dyn_spec_step"):
        exec(compile("from __future__ import annotations\n"
                     + method_source(release_tree / WORKER_V2, "EAGLEWorkerV2", name), WORKER_V2, "exec"),
             namespace)
    log = []

    def worker(dyn, decisions):
        def verify(b, grammar_barrier=None, **kw):
            log.append(f"verify {grammar_barrier} {kw.get('pp_proxy_tensors')}")
            return types.SimpleNamespace(new_seq_lens="verify-lens")

        w = routing_worker(log, dyn, decisions, verify, plain=lambda b, on_publish: on_publish("plain-lens"),
                           speculative_num_steps=3, activate_step_by_batch=lambda bs: log.append(f"bs={bs}"))
        spec_step = types.MethodType(namespace["_dyn_spec_step"], w)

        def logged_spec_step(*args):
            log.append("spec_step")
            return spec_step(*args)

        w._dyn_spec_step = logged_spec_step
        return w

    batch = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False),
                                  is_extend_in_batch=False, spec_info=RoutingDraftInput(), seq_lens=torch.tensor([5, 9]))
    publish = lambda lens: log.append(f"publish {lens}")  # noqa: E731
    # what forward_batch_generation is handed after the batch and the publish callback
    extra = ("barrier", "pp-tensors") if release == "0.5.23" else ("barrier",)
    verified = "verify barrier pp-tensors" if release == "0.5.23" else "verify barrier None"
    stock_step = ["spec_step", "draft", verified, "publish verify-lens", "draft_extend"]

    def fresh(b):
        b.spec_info = RoutingDraftInput()
        return b

    stock = worker(None, [])
    assert namespace["forward_batch_generation"](stock, batch, publish, *extra).new_seq_lens == "verify-lens"
    assert log == ["bs=2"] + stock_step
    log.clear()
    dyn = worker(object(), [False, False, True])
    results = [namespace["forward_batch_generation"](dyn, fresh(batch), publish, *extra) for _ in range(3)]
    assert results[:2] == ["plain-result", "plain-result"] and results[2].new_seq_lens == "verify-lens"
    assert log == ["bs=2", "plain", "publish plain-lens", "bs=2", "plain", "publish plain-lens",
                   "bs=2", "resync"] + stock_step


@only(*V2_RELEASES)
def test_0517_the_plain_backend_counts_in_the_host_seq_lens_decision(release, release_tree, tmp_path):
    """0.5.17 copies seq_lens to the host only when an attention backend of a spec-v2 step needs
    them (decide_needs_cpu_seq_lens over spec_v2_attn_backends). The plain decode backend is one
    of them: without it, a target whose verify backend opts out would hand a decode backend
    that needs them none."""
    namespace = {}
    exec(method_source(release_tree / WORKER_V2, "EAGLEWorkerV2", "spec_v2_attn_backends"), namespace)
    backends_of = namespace["spec_v2_attn_backends"].fget
    source = tmp_path / "overlap_utils.py"
    source.write_bytes(wheels.pristine("sglang", release).read(OVERLAP_UTILS))
    decide_ns = {"get_exec": lambda: types.SimpleNamespace(overlap=types.SimpleNamespace(enable_two_batch_overlap=False)),
                 "get_spec": lambda: types.SimpleNamespace(speculative_algorithm="EAGLE3")}
    exec(function_source(source, "decide_needs_cpu_seq_lens"), decide_ns)
    algo = types.SimpleNamespace(from_string=lambda name: types.SimpleNamespace(is_ngram=lambda: False))
    opts_out = types.SimpleNamespace(needs_cpu_seq_lens=False)
    worker = types.SimpleNamespace(
        _target_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(attn_backend=opts_out)),
        _draft_worker=types.SimpleNamespace(draft_attn_backend=opts_out, draft_extend_attn_backend=opts_out),
        _dyn_plain_state=None)
    server_args = types.SimpleNamespace(enable_two_batch_overlap=False, speculative_algorithm="EAGLE3")
    # 0.5.23 reads the server's settings from the runtime context
    args = () if release == "0.5.23" else (server_args,)
    with stub_modules({"sglang.srt.speculative.spec_info": dict(SpeculativeAlgorithm=algo)}):
        assert decide_ns["decide_needs_cpu_seq_lens"](*args, backends_of(worker)) is False
        worker._dyn_plain_state = types.SimpleNamespace(attn_backend=types.SimpleNamespace(needs_cpu_seq_lens=True))
        assert len(backends_of(worker)) == 4
        assert decide_ns["decide_needs_cpu_seq_lens"](*args, backends_of(worker)) is True


@only(*V2_RELEASES)
@pytest.mark.parametrize("layers, words", [
    (1, "draft extend: KV cache only in plain steps (CUDA graphs for batch sizes 1..8); one token per "
        "request, eager (no one-token draft-extend graphs on SGLang {release}) once when drafting resumes"),
    (2, "draft extend: one token per request, eager (no one-token draft-extend graphs on SGLang {release}) "
        "(no KV-only update with a draft of 2 layers"),
])
def test_0517_the_start_up_line_says_how_the_draft_is_kept(release, release_tree, runtime, policy, monkeypatch,
                                                           caplog, layers, words):
    """The plain path is built in init_cuda_graphs (0.5.17 captures the target's graphs after the
    workers are made); its start-up line names the backend, the graphs and the draft update."""
    runtime_stub = types.ModuleType("sglang.srt.speculative.dyn_disable_runtime")
    state = runtime.PlainDecodeState(types.SimpleNamespace(), None, "CUDA graphs for batch sizes 1..8", 0.25)
    runtime_stub.__dict__.update(
        build_plain_decode_state=lambda model_runner: state,
        draft_kv_only_reason=runtime.draft_kv_only_reason, plain_decode_message=runtime.plain_decode_message,
        ONE_TOKEN_DRAFT_EXTEND_NOTE=runtime.ONE_TOKEN_DRAFT_EXTEND_NOTE,
        debug_skip_draft_kv=runtime.debug_skip_draft_kv,
        build_draft_kv_only_graphs=lambda draft_runner, st: ("graphs", "CUDA graphs for batch sizes 1..8"))
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.dyn_disable_runtime", runtime_stub)
    monkeypatch.setattr(sys.modules["sglang.srt.speculative"], "dyn_disable_runtime", runtime_stub, raising=False)
    namespace = {"logger": logging.getLogger("eagle_worker_v2_under_test"),
                 "dyn_disable_draft_kv_only_from_env": policy.draft_kv_only_from_env,
                 "draft_tp_context": draft_tp_context}
    exec(method_source(release_tree / WORKER_V2, "EAGLEWorkerV2", "_dyn_init_plain_path"), namespace)
    draft = eagle3_draft(release, layers=layers)
    draft.tp_group = None
    worker = types.SimpleNamespace(_target_worker=types.SimpleNamespace(model_runner="target"),
                                   draft_worker=types.SimpleNamespace(draft_runner=draft,
                                                                      draft_tp_context=lambda g: nullcontext(),
                                                                      parallel_layout=DRAFT_LAYOUT))

    def warm_up():  # before the line: its note and memory are in it
        state.warmup_note = "plain step and resume warmed up at start for batch sizes 1..8 (4 sizes); "

    worker._dyn_warm_up = warm_up
    monkeypatch.delenv(policy.DRAFT_KV_ONLY_ENV, raising=False)
    with caplog.at_level(logging.INFO):
        namespace["_dyn_init_plain_path"](worker)
    assert worker._dyn_plain_state is state and worker._dyn_draft_kv_only is (layers == 1)
    assert worker._dyn_kv_only_graphs == ("graphs" if layers == 1 else None)
    line = caplog.records[-1].getMessage()
    assert line.startswith("Dynamic speculation disable: plain step is a decode forward on SimpleNamespace "
                           "with CUDA graphs for batch sizes 1..8; ")
    assert words.format(release=release) in line and line.endswith(
        "; plain step and resume warmed up at start for batch sizes 1..8 (4 sizes); extra GPU memory 0.25 GiB")
    print_prefixes = tomllib.loads((PATCHSET / "patchset.toml").read_text())["logs"]["print"]
    assert line.startswith(tuple(print_prefixes))

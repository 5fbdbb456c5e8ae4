"""The v2 plain step's draft extend covers the one new token per request, not steps + 1.

After a plain step the draft model needs KV and a hidden state for one position per request.
dyn-disable builds, at start, a second draft-extend CUDA-graph runner for one token per request
(its own triton backend, graph metadata sized for one token) when the stock draft extend replays
graphs on triton; otherwise plain steps keep the stock draft extend. The builder runs here with
stand-ins for the triton backend, the backend factory and the graph runner (they need a GPU);
the worker's use of it is checked in the source."""
from __future__ import annotations

import sys
import types

import pytest

from tests.dyn.conftest import load_by_path, method_source

RUNTIME = "sglang/srt/speculative/dyn_disable_runtime.py"
WORKER_V2 = "sglang/srt/speculative/eagle_worker_v2.py"


class TritonAttnBackend:
    def __init__(self, draft_runner=None):
        self.draft_runner = draft_runner
        self.speculative_num_steps = 3  # as read from server_args


class OtherBackend:
    pass


class EAGLEDraftExtendCudaGraphRunner:
    def __init__(self, worker, *, draft_extend_attn_backend=None, speculative_num_steps=None):
        self.worker = worker
        self.backend = draft_extend_attn_backend
        self.speculative_num_steps = speculative_num_steps
        # the real runner reads the backend's setting while capturing
        self.backend_steps_at_capture = draft_extend_attn_backend.speculative_num_steps


class DraftBackendFactory:
    made = []

    def __init__(self, server_args, draft_runner, topk, speculative_num_steps):
        self.draft_runner = draft_runner

    def create_draft_extend_backend(self):
        backend = TritonAttnBackend(self.draft_runner)
        DraftBackendFactory.made.append(backend)
        return backend


@pytest.fixture(scope="module")
def runtime(patched_tree):
    pytest.importorskip("torch")
    saved = dict(sys.modules)
    stubs = {}

    def stub(name, **attrs):
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        stubs[name] = module

    stub("sglang.srt.model_executor.forward_batch_info", CaptureHiddenMode=types.SimpleNamespace(FULL=2))
    stub("sglang.srt.speculative.dyn_disable", SpecSwitch=object, config_from_env=lambda: None)
    stub("sglang.srt.speculative.eagle_info", EagleVerifyInput=object)
    stub("sglang.srt.layers.attention.triton_backend", TritonAttnBackend=TritonAttnBackend)
    stub("sglang.srt.speculative.draft_utils", DraftBackendFactory=DraftBackendFactory)
    stub("sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner",
         EAGLEDraftExtendCudaGraphRunner=EAGLEDraftExtendCudaGraphRunner)
    for name in ("sglang", "sglang.srt", "sglang.srt.model_executor", "sglang.srt.speculative",
                 "sglang.srt.layers", "sglang.srt.layers.attention"):
        stubs.setdefault(name, types.ModuleType(name))
    sys.modules.update(stubs)
    module = load_by_path("dyn_disable_runtime_under_test", patched_tree / RUNTIME)
    yield module
    for name in list(sys.modules):
        if name not in saved:
            del sys.modules[name]
    sys.modules.update(saved)


def draft_worker(runner, backend):
    return types.SimpleNamespace(
        cuda_graph_runner_for_draft_extend=runner, draft_extend_attn_backend=backend,
        server_args=object(), draft_runner="draft-runner", topk=1, speculative_num_steps=3)


def test_triton_with_graphs_gets_a_one_token_runner_with_its_own_backend(runtime, caplog):
    stock_backend = TritonAttnBackend()
    stock = EAGLEDraftExtendCudaGraphRunner(None, draft_extend_attn_backend=stock_backend)
    worker = draft_worker(stock, stock_backend)
    with caplog.at_level("INFO"):
        runner = runtime.build_one_token_draft_extend(worker)
    assert isinstance(runner, EAGLEDraftExtendCudaGraphRunner) and runner is not stock
    assert runner.worker is worker and runner.speculative_num_steps == 0
    assert runner.backend is DraftBackendFactory.made[-1] and runner.backend is not stock_backend
    assert runner.backend_steps_at_capture == 0 and runner.backend.draft_runner == "draft-runner"
    assert stock_backend.speculative_num_steps == 3  # the speculative path is untouched
    assert "one token per request (CUDA graphs)" in caplog.text


@pytest.mark.parametrize("runner, backend, words", [
    (None, TritonAttnBackend(), "no CUDA graphs for the draft extend"),
    (EAGLEDraftExtendCudaGraphRunner(None, draft_extend_attn_backend=TritonAttnBackend()),
     OtherBackend(), "the OtherBackend draft attention backend"),
])
def test_other_setups_keep_the_stock_draft_extend_and_say_why(runtime, caplog, runner, backend, words):
    made = len(DraftBackendFactory.made)
    with caplog.at_level("INFO"):
        assert runtime.build_one_token_draft_extend(draft_worker(runner, backend)) is None
    assert len(DraftBackendFactory.made) == made
    assert words in caplog.text and "plain steps run the stock draft extend" in caplog.text


def test_plain_step_uses_the_one_token_extend_when_built(patched_tree):
    plain = method_source(patched_tree / WORKER_V2, "EAGLEWorkerV2", "_forward_plain_decode")
    assert "if self._dyn_draft_extend_runner is None:" in plain
    assert "self._dyn_one_token_draft_extend(batch, result, predict_one, hidden)" in plain
    init = method_source(patched_tree / WORKER_V2, "EAGLEWorkerV2", "__init__")
    assert "build_one_token_draft_extend(self.draft_worker)" in init


def test_one_token_extend_fills_one_slot_per_request(patched_tree):
    source = method_source(patched_tree / WORKER_V2, "EAGLEWorkerV2", "_dyn_one_token_draft_extend")
    assert "end_offset=batch.seq_lens + 1" in source and "draft_token_num=1" in source
    assert "prepare_for_extend_to_fill_draft_kvcache(batch, predict_one, 1," in source
    assert "num_tokens_per_req=1" in source

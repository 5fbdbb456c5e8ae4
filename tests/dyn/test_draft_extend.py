"""The v2 worker's one-token draft extend: graphs where the stock draft extend has them on triton.

With SGLANG_SPEC_DISABLE_DRAFT_KV_ONLY=0 (or a draft the KV-only update does not know) a plain
step runs the draft's extend over its one new token; when drafting resumes after KV-only plain
steps the same extend runs once, eagerly. dyn-disable builds, at start, a draft-extend CUDA-graph
runner for one token per request (its own triton backend, graph metadata sized for one token)
when the stock draft extend replays graphs on triton; otherwise the one-token extend runs eagerly,
and the start-up line says why. The builder runs here with stand-ins for the triton backend, the
backend factory and the graph runner (they need a GPU); the worker's use of it is executed in
test_plain_decode.py."""
from __future__ import annotations

import types

import pytest

from tests.dyn.conftest import load_by_path, public_attrs, stub_modules

RUNTIME = "sglang/srt/speculative/dyn_disable_runtime.py"
POLICY = "sglang/srt/speculative/dyn_disable.py"


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
    with stub_modules({
        "sglang.srt.model_executor.forward_batch_info": dict(
            CaptureHiddenMode=types.SimpleNamespace(FULL=2), ForwardBatch=object, ForwardMode=object),
        "sglang.srt.speculative.dyn_disable": public_attrs(
            load_by_path("dyn_disable_policy_for_draft_extend", patched_tree / POLICY)),
        "sglang.srt.speculative.eagle_info": dict(EagleVerifyInput=object),
        "sglang.srt.speculative.spec_info": dict(SpeculativeAlgorithm=object),
        "sglang.srt.layers.attention.triton_backend": dict(TritonAttnBackend=TritonAttnBackend),
        "sglang.srt.speculative.draft_utils": dict(DraftBackendFactory=DraftBackendFactory),
        "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner": dict(
            EAGLEDraftExtendCudaGraphRunner=EAGLEDraftExtendCudaGraphRunner),
    }):
        yield load_by_path("dyn_disable_runtime_under_test", patched_tree / RUNTIME)


def draft_worker(runner, backend):
    return types.SimpleNamespace(
        cuda_graph_runner_for_draft_extend=runner, draft_extend_attn_backend=backend,
        server_args=object(), draft_runner="draft-runner", topk=1, speculative_num_steps=3)


def test_triton_with_graphs_gets_a_one_token_runner_with_its_own_backend(runtime):
    stock_backend = TritonAttnBackend()
    stock = EAGLEDraftExtendCudaGraphRunner(None, draft_extend_attn_backend=stock_backend)
    worker = draft_worker(stock, stock_backend)
    runner, note = runtime.build_one_token_draft_extend(worker)
    assert isinstance(runner, EAGLEDraftExtendCudaGraphRunner) and runner is not stock
    assert runner.worker is worker and runner.speculative_num_steps == 0
    assert runner.backend is DraftBackendFactory.made[-1] and runner.backend is not stock_backend
    assert runner.backend_steps_at_capture == 0 and runner.backend.draft_runner == "draft-runner"
    assert stock_backend.speculative_num_steps == 3  # the speculative path is untouched
    assert note == "one token per request, CUDA graphs"


@pytest.mark.parametrize("runner, backend, words", [
    (None, TritonAttnBackend(), "captures no draft-extend graphs for the TritonAttnBackend draft backend"),
    (EAGLEDraftExtendCudaGraphRunner(None, draft_extend_attn_backend=TritonAttnBackend()),
     OtherBackend(), "graphs are built only for the triton backend, not OtherBackend"),
])
def test_other_setups_run_the_one_token_extend_eagerly_and_say_why(runtime, runner, backend, words):
    made = len(DraftBackendFactory.made)
    built, note = runtime.build_one_token_draft_extend(draft_worker(runner, backend))
    assert built is None and len(DraftBackendFactory.made) == made
    assert note.startswith("one token per request, eager") and words in note

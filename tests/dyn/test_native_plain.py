"""The native plain path (0004, SGLANG_SPEC_DISABLE_PLAIN_PATH=native) on SGLang 0.5.11, on the CPU.

While drafting is off the running batch is a non-speculative batch; when drafting resumes its
speculative state is rebuilt from the future map. What runs here is the patched wheel files' own
code: the scheduler's update_running_batch and run_batch, ScheduleBatch's prepare_for_decode,
filter_batch and merge_batch, spec-v2's EagleDraftInput prepare_for_decode / filter_batch /
merge_batch, the EAGLEWorkerV2's forward_batch_generation, _dyn_resync_draft and _dyn_spec_step, 0.5.11's
FutureMap, alloc_for_decode, 0001's policy and 0004's dyn_disable_native.py whole, with CPU torch.
Stand-ins: the KV allocator (a free list), the model forwards (the target's decode forward, the
draft's KV-only update and one-token extend, the stock draft and verify of a speculative step: they
log what they get and return tensors of the real shapes), ScheduleBatch.get_model_worker_batch
(it copies the fields the worker reads) and the output processing of a non-speculative step (0.5.11
does nothing to the KV counters there; the speculative one, _resolve_spec_overlap_token_ids, is the
real one). Nothing here ran on a GPU."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import sys
import types
from contextlib import nullcontext

import pytest

from tests.dyn.conftest import (PATCHSET, function_source, load_by_path, method_source, public_attrs,
                                stub_modules, tree_with)
from toolkit.patch import wheels

torch = pytest.importorskip("torch")

PATCHES = [PATCHSET / "0.5.11" / name for name in
           ("0001-dyn-disable.patch", "0002-dyn-disable-metrics.patch", "0004-dyn-disable-native-plain.patch")]
NATIVE = "sglang/srt/speculative/dyn_disable_native.py"
POLICY = "sglang/srt/speculative/dyn_disable.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
OUTPUT_MIXIN = "sglang/srt/managers/scheduler_output_processor_mixin.py"
INFO = "sglang/srt/speculative/eagle_info.py"
INFO_V2 = "sglang/srt/speculative/eagle_info_v2.py"
WORKER_V2 = "sglang/srt/speculative/eagle_worker_v2.py"
OVERLAP_UTILS = "sglang/srt/managers/overlap_utils.py"
MEM_COMMON = "sglang/srt/mem_cache/common.py"
STRIDE = 4          # speculative_num_draft_tokens (steps 3, topk 1)
HIDDEN = 2          # the draft's hidden size; the target's EAGLE-3 hidden states are 3 x that
SLOTS = 400         # KV slots 1..SLOTS-1 (0 is the padding slot)


class ModeName(str):
    def is_idle(self):
        return self == "IDLE"

    def is_decode(self):
        return self == "DECODE"

    def is_extend(self):
        return self == "EXTEND"

    def is_decode_or_idle(self):
        return self in ("DECODE", "IDLE")

    def is_prebuilt(self):
        return False

    def is_split_prefill(self):
        return False


class Mode:
    DECODE, EXTEND, IDLE = ModeName("DECODE"), ModeName("EXTEND"), ModeName("IDLE")


class Algo:
    def __init__(self, name):
        self.name = name

    def is_none(self):
        return self.name == "NONE"

    def supports_spec_v2(self):
        return not self.is_none()

    def __repr__(self):
        return self.name


class SpeculativeAlgorithm:
    NONE = Algo("NONE")
    EAGLE3 = Algo("EAGLE3")


class Capture:
    NULL, LAST, FULL = 0, 1, 2


class Result:
    """GenerationBatchResult's fields as the scheduler and the future map use them."""

    def __init__(self, **fields):
        self.__dict__.update(dict(next_draft_input=None, delay_sample_func=None, accept_lens=None,
                                  logits_output=None, routed_experts_output=None), **fields)

    def copy_to_cpu(self, return_logprob):
        pass


class Req:
    def __init__(self, rid, pool_idx, prompt_len):
        self.rid, self.req_pool_idx = rid, pool_idx
        self.kv_committed_len = self.kv_allocated_len = prompt_len
        self.decode_batch_idx = 0
        self.done = False
        self.stream = False
        self.grammar = None
        self.return_logprob = False
        self.return_hidden_states = False
        self.spec_verify_ct = self.spec_accepted_drafts = 0
        self.extend_input_len = self.extend_logprob_start_len = 0
        self.multimodal_inputs = None

    def finished(self):
        return self.done

    def update_spec_acceptance_histogram(self, n):
        pass


class FreeList:
    """The token allocator: slots handed out in order, freed slots go back."""

    def __init__(self):
        self.free = list(range(1, SLOTS))

    def alloc(self, n):
        out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n, "out of KV slots"
        return torch.tensor(out, dtype=torch.int64)


def assign_req_to_token_pool(req_pool_indices, req_to_token, start, end, out_cache_loc, bs):
    """Torch reference of SGLang's assign_req_to_token_pool_func kernel."""
    pt = 0
    for r, s, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
        req_to_token[r, s:e] = out_cache_loc[pt:pt + e - s].to(req_to_token.dtype)
        pt += e - s


@functools.lru_cache(maxsize=None)
def _code(path, class_name, name):
    """The compiled source of one method (or module-level function) of a patched file."""
    source = method_source(path, class_name, name) if class_name else function_source(path, name)
    return compile("from __future__ import annotations\n" + source, str(path), "exec")


def _exec(path, class_name, names, namespace):
    for name in names:
        exec(_code(path, class_name, name), namespace)
    return namespace


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """0.5.11's files with 0001, 0002 and 0004 applied, plus untouched wheel files the test runs."""
    root = tree_with(tmp_path_factory.mktemp("native"), PATCHES)
    wheel = wheels.pristine("sglang", "0.5.11")
    for path in (OVERLAP_UTILS, MEM_COMMON, INFO, OUTPUT_MIXIN):
        target = root / path
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(path))
    return root


class Env:
    """The loaded modules and stand-ins of one test."""


@dataclasses.dataclass
class WorkerBatch:
    """ModelWorkerBatch's fields that the worker and the future map read (a dataclass, as the
    real one: the worker's resume uses dataclasses.replace on it)."""
    forward_mode: object
    input_ids: object
    out_cache_loc: object
    seq_lens: object
    seq_lens_cpu: object
    seq_lens_sum: int
    req_pool_indices: object
    spec_info: object
    spec_algorithm: object
    sampling_info: object
    is_extend_in_batch: bool
    return_logprob: bool
    has_grammar: bool
    reqs: list
    capture_hidden_mode: int = Capture.NULL
    extend_seq_lens: object = None


@pytest.fixture()
def env(tree, monkeypatch):
    e = Env()
    e.pool = FreeList()
    e.req_to_token = torch.zeros((8, 128), dtype=torch.int32)
    e.calls = []
    alloc_token_slots = lambda tree_cache, n, backup_state=False: e.pool.alloc(n)  # noqa: E731
    e.policy = load_by_path("dyn_policy_native_test", tree / POLICY)
    with stub_modules({"sglang.srt.speculative.spec_utils": dict(spec_need_hidden_states=lambda: True),
                       "sglang.srt.utils": dict(is_cuda=lambda: False, is_hip=lambda: False)}):
        e.overlap = load_by_path("overlap_utils_native_test", tree / OVERLAP_UTILS)
    mem_ns = _exec(tree / MEM_COMMON, None, ["alloc_for_decode"], {"torch": torch, "alloc_token_slots": alloc_token_slots})
    e.mem_common = dict(alloc_for_decode=mem_ns["alloc_for_decode"], alloc_token_slots=alloc_token_slots)

    # EagleDraftInput: its scheduler-side methods, real (filter/merge of eagle_info, spec-v2's prepare)
    class DraftInput:
        def __init__(self, **fields):
            self.__dict__.update(dict(topk_p=None, topk_index=None, hidden_states=None, verified_id=None,
                                      future_indices=None, new_seq_lens=None, verify_done=None), **fields)

        def is_verify_input(self):
            return False

    info_ns = _exec(tree / INFO, "EagleDraftInput", ["filter_batch", "merge_batch"],
                    {"torch": torch, "FutureIndices": e.overlap.FutureIndices,
                     "envs": types.SimpleNamespace(SGLANG_SPEC_ENABLE_STRICT_FILTER_CHECK=types.SimpleNamespace(get=lambda: True)),
                     "logger": logging.getLogger("eagle_info_test")})
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.spec_utils", types.SimpleNamespace(
        assign_req_to_token_pool_func=assign_req_to_token_pool, maybe_detect_nan=lambda *a: None))
    v2_ns = _exec(tree / INFO_V2, "EagleDraftInputV2Mixin", ["prepare_for_decode"],
                  {"torch": torch, "get_alloc_len_per_decode": lambda: STRIDE, "alloc_token_slots": alloc_token_slots})
    DraftInput.filter_batch, DraftInput.merge_batch = info_ns["filter_batch"], info_ns["merge_batch"]
    DraftInput.prepare_for_decode = v2_ns["prepare_for_decode"]
    e.DraftInput = DraftInput

    # ScheduleBatch: the real methods the scheduler calls on a decode batch
    sb_names = ["is_spec_v2", "prepare_for_decode", "filter_batch", "merge_batch", "maybe_wait_verify_done",
                "host_seq_lens_exact", "host_lens_on_device", "batch_size", "is_empty"]
    sb_ns = _exec(tree / SCHEDULE_BATCH, "ScheduleBatch", sb_names, {
        "torch": torch, "alloc_for_decode": mem_ns["alloc_for_decode"], "is_pin_memory_available": lambda d: False,
        "get_global_server_args": lambda: types.SimpleNamespace(enable_mamba_extra_buffer=lambda: False),
        "ForwardMode": Mode, "Req": Req})

    class Batch:
        def __init__(self, reqs, lens, spec_algorithm, spec_info=None, output_ids=None, forward_mode=Mode.DECODE):
            self.reqs = list(reqs)
            self.forward_mode = forward_mode
            self.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
            self.seq_lens = torch.tensor(lens, dtype=torch.int64)
            self.seq_lens_cpu = self.seq_lens.clone()
            self.orig_seq_lens = self.seq_lens.clone()
            self.seq_lens_sum = int(self.seq_lens.sum())
            self.spec_algorithm, self.spec_info, self.output_ids = spec_algorithm, spec_info, output_ids
            self.input_ids = self.out_cache_loc = self.input_embeds = None
            self.enable_overlap = True
            self.device = "cpu"
            self.return_logprob = self.has_grammar = self.has_stream = self.return_hidden_states = False
            self.is_prefill_only = False
            self.multimodal_inputs = self.hisparse_coordinator = None
            self.top_logprobs_nums = self.token_ids_logprobs = None
            self.model_config = types.SimpleNamespace(is_encoder_decoder=False)
            self.tree_cache = types.SimpleNamespace(page_size=1)
            self.req_to_token_pool = types.SimpleNamespace(
                req_to_token=e.req_to_token,
                write=lambda idx, values: e.req_to_token.__setitem__(idx, values))
            self.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=1)
            self.sampling_info = types.SimpleNamespace(
                penalizer_orchestrator=types.SimpleNamespace(is_required=False), is_all_greedy=True,
                has_custom_logit_processor=False, need_min_p_sampling=False,
                filter_batch=lambda *a: None, merge_batch=lambda other: None, copy_for_forward=lambda: "sampling")

        def maybe_evict_swa(self):
            pass

        def check_decode_mem(self):
            return True

        def get_model_worker_batch(self):
            """Stand-in: the fields the worker and the future map read, as 0.5.11 copies them."""
            return WorkerBatch(
                forward_mode=self.forward_mode, input_ids=None if self.input_ids is None else self.input_ids.clone(),
                out_cache_loc=self.out_cache_loc, seq_lens=self.seq_lens, seq_lens_cpu=self.seq_lens_cpu,
                seq_lens_sum=self.seq_lens_sum, req_pool_indices=self.req_pool_indices, spec_info=self.spec_info,
                spec_algorithm=self.spec_algorithm, sampling_info=self.sampling_info, is_extend_in_batch=False,
                return_logprob=False, has_grammar=False, reqs=self.reqs,
                extend_seq_lens=getattr(self, "extend_lens", None))

    for name in sb_names:
        setattr(Batch, name, sb_ns[name])
    e.Batch = Batch
    yield e


class Models:
    """Stand-ins for the forwards: the target samples token (last input + 1) % 50; a speculative
    step accepts 2 tokens per request; the draft's hidden states are recognisable numbers."""

    def __init__(self, e):
        self.e = e

    def native_decode_forward(self, target_worker, state, batch):
        self.e.calls.append(("target_decode", batch))
        bs = len(batch.seq_lens)
        tokens = (batch.input_ids + 1) % 50
        hidden = torch.arange(bs * 3 * HIDDEN, dtype=torch.float32).view(bs, 3 * HIDDEN)
        return Result(logits_output=types.SimpleNamespace(next_token_logits=torch.zeros(bs, 50), hidden_states=hidden),
                      next_token_ids=tokens, can_run_cuda_graph=True)

    def target_prefill(self, batch):
        """The target's prefill (EAGLE-3 hidden states of every prompt position: row = position in
        the flattened batch * 10 + column; with CaptureHiddenMode.LAST each request's last position's
        only, as the logits processor prunes them); samples (last prompt token + 1) % 50 per request."""
        self.e.calls.append(("target_prefill", batch.capture_hidden_mode, batch.input_ids.tolist()))
        cols = torch.arange(3 * HIDDEN, dtype=torch.float32)
        hidden = torch.arange(len(batch.input_ids), dtype=torch.float32).unsqueeze(1) * 10 + cols
        ends = torch.tensor(batch.extend_seq_lens).cumsum(0) - 1
        if batch.capture_hidden_mode == Capture.LAST:
            hidden = hidden[ends]
        return Result(logits_output=types.SimpleNamespace(hidden_states=hidden, mm_input_embeds=None),
                      next_token_ids=(batch.input_ids[ends] + 1) % 50)

    def kv_only(self, tokens, hidden, positions, locs):
        self.e.calls.append(("kv_only", tokens.tolist(), positions.tolist(), locs.tolist()))
        return hidden[:, :HIDDEN] + 100.0

    def verify(self, batch):
        """The stock spec-v2 verify's result for `batch` (accept length 2)."""
        spec = batch.spec_info.draft_input
        self.e.calls.append(("verify", spec.topk_p.clone(), spec.topk_index.clone(), spec.hidden_states.clone(),
                             spec.verified_id.clone()))
        bs = len(batch.seq_lens)
        accept = torch.full((bs,), 2, dtype=torch.int32)
        first = (spec.verified_id.to(torch.int64) + 1) % 50
        predict = torch.stack([first, (first + 1) % 50, first * 0, first * 0], 1).view(-1)
        nxt = self.e.DraftInput(verified_id=((first + 1) % 50).to(torch.int32), new_seq_lens=batch.seq_lens + 2,
                                topk_p=torch.full((bs, 1), 0.5), topk_index=torch.full((bs, 1), 7),
                                hidden_states=torch.full((bs, HIDDEN), 3.0))
        return Result(next_token_ids=predict, accept_lens=accept, next_draft_input=nxt)


@pytest.fixture()
def system(env, tree, monkeypatch):
    # streams and events as no-ops (CPU torch has none)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    monkeypatch.setattr(torch, "get_device_module", lambda device: types.SimpleNamespace(
        current_stream=lambda: None, Event=lambda: types.SimpleNamespace(record=lambda: None)))
    """A scheduler (update_running_batch, run_batch: real) and an EAGLEWorkerV2
    (forward_batch_generation, _dyn_resync_draft: real) with the native path on."""
    e, models = env, Models(env)
    e.models = models

    def draft_extend_forward(fb, skip_attn_backend_init=False):
        e.calls.append(("resync", fb.input_ids.tolist(), fb.positions.tolist(), fb.out_cache_loc.tolist(),
                        fb.hidden.clone()))
        bs = fb.hidden.shape[0]
        logits = torch.zeros(bs, 50)
        logits[:, 9] = 1.0
        return types.SimpleNamespace(logits_output=types.SimpleNamespace(
            next_token_logits=logits, hidden_states=torch.full((bs, HIDDEN), 9.0)))

    class PrepareExtend:
        def __init__(self, **fields):
            self.__dict__.update(fields)

        def prepare_for_extend_to_fill_draft_kvcache(self, batch, predict, n, draft_runner, runner):
            return types.SimpleNamespace(spec_info=types.SimpleNamespace(), hidden=self.hidden_states,
                                         input_ids=predict, positions=batch.seq_lens, out_cache_loc=batch.out_cache_loc)

    use_plain_ns = _exec(tree / "sglang/srt/speculative/dyn_disable_runtime.py", None, ["use_plain_decode_state"],
                         {"contextlib": __import__("contextlib"),
                          "contextmanager": __import__("contextlib").contextmanager})
    e.forward_batches = []

    class ForwardBatch:
        @staticmethod
        def init_new(batch, model_runner):
            fb = types.SimpleNamespace(batch=dataclasses.replace(batch), attn_backend=model_runner.attn_backend,
                                       graph_runner=model_runner.graph_runner)
            e.forward_batches.append(fb)
            return fb

    runtime_stub = dict(
        use_plain_decode_state=use_plain_ns["use_plain_decode_state"],
        force_spec_reason=lambda batch: "logprobs" if batch.return_logprob else None,
        sync_sampled_tokens=lambda tokens, sampling: None,
        draft_input_hidden=lambda runner, hidden: hidden[:, :HIDDEN] + 100.0,
        request_slots=lambda req_to_token, rows, lens: req_to_token[rows, lens].to(torch.int64),
        draft_kv_only_extend=None)
    stubs = {
        "sglang.srt.speculative.dyn_disable": public_attrs(e.policy),
        "sglang.srt.speculative.dyn_disable_runtime": runtime_stub,
        "sglang.srt.managers.overlap_utils": public_attrs(e.overlap),
        "sglang.srt.speculative.spec_info": dict(SpeculativeAlgorithm=SpeculativeAlgorithm),
        "sglang.srt.speculative.eagle_info": dict(EagleDraftInput=e.DraftInput),
        "sglang.srt.speculative.spec_utils": dict(maybe_detect_nan=lambda *a: None,
                                                  assign_req_to_token_pool_func=assign_req_to_token_pool),
        "sglang.srt.mem_cache.common": e.mem_common,
        "sglang.srt.model_executor.forward_batch_info": dict(CaptureHiddenMode=Capture, ForwardBatch=ForwardBatch),
        "sglang.srt.managers.utils": dict(GenerationBatchResult=Result),
        "sglang.srt.layers.moe.utils": dict(speculative_moe_backend_context=nullcontext,
                                            speculative_moe_a2a_backend_context=nullcontext),
    }
    with stub_modules(stubs):
        native = load_by_path("sglang.srt.speculative.dyn_disable_native", tree / NATIVE)
        e.native_decode_forward = native.native_decode_forward   # the real one, for its own test
        monkeypatch.setattr(native, "native_decode_forward", models.native_decode_forward)
        e.native = native

        worker_ns = _exec(tree / WORKER_V2, "EAGLEWorkerV2", ["forward_batch_generation", "_dyn_resync_draft",
                                                            "_dyn_spec_step"], {
            "torch": torch, "dataclasses": dataclasses, "EagleDraftInput": PrepareExtend,
            "CaptureHiddenMode": Capture, "fast_topk": lambda p, k, dim: torch.topk(p, k, dim=dim),
            "speculative_moe_backend_context": nullcontext, "speculative_moe_a2a_backend_context": nullcontext})

        class Draft:
            topk = 1
            draft_runner = types.SimpleNamespace(tp_group=None, forward=draft_extend_forward)

            def draft_tp_context(self, group):
                return nullcontext()

            def draft(self, batch):
                return types.SimpleNamespace(is_verify_input=lambda: True, draft_input=batch.spec_info)

            def _draft_extend_for_decode(self, batch, output):
                pass

            def _draft_extend_for_prefill(self, batch, hidden, tokens, mm_input_embeds):
                e.calls.append(("draft_prefill", batch.capture_hidden_mode))
                bs = len(tokens)
                return e.DraftInput(verified_id=tokens.to(torch.int32), new_seq_lens=batch.seq_lens,
                                    topk_p=torch.full((bs, 1), 0.8), topk_index=torch.full((bs, 1), 4),
                                    hidden_states=torch.full((bs, HIDDEN), 5.0))

        worker = types.SimpleNamespace(
            device="cpu", topk=1, speculative_num_draft_tokens=STRIDE, plan_stream=None,
            draft_worker=Draft(), target_worker=types.SimpleNamespace(
                forward_batch_generation=models.target_prefill,
                model_config=types.SimpleNamespace(spec_hidden_size=HIDDEN, dtype=torch.float32)), _dyn_plain_state="plain-state",
            _dyn_draft_kv_only=True, _dyn_debug_skip_draft_kv=False, _dyn_resync_pending=False,
            _dyn_kv_only_graphs=types.SimpleNamespace(run=models.kv_only),
            req_to_token_pool=types.SimpleNamespace(req_to_token=e.req_to_token),
            dyn_disable=e.policy.SpecSwitch(e.policy.config_from_env(
                {e.policy.THRESHOLD_ENV: "2", e.policy.HYSTERESIS_ENV: "1"})))
        worker.verify = models.verify
        for name in ("forward_batch_generation", "_dyn_resync_draft", "_dyn_spec_step"):
            setattr(worker, name, types.MethodType(worker_ns[name], worker))
        worker._dyn_native = native.NativePlainPath(worker)
        e.worker = worker

        sched_ns = _exec(tree / SCHEDULER, "Scheduler", ["update_running_batch", "run_batch"], {
            "TEST_RETRACT": False, "TEST_RETRACT_INTERVAL": 1, "ForwardMode": Mode,
            "set_time_batch": lambda *a: None, "logger": logging.getLogger("scheduler_test")})
        mixin_ns = _exec(tree / OUTPUT_MIXIN, "SchedulerOutputProcessorMixin", ["_resolve_spec_overlap_token_ids"], {})
        stock_map = e.overlap.FutureMap(16, 0, 128, "cpu", SpeculativeAlgorithm.EAGLE3)
        stream = types.SimpleNamespace(wait_stream=lambda s: None)
        sched = types.SimpleNamespace(
            forward_ct=0, forward_sleep_time=None, is_generation=True, enable_overlap=True, enable_pdmux=False,
            spec_algorithm=SpeculativeAlgorithm.EAGLE3, model_worker=worker, draft_worker=worker,
            future_map=native.NativeFutureMap.adopt(stock_map), forward_stream_ctx=nullcontext(),
            forward_stream=stream, schedule_stream=stream,
            device_module=types.SimpleNamespace(Event=lambda: None), enable_hierarchical_cache=False,
            new_token_ratio=0.5, new_token_ratio_decay=0.0, min_new_token_ratio=0.1,
            server_args=types.SimpleNamespace(enable_dp_attention=False),
            dyn_native=worker._dyn_native)
        sched._profile_batch_predicate = lambda batch: None
        sched.record_batch_in_overlap = lambda mwb: None
        for name in ("update_running_batch", "run_batch"):
            setattr(sched, name, types.MethodType(sched_ns[name], sched))
        sched._resolve_spec_overlap_token_ids = types.MethodType(mixin_ns["_resolve_spec_overlap_token_ids"], sched)
        e.sched = sched
        yield e


def prefill(e, reqs, prompt_lens, first_tokens):
    """A speculative prefill batch after its run (as run_batch leaves one): KV slots of the prompts in
    req_to_token, the draft state (top-k >= 0) in the future map, output_ids = -future indices."""
    for req, n in zip(reqs, prompt_lens):
        e.req_to_token[req.req_pool_idx, :n] = e.pool.alloc(n).to(torch.int32)
    batch = e.Batch(reqs, prompt_lens, SpeculativeAlgorithm.EAGLE3, forward_mode=Mode.EXTEND)
    future = e.sched.future_map.alloc_future_indices(len(reqs))
    e.sched.future_map.store_to_map(future, Result(next_draft_input=e.DraftInput(
        verified_id=torch.tensor(first_tokens, dtype=torch.int32), new_seq_lens=batch.seq_lens,
        topk_p=torch.full((len(reqs), 1), 0.8), topk_index=torch.full((len(reqs), 1), 4),
        hidden_states=torch.full((len(reqs), HIDDEN), 5.0))))
    batch.spec_info = e.DraftInput(future_indices=future, new_seq_lens=batch.seq_lens)
    batch.output_ids = -future.indices
    batch.forward_mode = Mode.DECODE
    return batch


def step(e, batch):
    """One decode step of the overlap loop: update_running_batch and run_batch of this step, then
    the output processing of the previous step (its KV bookkeeping: the real one for a speculative
    step, none for a non-speculative one), in event_loop_overlap's order."""
    e.calls.clear()
    batch = e.sched.update_running_batch(batch)
    speculative = not batch.spec_algorithm.is_none()
    result = e.sched.run_batch(batch)
    finish_previous(e)
    e.pending = (speculative, list(batch.reqs), result)
    return batch


def finish_previous(e):
    pending, e.pending = getattr(e, "pending", None), None
    if pending is not None and pending[0]:
        _, reqs, result = pending
        result.next_token_ids, result.accept_lens = result.next_token_ids.cpu(), result.accept_lens.cpu()
        e.sched._resolve_spec_overlap_token_ids(result, types.SimpleNamespace(reqs=reqs))


def release(e, req):
    """release_kv_cache's effect on the slots: the request's positions go back to the allocator."""
    e.pool.free += e.req_to_token[req.req_pool_idx, :req.kv_allocated_len].tolist()
    e.req_to_token[req.req_pool_idx].zero_()


def leave(e, batch, reqs):
    """Requests that finish between steps: their slots released, the batch filtered (as the
    scheduler's filter_batch after the output processing)."""
    for r in reqs:
        r.done = True
        release(e, r)
    batch.filter_batch()


def assert_kv_consistent(e, reqs):
    """Every slot is either free or held by exactly one position of a live request, and each
    request holds exactly its kv_allocated_len positions."""
    held = []
    for req in reqs:
        assert req.kv_committed_len <= req.kv_allocated_len
        held += e.req_to_token[req.req_pool_idx, :req.kv_allocated_len].tolist()
    assert 0 not in held
    assert len(held) == len(set(held)), "a slot is used twice"
    assert sorted(held + e.pool.free) == list(range(1, SLOTS)), "a slot leaked"


def non_speculative_twin(e, batch):
    """What a server without speculation prepares from the same running requests: a copy of the
    batch (requests copied) put through the real prepare_for_decode as a non-speculative batch."""
    reqs = [types.SimpleNamespace(**vars(r)) for r in batch.reqs]
    twin = e.Batch([Req(r.rid, r.req_pool_idx, 0) for r in reqs], batch.seq_lens_cpu.tolist(),
                   SpeculativeAlgorithm.NONE, output_ids=batch.output_ids.clone())
    for copy, r in zip(twin.reqs, reqs):
        copy.__dict__.update(vars(r))
    saved = (e.req_to_token.clone(), list(e.pool.free))
    twin.prepare_for_decode()
    e.req_to_token.copy_(saved[0])
    e.pool.free = saved[1]
    return twin


def test_spec_then_native_plain_then_spec_with_requests_leaving_and_joining(system):
    e = system
    a, b = Req("a", 0, 10), Req("b", 1, 20)
    batch = prefill(e, [a, b], [10, 20], [1, 2])

    # step 1: 2 running (threshold 2): a stock speculative step, which over-allocates KV slots
    batch = step(e, batch)
    assert [c[0] for c in e.calls] == ["verify"] and not batch.spec_algorithm.is_none()
    assert a.kv_allocated_len == 10 + 2 * STRIDE

    # step 2: c joins (a speculative prefill merged into the speculative batch): 3 running > 2:
    # the first native plain step. The previous step's result is processed only after it (overlap).
    c = Req("c", 2, 8)
    batch.merge_batch(prefill(e, [c], [8], [40]))
    batch = step(e, batch)
    assert batch.spec_algorithm.is_none() and batch.spec_info is None
    (kind, mwb), kv = e.calls
    assert kind == "target_decode" and mwb.spec_info is None and mwb.forward_mode == "DECODE"
    assert mwb.input_ids.tolist() == [3, 4, 40]          # the verify's last tokens and the prefill's
    assert mwb.seq_lens.tolist() == [13, 23, 9] and batch.seq_lens_cpu.tolist() == [13, 23, 9]
    assert mwb.out_cache_loc.shape == (3,)               # one slot per request, not bs x draft tokens
    # a and b write into the slots the speculative step over-allocated at their position; c gets a new one
    assert mwb.out_cache_loc.tolist()[:2] == [e.req_to_token[0, 12].item(), e.req_to_token[1, 22].item()]
    assert kv == ("kv_only", [4, 5, 41], [12, 22, 8], mwb.out_cache_loc.tolist())
    assert [r.kv_committed_len for r in (a, b, c)] == [13, 23, 9]
    assert [r.kv_allocated_len for r in (a, b, c)] == [18, 28, 9]   # exact: no slot counted twice
    assert_kv_consistent(e, [a, b, c])

    # step 3: b finishes (filter) and d joins from a prefill (merge into the non-speculative batch)
    b.done = True
    release(e, b)
    d = Req("d", 3, 6)
    batch.filter_batch()
    batch.merge_batch(prefill(e, [d], [6], [30]))
    assert batch.spec_info is None and batch.spec_algorithm.is_none()
    twin = non_speculative_twin(e, batch)
    batch = step(e, batch)
    (kind, mwb), kv = e.calls
    assert mwb.input_ids.tolist() == [4, 41, 30]          # plain futures and the prefill's
    assert mwb.seq_lens.tolist() == [14, 10, 7] and kv[2] == [13, 9, 6]
    for name in ("forward_mode", "input_ids", "seq_lens", "seq_lens_cpu", "orig_seq_lens", "seq_lens_sum",
                 "spec_info", "spec_algorithm"):
        assert repr(getattr(batch, name)) == repr(getattr(twin, name)), name
    assert batch.out_cache_loc.shape == twin.out_cache_loc.shape
    assert [r.kv_committed_len for r in batch.reqs] == [r.kv_committed_len for r in twin.reqs]
    # a keeps the tail the speculative step over-allocated (freed when it finishes); the stock
    # non-speculative prepare would count its slot at seq_len a second time
    assert [r.kv_allocated_len for r in batch.reqs] == [18, 10, 7] and twin.reqs[0].kv_allocated_len == 19
    assert_kv_consistent(e, [a, c, d])

    # step 4: d finishes: 2 running: still plain (drafting resumes at <= 2 - 1)
    d.done = True
    release(e, d)
    batch = step(e, batch)
    assert batch.spec_algorithm.is_none() and [k[0] for k in e.calls] == ["target_decode", "kv_only"]

    # step 5: c finishes: 1 running: drafting resumes, and the batch's speculative state is rebuilt
    # from the futures of the last plain step
    c.done = True
    release(e, c)
    batch = step(e, batch)
    assert not batch.spec_algorithm.is_none()
    resync, verify = e.calls
    _, tokens, positions, locs, hidden = resync
    assert resync[0] == "resync" and tokens == [6] and positions == [14]   # a's last token, at its last position
    assert locs == [e.req_to_token[0, 14].item()]          # rewrites that position's draft KV
    assert hidden.tolist() == [[100.0, 101.0]]              # fc(target hidden) of the last plain step
    _, topk_p, topk_index, spec_hidden, verified = verify
    # the rebuilt top-k: the draft's token 9 (softmax of one logit 1 among 50 zeros), not the -1 mark
    assert topk_index.tolist() == [[9]] and topk_p.item() == pytest.approx(math.e / (math.e + 49))
    assert spec_hidden.tolist() == [[9.0] * HIDDEN] and verified.tolist() == [6]
    finish_previous(e)
    assert batch.seq_lens.tolist() == [17] and a.kv_committed_len == 17   # 15 + the two accepted tokens
    assert_kv_consistent(e, [a])


SETTINGS = {"SGLANG_SPEC_DISABLE_PLAIN_PATH": ("plain_path_from_env", "step or native"),
            "SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV": ("plain_draft_kv_from_env", "write or skip or defer")}


@pytest.mark.parametrize("name, raw, expected", [
    *[("SGLANG_SPEC_DISABLE_PLAIN_PATH", raw, value) for raw, value in [
        (None, "step"), ("", "step"), (" ", "step"), ("step", "step"), ("native", "native"), (" native\n", "native")]],
    *[("SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV", raw, value) for raw, value in [
        (None, "write"), ("", "write"), (" skip\n", "skip"), ("write", "write"), ("defer", "defer")]]])
def test_each_setting_reads_its_values(system, name, raw, expected):
    environ = {} if raw is None else {name: raw}
    assert getattr(system.native, SETTINGS[name][0])(environ) == expected


@pytest.mark.parametrize("name, raw", [
    *[("SGLANG_SPEC_DISABLE_PLAIN_PATH", raw) for raw in ["Native", "1", "auto", "native,step"]],
    *[("SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV", raw) for raw in ["Skip", "0", "none", "skip,write", "deferred"]]])
def test_a_bad_value_stops_the_server_naming_the_variable(system, name, raw, monkeypatch):
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_PATH", "native")
    monkeypatch.setenv(name, raw)
    worker = types.SimpleNamespace(dyn_disable=system.worker.dyn_disable, _dyn_draft_kv_only=True)
    with pytest.raises(system.policy.DynDisableConfigError, match=f"{name}={raw!r} must be {SETTINGS[name][1]}"):
        system.native.make_native(worker, types.SimpleNamespace())


@pytest.mark.parametrize("server, worker, reason", [
    (dict(disable_overlap_schedule=True), {}, "the overlap scheduler off"),
    (dict(page_size=16), {}, "page size 16"),
    (dict(disaggregation_mode="decode"), {}, "PD disaggregation"),
    ({}, dict(_dyn_draft_kv_only=False), "no KV-only draft update"),
])
def test_servers_the_native_path_cannot_serve_keep_the_step_path(system, monkeypatch, caplog, server, worker, reason):
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_PATH", "native")
    w = types.SimpleNamespace(**{"dyn_disable": system.worker.dyn_disable, "_dyn_draft_kv_only": True, **worker})
    with caplog.at_level(logging.WARNING):
        assert system.native.make_native(w, types.SimpleNamespace(**server)) is None
    assert f"SGLANG_SPEC_DISABLE_PLAIN_PATH=native not supported with {reason}" in caplog.text
    assert "plain steps use the step path" in caplog.text


def test_native_is_taken_only_where_dyn_disable_is_on_and_asked_for(system, monkeypatch, caplog):
    good = types.SimpleNamespace(dyn_disable=system.worker.dyn_disable, _dyn_draft_kv_only=True)
    args = types.SimpleNamespace(page_size=1, disaggregation_mode="null", disable_overlap_schedule=False)
    monkeypatch.delenv("SGLANG_SPEC_DISABLE_PLAIN_PATH", raising=False)
    assert system.native.make_native(good, args) is None                      # default: the step path
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_PATH", "native")
    # dyn-disable refused (DP attention, LoRA, a hybrid target, ...: make_switch gave None)
    assert system.native.make_native(types.SimpleNamespace(dyn_disable=None), args) is None
    with caplog.at_level(logging.INFO):
        path = system.native.make_native(good, args)
    assert isinstance(path, system.native.NativePlainPath) and "native plain path" in caplog.text


def test_a_logprob_request_joining_plain_steps_makes_the_next_step_speculate(system):
    """Requests the plain path would sample differently keep speculating at any load (0001's rule):
    in native mode the scheduler resumes for them, with the rebuilt draft state."""
    e = system
    reqs = [Req(i, i, 10 + i) for i in range(3)]
    batch = step(e, prefill(e, reqs, [10, 11, 12], [1, 2, 3]))
    assert batch.spec_algorithm.is_none()
    batch.return_logprob = True
    batch = step(e, batch)
    assert not batch.spec_algorithm.is_none() and [c[0] for c in e.calls] == ["resync", "verify"]
    assert e.worker.dyn_disable.forced_spec_steps == 1


def test_debug_switch_leaves_the_draft_kv_unwritten_but_still_rebuilds_at_resume(system):
    """SGLANG_SPEC_DISABLE_DEBUG_SKIP_DRAFT_KV=1 (the negative control of issue #24) in native mode:
    no KV-only update runs in plain steps; the resume still gets fc(target hidden states)."""
    e = system
    e.worker._dyn_debug_skip_draft_kv = True
    reqs = [Req(i, i, 10) for i in range(3)]
    batch = step(e, prefill(e, reqs, [10, 10, 10], [1, 2, 3]))
    assert [c[0] for c in e.calls] == ["target_decode"]
    for r in reqs[1:]:
        r.done = True
    batch = step(e, batch)
    resync = e.calls[0]
    assert resync[0] == "resync" and resync[4].tolist() == [[100.0, 101.0]]


def test_the_native_diff_applies_after_0001_and_0002_and_compiles(tree):
    """The `tree` fixture applied the three diffs in order to the pristine wheel files (git apply
    fails the fixture otherwise); the loader applies them in the same order, and every patched
    file byte-compiles."""
    from toolkit.patch import patchsets

    names = [p.name for p in patchsets.load_all()["dyn-disable"].patches("0.5.11")]
    assert names.index("0004-dyn-disable-native-plain.patch") > names.index("0002-dyn-disable-metrics.patch")
    for path in (NATIVE, SCHEDULER, SCHEDULE_BATCH, WORKER_V2, OUTPUT_MIXIN, "sglang/srt/speculative/eagle_worker.py"):
        compile((tree / path).read_text(), path, "exec")


def _metrics_hook(tree):
    """The `if` around update_spec_metrics in the patched process_batch_result_decode, as code."""
    import ast

    for node in ast.walk(ast.parse((tree / OUTPUT_MIXIN).read_text())):
        if isinstance(node, ast.If) and "update_spec_metrics" in ast.unparse(node.body[0]):
            return compile(ast.Module(body=[node], type_ignores=[]), OUTPUT_MIXIN, "exec")
    raise AssertionError("no update_spec_metrics call")


def test_plain_steps_count_as_steps_without_accepted_drafts(system, tree):
    """The Decode batch line divides the accepted tokens by the speculative steps counted since the
    last line: an interval of native plain steps only (non-speculative batches) must still count
    steps, or the line divides by zero. They count as the step path's plain steps do: one step
    with no accepted draft per request, also in each request's spec_verify_ct."""
    e = system
    code = _metrics_hook(tree)
    metrics_ns = _exec(tree / "sglang/srt/observability/scheduler_metrics_mixin.py", "SchedulerMetricsMixin",
                       ["update_spec_metrics"], {})
    sched = types.SimpleNamespace(spec_num_accepted_tokens=0, spec_num_forward_ct=0, num_generated_tokens=0,
                                  dyn_native=e.worker._dyn_native)
    sched.update_spec_metrics = types.MethodType(metrics_ns["update_spec_metrics"], sched)
    reqs = [Req(i, i, 10) for i in range(3)]
    plain = e.Batch(reqs, [11, 11, 11], SpeculativeAlgorithm.NONE)
    for _ in range(2):
        exec(code, {"self": sched, "batch": plain, "result": Result(num_accepted_drafts=0)})
    assert (sched.spec_num_forward_ct, sched.spec_num_accepted_tokens) == (6, 6)   # accept length 1.0
    assert [r.spec_verify_ct for r in reqs] == [2, 2, 2]
    spec = e.Batch(reqs, [13, 13, 13], SpeculativeAlgorithm.EAGLE3)
    exec(code, {"self": sched, "batch": spec, "result": Result(num_accepted_drafts=3)})
    assert (sched.spec_num_forward_ct, sched.spec_num_accepted_tokens) == (9, 12)
    assert [r.spec_verify_ct for r in reqs] == [2, 2, 2]    # a speculative step counts them elsewhere
    stock = types.SimpleNamespace(spec_num_accepted_tokens=0, spec_num_forward_ct=0, num_generated_tokens=0)
    stock.update_spec_metrics = types.MethodType(metrics_ns["update_spec_metrics"], stock)
    exec(code, {"self": stock, "batch": plain, "result": Result(num_accepted_drafts=0)})
    assert stock.spec_num_forward_ct == 0                   # a server without the native path: untouched


def test_plain_steps_use_up_the_over_allocated_tail_then_allocate_as_stock(system):
    """A spec-v2 step leaves each request up to 2 x draft tokens of KV slots ahead; the plain steps
    after it write into them one by one, then allocate one slot per step as a server without
    speculation does. No slot is leaked or shared at any step."""
    e = system
    a, b = Req("a", 0, 10), Req("b", 1, 20)
    batch = step(e, prefill(e, [a, b], [10, 20], [1, 2]))
    c = Req("c", 2, 8)
    batch.merge_batch(prefill(e, [c], [8], [40]))
    flags, free_before = [], []
    for _ in range(9):
        free_before.append(len(e.pool.free))
        batch = step(e, batch)
        assert batch.spec_algorithm.is_none()
        assert_kv_consistent(e, [a, b, c])
        flags.append(batch.dyn_native_slots)
    finish_previous(e)
    assert a.kv_committed_len == 12 + 9 and a.kv_allocated_len == a.kv_committed_len
    # a and b used their 6 slots of tail (positions 12..17 and 22..27) first; c allocated every step
    taken = [x - y for x, y in zip(free_before, free_before[1:] + [len(e.pool.free)])]
    assert taken == [1] * 6 + [3] * 3
    assert flags == [True] * 5 + [False] * 4


def test_the_v1_tree_worker_keeps_the_step_path_and_says_so(system, monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_PATH", "native")
    with caplog.at_level(logging.WARNING):
        system.native.step_path_only("EAGLEWorker (v1)")
    assert "SGLANG_SPEC_DISABLE_PLAIN_PATH=native not supported with EAGLEWorker (v1)" in caplog.text
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_PATH", "nativ")
    with pytest.raises(system.policy.DynDisableConfigError, match="SGLANG_SPEC_DISABLE_PLAIN_PATH='nativ'"):
        system.native.step_path_only("EAGLEWorker (v1)")


def test_the_plain_forward_is_a_decode_forward_on_the_plain_path_of_the_batch_as_prepared(system):
    """A native plain step's target forward: the non-speculative batch as the scheduler prepared it
    (the new token counted in seq_lens, one slot per request, no spec_info), on the plain decode
    path's attention backend and DECODE graphs (the verify ones restored after), with the EAGLE-3
    hidden states captured for the draft, sampled by the target's own sampler."""
    e = system
    runner = types.SimpleNamespace(attn_backend="verify-backend", graph_runner="verify-graphs",
                                   spec_algorithm=SpeculativeAlgorithm.EAGLE3)
    runner.forward = lambda fb: types.SimpleNamespace(
        logits_output=types.SimpleNamespace(next_token_logits=torch.zeros(2, 50)), can_run_graph=True,
        expert_distribution_metrics=None, routed_experts_output=None)
    runner.sample = lambda logits_output, fb: torch.tensor([7, 8])
    state = types.SimpleNamespace(attn_backend="plain-backend", graph_runner="plain-decode-graphs")
    batch = WorkerBatch(forward_mode=Mode.DECODE, input_ids=torch.tensor([3, 4]), out_cache_loc=torch.tensor([51, 52]),
                        seq_lens=torch.tensor([13, 23]), seq_lens_cpu=torch.tensor([13, 23]), seq_lens_sum=36,
                        req_pool_indices=torch.tensor([0, 1]), spec_info=None, spec_algorithm=SpeculativeAlgorithm.NONE,
                        sampling_info=None, is_extend_in_batch=False, return_logprob=False, has_grammar=False, reqs=[])
    out = e.native_decode_forward(types.SimpleNamespace(model_runner=runner), state, batch)
    (fb,) = e.forward_batches
    assert (fb.attn_backend, fb.graph_runner) == ("plain-backend", "plain-decode-graphs")
    assert (runner.attn_backend, runner.graph_runner) == ("verify-backend", "verify-graphs")
    seen = fb.batch
    assert seen.forward_mode == "DECODE" and seen.spec_info is None and seen.capture_hidden_mode == Capture.FULL
    assert seen.seq_lens.tolist() == [13, 23] and seen.out_cache_loc.tolist() == [51, 52]
    assert out.next_token_ids.tolist() == [7, 8] and out.can_run_cuda_graph


def test_the_future_map_compiles_the_non_speculative_resolve_at_start(system, monkeypatch):
    """0.5.11 resolves a non-speculative batch's input ids with a JIT kernel that a speculative
    server never calls; compiled on first use, it would stall the first plain step (as the decode
    positions' kernel stalled the first crossing, issue #25). Adopting the map calls it once."""
    e = system
    seen = []
    monkeypatch.setattr(e.overlap, "_resolve_future_token_ids", lambda ids, buf: seen.append((ids.tolist(), buf.shape)))
    with stub_modules({"sglang.srt.managers.overlap_utils": public_attrs(e.overlap)}):
        sys.modules["sglang.srt.managers"].overlap_utils = sys.modules["sglang.srt.managers.overlap_utils"]
        native_map = e.native.NativeFutureMap.adopt(e.overlap.FutureMap(16, 0, 128, "cpu", SpeculativeAlgorithm.EAGLE3))
    assert seen == [([0], native_map.token_ids_buf.shape)]


def _token_dependent_hidden(e, monkeypatch):
    """The target stand-in with hidden states that name the step's input token (row = token * 10
    + column), so a test can tell the last plain step's hidden states from an earlier one's."""
    def forward(target_worker, state, batch):
        out = e.models.native_decode_forward(target_worker, state, batch)
        cols = torch.arange(3 * HIDDEN, dtype=torch.float32)
        out.logits_output.hidden_states = batch.input_ids.to(torch.float32).unsqueeze(1) * 10 + cols
        return out

    monkeypatch.setattr(e.native, "native_decode_forward", forward)


def test_skip_mode_plain_steps_do_no_draft_work_and_the_resume_takes_the_last_plain_steps_hidden(
        system, monkeypatch):
    """SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=skip: a plain step is the target's decode alone (no KV-only
    update, no fc); at the resume each request that decoded plain gets fc over the target hidden
    states of its own last plain step, and a request prefilled since keeps its draft extend's."""
    e = system
    _token_dependent_hidden(e, monkeypatch)
    e.worker._dyn_native = path = e.native.NativePlainPath(e.worker, skip_draft_kv=True)
    e.sched.dyn_native = path
    a, b, c = Req("a", 0, 10), Req("b", 1, 12), Req("c", 2, 14)
    batch = step(e, prefill(e, [a, b, c], [10, 12, 14], [1, 2, 3]))
    for _ in range(3):
        assert batch.spec_algorithm.is_none()
        assert [k[0] for k in e.calls] == ["target_decode"]
        assert_kv_consistent(e, [a, b, c])
        batch = step(e, batch)
    assert [k[0] for k in e.calls] == ["target_decode"]
    last_inputs = e.calls[0][1].input_ids.tolist()         # a, b, c's input tokens of the 4th plain step
    assert path.last_target_hidden.shape == (e.req_to_token.shape[0], 3 * HIDDEN)
    # b finishes; d joins from a speculative prefill and asks for logprobs: the next step speculates
    leave(e, batch, [b])
    d = Req("d", 3, 6)
    batch.merge_batch(prefill(e, [d], [6], [30]))
    batch.return_logprob = True
    batch = step(e, batch)
    assert not batch.spec_algorithm.is_none() and [k[0] for k in e.calls] == ["resync", "verify"]
    hidden = e.calls[0][4]
    # fc stand-in: the first HIDDEN columns + 100; a (row 0) and c (row 2) from their last plain step
    assert hidden[0].tolist() == [last_inputs[0] * 10 + 100.0, last_inputs[0] * 10 + 101.0]
    assert hidden[1].tolist() == [last_inputs[2] * 10 + 100.0, last_inputs[2] * 10 + 101.0]
    assert hidden[2].tolist() == [5.0] * HIDDEN                # d: its prefill's draft extend
    finish_previous(e)
    assert_kv_consistent(e, [a, c, d])


@pytest.mark.parametrize("draft_kv", ["write", "defer"])
def test_a_plain_step_stores_only_its_tokens_and_the_resume_fills_its_rows_speculative_fields(
        system, monkeypatch, draft_kv):
    """A plain step stores in the future map what a server without speculation stores (the
    baseline's one copy a step): the speculative buffers of its rows keep whatever was there
    (write mode adds fc of the target hidden states, which its resume needs). The resume then
    takes each row the last plain step stored from that step (its token, the batch's length,
    the rebuild mark) and a row a prefill stored since from the prefill."""
    e = system
    _token_dependent_hidden(e, monkeypatch)
    e.worker._dyn_native = path = e.native.NativePlainPath(
        e.worker, skip_draft_kv=draft_kv != "write", defer_draft_prefill=draft_kv == "defer")
    e.sched.dyn_native = path
    fmap = e.sched.future_map
    a, b, c = Req("a", 0, 10), Req("b", 1, 12), Req("c", 2, 14)
    batch = step(e, prefill(e, [a, b, c], [10, 12, 14], [1, 2, 3]))
    batch = step(e, batch)
    assert batch.spec_algorithm.is_none()
    # leftovers of an earlier use of the ring, in every speculative buffer
    # (the hidden states too: the ring is torch.empty, and a NaN left there never equals itself)
    for buf, junk in ((fmap.verified_id_buf, 77), (fmap.new_seq_lens_buf, 999), (fmap.topk_p_buf, 0.5),
                      (fmap.topk_index_buf, 8), (fmap.hidden_states_buf, -3.0)):
        buf.fill_(junk)
    hidden_before = fmap.hidden_states_buf.clone()
    batch = step(e, batch)
    plain = fmap.last_plain_interval
    last_tokens = fmap.token_ids_buf[plain].tolist()
    assert fmap.verified_id_buf[plain].tolist() == [77] * 3 and fmap.topk_p_buf[plain].flatten().tolist() == [0.5] * 3
    assert fmap.new_seq_lens_buf[plain].tolist() == [999] * 3
    assert torch.equal(fmap.hidden_states_buf[plain], hidden_before[plain]) == (draft_kv != "write")
    # b finishes, d joins from a speculative prefill and asks for logprobs: the next step resumes
    leave(e, batch, [b])
    d = Req("d", 3, 6)
    batch.merge_batch(prefill(e, [d], [6], [30]))
    batch.return_logprob = True
    resolved = []
    stock_resolve = fmap.resolve_future

    def resolve_and_keep(mwb):
        stock_resolve(mwb)
        s = mwb.spec_info
        resolved.append((s.verified_id.tolist(), s.new_seq_lens.tolist(), s.topk_p.flatten().tolist(),
                         s.topk_index.flatten().tolist(), mwb.seq_lens.tolist()))

    monkeypatch.setattr(fmap, "resolve_future", resolve_and_keep)
    batch = step(e, batch)
    assert not batch.spec_algorithm.is_none() and [k[0] for k in e.calls] == ["resync", "verify"]
    (verified, new_lens, topk_p, topk_index, lens), = resolved
    assert verified == [last_tokens[0], last_tokens[2], 30]
    assert new_lens == lens[:2] + [6] and lens[2] == 6
    assert topk_p == [-1.0, -1.0, pytest.approx(0.8)] and topk_index[2] == 4
    finish_previous(e)
    assert_kv_consistent(e, [a, c, d])


def test_skip_and_write_modes_run_the_same_target_steps(system, monkeypatch):
    """The two modes differ only in the draft's work: the same requests give the same target
    batches (tokens, lengths, slots) step by step, and the same tokens come out."""
    e = system
    seen = {}
    for skip in (False, True):
        e.pool.free = list(range(1, SLOTS))
        e.req_to_token.zero_()
        e.pending = None
        e.worker._dyn_native = e.sched.dyn_native = e.native.NativePlainPath(e.worker, skip_draft_kv=skip)
        reqs = [Req(i, i, 10 + i) for i in range(3)]
        batch = step(e, prefill(e, reqs, [10, 11, 12], [1, 2, 3]))
        steps = []
        for _ in range(4):
            batch = step(e, batch)
            mwb = e.calls[0][1]
            steps.append((mwb.input_ids.tolist(), mwb.seq_lens.tolist(), mwb.out_cache_loc.tolist()))
            assert [k[0] for k in e.calls] == (["target_decode"] if skip else ["target_decode", "kv_only"])
        seen[skip] = steps
    assert seen[True] == seen[False]


def test_skip_is_taken_on_the_native_path_and_said_otherwise(system, monkeypatch, caplog):
    good = types.SimpleNamespace(dyn_disable=system.worker.dyn_disable, _dyn_draft_kv_only=True)
    args = types.SimpleNamespace(page_size=1, disaggregation_mode="null", disable_overlap_schedule=False)
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV", "skip")
    monkeypatch.delenv("SGLANG_SPEC_DISABLE_PLAIN_PATH", raising=False)
    with caplog.at_level(logging.WARNING):
        assert system.native.make_native(good, args) is None
    assert "SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=skip needs SGLANG_SPEC_DISABLE_PLAIN_PATH=native" in caplog.text
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_PATH", "native")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        path = system.native.make_native(good, args)
    assert path.skip_draft_kv and "SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=skip" in caplog.text
    monkeypatch.delenv("SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV")
    assert not system.native.make_native(good, args).skip_draft_kv


@pytest.fixture(scope="module")
def auto_controller(tmp_path_factory):
    """0003's threshold=auto controller (stdlib only), from 0.5.11's files with 0001-0003 applied."""
    root = tree_with(tmp_path_factory.mktemp("auto"), [PATCHSET / "0.5.11" / name for name in (
        "0001-dyn-disable.patch", "0002-dyn-disable-metrics.patch", "0003-dyn-disable-auto.patch")])
    return load_by_path("dyn_disable_auto_native_test", root / "sglang/srt/speculative/dyn_disable_auto.py")


def test_threshold_auto_on_the_native_path_resumes_when_acceptance_rises(system, auto_controller):
    """threshold=auto pairs each launched step with its result in launch order. A native plain step's
    result goes through the non-speculative output processing, which reports it to the controller
    (count_plain_step). Without that, the first speculative probe's accept lengths were paired
    with a plain step's launch and dropped: after acceptance rose from 1.2 to 3 the controller kept
    its estimate of 1.2 and never drafted again (a simulated 4 ms plain / 8 ms speculative step)."""
    e = system
    now = [0.0]
    switch = auto_controller.AutoSwitch(types.SimpleNamespace(threshold=0, hysteresis=0),
                                        auto_controller.AutoConfig(), clock=lambda: now[0])
    path = e.native.NativePlainPath(types.SimpleNamespace(dyn_disable=switch))
    sched = types.SimpleNamespace(update_spec_metrics=lambda bs, accepted: None)
    reqs = [Req("a", 0, 10), Req("b", 1, 10)]
    plain_batch = e.Batch(reqs, [11, 11], SpeculativeAlgorithm.NONE)

    def run(steps, accept):
        kinds = []
        for _ in range(steps):
            speculate = switch.decide(len(reqs))
            kinds.append(speculate)
            now[0] += 0.008 if speculate else 0.004
            if speculate:   # 0003's hook in the speculative output processing
                switch.observe_accept(len(reqs), [accept] * len(reqs))
            else:           # the native plain step's output processing
                path.count_plain_step(sched, plain_batch)
        return kinds

    low = run(3000, 1.2)
    assert low[-1000:].count(False) > 950                      # speculation loses: plain
    high = run(20000, 3)
    assert high[-1000:].count(True) > 950                      # it pays again: drafting resumes
    state = switch.as_dict()
    assert state["buckets"]["2"]["accept_len"] == pytest.approx(3.0)
    # every result counted on its own side: plain steps one token per request
    plain = state["time_accounting"]["plain"]
    assert plain["tokens"] == plain["steps"] * len(reqs) == (low + high).count(False) * len(reqs)


@pytest.mark.parametrize("defer", [True, False])
def test_defer_tells_an_auto_controller_that_it_marks_deferred_requests(system, auto_controller, defer):
    """threshold=auto reads a deferred request's first speculative steps at what requests with their
    draft context accept only where the native path marks them (dyn_disable_auto.note_accept)."""
    switch = auto_controller.AutoSwitch(types.SimpleNamespace(threshold=0, hysteresis=0),
                                        auto_controller.AutoConfig())
    system.native.NativePlainPath(types.SimpleNamespace(dyn_disable=switch), skip_draft_kv=True,
                                  defer_draft_prefill=defer)
    assert switch.marks_deferred is defer
    # a fixed threshold's switch has no such attribute and gets none
    fixed = types.SimpleNamespace(decide=lambda bs, force_spec=False: True)
    system.native.NativePlainPath(types.SimpleNamespace(dyn_disable=fixed), skip_draft_kv=True, defer_draft_prefill=True)
    assert not hasattr(fixed, "marks_deferred")


def arriving_prefill(e, reqs, prompt_lens):
    """A new prefill batch as get_new_batch_prefill hands it to run_batch: the prompts' KV slots
    allocated, input ids 10 * (request's index) + position, no spec_info yet."""
    for req, n in zip(reqs, prompt_lens):
        e.req_to_token[req.req_pool_idx, :n] = e.pool.alloc(n).to(torch.int32)
    batch = e.Batch(reqs, prompt_lens, SpeculativeAlgorithm.EAGLE3, forward_mode=Mode.EXTEND)
    batch.extend_lens = list(prompt_lens)
    batch.input_ids = torch.cat([torch.arange(n) + 10 * i for i, n in enumerate(prompt_lens)])
    batch.out_cache_loc = torch.cat([e.req_to_token[r.req_pool_idx, :n].to(torch.int64)
                                     for r, n in zip(reqs, prompt_lens)])
    return batch


def run_prefill(e, batch, running):
    """get_next_batch_to_run's hook (the real before_prefill) and the real run_batch of a prefill;
    the batch then waits, as a decode batch, to be merged."""
    deferred = e.sched.dyn_native.before_prefill(batch, running)
    e.calls.clear()
    e.sched.run_batch(batch)
    batch.forward_mode = Mode.DECODE
    return deferred


def defer_mode(e, monkeypatch):
    _token_dependent_hidden(e, monkeypatch)
    e.worker._dyn_native = path = e.native.NativePlainPath(e.worker, skip_draft_kv=True, defer_draft_prefill=True)
    e.sched.dyn_native = path
    return path


def test_defer_mode_prefills_an_arrival_beside_plain_steps_without_the_draft(system, monkeypatch):
    """SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=defer: a request that arrives while the running batch is plain
    gets the target's prefill alone (no draft extend over its prompt); it decodes plain with the
    others, and at the resume its draft state is rebuilt from the target hidden states of its own
    last position, as for the requests that decoded plain."""
    e = system
    path = defer_mode(e, monkeypatch)
    a, b, c = Req("a", 0, 10), Req("b", 1, 12), Req("c", 2, 14)
    batch = step(e, prefill(e, [a, b, c], [10, 12, 14], [1, 2, 3]))
    assert batch.spec_algorithm.is_none()

    d = Req("d", 3, 5)
    arrival = arriving_prefill(e, [d], [5])
    assert run_prefill(e, arrival, batch) and d.dyn_draft_deferred and d.dyn_prompt_draft_deferred is True
    (kind, capture, inputs), = e.calls                    # no draft_prefill
    assert kind == "target_prefill" and capture == Capture.LAST and inputs == [0, 1, 2, 3, 4]
    assert path.last_target_hidden[3].tolist() == [40.0 + col for col in range(3 * HIDDEN)]  # its last position
    future = arrival.spec_info.future_indices.indices
    fmap = e.sched.future_map
    assert fmap.topk_p_buf[future].tolist() == [[-1.0]]   # the mark: rebuild at the resume
    assert fmap.token_ids_buf[future].tolist() == fmap.verified_id_buf[future].tolist() == [5]
    assert arrival.seq_lens.tolist() == [5] and arrival.output_ids.tolist() == (-future).tolist()

    batch.merge_batch(arrival)
    batch = step(e, batch)
    assert batch.spec_algorithm.is_none() and [k[0] for k in e.calls] == ["target_decode"]
    assert e.calls[0][1].input_ids.tolist()[3] == 5      # d's first plain input: its prefill's token
    assert_kv_consistent(e, [a, b, c, d])

    # a, b and c finish: d alone resumes; its draft hidden state is fc of its last plain step's
    leave(e, batch, (a, b, c))
    batch = step(e, batch)
    assert [k[0] for k in e.calls] == ["resync", "verify"]
    assert e.calls[0][4].tolist() == [[50 + 100.0, 50 + 101.0]]   # input token 5 of that step, * 10, + fc's 100
    assert not d.dyn_draft_deferred
    # threshold=auto's mark stays after the resume: note_accept counts its first speculative steps
    assert d.dyn_prompt_draft_deferred is True and not getattr(a, "dyn_prompt_draft_deferred", False)
    finish_previous(e)
    assert_kv_consistent(e, [d])


def test_a_deferred_arrival_that_finds_the_running_batch_gone_is_rebuilt_before_it_drafts(system, monkeypatch):
    """The plain running batch empties between the deferred prefill and its merge, so the arrival
    becomes the running batch on its own, a speculative batch: its first step must still rebuild
    the draft state (a stale one would draft from the -1 mark), and later steps are stock."""
    e = system
    path = defer_mode(e, monkeypatch)
    reqs = [Req(i, i, 10) for i in range(3)]
    batch = step(e, prefill(e, reqs, [10, 10, 10], [1, 2, 3]))
    d = Req("d", 3, 4)
    arrival = arriving_prefill(e, [d], [4])
    assert run_prefill(e, arrival, batch)
    for r in reqs:
        r.done = True
        release(e, r)
    finish_previous(e)
    batch = step(e, arrival)                               # what get_next_batch_to_run does when empty
    assert not batch.spec_algorithm.is_none()
    assert [k[0] for k in e.calls] == ["resync", "verify"]
    assert e.calls[0][4].tolist() == [[30 + 100.0, 31 + 100.0]]   # the prefill's last position (row 3)
    assert e.calls[1][4].tolist() == [4]                  # verified id: the prefill's token (last input 3, + 1)
    batch = step(e, batch)
    assert [k[0] for k in e.calls] == ["verify"]
    assert path.defer_draft_prefill


@pytest.mark.parametrize("case", ["logprobs arriving", "logprobs running", "under the threshold", "multimodal",
                                  "skip mode"])
def test_a_prefill_that_will_not_decode_plain_first_drafts_as_stock(system, monkeypatch, case):
    """With requests that keep speculating at any load (arriving or running: the switch's count does
    not say the next step), with too few requests to go plain, for a multimodal request or in skip
    mode the prefill drafts as stock (target prefill, then the draft's extend) and leaves no mark."""
    e = system
    path = defer_mode(e, monkeypatch)
    reqs = [Req(i, i, 10) for i in range(3)]
    running = step(e, prefill(e, reqs, [10, 10, 10], [1, 2, 3]))
    assert running.spec_algorithm.is_none()
    arrivals = [Req("d", 3, 4), Req("e", 4, 4)]
    if case == "logprobs running":
        running.return_logprob = True
    if case == "under the threshold":
        running, arrivals = e.Batch([], [], SpeculativeAlgorithm.NONE), arrivals[:1]   # 1 <= threshold 2
    if case == "multimodal":
        arrivals[0].multimodal_inputs = object()
    if case == "skip mode":
        e.sched.dyn_native = e.worker._dyn_native = e.native.NativePlainPath(e.worker, skip_draft_kv=True)
    arrival = arriving_prefill(e, arrivals, [4] * len(arrivals))
    arrival.return_logprob = case == "logprobs arriving"
    assert not run_prefill(e, arrival, running)
    assert not any(getattr(r, "dyn_draft_deferred", False) for r in arrivals)
    assert [k[0] for k in e.calls] == ["target_prefill", "draft_prefill"]
    future = arrival.spec_info.future_indices.indices
    assert e.sched.future_map.topk_p_buf[future].view(-1).tolist() == pytest.approx([0.8] * len(arrivals))
    assert path.defer_draft_prefill


def test_a_wave_over_the_threshold_on_an_idle_server_is_deferred_whole(system, monkeypatch, caplog):
    """Nothing running, and a wave of arrivals above the threshold in two prefill batches: its first
    decode step will be plain, so neither batch runs the draft's extend (the second finds the first,
    not decoded yet, as the running batch); the wave decodes plain, and when it thins out the
    request left resumes with its draft state rebuilt from its own last plain step."""
    e = system
    caplog.set_level(logging.INFO)
    defer_mode(e, monkeypatch)
    idle = e.Batch([], [], SpeculativeAlgorithm.NONE)
    first = [Req("a", 0, 4), Req("b", 1, 4), Req("c", 2, 4)]
    wave = arriving_prefill(e, first, [4, 4, 4])
    assert run_prefill(e, wave, idle)                      # 3 > threshold 2
    second = [Req("d", 3, 5)]
    more = arriving_prefill(e, second, [5])
    assert run_prefill(e, more, wave)                      # beside the first, which has not decoded
    assert [k[0] for k in e.calls] == ["target_prefill"]
    wave.merge_batch(more)
    batch = step(e, wave)
    assert batch.spec_algorithm.is_none() and [k[0] for k in e.calls] == ["target_decode"]
    assert e.calls[0][1].input_ids.tolist() == [4, 14, 24, 5]  # each prompt's last token + 1
    batch = step(e, batch)
    last_inputs = e.calls[0][1].input_ids.tolist()
    leave(e, batch, first)
    batch = step(e, batch)
    assert [k[0] for k in e.calls] == ["resync", "verify"]
    assert e.calls[0][4].tolist() == [[last_inputs[3] * 10 + 100.0, last_inputs[3] * 10 + 101.0]]
    assert ("resume rebuilds the draft state of 1 of 1 requests that were prefilled without the draft "
            "(SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=defer; since start 2 prefills, 4 requests deferred)") in caplog.text
    assert not second[0].dyn_draft_deferred
    finish_previous(e)
    assert_kv_consistent(e, second)


def _first_arrival_alone_then_a_wave(e):
    """A wave on an idle server whose first request comes alone: under the resume point, so it is
    prefilled with the draft (stock), and it is the running batch, not decoded yet, when the rest of
    the wave arrives and takes the count over the threshold."""
    idle = e.Batch([], [], SpeculativeAlgorithm.NONE)
    a = Req("a", 0, 6)
    first = arriving_prefill(e, [a], [6])
    assert not run_prefill(e, first, idle)                 # 1 <= threshold 2
    assert [k[0] for k in e.calls] == ["target_prefill", "draft_prefill"]
    rest = [Req("d", 1, 4), Req("e", 2, 4)]
    more = arriving_prefill(e, rest, [4, 4])
    deferred = run_prefill(e, more, first)
    return first, more, a, rest, deferred


def test_the_rest_of_a_wave_whose_first_request_came_alone_is_deferred(system, monkeypatch, caplog):
    """The wave's first request ran the draft's prefill, but no speculative step yet: its host lengths
    are the prefill's, and with the rest of the wave its first step goes plain, so the rest is
    prefilled by the target alone; the wave decodes plain, and when it thins out the deferred request
    left resumes with its draft state rebuilt from its own last plain step."""
    e = system
    caplog.set_level(logging.INFO)
    defer_mode(e, monkeypatch)
    first, more, a, rest, deferred = _first_arrival_alone_then_a_wave(e)
    assert deferred and all(r.dyn_draft_deferred for r in rest) and not a.dyn_draft_deferred
    assert [k[0] for k in e.calls] == ["target_prefill"]
    first.merge_batch(more)
    # its first step goes plain on the lengths the host has: reading the device's would wait for
    # the prefill still running (the deferred one, launched just before)
    device_lens, host_lens, read = first.seq_lens, first.seq_lens_cpu.tolist(), []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: (read.append(t is device_lens), real_cpu(t, *a, **k))[1])
    batch = step(e, first)
    monkeypatch.setattr(torch.Tensor, "cpu", real_cpu)
    assert not any(read) and batch.seq_lens_cpu.tolist() == [n + 1 for n in host_lens]
    assert batch.spec_algorithm.is_none() and [k[0] for k in e.calls] == ["target_decode"]
    batch = step(e, batch)
    last_inputs = e.calls[0][1].input_ids.tolist()
    leave(e, batch, (a, rest[1]))
    batch = step(e, batch)
    assert [k[0] for k in e.calls] == ["resync", "verify"]
    assert e.calls[0][4].tolist() == [[last_inputs[1] * 10 + 100.0, last_inputs[1] * 10 + 101.0]]
    assert ("resume rebuilds the draft state of 1 of 1 requests that were prefilled without the draft "
            "(SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=defer; since start 1 prefills, 2 requests deferred)") in caplog.text
    finish_previous(e)
    assert_kv_consistent(e, [rest[0]])


def test_a_wave_that_thins_out_before_its_first_step_rebuilds_the_deferred_before_drafting(system, monkeypatch):
    """As above, but a deferred request is gone before the wave's first decode step, so that step
    speculates after all: the batch the rest merged into carries the mark, and its first step
    rebuilds the draft state (the first request from its draft extend's hidden state, the deferred
    one from its prefill's last position) instead of drafting from the -1 mark."""
    e = system
    defer_mode(e, monkeypatch)
    first, more, a, rest, deferred = _first_arrival_alone_then_a_wave(e)
    assert deferred
    first.merge_batch(more)
    leave(e, first, [rest[1]])
    finish_previous(e)
    batch = step(e, first)                                 # 2 <= threshold 2: speculate
    assert not batch.spec_algorithm.is_none()
    assert [k[0] for k in e.calls] == ["resync", "verify"]
    assert e.calls[0][4].tolist() == [[5.0, 5.0], [30 + 100.0, 31 + 100.0]]
    batch = step(e, batch)
    assert [k[0] for k in e.calls] == ["verify"]


def _arrivals_beside_a_batch_that_speculated(e):
    """Three requests decode plain, two finish, the one left resumes and speculates; then two
    arrivals take the count over the threshold again."""
    reqs = [Req(i, i, 10) for i in range(3)]
    running = step(e, prefill(e, reqs, [10, 10, 10], [1, 2, 3]))
    leave(e, running, reqs[1:])
    running = step(e, running)                            # 1 running: drafting resumed
    assert not running.spec_algorithm.is_none() and [k[0] for k in e.calls] == ["resync", "verify"]
    verified = int(e.calls[1][4][0])                       # the stand-in verify accepts v + 1, v + 2
    arrivals = [Req("d", 3, 4), Req("e", 4, 4)]
    arrival = arriving_prefill(e, arrivals, [4, 4])
    deferred = run_prefill(e, arrival, running)
    return running, arrival, reqs[0], arrivals, deferred, (verified + 2) % 50


def test_arrivals_beside_a_batch_that_speculated_are_deferred_and_its_next_step_goes_plain(system, monkeypatch):
    """The arrivals take a batch that has speculated over the threshold: they are prefilled by the
    target alone, and the merged batch's next step goes plain (the step that reads the last
    verify's lengths to the host): the speculated request's input is its verified token, the
    arrivals' their prefill's; no KV slot leaked or shared."""
    e = system
    defer_mode(e, monkeypatch)
    running, arrival, old, arrivals, deferred, last_token = _arrivals_beside_a_batch_that_speculated(e)
    assert deferred and [k[0] for k in e.calls] == ["target_prefill"]
    running.merge_batch(arrival)
    batch = step(e, running)
    assert batch.spec_algorithm.is_none() and [k[0] for k in e.calls] == ["target_decode"]
    inputs = e.calls[0][1].input_ids.tolist()
    assert inputs[1:] == [4, 14]                          # each arrival's last prompt token + 1
    assert inputs[0] == last_token                        # the speculated request's last accepted token
    finish_previous(e)
    assert_kv_consistent(e, [old] + arrivals)


def test_a_speculated_batch_whose_arrivals_thin_out_takes_one_plain_step_before_it_resumes(system, monkeypatch):
    """As above, but an arrival is gone before the next step, so the switch wants to speculate:
    the batch has speculated (its lengths are the verify's, on the device) and holds a deferred
    request, so that step goes plain and the one after resumes with the draft state rebuilt."""
    e = system
    defer_mode(e, monkeypatch)
    running, arrival, old, arrivals, deferred, last_token = _arrivals_beside_a_batch_that_speculated(e)
    assert deferred
    running.merge_batch(arrival)
    leave(e, running, [arrivals[1]])
    batch = step(e, running)                               # 2 <= threshold 2, but one plain step first
    assert batch.spec_algorithm.is_none() and [k[0] for k in e.calls] == ["target_decode"]
    batch = step(e, batch)
    assert not batch.spec_algorithm.is_none() and [k[0] for k in e.calls] == ["resync", "verify"]
    batch = step(e, batch)
    assert [k[0] for k in e.calls] == ["verify"]
    finish_previous(e)
    assert_kv_consistent(e, [old, arrivals[0]])


def test_defer_is_taken_on_the_native_path_and_logged(system, monkeypatch, caplog):
    good = types.SimpleNamespace(dyn_disable=system.worker.dyn_disable, _dyn_draft_kv_only=True)
    args = types.SimpleNamespace(page_size=1, disaggregation_mode="null", disable_overlap_schedule=False)
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV", "defer")
    monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_PATH", "native")
    with caplog.at_level(logging.INFO):
        path = system.native.make_native(good, args)
    assert path.skip_draft_kv and path.defer_draft_prefill
    assert "SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=defer" in caplog.text
    monkeypatch.delenv("SGLANG_SPEC_DISABLE_PLAIN_PATH")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert system.native.make_native(good, args) is None
    assert "SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=defer needs SGLANG_SPEC_DISABLE_PLAIN_PATH=native" in caplog.text


def test_the_native_profile_waits_for_what_the_native_path_logs_and_fails_fast_when_it_is_turned_down(
        system, monkeypatch, caplog, tmp_path):
    """`invoke server start eagle3-v2-dyn-native` at TP=8: its environment is one the patched code
    takes (native, defer), every rank's start-up lines satisfy the readiness rule, and a server that
    turns the native path down (here: the overlap scheduler off) logs a line that the host side's
    `[logs] refuse` matching finds, so the start fails at once with the reason instead of waiting
    for a line that never comes. The log lines are the patched modules' own."""
    from toolkit.core.inventory import Host
    from toolkit.hostside import server_ctl
    from toolkit.server import server

    host = Host(name="gpu", address="gpu.example", venv="/opt/venv", gpus=8,
                server={"model": "/m/target", "draft_model": "/m/draft", "tp_size": 8})
    plan = server.plan(host, "eagle3-v2-dyn-native", {"dyn_threshold": 12})
    assert plan.requires_patched_files == [NATIVE]
    assert system.native.plain_path_from_env(plan.env) == "native"
    assert system.native.plain_draft_kv_from_env(plan.env) == "defer"
    for key, value in plan.env.items():
        monkeypatch.setenv(key, value)
    switch = system.policy.SpecSwitch(system.policy.config_from_env(plan.env))
    worker = types.SimpleNamespace(dyn_disable=system.worker.dyn_disable, _dyn_draft_kv_only=True)
    serving = types.SimpleNamespace(page_size=1, disaggregation_mode="null", disable_overlap_schedule=False)

    def logged(server_args):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            path = system.native.make_native(worker, server_args)
        return path, [switch.startup_message(), *(r.getMessage() for r in caplog.records)]

    def log_of(lines):
        rows = [f"[2026-12-04 10:00:0{rank} TP{rank}] {text}" for rank in range(8)
                for text in ["Load weight end", *lines]]
        rows += [f"[2026-12-04 10:00:09] {text}" for text in plan.log_lines]   # SGLang's own, once
        path = tmp_path / "server.log"
        path.write_text("\n".join(rows) + "\n")
        return path

    prefixes = server.log_prefixes()
    record = {"log_lines": plan.log_lines, "rank_log_lines": plan.rank_log_lines, "tp_size": 8,
              "patch_stack": ["dyn-disable"], **prefixes}
    path, lines = logged(serving)
    assert isinstance(path, system.native.NativePlainPath) and path.defer_draft_prefill
    assert server_ctl._missing_lines(log_of(lines), record) == []

    turned_down, lines = logged(types.SimpleNamespace(**{**vars(serving), "disable_overlap_schedule": True}))
    assert turned_down is None
    log = log_of(lines)
    missing = server_ctl._missing_lines(log, record)
    assert missing == [f"TP{rank}: Dynamic speculation disable: native plain path "
                       f"(SGLANG_SPEC_DISABLE_PLAIN_PATH=native)" for rank in range(8)]
    refused = server_ctl._print_lines(log, record, kind="refuse_prefixes")
    assert [rank for rank, _ in refused] == list(range(8))
    assert all("native not supported with the overlap scheduler off" in text for _, text in refused)
    # the step-path profile is not held to it: the same log is ready for eagle3-v2-dyn
    step = server.plan(host, "eagle3-v2-dyn", {"dyn_threshold": 12})
    assert server_ctl._missing_lines(log, {**record, "rank_log_lines": step.rank_log_lines}) == []


@pytest.mark.parametrize("setting", [None, "write", "skip", "defer"])
def test_server_info_says_which_plain_path_the_server_took(system, tree, monkeypatch, setting):
    """/server_info's dyn_spec_disable (the patched statements of scheduler.py, run as they are):
    `plain_path` is "native" only where the native path was taken, with the draft's upkeep setting
    beside it; a step-path server says "step". invoke bench records and watch read these fields."""
    from tests.dyn.test_counters import patched_statements

    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.dyn_disable_native", system.native)
    if setting is not None:
        monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_PATH", "native")
        monkeypatch.setenv("SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV", setting)
    worker = types.SimpleNamespace(dyn_disable=system.worker.dyn_disable, _dyn_draft_kv_only=True)
    serving = types.SimpleNamespace(page_size=1, disaggregation_mode="null", disable_overlap_schedule=False)
    native = system.native.make_native(worker, serving)
    assert (native is None) == (setting is None)
    namespace = {"self": types.SimpleNamespace(draft_worker=worker, dyn_native=native), "ret": {}}
    exec(patched_statements(tree / SCHEDULER), namespace)
    got = namespace["ret"]["dyn_spec_disable"]
    assert got["threshold"] == system.worker.dyn_disable.config.threshold    # 0001's counters stay
    want = {"plain_path": "step"} if setting is None else {"plain_path": "native", "plain_draft_kv": setting}
    assert {k: got[k] for k in ("plain_path", "plain_draft_kv") if k in got} == want

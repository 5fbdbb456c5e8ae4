"""The v2 scheduler no longer waits for a plain step before preparing the next one.

After a plain (one-token) step the host knows every request's new length, so the patch has the
scheduler advance its host copy of seq_lens by one, and then
- the spec-v2 `prepare_for_decode` skips the wait on the step's verify event and the copy back;
- `ScheduleBatch.filter_batch` (every step) and `merge_batch` (a prefill joins) skip the same
  wait and rebuild the device seq_lens from the host copy instead of reading the forward
  stream's tensor, so the schedule stream never depends on the step still running (a later
  pageable copy on it would block the host just the same).

The real functions of the patched wheel files run here with CPU torch and stand-ins for the
allocator, the triton kernel and the forward stream's tensor; the scheduler and worker hunks are
checked in the source (their functions need a GPU server to run)."""
from __future__ import annotations

import ast
import sys
import types

import pytest

from tests.dyn.conftest import method_source

torch = pytest.importorskip("torch")

INFO_V2 = "sglang/srt/speculative/eagle_info_v2.py"
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"
WORKER_V2 = "sglang/srt/speculative/eagle_worker_v2.py"


class _GpuSeqLens:
    """Stands for the device tensor: `.cpu()` is the copy (and sync) the patch avoids."""

    def __init__(self, values):
        self.values = torch.tensor(values, dtype=torch.int64)
        self.copies_to_host = 0

    def cpu(self):
        self.copies_to_host += 1
        return self.values.clone()


class _Batch:
    def __init__(self, host_lens, device_lens):
        self.reqs = [types.SimpleNamespace(kv_committed_len=n, kv_allocated_len=n + 2, decode_batch_idx=0)
                     for n in host_lens]
        self.seq_lens_cpu = torch.tensor(host_lens, dtype=torch.int64)
        self.seq_lens = _GpuSeqLens(device_lens)
        self.seq_lens_sum = None
        self.waits = 0
        self.device = "cpu"
        self.tree_cache = None
        self.req_pool_indices = torch.arange(len(host_lens))
        self.req_to_token_pool = types.SimpleNamespace(req_to_token=torch.zeros((8, 64), dtype=torch.int32))
        self.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=1)
        self.sampling_info = types.SimpleNamespace(
            penalizer_orchestrator=types.SimpleNamespace(is_required=False))

    def batch_size(self):
        return len(self.reqs)

    def maybe_evict_swa(self):
        pass

    def maybe_wait_verify_done(self):
        self.waits += 1


@pytest.fixture()
def prepare_for_decode(patched_tree, monkeypatch):
    assigned = []
    spec_utils = types.ModuleType("sglang.srt.speculative.spec_utils")
    spec_utils.assign_req_to_token_pool_func = lambda *args: assigned.append(args)
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.spec_utils", spec_utils)
    namespace = {"torch": torch, "get_alloc_len_per_decode": lambda: 1,
                 "alloc_token_slots": lambda tree_cache, n: torch.arange(n)}
    source = method_source(patched_tree / INFO_V2, "EagleDraftInputV2Mixin", "prepare_for_decode")
    exec(compile("from __future__ import annotations\n" + source, INFO_V2, "exec"), namespace)
    return namespace["prepare_for_decode"], assigned


def test_after_a_plain_step_the_host_lengths_are_used_without_waiting(prepare_for_decode):
    prepare, assigned = prepare_for_decode
    # host copy already advanced by the scheduler; the device values are not needed
    batch = _Batch(host_lens=[11, 21, 31], device_lens=[11, 21, 31])
    prepare(types.SimpleNamespace(dyn_plain_step=True), batch)
    assert batch.waits == 0 and batch.seq_lens.copies_to_host == 0
    assert batch.seq_lens_cpu.tolist() == [11, 21, 31] and batch.seq_lens_sum == 63
    assert len(assigned) == 1  # KV slots for the next step are still assigned


def test_after_a_speculative_step_it_waits_and_reads_the_device_lengths(prepare_for_decode):
    prepare, _ = prepare_for_decode
    # accepted lengths vary: only the device knows them
    batch = _Batch(host_lens=[10, 20, 30], device_lens=[13, 21, 33])
    prepare(types.SimpleNamespace(), batch)
    assert batch.waits == 1 and batch.seq_lens.copies_to_host == 1
    assert batch.seq_lens_cpu.tolist() == [13, 21, 33] and batch.seq_lens_sum == 67


def _scheduler_host_advance(patched_tree):
    """The `if` the patch adds to the scheduler after it takes a v2 step's result, as code."""
    tree = ast.parse((patched_tree / SCHEDULER).read_text())
    found = [node for node in ast.walk(tree) if isinstance(node, ast.If)
             and "dyn_plain_step" in ast.unparse(node.test)]
    assert len(found) == 1
    return compile(ast.Module(body=[found[0]], type_ignores=[]), SCHEDULER, "exec")


@pytest.mark.parametrize("plain, expected", [(True, [12, 22, 32]), (False, [11, 21, 31])])
def test_scheduler_advances_the_host_lengths_only_after_a_plain_step(patched_tree, plain, expected):
    batch = types.SimpleNamespace(spec_info=_SpecInfo(plain), seq_lens_cpu=torch.tensor([11, 21, 31]))
    exec(_scheduler_host_advance(patched_tree), {"batch": batch})
    assert batch.seq_lens_cpu.tolist() == expected


class _ForwardStreamLens:
    """Stands for seq_lens still being written by the forward stream: reading it on the
    schedule stream (indexing, `.sum().item()`) is what the patch avoids after a plain step."""

    dtype = torch.int64

    def __init__(self, values):
        self.values = torch.tensor(values, dtype=torch.int64)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return self.values[index]

    def sum(self):
        self.reads += 1
        return self.values.sum()


class _SpecInfo:
    def __init__(self, plain: bool):
        if plain:
            self.dyn_plain_step = True
        self.filtered_with = None
        self.merged_with = None

    def filter_batch(self, new_indices, has_been_filtered):
        self.filtered_with = new_indices.tolist()

    def merge_batch(self, other):
        self.merged_with = other


def _req(finished=False):
    return types.SimpleNamespace(finished=lambda: finished, return_logprob=False, stream=False, grammar=None)


@pytest.fixture()
def schedule_batch_class(patched_tree):
    """A stand-in ScheduleBatch whose filter/merge methods are the patched file's own."""
    namespace = {"torch": torch, "Optional": object, "Union": object, "List": object,
                 "Req": type("Req", (), {}), "is_pin_memory_available": lambda device: False}
    names = ("host_seq_lens_exact", "host_lens_on_device", "filter_batch", "merge_batch")
    for name in names:
        source = method_source(patched_tree / SCHEDULE_BATCH, "ScheduleBatch", name)
        exec(compile("from __future__ import annotations\n" + source, SCHEDULE_BATCH, "exec"), namespace)

    class Batch:
        is_spec_v2 = True
        device = "cpu"

        def __init__(self, reqs, host_lens, device_lens, plain):
            self.reqs = reqs
            self.seq_lens_cpu = torch.tensor(host_lens, dtype=torch.int64)
            self.seq_lens = device_lens
            self.req_pool_indices = torch.arange(len(reqs))
            self.orig_seq_lens = torch.tensor(host_lens, dtype=torch.int32)
            self.seq_lens_sum = None
            self.spec_info = _SpecInfo(plain)
            self.waits = 0
            self.model_config = types.SimpleNamespace(is_encoder_decoder=False)
            self.multimodal_inputs = self.output_ids = None
            self.return_logprob = self.return_hidden_states = False
            self.is_prefill_only = self.has_stream = self.has_grammar = False
            self.top_logprobs_nums = self.token_ids_logprobs = None
            self.sampling_info = types.SimpleNamespace(filter_batch=lambda *a: None, merge_batch=lambda *a: None)

        def maybe_wait_verify_done(self):
            self.waits += 1

    for name in names:
        setattr(Batch, name, namespace[name])
    return Batch


def test_filter_after_a_plain_step_uses_the_host_lengths_without_waiting(schedule_batch_class):
    forward_lens = _ForwardStreamLens([99, 99, 99])  # not yet written: must not be read
    batch = schedule_batch_class([_req(), _req(finished=True), _req()], [11, 21, 31], forward_lens, plain=True)
    batch.filter_batch(v1_spec_info_filtered=True)
    assert batch.waits == 0 and forward_lens.reads == 0
    assert batch.seq_lens.tolist() == [11, 31] and batch.seq_lens_cpu.tolist() == [11, 31]
    assert batch.seq_lens_sum == 42 and batch.spec_info.filtered_with == [0, 2]


def test_filter_after_a_plain_step_with_nothing_finished_touches_nothing(schedule_batch_class):
    forward_lens = _ForwardStreamLens([12, 22])
    batch = schedule_batch_class([_req(), _req()], [12, 22], forward_lens, plain=True)
    batch.filter_batch(v1_spec_info_filtered=True)
    assert batch.waits == 0 and forward_lens.reads == 0 and batch.seq_lens is forward_lens


def test_filter_after_a_speculative_step_waits_and_reads_the_device_lengths(schedule_batch_class):
    forward_lens = _ForwardStreamLens([13, 24, 33])  # accepted lengths only the device knows
    batch = schedule_batch_class([_req(), _req(finished=True), _req()], [10, 20, 30], forward_lens, plain=False)
    batch.filter_batch(v1_spec_info_filtered=True)
    assert batch.waits == 1 and forward_lens.reads == 1
    assert batch.seq_lens.tolist() == [13, 33] and batch.seq_lens_sum == 46


def test_merge_after_a_plain_step_takes_the_host_lengths(schedule_batch_class):
    forward_lens = _ForwardStreamLens([99, 99])
    running = schedule_batch_class([_req(), _req()], [11, 21], forward_lens, plain=True)
    running.seq_lens_sum = 32
    prefill = schedule_batch_class([_req()], [7], torch.tensor([7]), plain=False)
    prefill.seq_lens_sum = 7
    running.merge_batch(prefill)
    assert running.waits == 0 and forward_lens.reads == 0
    assert running.seq_lens.tolist() == [11, 21, 7] and running.seq_lens_cpu.tolist() == [11, 21, 7]
    assert running.spec_info.merged_with is prefill.spec_info


def test_merge_after_a_speculative_step_still_waits(schedule_batch_class):
    running = schedule_batch_class([_req()], [10], torch.tensor([13]), plain=False)
    running.seq_lens_sum = 13
    prefill = schedule_batch_class([_req()], [7], torch.tensor([7]), plain=False)
    prefill.seq_lens_sum = 7
    running.merge_batch(prefill)
    assert running.waits == 1 and running.seq_lens.tolist() == [13, 7]

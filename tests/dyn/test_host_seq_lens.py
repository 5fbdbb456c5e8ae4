"""The v2 scheduler no longer waits for a plain step before preparing the next one.

After a plain (one-token) step the host knows every request's new length, so the patch has the
scheduler advance its host copy of seq_lens by one and lets the spec-v2 `prepare_for_decode`
skip the wait on the step's verify event and the copy back from the GPU. On the H200 this
took the v2 plain step from 0.67x to 0.80x of baseline at concurrency 8 (docs/dyn-disable.md).

The real `prepare_for_decode` of the patched wheel file runs here with CPU torch and stand-ins
for the allocator and the triton kernel; the scheduler and worker hunks are checked in the
source (their functions need a GPU server to run)."""
from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

INFO_V2 = "sglang/srt/speculative/eagle_info_v2.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"
WORKER_V2 = "sglang/srt/speculative/eagle_worker_v2.py"


def _function_source(path: Path, class_name: str, func_name: str) -> str:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == func_name:
                    return ast.unparse(item)
    raise AssertionError(f"{class_name}.{func_name} not found in {path}")


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
    source = _function_source(patched_tree / INFO_V2, "EagleDraftInputV2Mixin", "prepare_for_decode")
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


def test_scheduler_advances_the_host_lengths_only_after_a_plain_step(patched_tree):
    text = (patched_tree / SCHEDULER).read_text()
    anchor = "batch.seq_lens = batch_result.next_draft_input.new_seq_lens\n"
    assert text.count(anchor) == 1
    following = text.split(anchor, 1)[1].splitlines()[:6]
    assert following[0].strip() == 'if getattr(batch.spec_info, "dyn_plain_step", False):'
    assert "batch.seq_lens_cpu = batch.seq_lens_cpu + 1" in [line.strip() for line in following]
    assert text.count("batch.seq_lens_cpu + 1") == 1


def test_only_the_plain_step_marks_its_result(patched_tree):
    tree = ast.parse((patched_tree / WORKER_V2).read_text())
    marking = [func.name for func in ast.walk(tree) if isinstance(func, ast.FunctionDef)
               for node in ast.walk(func)
               if isinstance(node, ast.Attribute) and node.attr == "dyn_plain_step"
               and isinstance(node.ctx, ast.Store)]
    assert marking == ["_forward_plain_decode"]

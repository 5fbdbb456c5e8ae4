"""The start-up warm-up compiles the scheduler's req_to_token kernel as a resume launches it.

Every spec-v2 speculative decode step's prepare_for_decode (0.5.11: EagleDraftInputV2Mixin's;
0.5.17 and 0.5.23: eagle_prepare_for_decode, through alloc_for_spec_decode) writes the step's KV
slots into req_to_token with the triton kernel assign_req_to_token_pool. Triton compiles one
variant per constexpr (the row length, the batch size's next power of two) and per dtype and
16-byte alignment of each pointer. Plain steps never launch it, so the first resume after them
compiled the variants it met while every running request waited (88 and 113 ms at one resume on
an H100, two variants: docs/evidence/plain-at-baseline section 12).

Here the scheduler's own functions (executed from each release's files, patched where the stack touches them, with CPU torch, a free
list that hands out slices as SGLang's allocator does, and a recording stand-in for the kernel)
run every batch size a speculative step may have; the warm-up function of each release's patch
stack (executed) must launch every variant they launched, and write nothing."""
from __future__ import annotations

import functools
import sys
import types

import pytest

from tests.dyn.conftest import PATCHSET, function_source, method_source, tree_with
from toolkit.patch import wheels

torch = pytest.importorskip("torch")

RUNTIME = "sglang/srt/speculative/dyn_disable_runtime.py"
# where each release's scheduler prepares a speculative decode step
SCHEDULER_FILES = {"0.5.11": ["sglang/srt/speculative/eagle_info_v2.py"],
                   "0.5.17": ["sglang/srt/mem_cache/allocation.py", "sglang/srt/speculative/eagle_utils.py"],
                   "0.5.23": ["sglang/srt/mem_cache/allocation.py", "sglang/srt/mem_cache/allocation_sizing.py",
                              "sglang/srt/speculative/eagle_utils.py"]}
SIZES = list(range(1, 65))  # a server whose largest plain decode graph is 64


@pytest.fixture(scope="module")
def stack_tree(tmp_path_factory, release):
    """The release's files with its whole dyn-disable stack applied (the warm-up is 0004's on
    0.5.11, 0001's on 0.5.17 and 0.5.23), and its scheduler files (as the wheel has them where the
    stack does not touch them)."""
    root = tree_with(tmp_path_factory.mktemp(f"stack-{release}"), sorted((PATCHSET / release).glob("*.patch")),
                     release)
    wheel = wheels.pristine("sglang", release)
    for path in SCHEDULER_FILES[release]:
        if not (root / path).exists():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(wheel.read(path))
    return root


def variant(args) -> tuple:
    """What triton compiles apart for one launch of assign_req_to_token_pool_func."""
    rows, req_to_token, start, end, out_cache_loc, batch_size = args
    pointers = (rows, req_to_token, start, end, out_cache_loc)
    return (tuple(t.dtype for t in pointers), tuple(t.data_ptr() % 16 == 0 for t in pointers),
            req_to_token.shape[1], 1 << (batch_size - 1).bit_length())


def assign_reference(rows, req_to_token, start, end, out_cache_loc, batch_size):
    """What the kernel writes: each request's slots [start, end) from out_cache_loc, in order."""
    offset = 0
    for i in range(batch_size):
        n = int(end[i] - start[i])
        req_to_token[int(rows[i]), int(start[i]):int(end[i])] = out_cache_loc[offset:offset + n]
        offset += n


class FreeList:
    """SGLang's token allocator as far as alignment goes: each allocation is the head of the
    free list, a slice, so where it starts moves with every allocation before it."""

    def __init__(self):
        self.free = torch.arange(1, 1 << 16, dtype=torch.int64)

    def alloc(self, _tree_cache, n):
        out, self.free = self.free[:n], self.free[n:]
        return out


def speculative_batch(bs, req_to_token):
    # requests a step past their last allocation by 0-2 tokens: the slots each step needs vary
    kv = [types.SimpleNamespace(kv_committed_len=40 + i, kv_allocated_len=40 + i + i % 3) for i in range(bs)]
    reqs = [types.SimpleNamespace(kv_committed_len=40 + i, kv_allocated_len=40 + i + i % 3, decode_batch_idx=0,
                                  kv=kv[i]) for i in range(bs)]
    seq_lens = torch.tensor([40 + i for i in range(bs)], dtype=torch.int64)
    return types.SimpleNamespace(
        reqs=reqs, device="cpu", seq_lens=seq_lens,
        tree_cache=types.SimpleNamespace(token_to_kv_pool_allocator=types.SimpleNamespace(page_size=1)),
        seq_lens_cpu=seq_lens.clone(),
        # the scheduler's request rows: int64 (ScheduleBatch builds and filters them so)
        req_pool_indices=torch.arange(bs, dtype=torch.int64),
        req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool_allocator=types.SimpleNamespace(page_size=1),
        sampling_info=types.SimpleNamespace(penalizer_orchestrator=types.SimpleNamespace(is_required=False)),
        batch_size=lambda: bs, maybe_evict_swa=lambda: None, maybe_wait_verify_done=lambda: None)


def scheduler_launches(release, tree, monkeypatch) -> list:
    """Every assign_req_to_token_pool_func launch of the release's own speculative
    prepare_for_decode (in `tree`) over batches of every size in SIZES, in turn."""
    launches = []
    record = lambda *args: launches.append(args)  # noqa: E731
    allocator = FreeList()
    req_to_token = torch.zeros((80, 256), dtype=torch.int32)  # SGLang's req_to_token is int32
    if release == "0.5.11":
        spec_utils = types.ModuleType("sglang.srt.speculative.spec_utils")
        spec_utils.assign_req_to_token_pool_func = record
        for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, "sglang.srt.speculative.spec_utils", spec_utils)
        path = "sglang/srt/speculative/eagle_info_v2.py"
        namespace = {"torch": torch, "get_alloc_len_per_decode": lambda: 4, "alloc_token_slots": allocator.alloc}
        source = method_source(tree / path, "EagleDraftInputV2Mixin", "prepare_for_decode")
        exec(compile("from __future__ import annotations\n" + source, path, "exec"), namespace)
        prepare = functools.partial(namespace["prepare_for_decode"], types.SimpleNamespace())
    else:
        allocation = {"torch": torch, "alloc_token_slots": allocator.alloc, "assign_req_to_token_pool_func": record}
        exec(compile("from __future__ import annotations\n" + function_source(
            tree / "sglang/srt/mem_cache/allocation.py", "alloc_for_spec_decode"), "allocation.py", "exec"), allocation)
        namespace = {"torch": torch, "get_alloc_reserve_per_decode": lambda: 4,
                     "alloc_for_spec_decode": allocation["alloc_for_spec_decode"],
                     "get_spec": lambda: types.SimpleNamespace(speculative_eagle_topk=1)}
        sizing = tree / "sglang/srt/mem_cache/allocation_sizing.py"  # 0.5.23 moved the lengths' arithmetic here
        if sizing.exists():
            exec(compile(function_source(sizing, "page_aligned_decode_alloc_lens"), str(sizing), "exec"), namespace)
        exec(compile("from __future__ import annotations\n" + function_source(
            tree / "sglang/srt/speculative/eagle_utils.py", "eagle_prepare_for_decode"), "eagle_utils.py", "exec"),
            namespace)
        prepare = namespace["eagle_prepare_for_decode"]
    for bs in SIZES:
        prepare(speculative_batch(bs, req_to_token))
    return launches


def warm_up_function(stack_tree):
    namespace = {"torch": torch}
    exec(compile(function_source(stack_tree / RUNTIME, "warm_up_req_to_token_assign"), RUNTIME, "exec"), namespace)
    return namespace["warm_up_req_to_token_assign"]


def test_the_warmup_launches_every_variant_the_schedulers_own_steps_launch(release, stack_tree, monkeypatch):
    scheduled = {variant(args) for args in scheduler_launches(release, stack_tree, monkeypatch)}
    # the stand-in allocator met both alignments of out_cache_loc, as a running server does
    assert {v[1][4] for v in scheduled} == {True, False}
    assert {v[3] for v in scheduled} == {1, 2, 4, 8, 16, 32, 64}

    warmed = []
    req_to_token = torch.zeros((80, 256), dtype=torch.int32)
    uppers = warm_up_function(stack_tree)(req_to_token, SIZES, "cpu",
                                          assign=lambda *args: warmed.append(args))
    assert uppers == [1, 2, 4, 8, 16, 32, 64]
    missing = scheduled - {variant(args) for args in warmed}
    assert not missing, f"variants the first resume would compile: {missing}"


def test_the_warmups_launches_write_nothing(release, stack_tree):
    req_to_token = torch.full((80, 256), -1, dtype=torch.int32)  # a live server's rows
    before = req_to_token.clone()
    warm_up_function(stack_tree)(req_to_token, [1, 3, 16, 48], "cpu", assign=assign_reference)
    assert torch.equal(req_to_token, before)
    # the reference does write when asked to (the check above can fail)
    assign_reference(torch.tensor([2]), req_to_token, torch.tensor([5]), torch.tensor([7]),
                     torch.tensor([11, 12]), 1)
    assert req_to_token[2, 5:7].tolist() == [11, 12]


def test_only_the_powers_of_two_the_sizes_round_to_are_compiled(release, stack_tree):
    launches = []
    uppers = warm_up_function(stack_tree)(torch.zeros((4, 32), dtype=torch.int32), [1, 3, 5, 6, 7, 8], "cpu",
                                          assign=lambda *args: launches.append(args))
    assert uppers == [1, 4, 8]
    assert [args[5] for args in launches] == [1, 1, 4, 4, 8, 8]  # each aligned, then not

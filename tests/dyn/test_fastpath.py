"""The dyn-disable-fastpath patchset against the real SGLang 0.5.11 wheel files.

It applies on top of dyn-disable, the patched files byte-compile, the env/eligibility logic is
right, and (CPU torch, when installed) the new triton-backend metadata for a one-token-per-request
TARGET_VERIFY batch equals what the stock decode path builds for seq_lens + 1, in eager mode, at
CUDA-graph capture and at padded replay, writing only the static graph buffers. The triton
kernels cannot run here: a torch reference stands in for the kv-indices kernel and a simple
stand-in for the kv-splits heuristic (the same one is used on both sides of each comparison)."""
from __future__ import annotations

import enum
import py_compile
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from tests.dyn.conftest import PATCH as BASE_PATCH
from tests.dyn.conftest import assert_imports_without_torch, load_by_path, touched_paths, tree_with
from toolkit import wheels

REPO = Path(__file__).resolve().parents[2]
PATCHSET = REPO / "patchsets" / "dyn-disable-fastpath"
PATCH = PATCHSET / "0001-dyn-disable-fastpath.patch"
TRITON = "sglang/srt/layers/attention/triton_backend.py"
POLICY = "sglang/srt/speculative/dyn_disable.py"
RUNTIME = "sglang/srt/speculative/dyn_disable_runtime.py"
ACTIVE_LINE = "Dynamic speculation disable: plain step uses the decode attention kernel"


@pytest.fixture(scope="module")
def patch_text() -> str:
    return PATCH.read_text()


@pytest.fixture(scope="module")
def stacked_tree(tmp_path_factory) -> Path:
    """Pristine 0.5.11 files touched by either patch, then dyn-disable, then this patchset."""
    return tree_with(tmp_path_factory.mktemp("stacked"), [BASE_PATCH, PATCH])


@pytest.fixture(scope="module")
def policy(stacked_tree):
    return load_by_path("dyn_disable_fastpath_policy", stacked_tree / POLICY)


# --- the patch itself ---------------------------------------------------------------------

def test_patch_touches_the_expected_files_and_only_adds_lines(patch_text):
    assert dict(touched_paths(patch_text)) == {TRITON: False, POLICY: False, RUNTIME: False}
    removed = [line for line in patch_text.splitlines()
               if line.startswith("-") and not line.startswith("--- ")]
    assert removed == [], "stock lines must stay as they are"


def test_patch_needs_dyn_disable_underneath(tmp_path, patch_text):
    """On the pristine wheel files alone (no dyn-disable) the diff does not apply."""
    wheel = wheels.pristine("sglang", "0.5.11")
    target = tmp_path / TRITON
    target.parent.mkdir(parents=True)
    target.write_bytes(wheel.read(TRITON))
    done = subprocess.run(["git", "apply", "--check", "-p1", str(PATCH)], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode != 0


def test_stack_does_not_apply_twice(stacked_tree):
    done = subprocess.run(["git", "apply", "--check", "-p1", str(PATCH)], cwd=stacked_tree,
                          capture_output=True, text=True)
    assert done.returncode != 0


@pytest.mark.parametrize("path", [TRITON, POLICY, RUNTIME])
def test_patched_file_byte_compiles(stacked_tree, tmp_path, path):
    py_compile.compile(str(stacked_tree / path), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_device_applier_applies_the_stack(tmp_path, stacked_tree):
    """gpu/apply_patch.py (what the lead's GPU call uses) gives the same bytes as git apply."""
    wheel = wheels.pristine("sglang", "0.5.11")
    applier = REPO / "gpu" / "apply_patch.py"
    for patch in (BASE_PATCH, PATCH):
        for path, is_new in touched_paths(patch.read_text()):
            target = tmp_path / path
            if not is_new and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(wheel.read(path))
        done = subprocess.run([sys.executable, str(applier), str(patch), str(tmp_path)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    for path in (TRITON, POLICY, RUNTIME):
        assert (tmp_path / path).read_bytes() == (stacked_tree / path).read_bytes(), path


def test_patchset_toml_matches_the_code(stacked_tree):
    meta = tomllib.loads((PATCHSET / "patchset.toml").read_text())
    assert meta["name"] == PATCHSET.name
    assert meta["requires"] == ["dyn-disable"] and meta["order"] == 30
    assert meta["versions"] == ["0.5.11"]
    assert meta["patches"] == [PATCH.name]
    assert list(meta["env"]) == ["SGLANG_SPEC_DISABLE_DECODE_ATTN"]
    assert meta["logs"]["startup"] == [ACTIVE_LINE]
    policy_src = (stacked_tree / POLICY).read_text()
    assert '"SGLANG_SPEC_DISABLE_DECODE_ATTN"' in policy_src
    assert '"Dynamic speculation disable: plain step uses the decode attention kernel"' in policy_src


def test_runtime_enables_the_flag_before_capturing_the_plain_graphs(stacked_tree):
    src = (stacked_tree / RUNTIME).read_text()
    build = src[src.index("def build_plain_verify_state"):src.index("def enable_decode_attn_for_plain_step")]
    assert build.index("enable_decode_attn_for_plain_step(attn_backend)") < build.index("CudaGraphRunner(")
    assert build.index("_get_attention_backend(") < build.index("enable_decode_attn_for_plain_step(")


def test_policy_module_still_imports_without_torch(stacked_tree):
    assert_imports_without_torch(stacked_tree / POLICY, "assert m.decode_attn_wanted({}) is True")


# --- env switch and eligibility (pure Python) ---------------------------------------------

@pytest.mark.parametrize("raw", [None, "", "  ", "1", "true", "YES", "on"])
def test_decode_attention_is_on_by_default_and_for_true_words(policy, raw):
    env = {} if raw is None else {"SGLANG_SPEC_DISABLE_DECODE_ATTN": raw}
    assert policy.decode_attn_wanted(env) is True


@pytest.mark.parametrize("raw", ["0", "false", "No", " off "])
def test_decode_attention_off_words(policy, raw):
    assert policy.decode_attn_wanted({"SGLANG_SPEC_DISABLE_DECODE_ATTN": raw}) is False


@pytest.mark.parametrize("raw", ["2", "enable", "-1"])
def test_decode_attention_bad_value_is_a_clear_error(policy, raw):
    with pytest.raises(policy.DynDisableConfigError) as err:
        policy.decode_attn_wanted({"SGLANG_SPEC_DISABLE_DECODE_ATTN": raw})
    assert "SGLANG_SPEC_DISABLE_DECODE_ATTN" in str(err.value) and repr(raw) in str(err.value)


def eligible(**overrides):
    args = dict(backend_name="TritonAttnBackend", is_plain_triton_backend=True, num_draft_tokens=1,
                sliding_window_size=None, use_mla=False, has_separate_swa_head_dim=False)
    args.update(overrides)
    return args


def test_plain_triton_backend_for_one_token_is_eligible(policy):
    assert policy.decode_attn_unavailable_reason(**eligible()) is None
    assert policy.decode_attn_unavailable_reason(**eligible(sliding_window_size=-1)) is None


@pytest.mark.parametrize("overrides, words", [
    (dict(backend_name="FlashInferAttnBackend", is_plain_triton_backend=False), "FlashInferAttnBackend"),
    (dict(num_draft_tokens=4), "4 tokens per request"),
    (dict(sliding_window_size=4096), "sliding-window"),
    (dict(has_separate_swa_head_dim=True), "sliding-window head dim"),
    (dict(use_mla=True), "MLA"),
])
def test_unsupported_setups_keep_the_verify_kernel_with_a_reason(policy, overrides, words):
    reason = policy.decode_attn_unavailable_reason(**eligible(**overrides))
    assert reason is not None and words in reason
    message = policy.decode_attn_status_message(True, reason)
    assert "not available" in message and words in message
    assert message != policy.DECODE_ATTN_ACTIVE_MESSAGE


def test_status_messages(policy):
    assert policy.decode_attn_status_message(True, None) == ACTIVE_LINE
    off = policy.decode_attn_status_message(False, None)
    assert "verify attention kernel" in off and "SGLANG_SPEC_DISABLE_DECODE_ATTN=0" in off


# --- triton backend metadata on CPU torch ------------------------------------------------

class Mode(enum.Enum):
    DECODE = 1
    TARGET_VERIFY = 2
    EXTEND = 3

    def is_target_verify(self):
        return self is Mode.TARGET_VERIFY

    def is_decode_or_idle(self):
        return self is Mode.DECODE

    def is_decode(self):
        return self is Mode.DECODE

    def is_idle(self):
        return False

    def is_draft_extend(self, include_v2=False):
        return False


class Launch:
    """`kernel[grid](...)` for a Python reference; records the calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(grid)
            return self.fn(grid, *args, **kwargs)
        return run


def ref_kv_indices(grid, req_to_token, req_pool_indices, lens, kv_indptr, kv_start_idx, kv_indices,
                   stride):
    assert kv_start_idx is None
    for pid in range(grid[0]):
        start, n = int(kv_indptr[pid]), int(lens[pid])
        assert int(kv_indptr[pid + 1]) - start == n
        kv_indices[start:start + n] = req_to_token[int(req_pool_indices[pid]), :n]


def stand_in_kv_splits(grid, num_kv_splits, seq_lens, num_seq, num_group, num_head, num_kv_head,
                       max_kv_splits, device_core_count, MAX_NUM_SEQ):
    for i in range(num_seq):
        value = min(max_kv_splits, (int(seq_lens[i]) + 15) // 16)
        for g in range(num_group):
            num_kv_splits[i * num_group + g] = value


@pytest.fixture(scope="module")
def triton_module(stacked_tree):
    torch = pytest.importorskip("torch")
    saved = dict(sys.modules)
    triton = types.ModuleType("triton")
    triton.jit = lambda fn: Launch(stand_in_kv_splits)
    triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    tl = types.ModuleType("triton.language")
    tl.constexpr = object
    triton.language = tl
    stubs = {"triton": triton, "triton.language": tl}

    def stub(name, **attrs):
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        stubs[name] = module

    class AttentionBackend:
        pass

    stub("sglang.srt.configs.model_config", AttentionArch=enum.Enum("AttentionArch", "MHA MLA"))
    stub("sglang.srt.layers.attention.base_attn_backend", AttentionBackend=AttentionBackend)
    stub("sglang.srt.layers.attention.utils",
         create_flashinfer_kv_indices_triton=Launch(ref_kv_indices))
    stub("sglang.srt.layers.dp_attention", get_attention_tp_size=lambda: 1)
    stub("sglang.srt.layers.radix_attention", AttentionType=enum.Enum("AttentionType", "DECODER"))
    stub("sglang.srt.mem_cache.swa_memory_pool", SWAKVPool=type("SWAKVPool", (), {}))
    stub("sglang.srt.model_executor.forward_batch_info", ForwardBatch=object, ForwardMode=Mode)
    stub("sglang.srt.speculative.spec_utils", generate_draft_decode_kv_indices=None)
    stub("sglang.srt.utils", get_bool_env_var=None, get_device_core_count=None,
         get_int_env_var=None, next_power_of_2=None)
    for name in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention",
                 "sglang.srt.model_executor", "sglang.srt.speculative", "sglang.srt.mem_cache",
                 "sglang.srt.configs"):
        stubs.setdefault(name, types.ModuleType(name))
    sys.modules.update(stubs)
    try:
        module = load_by_path("triton_backend_under_test", stacked_tree / TRITON)
    finally:
        for name in list(sys.modules):
            if name not in saved:
                del sys.modules[name]
        sys.modules.update(saved)
    return torch, module


MAX_BS, MAX_REQS, CONTEXT = 8, 6, 40


def make_backend(triton_module, fast: bool):
    torch, mod = triton_module
    backend = mod.TritonAttnBackend.__new__(mod.TritonAttnBackend)
    generator = torch.Generator().manual_seed(0)
    backend.__dict__.update(
        skip_prefill=False, sliding_window_size=None, window_kv_indptr=None,
        req_to_token=torch.randperm(MAX_REQS * CONTEXT, generator=generator)
        .to(torch.int32).view(MAX_REQS, CONTEXT),
        num_draft_tokens=1, speculative_num_steps=1, use_mla=False, num_head=8, num_kv_head=2,
        v_head_dim=16, swa_v_head_dim=None, max_context_len=CONTEXT, device="cpu",
        device_core_count=132, static_kv_splits=False, max_kv_splits=4,
        enable_deterministic=False, split_tile_size=None,
        kv_indptr=torch.zeros(MAX_REQS + 1, dtype=torch.int32),
        qo_indptr=torch.zeros(MAX_REQS + 1, dtype=torch.int64),
        mask_indptr=torch.zeros(MAX_REQS + 1, dtype=torch.int64),
        forward_metadata=None, cuda_graph_custom_mask=None,
    )
    backend.one_token_verify_as_decode = fast
    return backend


def batch(torch, mode, req_pool_indices, seq_lens, spec_info=None):
    seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
    return types.SimpleNamespace(
        forward_mode=mode, batch_size=len(req_pool_indices),
        req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64),
        seq_lens=seq_lens, seq_lens_sum=int(seq_lens.sum()), spec_info=spec_info)


def metadata_parts(torch, backend, bs):
    meta = backend.forward_metadata
    total = int(backend.kv_indptr[bs])
    return (backend.kv_indptr[: bs + 1].clone(), meta.kv_indices[:total].clone(),
            meta.num_kv_splits[:bs].clone())


REQS, LENS = [4, 1, 3], [5, 17, 30]  # seq_lens in TARGET_VERIFY exclude the verified token


def test_new_backend_flag_defaults_off_in_the_constructor(stacked_tree):
    src = (stacked_tree / TRITON).read_text()
    init = src[src.index("class TritonAttnBackend"):src.index("    def get_num_kv_splits(")]
    assert "self.one_token_verify_as_decode = False" in init


def test_eager_metadata_equals_stock_decode_for_seq_lens_plus_one(triton_module):
    torch, mod = triton_module
    fast, ref = make_backend(triton_module, True), make_backend(triton_module, False)
    fast.init_forward_metadata(batch(torch, Mode.TARGET_VERIFY, REQS, LENS,
                                     spec_info=types.SimpleNamespace(custom_mask="unused")))
    ref.init_forward_metadata(batch(torch, Mode.DECODE, REQS, [n + 1 for n in LENS]))
    for mine, stock in zip(metadata_parts(torch, fast, 3), metadata_parts(torch, ref, 3)):
        assert torch.equal(mine, stock)
    meta = fast.forward_metadata
    assert meta.qo_indptr is None and meta.custom_mask is None and meta.max_extend_len is None
    assert meta.attn_logits.shape == ref.forward_metadata.attn_logits.shape == (3, 8, 4, 16)
    assert meta.attn_logits.dtype == meta.attn_lse.dtype == torch.float32
    assert meta.attn_lse.shape == (3, 8, 4) and meta.num_kv_splits.dtype == torch.int32
    # each request's last key is the verified token's slot, req_to_token[req, seq_len]
    ends = fast.kv_indptr[1:4].long() - 1
    assert meta.kv_indices[ends].tolist() == [int(fast.req_to_token[r, n]) for r, n in zip(REQS, LENS)]


def test_eager_verify_without_the_flag_stays_stock_extend(triton_module):
    torch, mod = triton_module
    plain = make_backend(triton_module, False)
    mask = torch.ones(sum(LENS) + 3, dtype=torch.bool)
    plain.init_forward_metadata(batch(torch, Mode.TARGET_VERIFY, REQS, LENS,
                                      spec_info=types.SimpleNamespace(custom_mask=mask)))
    meta = plain.forward_metadata
    assert meta.custom_mask is mask and meta.max_extend_len == 1 and meta.attn_logits is None
    assert int(plain.kv_indptr[3]) == sum(LENS)  # prefix only, the verified token comes as k/v


def graph_inputs(torch, reqs, lens, bs):
    """The runner's static buffers after populate_from_forward_batch for a smaller raw bs."""
    req_pool_indices = torch.full((MAX_BS,), 5, dtype=torch.int64)  # stale rows
    seq_lens = torch.full((MAX_BS,), 1, dtype=torch.int32)  # get_cuda_graph_seq_len_fill_value()
    req_pool_indices[: len(reqs)] = torch.tensor(reqs)
    seq_lens[: len(lens)] = torch.tensor(lens, dtype=torch.int32)
    return req_pool_indices[:bs], seq_lens[:bs]


def test_capture_and_padded_replay_equal_stock_decode_and_keep_static_buffers(triton_module):
    torch, mod = triton_module
    fast, ref = make_backend(triton_module, True), make_backend(triton_module, False)
    for backend in (fast, ref):
        backend.init_cuda_graph_state(MAX_BS, MAX_BS)  # the plain runner: max_bs x 1 token
    bs = 4
    spec = types.SimpleNamespace(custom_mask=torch.ones(64, dtype=torch.bool))
    capture_reqs, capture_lens = graph_inputs(torch, [], [], bs)
    fast.init_forward_metadata_capture_cuda_graph(bs, bs, capture_reqs, capture_lens, None,
                                                  Mode.TARGET_VERIFY, spec)
    ref.init_forward_metadata_capture_cuda_graph(bs, bs, capture_reqs, capture_lens + 1, None,
                                                 Mode.DECODE, None)
    captured = fast.forward_metadata
    assert captured.attn_logits is fast.cuda_graph_attn_logits
    assert captured.attn_lse is fast.cuda_graph_attn_lse
    assert captured.num_kv_splits is fast.cuda_graph_num_kv_splits
    assert captured.kv_indices is fast.cuda_graph_kv_indices
    assert captured.kv_indptr.data_ptr() == fast.kv_indptr.data_ptr()
    assert captured.qo_indptr is None and captured.custom_mask is None
    assert fast.cuda_graph_attn_logits.shape == (MAX_BS, 8, 4, 16)
    assert torch.equal(fast.kv_indptr[: bs + 1], ref.kv_indptr[: bs + 1])

    # replay: 3 real requests padded to the captured bs 4
    reqs, lens = graph_inputs(torch, REQS, LENS, bs)
    fast.init_forward_metadata_replay_cuda_graph(bs, reqs, lens, sum(LENS) + 1, None,
                                                 Mode.TARGET_VERIFY, spec, seq_lens_cpu=None)
    ref.init_forward_metadata_replay_cuda_graph(bs, reqs, lens + 1, sum(LENS) + 3 + 2, None,
                                                Mode.DECODE, None, seq_lens_cpu=None)
    assert fast.forward_metadata is captured, "replay must only refill the captured buffers"
    total = int(ref.kv_indptr[bs])
    assert total == sum(LENS) + 3 + 2
    assert torch.equal(fast.kv_indptr[: bs + 1], ref.kv_indptr[: bs + 1])
    assert torch.equal(fast.cuda_graph_kv_indices[:total], ref.cuda_graph_kv_indices[:total])
    assert torch.equal(fast.cuda_graph_num_kv_splits[:bs], ref.cuda_graph_num_kv_splits[:bs])
    assert fast.cuda_graph_num_kv_splits[:3].tolist() == [1, 2, 2]


def test_forward_extend_hands_one_token_verify_to_forward_decode(triton_module):
    torch, mod = triton_module
    fast = make_backend(triton_module, True)
    seen = []
    fast.forward_decode = lambda q, k, v, layer, fb, save_kv_cache=True, sinks=None: (
        seen.append((q, k, v, layer, fb, save_kv_cache, sinks)) or "decoded")
    q, k, v = torch.zeros(3, 8 * 16), torch.zeros(3, 2, 16), torch.zeros(3, 2, 16)
    fb = types.SimpleNamespace(forward_mode=Mode.TARGET_VERIFY)
    assert fast.forward_extend(q, k, v, "layer", fb, save_kv_cache=False, sinks="s") == "decoded"
    assert seen == [(q, k, v, "layer", fb, False, "s")]


@pytest.mark.parametrize("fast_flag, mode", [(False, Mode.TARGET_VERIFY), (True, Mode.EXTEND)])
def test_forward_extend_stays_stock_otherwise(triton_module, fast_flag, mode):
    torch, mod = triton_module
    backend = make_backend(triton_module, fast_flag)
    backend.forward_decode = lambda *a, **kw: pytest.fail("forward_decode must not run")

    class Stop(Exception):
        pass

    def set_kv_buffer(*args, **kwargs):
        raise Stop  # the stock extend path saves the KV first

    layer = types.SimpleNamespace(qk_head_dim=16, v_head_dim=16, tp_q_head_num=8, k_scale=None)
    fb = types.SimpleNamespace(forward_mode=mode, out_cache_loc=None,
                               token_to_kv_pool=types.SimpleNamespace(set_kv_buffer=set_kv_buffer))
    with pytest.raises(Stop):
        backend.forward_extend(torch.zeros(3, 128), torch.zeros(3, 2, 16), torch.zeros(3, 2, 16),
                               layer, fb)

# Sourced (from the repo root) by the gpu/ scripts on the device machine: the environment every
# SGLang server there runs with, and the toolkit's control side for `--host local` runs.
# Sets STUBS (the IPython stub folder of the trimmed site, "" where the image has IPython) and
# NUMA_DIR (the carried libnuma, "" where the image has it); exports the rest.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MAX_JOBS=16
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # NVLink multicast stays off
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
# SGLANG_RELEASE=0.5.17: the site carried as .whl1-0.5.17 .whl2 .whl3-0.5.17 (gpu/README.md)
. gpu/release.sh
export SGLANG_RELEASE=$REL
STUBS=""; python3 -c "import IPython.display" 2>/dev/null || STUBS=/tmp/site/_stubs   # sglang imports it
# 0.5.17: the site's stand-ins for xgrammar.StructuralTag (pack_site.sh) and deep_gemm (run_dyn.sh);
# SGLANG_ENABLE_JIT_DEEPGEMM=0 so that sglang does not take the deep_gemm one for DeepGEMM
if [ -n "$SFX" ]; then
  export SGLANG_ENABLE_JIT_DEEPGEMM=0
  python3 -c "import xgrammar, deep_gemm" 2>/dev/null || STUBS=/tmp/site/_stubs
fi
# 0.5.23's site carries sglang-kernel 0.4.5 (0.4.10, its pin, needs torch 2.14; gpu/README.md "SGLang 0.5.23
# carry"), and 0.5.23 refuses to start below 0.4.9 ("sglang-kernel is installed with version 0.4.5, which is
# less than the minimum required version 0.4.9", the second 0.5.23 call): upstream's own switch skips that check
[ "$REL" != 0.5.23 ] || export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# 0.5.23's radix tree core is a Rust extension built against its pinned torch 2.14.1; on the image's torch 2.11
# it reads an int64 tensor's dtype as another ("insert value must be an int64 tensor, got QInt32", the
# fifth 0.5.23 call, at the first prefill). Upstream's Python tree core (its KV-sharding default) is the
# other registered backend: every lab 0.5.23 server, baseline included, runs on it
[ "$REL" != 0.5.23 ] || export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
export EXTRA_PYTHONPATH=$STUBS
# the simulated acceptance's draw, set on every call (a warm machine keeps the last call's site):
# SIM_ACCEPT=per-request draws each request's accept length apart (gpu/sim_accept.py, 0.5.11 only)
set_sim_accept() { python3 gpu/sim_accept.py "${SIM_ACCEPT:-per-step}" /tmp/site /tmp/stock /tmp/naive /tmp/noisy; }
NUMA_DIR=""; [ -n "$SFX" ] || ldconfig -p | grep -q 'libnuma.so.1 ' || NUMA_DIR=$PWD/.whl1/libnuma     # sgl_kernel 0.4.2 needs it
[ -z "$NUMA_DIR" ] || export LD_LIBRARY_PATH=$NUMA_DIR:${LD_LIBRARY_PATH:-}

server_env_toml() {  # the [HOST.server.env] lines of every server in a toolkit inventory written here
  echo "PYTHONPATH = \"/tmp/site${STUBS:+:$STUBS}\""
  [ -z "$NUMA_DIR" ] || echo "LD_LIBRARY_PATH = \"$LD_LIBRARY_PATH\""
  printf '%s\n' 'HF_HUB_OFFLINE = "1"' 'NCCL_NVLS_ENABLE = "0"' 'TORCH_SYMM_MEM_DISABLE_MULTICAST = "1"' \
    'NVSHMEM_DISABLE_NVLS = "1"'
}

toolkit_side() {  # toolkit_side INVENTORY_DIR: the carried .tkwheels, this checkout, that inventory
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tk .tkwheels/*.whl 2>&1 | grep -v WARNING
  export PYTHONPATH=/tmp/tk:$PWD TOOLKIT_CACHE=$PWD/.tkwheels/cache TOOLKIT_INVENTORY=$1
  export GIT_PYTHON_REFRESH=quiet  # compiled patch images come from the carried cache; git may be absent
  mkdir -p "$1"
}

tk() { echo >&2; echo "\$ invoke $*" >&2; python3 -m invoke "$@"; local rc=$?; echo "[exit $rc]" >&2; return $rc; }  # the echo lines to stderr: a `--json` redirect stays JSON

"""Lab shim for one SGLang 0.5.23 module that imports the CuTe DSL at module level.

gpu/stand_ins/scope_cutlass.sh (run by gpu/run_dyn.sh where the site has no nvidia-cutlass-dsl) puts
this file in place of each module of gpu/stand_ins/cutlass_scoped_modules.txt and keeps the real
module beside it as `<name>.py.real`. Importing the shim runs the real module's code, with
`cutlass` resolving to the lab's stand-in (`_cutlass_stand_in/cutlass`, copied beside it) only
while that code runs. Afterwards `cutlass` is unimportable again.

Why only while it runs: FlashInfer 0.7.2 asks `importlib.util.find_spec("cutlass")` whether the
CuTe DSL is installed and, if it is, builds its own CuTe DSL kernels when `import flashinfer` runs.
With the stand-in on the whole path, `import flashinfer` itself failed (the fourth 0.5.23 call:
`cutlass.CUDA_VERSION.major > 13` in `fused_moe/cute_dsl/blackwell/moe_w4a16_utils.py`). Scoped,
FlashInfer sees what it sees without the package, and the listed modules (SM100-only kernels that
SGLang's Llama and DeepseekV3 models import on every CUDA host) keep their real code.
"""
import importlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_REAL = os.path.abspath(__file__) + ".real"
_STAND_IN_DIR = os.path.join(_HERE, "_cutlass_stand_in")


def _cutlass_modules():
    return [name for name in sys.modules if name == "cutlass" or name.startswith("cutlass.")]


def _run_real_module(namespace: dict) -> None:
    meta_path = list(sys.meta_path)
    sys.path.insert(0, _STAND_IN_DIR)
    try:
        with open(_REAL) as f:
            code = compile(f.read(), _REAL, "exec")
        exec(code, namespace)
    finally:
        sys.path.remove(_STAND_IN_DIR)
        sys.meta_path[:] = meta_path  # the stand-in's finder for `cutlass.<sub>` leaves too
        for name in _cutlass_modules():
            del sys.modules[name]
        importlib.invalidate_caches()


_run_real_module(globals())

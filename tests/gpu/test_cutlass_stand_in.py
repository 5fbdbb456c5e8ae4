"""gpu/stand_ins/cutlass and its shim cutlass_scoped.py: the CuTe DSL stand-in of the lab's SGLang
0.5.23 site (gpu/run_dyn.sh).

The third 0.5.23 call's servers died building the model: `layers/dual_gemm.py` imports
`kernels/ops/gemm/cutedsl_dual_gemm.py`, which runs `import cutlass` at module level, and the carry
has no nvidia-cutlass-dsl (its compiler library is 193 MB). The stand-in must let that real module
import, and what the model layer then asks it must be the real answer on a non-SM100 GPU. The fourth
call showed the stand-in must not be visible anywhere else: FlashInfer asks `find_spec("cutlass")`
and, told yes, builds its own CuTe DSL kernels at `import flashinfer`, which the stand-in cannot."""
import importlib
import importlib.util
import shutil
import sys
import types

import pytest

from tests.gpu.scripts import ROOT, modules_named

DUAL_GEMM = "sglang/kernels/ops/gemm/cutedsl_dual_gemm.py"


@pytest.fixture
def stand_in(monkeypatch):
    """`cutlass` resolved to the stand-in, in a clean import state (put back after the test)."""
    for name in modules_named("cutlass"):
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(ROOT / "gpu" / "stand_ins"))
    before = list(sys.meta_path)
    import cutlass

    yield cutlass
    sys.meta_path[:] = before
    for name in modules_named("cutlass"):
        del sys.modules[name]


def fake_module(monkeypatch, name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def scoped_site(tmp_path, real_source: str):
    """A site laid out as gpu/run_dyn.sh lays out 0.5.23's: the shim in the module's place, the real
    module beside it as .py.real, the stand-in in `_cutlass_stand_in/`."""
    package = tmp_path / "labsite" / "gemm"
    package.mkdir(parents=True)
    (tmp_path / "labsite" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    shutil.copy(ROOT / "gpu" / "stand_ins" / "cutlass_scoped.py", package / "cutedsl_dual_gemm.py")
    (package / "cutedsl_dual_gemm.py.real").write_text(real_source)
    shutil.copytree(ROOT / "gpu" / "stand_ins" / "cutlass", package / "_cutlass_stand_in" / "cutlass")
    return tmp_path


@pytest.fixture
def no_cutlass(monkeypatch):
    """A clean import state without `cutlass`, as on the device (put back after the test)."""
    for name in modules_named("cutlass") + modules_named("labsite"):
        monkeypatch.delitem(sys.modules, name)
    before = list(sys.meta_path)
    yield
    sys.meta_path[:] = before
    for name in modules_named("cutlass") + modules_named("labsite"):
        del sys.modules[name]


def test_the_real_0523_dual_gemm_module_imports_under_the_shim_and_flashinfer_still_sees_no_dsl(
        no_cutlass, tmp_path, monkeypatch):
    from toolkit.patch import wheels

    source = wheels.pristine("sglang", "0.5.23").read(DUAL_GEMM).decode()
    registered = []
    # the module's own sglang and cuda-python imports (the device has them; the dev machine not all)
    fake_module(monkeypatch, "cuda")
    fake_module(monkeypatch, "cuda.bindings")
    fake_module(monkeypatch, "cuda.bindings.driver", CUstream=object)
    fake_module(monkeypatch, "sglang.kernels.kernel_api_logging", debug_kernel_api=lambda fn: fn)
    fake_module(monkeypatch, "sglang.srt.utils", is_sm100_supported=lambda: False)
    fake_module(monkeypatch, "sglang.srt.utils.common",
                direct_register_custom_op=lambda *a, **k: registered.append(a or k))
    monkeypatch.syspath_prepend(str(scoped_site(tmp_path, source)))
    meta_path = list(sys.meta_path)

    module = importlib.import_module("labsite.gemm.cutedsl_dual_gemm")

    assert module.MAX_DUAL_GEMM_DECODE_TOKENS == 16
    assert module.DualGemmQuantMode.UNQUANT.is_quantized is False
    # what layers/dual_gemm.py asks while the model is built: no dual GEMM on this GPU
    assert module.can_use_dual_gemm(16, 4096, 14336, module.DualGemmQuantMode.UNQUANT) is False
    assert len(registered) == 2   # its two custom ops were registered, as on the device
    # FlashInfer's probe (flashinfer/cute_dsl/availability.py) answers as without the package
    assert importlib.util.find_spec("cutlass") is None
    assert sys.meta_path == meta_path
    # the module's kernels still hold the stand-in: run, they raise
    with pytest.raises(RuntimeError, match="stand-in"):
        module.cutlass.Int32(128)


SCOPED_LIST = ROOT / "gpu" / "stand_ins" / "cutlass_scoped_modules.txt"


def scoped_modules():
    return [line.strip() for line in SCOPED_LIST.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_every_scoped_module_of_the_real_0523_wheel_imports_under_its_shim(no_cutlass, tmp_path, monkeypatch):
    """The site as gpu/run_dyn.sh lays it out for every module in cutlass_scoped_modules.txt, under
    their real package paths (the DSA pair imports one another by absolute name)."""
    from toolkit.patch import wheels

    wheel = wheels.pristine("sglang", "0.5.23")
    paths = scoped_modules()
    assert "sglang/kernels/ops/gemm/cutedsl_dual_gemm.py" in paths and len(paths) == 3
    for path in paths:
        target = tmp_path / path
        for folder in list(target.relative_to(tmp_path).parents)[:-1]:
            (tmp_path / folder).mkdir(parents=True, exist_ok=True)
            (tmp_path / folder / "__init__.py").touch()
        shutil.copy(ROOT / "gpu" / "stand_ins" / "cutlass_scoped.py", target)
        target.with_name(target.name + ".real").write_bytes(wheel.read(path))
        shutil.copytree(ROOT / "gpu" / "stand_ins" / "cutlass", target.parent / "_cutlass_stand_in" / "cutlass",
                        dirs_exist_ok=True)
    fake_module(monkeypatch, "cuda")
    fake_module(monkeypatch, "cuda.bindings")
    fake_module(monkeypatch, "cuda.bindings.driver", CUstream=object)
    fake_module(monkeypatch, "sglang.kernels.kernel_api_logging", debug_kernel_api=lambda fn: fn)
    fake_module(monkeypatch, "sglang.srt.utils", is_sm100_supported=lambda: False)
    fake_module(monkeypatch, "sglang.srt.utils.common", direct_register_custom_op=lambda *a, **k: None)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    meta_path, sys_path = list(sys.meta_path), list(sys.path)
    try:
        for path in paths:   # the list's order: the DSA kernel imports its fp8 sibling, a shim inside a shim
            module = importlib.import_module(path[:-3].replace("/", "."))
            assert module.__file__ == str(tmp_path / path)
            assert importlib.util.find_spec("cutlass") is None
        assert sys.meta_path == meta_path and sys.path == sys_path
    finally:
        for name in set(sys.modules) - before:
            del sys.modules[name]


def test_a_real_module_that_fails_leaves_no_cutlass_behind(no_cutlass, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(scoped_site(tmp_path, "import cutlass\nraise ValueError('broken at import')\n")))
    meta_path, path = list(sys.meta_path), list(sys.path)

    with pytest.raises(ValueError, match="broken at import"):
        importlib.import_module("labsite.gemm.cutedsl_dual_gemm")

    assert importlib.util.find_spec("cutlass") is None
    assert sys.meta_path == meta_path and sys.path == path


def test_the_shim_without_its_real_module_names_the_missing_file(no_cutlass, tmp_path, monkeypatch):
    site = scoped_site(tmp_path, "")
    (site / "labsite" / "gemm" / "cutedsl_dual_gemm.py.real").unlink()
    monkeypatch.syspath_prepend(str(site))

    with pytest.raises(FileNotFoundError, match=r"cutedsl_dual_gemm\.py\.real"):
        importlib.import_module("labsite.gemm.cutedsl_dual_gemm")
    assert importlib.util.find_spec("cutlass") is None


MODULE_TOP_LEVEL = """
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import tcgen05
from cutlass.utils import blackwell_helpers as sm100_utils

WIDTH = cutlass.Int32(128)                 # a DSL constant, called at import
TILES = WIDTH * 2 // cutlass.Int32(16)     # arithmetic at import
Index = int | cutlass.Int32                # a type union evaluated at import (no lazy annotations)


@cute.jit
def launch(x):
    return x + 1


@cute.kernel(preprocess=False)
def kernel(x):
    return x * 2


class Kernel(cute.Struct):                 # a class on a DSL base
    mode = tcgen05.OperandMajorMode.K
    layout = sm100_utils.make_smem_layout_a
"""


def test_a_module_written_against_the_dsl_imports_with_inert_names(stand_in, tmp_path, monkeypatch):
    (tmp_path / "dsl_user.py").write_text(MODULE_TOP_LEVEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import dsl_user

    assert stand_in.STAND_IN is True
    assert dsl_user.launch(1) == 2 and dsl_user.kernel(2) == 4   # decorators hand the function back
    assert dsl_user.Kernel.__mro__[-1] is object
    assert "stand-in" in repr(dsl_user.WIDTH) and "stand-in" in repr(dsl_user.TILES)
    assert not dsl_user.Kernel.mode
    assert "stand-in" in repr(dsl_user.Kernel.layout)
    monkeypatch.delitem(sys.modules, "dsl_user")


def test_a_stand_in_called_after_the_imports_raises_instead_of_running_nothing(stand_in):
    """A kernel that ran on the stand-in would leave its output tensor unwritten: it must stop."""
    with pytest.raises(RuntimeError, match="stand-in"):
        stand_in.cute.compile(object(), 2)
    with pytest.raises(RuntimeError, match="nvidia-cutlass-dsl is not installed"):
        stand_in.Int32(128)
    with pytest.raises(RuntimeError, match="stand-in"):
        stand_in.Int32 * 2

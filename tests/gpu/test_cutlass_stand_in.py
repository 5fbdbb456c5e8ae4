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
import subprocess
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


def scoped_site(site, sources: dict, *paths):
    """`site` laid out as gpu/run_dyn.sh lays out 0.5.23's: each module written at its path (with
    the package __init__s on the way), then gpu/stand_ins/scope_cutlass.sh run on it (for `paths`,
    or for its own list when none is given)."""
    for path, source in sources.items():
        target = site / path
        for folder in list(target.relative_to(site).parents)[:-1]:
            (site / folder).mkdir(parents=True, exist_ok=True)
            (site / folder / "__init__.py").touch()
        target.write_bytes(source)
    subprocess.run(["bash", "gpu/stand_ins/scope_cutlass.sh", str(site), *paths], cwd=ROOT, check=True,
                   capture_output=True, timeout=60)
    return site


def module_name(path):
    return path[:-3].replace("/", ".")


@pytest.fixture
def registered_ops():
    """The custom ops the modules under test register (SGLang's direct_register_custom_op, faked)."""
    return []


@pytest.fixture
def site(monkeypatch, tmp_path, registered_ops):
    """An empty site on sys.path in a clean import state without `cutlass`, as on the device, with
    the modules the real 0.5.23 CuTe DSL modules import beside `cutlass` faked (the device has them;
    the dev machine not all); the site's modules are forgotten after the test (torch, imported by
    the real modules, stays: a second import of it in one process fails)."""
    for name in modules_named("cutlass"):
        monkeypatch.delitem(sys.modules, name)
    fake_module(monkeypatch, "cuda")
    fake_module(monkeypatch, "cuda.bindings")
    fake_module(monkeypatch, "cuda.bindings.driver", CUstream=object)
    fake_module(monkeypatch, "sglang.kernels.kernel_api_logging", debug_kernel_api=lambda fn: fn)
    fake_module(monkeypatch, "sglang.srt.utils", is_sm100_supported=lambda: False)
    fake_module(monkeypatch, "sglang.srt.utils.common",
                direct_register_custom_op=lambda *a, **k: registered_ops.append(a or k))
    monkeypatch.syspath_prepend(str(tmp_path))
    before, meta_path = set(sys.modules), list(sys.meta_path)
    yield tmp_path
    sys.meta_path[:] = meta_path
    for name in set(modules_named("sglang")) - before:
        del sys.modules[name]


def test_the_real_0523_dual_gemm_module_imports_under_the_shim_and_flashinfer_still_sees_no_dsl(site, registered_ops):
    from toolkit.patch import wheels

    scoped_site(site, {DUAL_GEMM: wheels.pristine("sglang", "0.5.23").read(DUAL_GEMM)}, DUAL_GEMM)
    meta_path = list(sys.meta_path)

    module = importlib.import_module(module_name(DUAL_GEMM))

    assert module.__file__ == str(site / DUAL_GEMM)   # the shim, the real code run by it
    assert module.MAX_DUAL_GEMM_DECODE_TOKENS == 16
    assert module.DualGemmQuantMode.UNQUANT.is_quantized is False
    # what layers/dual_gemm.py asks while the model is built: no dual GEMM on this GPU
    assert module.can_use_dual_gemm(16, 4096, 14336, module.DualGemmQuantMode.UNQUANT) is False
    assert len(registered_ops) == 2   # its two custom ops were registered, as on the device
    # FlashInfer's probe (flashinfer/cute_dsl/availability.py) answers as without the package
    assert importlib.util.find_spec("cutlass") is None
    assert sys.meta_path == meta_path
    # the module's kernels still hold the stand-in: run, they raise
    with pytest.raises(RuntimeError, match="stand-in"):
        module.cutlass.Int32(128)


SCOPED_LIST = ROOT / "gpu" / "stand_ins" / "cutlass_scoped_modules.txt"


def test_every_listed_module_of_the_real_0523_wheel_imports_under_its_shim(site):
    """The script's own list, from the wheel, under the real package paths (the DSA kernel imports
    its fp8 sibling by absolute name: a shim inside a shim)."""
    from toolkit.patch import wheels

    wheel = wheels.pristine("sglang", "0.5.23")
    paths = [line for line in SCOPED_LIST.read_text().splitlines() if line and not line.startswith("#")]
    assert DUAL_GEMM in paths and len(paths) == 3
    scoped_site(site, {path: wheel.read(path) for path in paths})
    meta_path, sys_path = list(sys.meta_path), list(sys.path)

    for path in paths:
        module = importlib.import_module(module_name(path))
        assert module.__file__ == str(site / path)
        assert importlib.util.find_spec("cutlass") is None
    assert sys.meta_path == meta_path and sys.path == sys_path


def test_a_real_module_that_fails_leaves_no_cutlass_behind(site):
    scoped_site(site, {DUAL_GEMM: b"import cutlass\nraise ValueError('broken at import')\n"}, DUAL_GEMM)
    meta_path, path = list(sys.meta_path), list(sys.path)

    with pytest.raises(ValueError, match="broken at import"):
        importlib.import_module(module_name(DUAL_GEMM))

    assert importlib.util.find_spec("cutlass") is None
    assert sys.meta_path == meta_path and sys.path == path


def test_the_shim_without_its_real_module_names_the_missing_file(site):
    scoped_site(site, {DUAL_GEMM: b""}, DUAL_GEMM)
    (site / (DUAL_GEMM + ".real")).unlink()

    with pytest.raises(FileNotFoundError, match=r"cutedsl_dual_gemm\.py\.real"):
        importlib.import_module(module_name(DUAL_GEMM))
    assert importlib.util.find_spec("cutlass") is None


def test_the_layout_script_refuses_a_module_the_site_lacks(tmp_path):
    run = subprocess.run(["bash", "gpu/stand_ins/scope_cutlass.sh", str(tmp_path), "sglang/missing.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and f"no {tmp_path}/sglang/missing.py" in run.stderr
    assert list(tmp_path.iterdir()) == []


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

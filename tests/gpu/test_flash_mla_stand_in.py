"""gpu/stand_ins/flash_mla: the FlashMLA stand-in of the lab's SGLang 0.5.23 site (gpu/run_dyn.sh).

The fifth 0.5.23 call's speculative servers died capturing their draft graphs: the v2 EAGLE worker
imports `layers/attention/flashmla_backend.py` to ask whether the draft's backend is FlashMLA, and
`kernels/ops/attention/flash_mla_interface.py` runs `import flash_mla` (sgl-flash-mla, not carried)
at module level. The real interface module must import against the stand-in, the isinstance
question must get the true answer (no), and any FlashMLA kernel must raise rather than run as a
no-op."""
import sys
import types

import pytest

from tests.gpu.scripts import ROOT, modules_named

INTERFACE = "sglang/kernels/ops/attention/flash_mla_interface.py"


@pytest.fixture
def interface(monkeypatch):
    """The wheel's real flash_mla_interface.py, executed with `flash_mla` resolved to the stand-in."""
    from toolkit.patch import wheels

    for name in modules_named("flash_mla"):
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(ROOT / "gpu" / "stand_ins"))
    source = wheels.pristine("sglang", "0.5.23").read(INTERFACE).decode()
    module = types.ModuleType("flash_mla_interface")
    exec(compile(source, INTERFACE, "exec"), module.__dict__)
    yield module
    for name in modules_named("flash_mla"):
        del sys.modules[name]


def test_the_real_0523_interface_imports_and_a_triton_backend_is_not_flashmla(interface):
    assert not isinstance(object(), interface.FlashMLASchedMeta)


def test_every_flashmla_kernel_raises_instead_of_running_nothing(interface):
    with pytest.raises(RuntimeError, match="sgl-flash-mla is not installed"):
        interface.flash_mla.get_mla_metadata()
    with pytest.raises(RuntimeError, match="stand-in"):
        interface._mega.prefill
    with pytest.raises(RuntimeError, match="stand-in"):
        interface.FlashMLASchedMeta()

"""Stand-in for nvidia-cutlass-dsl (the CuTe DSL) in the lab's SGLang 0.5.23 site.

gpu/run_dyn.sh puts it in the site's _stubs only where `import cutlass` fails. SGLang 0.5.23
requires nvidia-cutlass-dsl[cu13] 4.8.0, whose compiler library alone is 193 MB (the
nvidia-cutlass-dsl-libs-cu13 wheel is 92 MB): far over what a device call carries. Its CuTe DSL
kernels are imported at module level on every CUDA host (the third 0.5.23 call:
`layers/dual_gemm.py` imports `kernels/ops/gemm/cutedsl_dual_gemm.py` while the model is built,
and that module runs `import cutlass`), but those the lab's shapes reach are gated to SM100
(`can_use_dual_gemm` asks `is_sm100_supported()`), so on an H200 they are imported, never run.

Every `cutlass.*` module imports, and every name in one is a placeholder: attributes, indexing
and, while a module is being imported, calls and operators give placeholders (module-level constants such as
`cutlass.Int32(128)`), and used as a decorator it hands the function back. Called after the
imports, as a kernel that actually ran would call it, a placeholder raises, so a kernel never
leaves an output tensor unwritten without a word. A user's 0.5.23 install has the real package.
"""
import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder:
    __slots__ = ("_name",)

    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        return _attribute(self._name, attr)

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], (type, types.FunctionType)):
            return args[0]  # @cute.jit, @cute.kernel, @dataclass-like decorators
        return self._used("called")

    def __getitem__(self, key):
        return _Placeholder(f"{self._name}[...]")

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __repr__(self):
        return f"<cutlass stand-in {self._name}>"

    def _used(self, how):
        """A placeholder while a module is being imported (module-level constants, arithmetic,
        `int | cutlass.Int32` annotations); afterwards, a kernel at work: it raises."""
        if _importing():
            return _Placeholder(f"{self._name}({how})")
        raise RuntimeError(f"{self._name} {how}, but this site's cutlass is the lab's stand-in "
                           "(gpu/stand_ins/cutlass): nvidia-cutlass-dsl is not installed")

    def _operator(self, *other):
        return self._used("used in arithmetic")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _operator
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _operator
    __or__ = __ror__ = __and__ = __rand__ = __lshift__ = __rshift__ = __neg__ = _operator


def _attribute(owner: str, attr: str):
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    return _Placeholder(f"{owner}.{attr}")


def _importing() -> bool:
    """Whether the caller runs inside an import (a module's top level), read from the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr):
        return _attribute(self.__name__, attr)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any `cutlass.<sub>` module, made on import."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("cutlass."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


STAND_IN = True
__path__ = []
__version__ = "0+stand-in"
sys.meta_path.append(_Finder())


def __getattr__(attr):
    return _attribute("cutlass", attr)

"""The gpu/ scripts are stdlib scripts, not a package: tests load them by path."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_gpu_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def modules_named(top):
    """The names in sys.modules of a top-level module and its submodules (for a test that imports a
    stand-in under a real package's name and must leave no trace of it)."""
    import sys

    return [name for name in sys.modules if name == top or name.startswith(top + ".")]

"""The gpu/ scripts are stdlib scripts, not a package: tests load them by path."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_gpu_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

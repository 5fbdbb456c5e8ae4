"""gpu/import_reach.py on a made-up package: which modules import a name when imported (top-level
imports, relative ones, package __init__s), which reach it only inside a function, and the chain."""
import subprocess
import sys

from .scripts import ROOT, load_gpu_script

import_reach = load_gpu_script("import_reach")

FILES = {
    "pkg/__init__.py": "",
    "pkg/kernels/__init__.py": "",
    "pkg/kernels/dsl_kernel.py": "import json\nimport dsl.cute as cute\n",
    "pkg/kernels/plain.py": "import json\n",
    "pkg/kernels/heavy/__init__.py": "from dsl import runtime\n",
    "pkg/kernels/heavy/inner.py": "x = 1\n",                         # needs it: its package does
    "pkg/layers/__init__.py": "",
    "pkg/layers/indexer.py": "from ..kernels import dsl_kernel\n",   # relative, top level
    "pkg/layers/gemm.py": "def pick():\n    from pkg.kernels.dsl_kernel import cute\n",
    "pkg/layers/typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from pkg.kernels import dsl_kernel\nelse:\n    import json\n"),
    "pkg/models/__init__.py": "",
    "pkg/models/big.py": "from pkg.layers.indexer import *\n",
    "pkg/models/small.py": "from pkg.layers import gemm, typed\n",
    "pkg/models/guarded.py": "import os\nif os.environ.get('HIP'):\n    from pkg.kernels import dsl_kernel\n",
}


def make(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)


def test_top_level_imports_spread_and_function_imports_do_not(tmp_path):
    make(tmp_path)
    reach = import_reach.Reach(str(tmp_path), "pkg", "dsl")
    assert reach.needs == {"pkg.kernels.dsl_kernel", "pkg.kernels.heavy", "pkg.kernels.heavy.inner",
                           "pkg.layers.indexer", "pkg.models.big", "pkg.models.guarded"}
    assert reach.lazily_reached("pkg") == {"pkg.layers.gemm": ["pkg.kernels.dsl_kernel"]}
    assert reach.chain("pkg.models.big") == ["pkg.models.big", "pkg.layers.indexer", "pkg.kernels.dsl_kernel"]
    assert reach.chain("pkg.models.small") == []
    assert reach.chain("pkg.models.guarded") == ["pkg.models.guarded", "pkg.kernels.dsl_kernel"]


def test_unconditional_leaves_out_imports_under_an_if(tmp_path):
    make(tmp_path)
    reach = import_reach.Reach(str(tmp_path), "pkg", "dsl", unconditional=True)
    assert "pkg.models.guarded" not in reach.needs and "pkg.models.big" in reach.needs


def test_the_command_prints_counts_and_chains_and_refuses_a_missing_package(tmp_path):
    make(tmp_path)
    script = str(ROOT / "gpu" / "import_reach.py")
    run = subprocess.run([sys.executable, script, str(tmp_path), "pkg", "dsl", "--chain", "pkg.models.big",
                          "--chain", "pkg.models.small"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "6 of 14 modules of pkg may import dsl when imported" in run.stdout
    assert "inside a function: pkg.layers.gemm -> pkg.kernels.dsl_kernel" in run.stdout
    assert "chain pkg.models.big: pkg.models.big -> pkg.layers.indexer -> pkg.kernels.dsl_kernel -> dsl" in run.stdout
    assert "chain pkg.models.small: does not import dsl" in run.stdout
    bad = subprocess.run([sys.executable, script, str(tmp_path), "nopkg", "dsl"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "no package 'nopkg'" in bad.stderr

"""gpu/trim_fi_csrc.py and gpu/trim_tf_models.py (the 0.5.23 carry's trims) on small made-up sites:
what is reachable stays, what is not goes. The checks against the real wheels are one-off scripts
(gpu/check_fi_csrc_trim.py, gpu/check_tf_trim.py; gpu/README.md "SGLang 0.5.23 carry")."""
import subprocess
import sys

from .scripts import ROOT


def write(path, text=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def run(script, site):
    return subprocess.run([sys.executable, str(ROOT / "gpu" / script), str(site)], capture_output=True, text=True,
                          check=True).stdout


def fi_site(tmp_path):
    csrc = tmp_path / "flashinfer" / "data" / "csrc"
    write(csrc / "norm.cu", '#include "tvm_ffi_utils.h"\n#include <flashinfer/norm.cuh>\n')
    write(csrc / "flashinfer_norm_binding.cu", '#include "tvm_ffi_utils.h"\n')
    write(csrc / "tvm_ffi_utils.h", "#pragma once\n")
    # reached only through a header outside csrc (data/include), under an #if
    write(tmp_path / "flashinfer" / "data" / "include" / "flashinfer" / "norm.cuh",
          '#if 0\n#include "nv_internal/common/assert.h"\n#endif\n')
    write(csrc / "nv_internal" / "common" / "assert.h", '#include "logger.h"\n')
    write(csrc / "nv_internal" / "common" / "logger.h")
    # sglang's own JIT source includes a csrc header; its Python names a csrc source
    write(tmp_path / "sglang" / "jit" / "csrc" / "k.cuh", "#include <tensorrt_llm/kernels/quant.h>\n")
    write(csrc / "nv_internal" / "tensorrt_llm" / "kernels" / "quant.h")
    write(tmp_path / "sglang" / "jit" / "moe.py", 'SOURCES = [csrc / "fused_moe/routing.cu"]\n')
    write(csrc / "fused_moe" / "routing.cu", '#include "routing.cuh"\n')
    write(csrc / "fused_moe" / "routing.cuh")
    write(csrc / "batch_decode.cu", '#include "decode.cuh"\n')
    write(csrc / "decode.cuh")
    write(csrc / "templates" / "batch_prefill.jinja", "{{ x }}\n")
    return csrc


def test_csrc_keeps_what_norm_and_sglang_include_and_drops_the_rest(tmp_path):
    csrc = fi_site(tmp_path)
    out = run("trim_fi_csrc.py", tmp_path)
    kept = sorted(str(p.relative_to(csrc)) for p in csrc.rglob("*") if p.is_file())
    assert kept == ["flashinfer_norm_binding.cu", "fused_moe/routing.cu", "fused_moe/routing.cuh", "norm.cu",
                    "nv_internal/common/assert.h", "nv_internal/common/logger.h",
                    "nv_internal/tensorrt_llm/kernels/quant.h", "tvm_ffi_utils.h"]
    assert not (csrc / "templates").exists()
    assert "kept 8 files" in out


def test_csrc_dry_run_drops_nothing(tmp_path):
    csrc = fi_site(tmp_path)
    before = sorted(csrc.rglob("*"))
    subprocess.run([sys.executable, str(ROOT / "gpu" / "trim_fi_csrc.py"), str(tmp_path), "--dry-run"], check=True,
                   capture_output=True)
    assert sorted(csrc.rglob("*")) == before


def test_csrc_refuses_a_site_without_the_norm_sources(tmp_path):
    write(tmp_path / "flashinfer" / "data" / "csrc" / "batch_decode.cu")
    run_ = subprocess.run([sys.executable, str(ROOT / "gpu" / "trim_fi_csrc.py"), str(tmp_path)], capture_output=True,
                          text=True)
    assert run_.returncode != 0 and "norm.cu" in run_.stderr
    assert (tmp_path / "flashinfer" / "data" / "csrc" / "batch_decode.cu").exists()


def tf_site(tmp_path):
    models = tmp_path / "transformers" / "models"
    write(tmp_path / "transformers" / "__init__.py")
    write(models / "__init__.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .bert import *\n")
    for name in ["auto", "llama", "mistral", "bert", "siglip", "gpt2"]:
        write(models / name / "__init__.py",
              f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .modeling_{name} import *\n")
        write(models / name / f"configuration_{name}.py", f"__all__ = ['{name.title()}Config']\n")
        write(models / name / f"modular_{name}.py", "from ..gpt2.modeling_gpt2 import GPT2Model\n")
    write(models / "llama" / "modeling_llama.py", "__all__ = ['LlamaModel']\n")
    # mistral's modeling imports llama's inside a function; sglang names mistral only
    write(models / "mistral" / "modeling_mistral.py",
          "def f():\n    from ..llama.modeling_llama import LlamaModel\n__all__ = ['MistralModel']\n")
    write(models / "bert" / "modeling_bert.py", "__all__ = ['BertModel']\n")
    write(models / "siglip" / "modeling_siglip.py", "__all__ = ['SiglipVisionModel']\n")
    write(models / "gpt2" / "modeling_gpt2.py", "__all__ = ['GPT2Model']\n")
    write(models / "auto" / "modeling_auto.py", "MAPPING = {'bert': 'BertModel'}\n")
    # sglang: a model file named after mistral, and a vision tower taken from transformers by name
    write(tmp_path / "sglang" / "srt" / "models" / "mistral.py", "from transformers import SiglipVisionModel\n")
    return models


def test_tf_drops_modeling_of_unnamed_models_and_every_modular_file(tmp_path):
    models = tf_site(tmp_path)
    run("trim_tf_models.py", tmp_path)
    modeling = sorted(p.name for p in models.rglob("modeling_*.py"))
    # llama stays through mistral's import; bert and gpt2 only appear in TYPE_CHECKING / modular files
    assert modeling == ["modeling_auto.py", "modeling_llama.py", "modeling_mistral.py", "modeling_siglip.py"]
    assert not list(models.rglob("modular_*.py"))
    assert len(list(models.rglob("configuration_*.py"))) == 6


def test_tf_keeps_a_model_that_sglang_imports_by_module_path(tmp_path):
    models = tf_site(tmp_path)
    write(tmp_path / "sglang" / "srt" / "utils.py",
          "def f():\n    from transformers.models.gpt2.modeling_gpt2 import GPT2Model\n")
    run("trim_tf_models.py", tmp_path)
    assert (models / "gpt2" / "modeling_gpt2.py").exists()
    assert not (models / "bert" / "modeling_bert.py").exists()


def test_tf_keeps_the_modeling_code_that_a_kept_processor_imports(tmp_path):
    # transformers 5.19's sam2_video: processing_sam2_video.py imports its own folder's modeling file
    models = tf_site(tmp_path)
    write(models / "gpt2" / "processing_gpt2.py", "from .modeling_gpt2 import GPT2Model\n")
    run("trim_tf_models.py", tmp_path)
    assert (models / "gpt2" / "modeling_gpt2.py").exists()
    assert not (models / "bert" / "modeling_bert.py").exists()

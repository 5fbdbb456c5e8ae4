"""The sandbox's reference model, made for real in the CPU reference venv (torch + transformers)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from toolkit.core import hostrun
from toolkit.server import refmodel
from toolkit.core.transport import LocalTransport

SOURCE = Path(refmodel.__file__)


def run_in_venv(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), *args], capture_output=True, text=True, timeout=300)


def test_model_is_made_from_the_host_code_zip_and_then_reused(cpu_ref_venv, tmp_path):
    out = tmp_path / "models" / "tiny-llama"
    # Sent the way the server engine sends it to a host: hostrun's zip on the venv Python's stdin.
    python = str(cpu_ref_venv / "bin" / "python")
    first = hostrun.run_script(LocalTransport(), "refmodel", {"out_dir": str(out)}, python=python, function="make")
    assert first == {"model": str(out), "made": True, "seed": 0}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", refmodel.STAMP_NAME):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (2, 128, 4)
    assert 300 <= config["vocab_size"] <= 400
    weights_before = (out / "model.safetensors").stat().st_mtime_ns

    again = run_in_venv(cpu_ref_venv, str(SOURCE), str(out))   # and as a script of its own
    assert json.loads(again.stdout.splitlines()[-1])["made"] is False, again.stderr
    assert (out / "model.safetensors").stat().st_mtime_ns == weights_before


def test_chat_template_renders_the_llama3_layout():
    import jinja2

    template = jinja2.Environment().from_string(refmodel.CHAT_TEMPLATE)
    text = template.render(bos_token=refmodel.BOS, add_generation_prompt=True, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}])
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_refuses_to_overwrite_a_folder_that_is_not_a_reference_model(tmp_path):
    foreign = tmp_path / "weights"
    foreign.mkdir()
    (foreign / "precious.bin").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a reference model"):
        refmodel.make_model(foreign)
    assert (foreign / "precious.bin").read_text() == "keep me"


def test_refmodel_imports_nothing_from_the_toolkit():
    # It runs on hosts from the zip (package toolkit_hostside) and here as a script of its own.
    text = SOURCE.read_text()
    assert "from toolkit" not in text.replace("from toolkit.server.refmodel", "")
    assert "from ." not in text

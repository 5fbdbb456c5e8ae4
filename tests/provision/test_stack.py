"""The stack files: every pin the issue names, one-line version changes, clear errors."""
from __future__ import annotations

import pytest

from toolkit import stack
from toolkit.stack import StackError, version_matches


def test_gpu_stack_pins_the_whole_release():
    gpu = stack.load("gpu")
    pins = {p.name: p.version for p in gpu.pins}
    assert pins == {
        "nvidia-cuda-nvcc": "13.0.88", "nvidia-nvvm": "13.0.88", "nvidia-cuda-crt": "13.0.88",
        "nvidia-cuda-runtime": "13.0.96", "torch": "2.11.0+cu130", "cuda-toolkit": "13.0.2",
        "flashinfer-python": "0.6.8.post1", "flashinfer-cubin": "0.6.8.post1", "sglang-kernel": "0.4.2",
        "sglang": "0.5.11"}
    assert gpu.gpu and gpu.min_driver == 580
    assert gpu.step("torch").index_url == "https://download.pytorch.org/whl/cu130"
    assert [s.name for s in gpu.steps] == ["cuda-compiler", "torch", "flashinfer", "sglang-kernel", "sglang"]


def test_cpu_ref_stack_matches_the_reference_server_pins():
    cpu = stack.load("cpu-ref")
    specs = [p.spec for p in cpu.pins]
    assert "torch==2.13.0" in specs and "transformers[serving]==5.24.0" in specs
    assert cpu.step("sglang").no_deps and cpu.step("flashinfer").no_deps
    assert not cpu.gpu and all(s.index_url is None for s in cpu.steps)
    # the same CUDA 13 compiler pins as the GPU stack
    assert cpu.step("cuda-compiler").pins == stack.load("gpu").step("cuda-compiler").pins
    # constraints carry no extras, so pip accepts them
    assert "transformers==5.24.0\n" in cpu.constraints()


def test_a_new_version_is_a_one_line_change(tmp_path):
    text = (stack.stacks_dir() / "gpu.toml").read_text()
    changed = text.replace('pins = { "sglang" = "0.5.11" }', 'pins = { "sglang" = "0.5.12" }')
    assert sum(a != b for a, b in zip(text.splitlines(), changed.splitlines())) == 1
    path = tmp_path / "gpu-next.toml"
    path.write_text(changed)
    assert {p.name: p.version for p in stack.load(str(path)).pins}["sglang"] == "0.5.12"


@pytest.mark.parametrize("mutation, message", [
    (('"nvidia-nvvm" = "13.0.88"', '"nvidia-nvvm" = ">=13.0"'), "exact version"),
    (("min_driver = 580", "min_driver = \"580\""), "min_driver"),
    (('index = "torch-cu130"', 'index = "nowhere"'), "unknown index"),
    (('"sglang" = "0.5.11"', '"sglang" = "0.5.11", "SGLang" = "0.5.11"'), "pinned twice"),
    (("cuda = \"13.0\"", "cuda = \"13.0\"\ncolour = 1"), "unknown keys: colour"),
    (('python = "3.10"', 'python = "3"'), "python must look like"),
])
def test_malformed_stack_is_refused_with_the_reason(tmp_path, mutation, message):
    text = (stack.stacks_dir() / "gpu.toml").read_text()
    assert mutation[0] in text
    path = tmp_path / "broken.toml"
    path.write_text(text.replace(mutation[0], mutation[1], 1))
    with pytest.raises(StackError, match=message) as info:
        stack.load(str(path))
    assert "broken.toml" in str(info.value)


def test_unknown_stack_lists_the_known_ones():
    with pytest.raises(StackError, match="known stacks: cpu-ref, cpu-ref-0.5.17, cpu-ref-0.5.23, gpu, gpu-0.5.17,"
                                         " gpu-0.5.23"):
        stack.load("nope")


CASES = [("2.13.0+cpu", "2.13.0", True), ("2.11.0+cu130", "2.11.0+cu130", True), ("2.11.0", "2.11.0+cu130", False),
         ("2.11.0+cu128", "2.11.0+cu130", False), ("13.0.88", "13.0.88", True), ("13.5.0", "13.0.88", False),
         ("0.6.8.post1", "0.6.8.post1", True), ("0.6.8", "0.6.8.post1", False), ("2.11", "2.11.0", True),
         (None, "1.0", False), ("0.5.11", "0.5.1", False)]


# (installed, pinned, CUDA build of the install as torch/version.py says, or None, expected)
CUDA_CASES = [("2.11.0", "2.11.0+cu130", "13.0", True), ("2.11", "2.11.0+cu130", "13.0", True),
              ("2.11.0", "2.11.0+cu128", "12.8", True), ("2.11.0", "2.11.0+cu130", "12.8", False),
              ("2.11.0", "2.11.0+cu130", None, False), ("2.11.0+cpu", "2.11.0+cu130", "13.0", False),
              ("2.11.0+cu128", "2.11.0+cu130", "13.0", False), ("2.10.0", "2.11.0+cu130", "13.0", False),
              ("2.11.0", "2.11.0+cpu", "13.0", False), ("2.11.0", "2.11.0", "13.0", True)]


def _host_side_rule():
    from toolkit.hostside import provision_step   # the name provision_step uses on the host
    return provision_step.version_matches


@pytest.mark.parametrize("installed, pinned, expected", CASES)
def test_version_rule_is_the_same_on_both_sides(installed, pinned, expected):
    assert version_matches(installed, pinned) is expected
    assert _host_side_rule()(installed, pinned) is expected


@pytest.mark.parametrize("installed, pinned, cuda, expected", CUDA_CASES)
def test_an_unlabelled_torch_matches_a_cuda_pin_only_by_its_known_build(installed, pinned, cuda, expected):
    assert version_matches(installed, pinned, cuda) is expected
    assert _host_side_rule()(installed, pinned, cuda) is expected

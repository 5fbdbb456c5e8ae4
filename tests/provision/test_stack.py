"""The stack files: pins that the pinned SGLang wheel accepts, a new pin reinstalls its step only, clear errors."""
from __future__ import annotations

import email
import pytest
from packaging.requirements import Requirement

from tests.conftest import CPU_REF_REQUIREMENTS
from toolkit.provision import provision, stack
from toolkit.patch import wheels
from toolkit.provision.facts import Facts
from toolkit.core.inventory import Host
from toolkit.provision.stack import StackError, version_matches


def sglang_disagrees(gpu: stack.Stack) -> tuple[set[str], list[str]]:
    """The stack's pins that the pinned SGLang wheel's own Requires-Dist also names (checked), and
    those of them that it does not accept (pip would refuse the stack or move the package)."""
    version = next(p.version for p in gpu.pins if p.name == "sglang")
    wheel = wheels.pristine("sglang", version)
    metadata = email.message_from_bytes(wheel.read(f"{wheel.dist_info}/METADATA"))
    pins = {p.name: p.version for p in gpu.pins}
    checked, wrong = set(), []
    for line in metadata.get_all("Requires-Dist"):
        required = Requirement(line)
        name = stack.normalize(required.name)
        if name not in pins or (required.marker and not required.marker.evaluate({"extra": ""})):
            continue
        checked.add(name)
        if not required.specifier.contains(pins[name], prereleases=True):
            wrong.append(f"{name} {pins[name]}: sglang {version} requires {required.specifier}")
    return checked, wrong


GPU_STACKS = [name for name in stack.available() if stack.load(name).gpu]


@pytest.mark.parametrize("name", GPU_STACKS)
def test_gpu_stack_pins_what_its_sglang_wheel_requires(name):
    checked, wrong = sglang_disagrees(stack.load(name))
    assert {"torch", "sglang-kernel", "flashinfer-python"} <= checked
    assert wrong == []


def test_a_kernel_pin_the_sglang_wheel_does_not_accept_is_found(tmp_path):
    text = (stack.stacks_dir() / "gpu.toml").read_text()
    broken = tmp_path / "gpu-broken.toml"
    broken.write_text(text.replace('"sglang-kernel" = "0.4.2"', '"sglang-kernel" = "0.4.3"'))
    assert sglang_disagrees(stack.load(str(broken)))[1] == ["sglang-kernel 0.4.3: sglang 0.5.11 requires ==0.4.2"]


def test_cpu_ref_stack_matches_the_reference_server_pins():
    cpu = stack.load("cpu-ref")
    # the stack installs what the tests' own reference-server venv is built from
    assert set(CPU_REF_REQUIREMENTS) <= {p.spec for p in cpu.pins}
    assert cpu.step("sglang").no_deps and cpu.step("flashinfer").no_deps
    assert not cpu.gpu and all(s.index_url is None for s in cpu.steps)
    # the same CUDA 13 compiler pins as the GPU stack
    assert cpu.step("cuda-compiler").pins == stack.load("gpu").step("cuda-compiler").pins
    # constraints carry no extras, so pip accepts them
    assert "transformers==5.24.0\n" in cpu.constraints()


def _installed(gpu: stack.Stack) -> Facts:
    """A host's facts with every pin of GPU installed in its venv."""
    packages = {p.name: {"version": p.version, "cuda": gpu.cuda} for p in gpu.pins}
    return Facts(host="h", raw={"packages": packages, "venv": {"exists": True}, "commands": {"g++": "/usr/bin/g++"},
                                "creator": {"version": "3.12.3", "ensurepip": True},
                                "python": {"version": "3.12.3", "runs": True}})


def test_a_new_sglang_pin_reinstalls_only_the_sglang_step(tmp_path):
    gpu = stack.load("gpu")
    host = Host(name="h", address="127.0.0.1", venv="/opt/sglang/venv")
    facts = _installed(gpu)
    assert [s.name for s in provision.plan(gpu, facts, host) if s.needed] == []
    path = tmp_path / "gpu-next.toml"
    path.write_text((stack.stacks_dir() / "gpu.toml").read_text().replace('"sglang" = "0.5.11"', '"sglang" = "0.5.12"'))
    planned = [s for s in provision.plan(stack.load(str(path)), facts, host) if s.needed]
    assert [(s.name, s.detail) for s in planned] == [("sglang", "sglang 0.5.11 -> 0.5.12")]


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


@pytest.mark.parametrize("installed, pinned, expected", CASES)
def test_version_rule(installed, pinned, expected):
    assert version_matches(installed, pinned) is expected


@pytest.mark.parametrize("installed, pinned, cuda, expected", CUDA_CASES)
def test_an_unlabelled_torch_matches_a_cuda_pin_only_by_its_known_build(installed, pinned, cuda, expected):
    assert version_matches(installed, pinned, cuda) is expected

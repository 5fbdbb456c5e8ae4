"""The dyn-disable patchset against the real SGLang 0.5.11 wheel files: it applies (git and the
device's stdlib applier agree), the patched files byte-compile, the policy module is torch-free,
and patchset.toml matches the code."""
from __future__ import annotations

import py_compile
import subprocess
import sys
import tomllib

import pytest

from tests.dyn.conftest import PATCH, PATCHSET, REPO, assert_imports_without_torch, touched_paths
from toolkit import patchsets

EXPECTED = {
    "sglang/srt/speculative/dyn_disable.py": True,
    "sglang/srt/speculative/dyn_disable_runtime.py": True,
    "sglang/srt/speculative/eagle_worker.py": False,
    "sglang/srt/speculative/eagle_worker_v2.py": False,
    "sglang/srt/speculative/eagle_info_v2.py": False,
    "sglang/srt/managers/scheduler.py": False,
    "sglang/srt/managers/schedule_batch.py": False,
    "sglang/srt/observability/scheduler_metrics_mixin.py": False,
}


def test_patch_touches_only_the_expected_files(patch_text):
    assert dict(touched_paths(patch_text)) == EXPECTED
    assert "GIT binary patch" not in patch_text and "__pycache__" not in patch_text


def test_git_apply_check_passes_on_pristine_files(pristine_tree):
    done = subprocess.run(["git", "apply", "--check", "-p1", str(PATCH)], cwd=pristine_tree,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_patch_does_not_apply_twice(patched_tree):
    done = subprocess.run(["git", "apply", "--check", "-p1", str(PATCH)], cwd=patched_tree,
                          capture_output=True, text=True)
    assert done.returncode != 0


def test_device_applier_matches_git_and_refuses_a_second_run(tmp_path, pristine_tree, patched_tree):
    import shutil
    shutil.copytree(pristine_tree, tmp_path, dirs_exist_ok=True)
    applier = REPO / "gpu" / "apply_patch.py"
    first = subprocess.run([sys.executable, str(applier), str(PATCH), str(tmp_path)],
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stdout
    for path in EXPECTED:
        assert (tmp_path / path).read_bytes() == (patched_tree / path).read_bytes(), path
    before = {p: (tmp_path / p).read_bytes() for p in EXPECTED}
    second = subprocess.run([sys.executable, str(applier), str(PATCH), str(tmp_path)],
                            capture_output=True, text=True)
    assert second.returncode == 1 and "nothing written" in second.stdout
    assert {p: (tmp_path / p).read_bytes() for p in EXPECTED} == before


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_patched_file_byte_compiles(patched_tree, tmp_path, path):
    py_compile.compile(str(patched_tree / path), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_policy_module_imports_without_torch(patched_tree):
    assert_imports_without_torch(patched_tree / "sglang/srt/speculative/dyn_disable.py",
                                 "assert m.config_from_env({}) is None")


def test_patchset_toml_names_the_log_lines_the_code_writes(dyn):
    """The toolkit waits for [logs] startup and prints the lines [logs] print names: both must
    match what the patched code logs, or `server start` would wait forever / stay silent."""
    meta = tomllib.loads((PATCHSET / "patchset.toml").read_text())
    assert patchsets.load_all(REPO / "patchsets")["dyn-disable"].releases == {"0.5.11": [PATCH.name]}
    startup = dyn.SpecSwitch(dyn.config_from_env({dyn.THRESHOLD_ENV: "5"})).startup_message()
    assert meta["logs"]["startup"] and all(startup.startswith(line) for line in meta["logs"]["startup"])
    switch = dyn.SpecSwitch(dyn.config_from_env({dyn.THRESHOLD_ENV: "5"}))
    switch.decide(9)
    assert any(switch.switch_message(9).startswith(p) for p in meta["logs"]["print"])
    documented = set(meta["env"])
    assert {dyn.THRESHOLD_ENV, dyn.HYSTERESIS_ENV, dyn.DRAFT_KV_ONLY_ENV} <= documented
    for claim in meta["verified"]:
        assert {"date", "where", "what"} <= set(claim)
        if "evidence" in claim:
            assert (REPO / claim["evidence"]).exists(), claim["evidence"]


def test_toolkit_loader_accepts_the_patchset():
    from toolkit import patchsets
    known = patchsets.load_all(REPO / "patchsets")
    assert "dyn-disable" in known

"""The dyn-disable patchset against the real SGLang wheel files of every release it has a diff for
(0.5.11, 0.5.17 and 0.5.23): it applies (git and the device's stdlib applier agree), the patched files
byte-compile, the policy module is torch-free and the same on every release, and patchset.toml
matches the code."""
from __future__ import annotations

import py_compile
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.dyn.conftest import (
    PATCHSET,
    RELEASES,
    REPO,
    assert_imports_without_torch,
    patch_for,
    touched_paths,
    tree_with,
)
from toolkit.patch import patchsets, wheels

POLICY = "sglang/srt/speculative/dyn_disable.py"
RUNTIME = "sglang/srt/speculative/dyn_disable_runtime.py"

EXPECTED = {
    "0.5.11": {
        POLICY: True,
        RUNTIME: True,
        "sglang/srt/speculative/eagle_worker.py": False,
        "sglang/srt/speculative/eagle_worker_v2.py": False,
        "sglang/srt/speculative/eagle_info_v2.py": False,
        "sglang/srt/managers/scheduler.py": False,
        "sglang/srt/managers/schedule_batch.py": False,
        "sglang/srt/observability/scheduler_metrics_mixin.py": False,
        # the plain path's memory kept out of the KV cache when it is sized (issue #33 item 4)
        "sglang/srt/model_executor/model_runner_kv_cache_mixin.py": False,
    },
    # 0.5.17: no v1 worker, no eagle_info_v2.py / scheduler_metrics_mixin.py; the host seq_lens
    # hunks of schedule_batch.py are upstream's own future-map publish now (docs/porting.md)
    "0.5.17": {
        POLICY: True,
        RUNTIME: True,
        "sglang/srt/speculative/eagle_worker_v2.py": False,
        "sglang/srt/managers/scheduler.py": False,
        "sglang/srt/managers/scheduler_components/metrics_reporter.py": False,
        # the plain path's memory kept out of the KV cache when it is sized (issue #33 item 4)
        "sglang/srt/mem_cache/kv_cache_configurator.py": False,
    },
    # 0.5.23: /server_info's entry goes to the internal-state controller (scheduler.py delegates);
    # the KV-cache reserve (issue #33 item 4) to the KV cache configurator
    "0.5.23": {
        POLICY: True,
        RUNTIME: True,
        "sglang/srt/speculative/eagle_worker_v2.py": False,
        "sglang/srt/managers/scheduler_components/internal_state.py": False,
        "sglang/srt/managers/scheduler_components/metrics_reporter.py": False,
        "sglang/srt/mem_cache/kv_cache_configurator.py": False,
    },
}


@pytest.fixture(scope="module")
def release_pristine_tree(tmp_path_factory, release):
    """The pristine files of SGLang `release` its dyn-disable diff modifies, in a fresh folder."""
    wheel = wheels.pristine("sglang", release)
    root = tmp_path_factory.mktemp(f"dyn-pristine-{release}")
    for path, is_new in touched_paths(patch_for(release).read_text()):
        if not is_new:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(wheel.read(path))
    return root


def test_patch_touches_only_the_expected_files(release):
    text = patch_for(release).read_text()
    assert dict(touched_paths(text)) == EXPECTED[release]
    assert "GIT binary patch" not in text and "__pycache__" not in text


def test_git_apply_check_passes_on_pristine_files(release, release_pristine_tree):
    done = subprocess.run(["git", "apply", "--check", "-p1", str(patch_for(release))],
                          cwd=release_pristine_tree, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_patch_does_not_apply_twice(release, release_tree):
    done = subprocess.run(["git", "apply", "--check", "-p1", str(patch_for(release))], cwd=release_tree,
                          capture_output=True, text=True)
    assert done.returncode != 0


@pytest.mark.parametrize("other", RELEASES)
def test_the_other_releases_diff_does_not_apply(release, other, release_pristine_tree, tmp_path):
    """Each release's diff is for its own files: 0.5.11's does not go onto 0.5.17 (its files are
    gone or moved) nor 0.5.17's onto 0.5.11 or 0.5.23 (what `invoke patch apply` relies on to
    refuse)."""
    if other == release:
        pytest.skip("a release's own diff")
    shutil.copytree(release_pristine_tree, tmp_path, dirs_exist_ok=True)
    done = subprocess.run(["git", "apply", "--check", "-p1", str(patch_for(other))], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode != 0


def test_device_applier_matches_git_and_refuses_a_second_run(tmp_path, release, release_pristine_tree,
                                                           release_tree):
    shutil.copytree(release_pristine_tree, tmp_path, dirs_exist_ok=True)
    applier = REPO / "gpu" / "apply_patch.py"
    patch = patch_for(release)
    first = subprocess.run([sys.executable, str(applier), str(patch), str(tmp_path)],
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stdout
    for path in EXPECTED[release]:
        assert (tmp_path / path).read_bytes() == (release_tree / path).read_bytes(), path
    before = {p: (tmp_path / p).read_bytes() for p in EXPECTED[release]}
    second = subprocess.run([sys.executable, str(applier), str(patch), str(tmp_path)],
                            capture_output=True, text=True)
    assert second.returncode == 1 and "nothing written" in second.stdout
    assert {p: (tmp_path / p).read_bytes() for p in EXPECTED[release]} == before


def test_device_applier_takes_the_whole_stack_as_git_does(tmp_path, release):
    """gpu/run_dyn.sh setup applies every diff of the release in order with the device's applier;
    a later diff written before an earlier one grew the same file (0004 after 0003 on 0.5.11)
    sits at an offset, which `git apply` (the toolkit) takes and a strict applier refused, so a
    device call once started no server at all."""
    stack = sorted((REPO / "patchsets" / "dyn-disable" / release).glob("*.patch"))
    (tmp_path / "git").mkdir()
    (tmp_path / "device").mkdir()
    with_git = tree_with(tmp_path / "git", stack, release)
    with_device = tree_with(tmp_path / "device", stack, release,
                            applier=lambda patch, root: [sys.executable, str(REPO / "gpu" / "apply_patch.py"),
                                                         str(patch), str(root)])
    files = sorted(p.relative_to(with_git) for p in with_git.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(with_device) for p in with_device.rglob("*") if p.is_file())
    for path in files:
        assert (with_device / path).read_bytes() == (with_git / path).read_bytes(), path


@pytest.mark.parametrize("path", sorted(EXPECTED["0.5.11"]))
def test_patched_0511_file_byte_compiles(patched_tree, tmp_path, path):
    py_compile.compile(str(patched_tree / path), cfile=str(tmp_path / "out.pyc"), doraise=True)


@pytest.mark.parametrize("release_and_path", [(r, p) for r in ("0.5.17", "0.5.23") for p in sorted(EXPECTED[r])],
                         ids=lambda rp: f"{rp[0]}-{rp[1].rsplit('/', 1)[-1]}")
def test_patched_v2_release_file_byte_compiles(tmp_path_factory, tmp_path, release_and_path):
    release, path = release_and_path
    tree = tree_with(tmp_path_factory.mktemp(f"dyn-{release}-compile"), [patch_for(release)], release)
    py_compile.compile(str(tree / path), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_policy_module_imports_without_torch(release_tree):
    assert_imports_without_torch(release_tree / POLICY, "assert m.config_from_env({}) is None")


def test_the_policy_module_is_the_same_on_every_release():
    """The switch, its knobs and its log lines are one file for every release, so profiles, smoke
    and bench parse the same lines whichever release a host runs."""
    added = []
    for release in RELEASES:
        text = patch_for(release).read_text()
        block = text.split(f"diff --git a/{POLICY} b/{POLICY}\n")[1].split("\ndiff --git ")[0]
        added.append(block)
    assert all(block == added[0] for block in added[1:])


def test_patchset_toml_names_the_log_lines_the_code_writes(dyn):
    """The toolkit waits for [logs] startup and prints the lines [logs] print names: both must
    match what the patched code logs, or `server start` would wait forever / stay silent."""
    meta = tomllib.loads((PATCHSET / "patchset.toml").read_text())
    releases = patchsets.load_all(REPO / "patchsets")["dyn-disable"].releases
    assert {release: names[0] for release, names in releases.items()} == {
        release: patch_for(release).name for release in RELEASES}   # then 0002 (metrics)
    startup = dyn.SpecSwitch(dyn.config_from_env({dyn.THRESHOLD_ENV: "5"})).startup_message()
    assert meta["logs"]["startup"] and all(startup.startswith(line) for line in meta["logs"]["startup"])
    switch = dyn.SpecSwitch(dyn.config_from_env({dyn.THRESHOLD_ENV: "5"}))
    switch.decide(9)
    assert any(switch.switch_message(9).startswith(p) for p in meta["logs"]["print"])
    documented = set(meta["env"])
    read = {value for name, value in vars(dyn).items() if name.endswith("_ENV")}  # every knob the patch reads
    assert {dyn.THRESHOLD_ENV, dyn.HYSTERESIS_ENV, dyn.DRAFT_KV_ONLY_ENV} <= read <= documented
    for claim in meta["verified"]:
        assert {"date", "where", "what"} <= set(claim)
        if "evidence" in claim:
            assert (REPO / claim["evidence"]).exists(), claim["evidence"]

"""Targets that cannot be replaced, symlinked targets, leftovers of killed runs: real files, real sshd.

Immutable files use `chattr +i` (the tests run as root on ext4 here; the fixture fails, never
skips, where chattr does not work). A read-only folder only stops a non-root user, so that
case runs the host scripts as `nobody` through `runuser`.
"""
import base64
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from toolkit.core import hostrun
from toolkit.patch import patching
from toolkit.core.transport import LocalTransport

from .conftest import sha256
from .faults import armed

AUTH = "sglang/srt/utils/auth.py"


def state_dir(host) -> Path:
    return Path(host.toolkit_state_dir) / "patch"


def three_files():
    return patching.load_patchsets()["three"].touched()


class Immutable:
    """`chattr +i` with a guaranteed `chattr -i` at the end (a flagged file blocks rmtree)."""

    def __init__(self):
        self.flagged = []

    def track(self, path: Path) -> Path:
        self.flagged.append(path)
        return path

    def set(self, path: Path) -> None:
        subprocess.run(["chattr", "+i", str(self.track(path))], check=True)
        assert "i" in subprocess.run(["lsattr", "-d", str(path)], capture_output=True, text=True,
                                     check=True).stdout.split()[0]

    def clear(self, path: Path) -> None:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.fixture
def immutable():
    flags = Immutable()
    yield flags
    for path in flags.flagged:
        subprocess.run(["chattr", "-i", str(path)], check=False, capture_output=True)


def assert_pristine(site, wheel, paths):
    for p in paths:
        assert sha256(site / p) == wheel.record[p], p


def assert_no_leftovers(host, site):
    assert not (state_dir(host) / "journal.json").exists()
    assert not list((site / "sglang").rglob("*.toolkit-new"))


def test_immutable_target_is_refused_before_any_file_changes(host, site, patchsets_dir, sglang_wheel, immutable):
    files = three_files()
    immutable.set(site / files[2])
    for dry_run in (True, False):
        with pytest.raises(patching.PatchRefused) as refused:
            patching.apply(host, "three", dry_run=dry_run)
        reason = refused.value.reason
        assert files[2] in reason and "immutable attribute" in reason and "nothing written" in reason
        assert f"chattr -i {site / files[2]}" in reason
        assert files[0] not in reason and files[1] not in reason
    assert_pristine(site, sglang_wheel, files)
    assert not state_dir(host).exists(), "nothing written: no backups, no state"
    verdict = patching.verify(host)
    assert verdict.ok and any(files[2] in n and "cannot be replaced" in n for n in verdict.notes)

    immutable.clear(site / files[2])
    assert patching.apply(host, "three").changed == 3
    assert patching.verify(host).ok


def test_flag_set_after_the_probe_is_caught_by_the_host_run(host, site, patchsets_dir, sglang_wheel, immutable):
    files = three_files()

    def set_flag_when_writing(text):
        if "writing" in text:  # the probe is done, the host-side run is next
            immutable.set(site / files[1])

    with pytest.raises(patching.PatchRefused, match="cannot replace .*immutable attribute.*nothing written"):
        patching.apply(host, "three", note=set_flag_when_writing)
    assert_pristine(site, sglang_wheel, files)
    assert not (state_dir(host) / "backups").exists() and not (state_dir(host) / "state.json").exists()
    assert_no_leftovers(host, site)


def test_rename_that_fails_midway_puts_back_the_files_already_replaced(host, site, patchsets_dir, sglang_wheel,
                                                                        immutable):
    """The flag appears after the check (a race): the run puts back what it had replaced."""
    files = three_files()
    second = immutable.track(site / files[1])
    flag_it = f"import subprocess; subprocess.run(['chattr', '+i', {str(second)!r}], check=True)"
    with armed("after-rename-1", run=flag_it), pytest.raises(patching.PatchRefused) as refused:
        patching.apply(host, "three")
    reason = refused.value.reason
    assert f"could not replace {files[1]}" in reason and "after 1 of 3 renames" in reason
    assert "put the 1 file(s) already replaced back: nothing changed" in reason
    assert_pristine(site, sglang_wheel, files)
    assert_no_leftovers(host, site)
    assert not (state_dir(host) / "state.json").exists(), "the state is as before: nothing applied"
    assert patching.verify(host).ok


def test_cut_run_that_can_be_neither_finished_nor_undone_is_reported_file_by_file(host, site, patchsets_dir,
                                                                                 sglang_wheel, immutable):
    files = three_files()
    with armed("after-rename-2"), pytest.raises(Exception, match="exit 137"):
        patching.apply(host, "three")
    image = patching.compiler.compile_stack([patching.load_patchsets()["three"]], "0.5.11")
    assert sha256(site / files[0]) == image.files[files[0]].sha256  # renamed before the kill
    immutable.set(site / files[0])   # holds the new bytes: cannot be put back
    immutable.set(site / files[2])   # still old: cannot be rolled forward

    verdict = patching.verify(host)  # finishes the cut run as far as it can, then reports
    outcome = verdict.recovered["outcome"]
    assert outcome.startswith(f"rolled back ({files[2]} could not be replaced: [Errno 1]")
    assert f"could not restore {files[0]} (restoring it failed" in outcome
    rows = {f.path: f for f in verdict.files}
    assert not verdict.ok
    assert rows[files[0]].status == "drifted" and "it holds the new content of the cut run" in rows[files[0]].detail
    assert rows[files[1]].status == "pristine" and rows[files[2]].status == "pristine"
    assert any("revert --all --force" in n for n in verdict.notes)
    again = patching.verify(host)  # the state keeps telling the same story
    assert again.recovered is None and {f.path: f.status for f in again.files}[files[0]] == "drifted"
    with pytest.raises(patching.PatchRefused, match="left .* damaged"):
        patching.apply(host, "three")
    with pytest.raises(patching.PatchRefused, match="cannot replace"):
        patching.revert(host, force=True)  # still immutable: refused, nothing written

    immutable.clear(site / files[0])
    immutable.clear(site / files[2])
    fixed = patching.revert(host, force=True)
    assert fixed.record_ok
    assert_pristine(site, sglang_wheel, files)
    assert patching.verify(host).ok
    assert patching.apply(host, "three").changed == 3


def test_symlinked_target_is_refused_and_stays_a_link(host, site, patchsets_dir, sglang_wheel, tmp_path):
    """Decision (docs/patching.md): never replace a symbolic link, never write through it."""
    target = site / AUTH
    elsewhere = tmp_path / "auth_elsewhere.py"
    shutil.copyfile(target, elsewhere)
    target.unlink()
    target.symlink_to(elsewhere)
    with pytest.raises(patching.PatchRefused) as refused:
        patching.apply(host, "one-file")
    assert f"{target} is a symbolic link (to {elsewhere})" in refused.value.reason
    assert target.is_symlink() and sha256(elsewhere) == sglang_wheel.record[AUTH]

    target.unlink()  # the advised fix: a copy instead of the link
    shutil.copyfile(elsewhere, target)
    patching.apply(host, "one-file")
    patched = target.read_bytes()
    elsewhere.write_bytes(patched)
    target.unlink()
    target.symlink_to(elsewhere)  # a link to the right bytes: verify is content-only, revert still refuses
    verdict = patching.verify(host)
    assert verdict.ok and any("symbolic link" in n for n in verdict.notes)
    with pytest.raises(patching.PatchRefused, match="symbolic link"):
        patching.revert(host)
    assert target.is_symlink() and elsewhere.read_bytes() == patched


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_temporaries_of_dead_runs_are_removed_and_a_live_runs_are_kept(host, site, patchsets_dir, sglang_wheel):
    patching.apply(host, "one-file")
    folder, dead = state_dir(host), _dead_pid()
    stale = [folder / f"state.json.tmp{dead}", folder / f"journal.json.tmp{dead}",
             folder / "backups" / f"{'0' * 64}.tmp{dead}"]
    live = folder / f"state.json.tmp{os.getpid()}"  # this test process is alive: like a concurrent run
    for path in stale + [live]:
        path.write_bytes(b"partial")
    verdict = patching.verify(host)
    assert verdict.ok and not any(p.exists() for p in stale) and live.exists()
    assert any("removed 3 temporary file(s)" in n for n in verdict.notes)
    assert patching.verify(host).notes == [], "nothing left to remove the second time"
    live.unlink()

    files = three_files()  # a killed recovery write beside a target is removed with its journal
    with armed("after-rename-1"), pytest.raises(Exception, match="exit 137"):
        patching.apply(host, "three")
    beside = site / f"{files[0]}.tmp{dead}"
    beside.write_bytes(b"partial")
    assert patching.verify(host).recovered["outcome"] == "rolled forward"
    assert not beside.exists()


# -- a read-only folder for a user who is not root ---------------------------------------------

def _run_as_nobody(script: str, args: dict) -> dict:
    return hostrun.run_script(LocalTransport(), script, args, python="runuser -u nobody -- python3")


def test_read_only_folder_for_a_non_root_user(sglang_wheel):
    root = Path(tempfile.mkdtemp(prefix="toolkit-ro-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        site = root / "site"
        target = site / "sglang" / "srt" / "x.py"
        target.parent.mkdir(parents=True)
        target.write_text("X = 1\n")
        dist = site / "sglang-0.5.11.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.11\n\n")
        state = root / "state"
        state.mkdir()
        shutil.chown(state, "nobody")
        args = {"package": "sglang", "venv": None, "pythonpath": str(site), "state_dir": str(state),
                "lock_timeout": 5}
        rel, old = "sglang/srt/x.py", sha256(target)

        probed = _run_as_nobody("patch_probe", dict(args, paths=[rel], recover=True))
        assert probed["blocked"] == {rel: f"folder {target.parent} is not writable by nobody"
                                          f" (read-only folder or file system)"}
        new = b"X = 2\n"
        plan = dict(args, version="0.5.11", expect={rel: old}, expect_state_sha=None, state_changed=True,
                    writes=[{"path": rel, "sha256": hashlib.sha256(new).hexdigest(),
                             "content": base64.b64encode(new).decode()}],
                    state={"format": 1, "package": "sglang", "version": "0.5.11", "stack": [], "files": {}})
        refused = _run_as_nobody("patch_apply", plan)
        assert refused["refused"].startswith(f"cannot replace {rel}: folder {target.parent} is not writable")
        assert sha256(target) == old and not (state / "patch" / "backups").exists()
        assert not list(target.parent.iterdir())[1:], "no temporary file beside the target"

        shutil.chown(target.parent, "nobody")  # the same plan, once the folder is the user's
        done = _run_as_nobody("patch_apply", plan)
        assert done["changed"] == [rel] and target.read_bytes() == new
        assert json.loads((state / "patch" / "state.json").read_text())["version"] == "0.5.11"
    finally:
        shutil.rmtree(root, ignore_errors=True)

"""A state folder (`<venv>/.toolkit`) the run cannot write, though site-packages is writable: the
dry run must say what the real run will meet, and the real run must refuse with a clear line,
before anything is written.

Root ignores mode bits, so two real set-ups: `chattr +i` on `.toolkit` (root over the sandbox
sshd: even root cannot write there), and a user who is not root (`nobody`, through `runuser`,
as an SSH login as that user would run the host scripts) whose site-packages folder is its own
while the venv and `.toolkit` belong to root."""
import base64
import dataclasses
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from toolkit.core import hostrun
from toolkit.patch import patching
from toolkit.core.inventory import Host
from toolkit.core.transport import LocalTransport

from .conftest import _private_copy, sha256

RUNUSER = shutil.which("runuser")


def three(site: Path) -> list[Path]:
    return [site / p for p in patching.load_patchsets()["three"].touched()]


def test_an_immutable_state_folder_is_refused_by_the_dry_run_and_the_run(host, host_venv, site, patchsets_dir,
                                                                         sglang_wheel):
    toolkit = host_venv / ".toolkit"
    toolkit.mkdir()
    subprocess.run(["chattr", "+i", str(toolkit)], check=True)
    try:
        for dry_run in (True, False):
            with pytest.raises(patching.PatchRefused) as refused:
                patching.apply(host, "three", dry_run=dry_run)
            assert refused.value.reason == (
                f"sandbox: the toolkit's state folder {toolkit}/patch cannot be written: folder {toolkit} has the"
                f" immutable attribute (`lsattr` shows 'i'); clear it with `chattr -i {toolkit}`; nothing written")
        assert all(sha256(p) == sglang_wheel.record[str(p.relative_to(site))] for p in three(site))
        assert list(toolkit.iterdir()) == []
    finally:
        subprocess.run(["chattr", "-i", str(toolkit)], check=False)
    assert patching.apply(host, "three").changed == 3   # once the attribute is gone


class AsUser(LocalTransport):
    """This machine, every command run as USER (`runuser`), like an SSH login as that user."""

    def __init__(self, user: str):
        super().__init__()
        self.user = user

    def _run(self, command, *, stdin, timeout, env):
        return super()._run(f"{RUNUSER} -u {self.user} -- {command}", stdin=stdin, timeout=timeout, env=env)


@pytest.fixture
def nobody_host(base_venv, monkeypatch):
    """A venv owned by root whose sglang/srt/utils folder belongs to `nobody`, and a root-owned
    `.toolkit` in it; a local host whose commands run as nobody."""
    if os.geteuid() != 0 or not RUNUSER:
        pytest.skip("needs root and runuser to run the host scripts as another user")
    root = Path(tempfile.mkdtemp(prefix="toolkit-nobody-", dir="/tmp"))   # pytest's tmp is root's only
    os.chmod(root, 0o755)
    venv = _private_copy(base_venv, root / "venv")
    site = next(venv.glob("lib/python*/site-packages"))
    shutil.chown(site / "sglang" / "srt" / "utils", "nobody")   # a real copy (conftest.PRIVATE), not hard links
    (venv / ".toolkit").mkdir(mode=0o755)
    host = Host(name="shared", transport="local", venv=str(venv))
    monkeypatch.setattr(Host, "connect", lambda self: AsUser("nobody"))
    try:
        yield host, venv, site
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_state_folder_of_another_user_is_refused_naming_the_owner(nobody_host, patchsets_dir, sglang_wheel):
    host, venv, site = nobody_host
    why = (f"the toolkit's state folder {venv}/.toolkit/patch cannot be written by nobody: folder"
           f" {venv}/.toolkit belongs to root (mode 755); {venv} belongs to root: run the patch commands as"
           f" root (`user = \"root\"` in the inventory) or give nobody write access to {venv}/.toolkit")
    expected = f"shared: {why}; nothing written"
    checked = patching.verify(host)   # nobody can read all of it, and is told what a write would meet
    assert checked.ok and checked.notes == [f"apply/revert will refuse: {why}"]
    for dry_run in (True, False):
        with pytest.raises(patching.PatchRefused) as refused:
            patching.apply(host, "three", dry_run=dry_run)
        assert refused.value.reason == expected
    assert all(sha256(p) == sglang_wheel.record[str(p.relative_to(site))] for p in three(site))
    assert list((venv / ".toolkit").iterdir()) == []

    # the host run refuses the same way when it gets a plan (the folder changed after the probe)
    rel = "sglang/srt/utils/request_logger.py"
    new = b"X = 2\n"
    plan = {"package": "sglang", "venv": str(venv), "pythonpath": None, "state_dir": f"{venv}/.toolkit",
            "lock_timeout": 5, "version": "0.5.11", "expect": {rel: sha256(site / rel)}, "expect_state_sha": None,
            "writes": [{"path": rel, "sha256": hashlib.sha256(new).hexdigest(),
                        "content": base64.b64encode(new).decode()}],
            "state": {"format": 1, "package": "sglang", "version": "0.5.11", "stack": [], "files": {}},
            "state_changed": True}
    answer = hostrun.run_script(AsUser("nobody"), "patch_apply", plan)
    assert answer == {"refused": f"{why}; nothing written"}

    shutil.chown(venv / ".toolkit", "nobody")   # once the state folder is the user's, the same apply runs
    applied = patching.apply(host, "three")
    assert applied.changed == 3 and patching.verify(host).ok
    assert dataclasses.asdict(applied)["stack_after"] == ["three"]

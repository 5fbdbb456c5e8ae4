"""`facts` for a user who cannot reach the venv's interpreter: the venv's bin/python links into a
folder only root may enter. The host-side facts script runs as `nobody` (runuser), as the SSH
user of such a host would; root ignores the folder's mode, so root sees a working venv."""
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from toolkit.provision import facts, provision, stack
from toolkit.core.inventory import Host
from toolkit.core.transport import LocalTransport

RUNUSER = shutil.which("runuser")   # looked up before a test narrows PATH


class AsUser(LocalTransport):
    """This machine, every command run as USER (`runuser`), like an SSH login as that user."""

    def __init__(self, user: str):
        super().__init__()
        self.user = user

    def _run(self, command, *, stdin, timeout, env):
        return super()._run(f"{RUNUSER} -u {self.user} -- {command}", stdin=stdin, timeout=timeout, env=env)


@pytest.fixture
def linked_venv():
    if os.geteuid() != 0 or not RUNUSER:
        pytest.skip("needs root and runuser to run the facts as another user")
    root = Path(tempfile.mkdtemp(prefix="toolkit-facts-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        home = root / "python-home"          # the interpreter's own folder: root only
        (home / "bin").mkdir(parents=True)
        os.symlink(os.path.realpath(sys.executable), home / "bin" / "python3")
        os.chmod(home, 0o700)
        venv = root / "venv"
        (venv / "bin").mkdir(parents=True)
        (venv / "pyvenv.cfg").write_text(f"home = {home / 'bin'}\n")
        os.symlink("../../python-home/bin/python3", venv / "bin" / "python")
        yield home, venv
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_venv_whose_interpreter_links_into_an_unreadable_folder_says_so(linked_venv, no_gpu):
    home, venv = linked_venv
    host = Host(name="linked", transport="local", venv=str(venv), stack="cpu-ref")
    cpu_ref = stack.load("cpu-ref")

    as_root = facts.gather(host, cpu_ref, transport=LocalTransport())
    assert as_root.venv_exists and as_root.raw["python"]["runs"]   # the venv itself is sound

    found = facts.gather(host, cpu_ref, transport=AsUser("nobody"))
    why = (f"{home}/bin/python3 ({venv}/bin/python leads there): folder {home} is not readable by nobody"
           f" (mode 700, owner root)")
    assert found.raw["venv"]["unreadable"] == why and found.raw["python"]["error"] == why
    assert not found.venv_exists and "does not exist" not in str(found.raw)
    rows = dict(found.summary_rows())
    assert rows["venv"] == f"{venv} (cannot be used: {why})"
    assert rows["target python"] == f"not runnable: {why}"
    with pytest.raises(provision.ProvisionError, match="is there but cannot be used: .*not readable by nobody"):
        provision.preflight(cpu_ref, found, host)  # no venv is made over it

    missing = dataclasses.replace(host, venv=str(venv.parent / "absent"))
    gone = facts.gather(missing, cpu_ref, transport=AsUser("nobody"))
    assert gone.raw["python"]["error"] == "venv does not exist" and not gone.raw["venv"]["unreadable"]

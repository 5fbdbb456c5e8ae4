"""A file restored from its backup (the guard's restore, a patch run's rollback) keeps its mode, whatever
the umask: real files, the host code called directly."""
from __future__ import annotations

import hashlib
import os

from toolkit.hostside import rollout_hostlib


def test_the_guard_restores_a_file_with_the_mode_it_had_under_a_restrictive_umask(tmp_path):
    site, state = tmp_path / "site", tmp_path / "state"
    files = {"pkg/mod.py": 0o644, "pkg/run.sh": 0o755}
    before = {}
    for rel, mode in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        pristine = f"pristine {rel}\n".encode()
        before[rel] = hashlib.sha256(pristine).hexdigest()
        backup = state / "patch" / "backups" / before[rel]
        backup.parent.mkdir(parents=True, exist_ok=True)
        backup.write_bytes(pristine)
        path.write_bytes(b"patched\n")
        path.chmod(mode)
    journal = {"site": str(site), "state_dir": str(state), "before": {"files": before, "state": None}}
    umask = os.umask(0o077)    # a hardened account's: the guard inherits the SSH session's
    try:
        done = rollout_hostlib.restore_files(journal)
    finally:
        os.umask(umask)
    assert sorted(done["restored"]) == sorted(files) and not done["failed"], done
    for rel, mode in files.items():
        assert (site / rel).read_bytes() == f"pristine {rel}\n".encode()
        assert oct((site / rel).stat().st_mode & 0o777) == oct(mode), rel

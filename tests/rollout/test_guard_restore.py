"""The guard's rollback on real files, the host code called directly: a file restored from its backup
keeps its mode whatever the umask; a restore or a server step that cannot finish ends the journal
rollback-failed with the reason."""
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


def test_a_rollback_that_cannot_take_the_patch_lock_ends_failed_saying_why(tmp_path, monkeypatch):
    """A guard whose restore cannot take the patch lock (a patch run holds it) ends the journal
    rollback-failed with the reason instead of dying with it in rolling-back (a guard started again
    would fail the same way, in a loop)."""
    from toolkit.hostside import patch_hostlib

    monkeypatch.setattr(rollout_hostlib, "RESTORE_LOCK_WAIT_S", 0.3)
    site, state, folder = tmp_path / "site", tmp_path / "state", tmp_path / "rollout"
    site.mkdir()
    folder.mkdir()
    journal = {"site": str(site), "state_dir": str(state), "before": {"files": {}, "state": None},
               "lease": str(folder / "lease"), "lease_s": 60}
    rollout_hostlib.add_event(journal, "rollback-requested", "the smoke failed")
    rollout_hostlib.write_journal(str(folder), journal)
    sd = patch_hostlib.StateDir(str(state))
    with patch_hostlib.Lock(sd, 5):     # held here as another patch run would hold it
        assert rollout_hostlib.guard_main(str(folder), poll=0.05) == 0
    ended = rollout_hostlib.read_journal(str(folder))
    assert ended["phase"] == "rollback-failed"
    assert ended["result"]["reason"].startswith("files not restored, server left as it is: another toolkit patch "
                                                "run holds the lock on this host")
    assert ended["events"][-1]["detail"] == ended["result"]["reason"]


def test_a_payload_that_does_not_answer_in_time_is_an_error_answer_not_an_exception(tmp_path):
    payload = tmp_path / "stop.py"
    payload.write_text("import time\ntime.sleep(30)\n")
    assert rollout_hostlib._run_payload(str(payload), timeout=0.5) == {"_error": "no answer after 0.5 s"}

# A rollout's journal on the host and its guard. Standard library only, Python 3.8+.
#
# <state_dir>/rollout/
#   journal.json   the current (or last) rollout on this host: its phase, the state before it
#                  (file hashes, patch state, which server ran), the payloads that bring it back
#   lock           flock'ed for every phase change, so the controller and the guard never both win
#   lease          touched by the controller every few seconds while it drives this host
#   guard.py       the guard: started detached when the rollout is armed, it exits once the
#                  journal says kept or rolled back; when asked, or when the lease is older than
#                  lease_s (controller killed, SSH cut), it rolls the host back by itself
#   payloads/      server_ctl runs prepared by the controller (stop; start + wait of the old server)
#   history.jsonl  earlier journals, one per line
import json
import os
import subprocess
import sys
import time

from ._lib import sha256_file
from .locks import FileLock
from .patch_hostlib import (Lock, Refused, StateDir, full_path, recover, remove_stale_pycache,
                            restore_from_backup, write_atomic, write_json_atomic)

ROLLOUT_FORMAT = 1
RESTORE_LOCK_WAIT_S = 600   # a patch run that holds the lock longer ends the rollback as failed
TERMINAL = ("kept", "rolled-back", "rollback-failed")
RESULT_MARKER = "@@TOOLKIT-RESULT@@"


def rollout_dir(state_dir):
    return os.path.join(state_dir, "rollout")


def journal_lock(folder):
    """Held for every phase change, so the controller and the guard never both win."""
    return FileLock(os.path.join(folder, "lock"))


def read_journal(folder):
    try:
        with open(os.path.join(folder, "journal.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_journal(folder, journal):
    write_json_atomic(os.path.join(folder, "journal.json"), journal)


def add_event(journal, phase, detail=""):
    journal["phase"] = phase
    journal.setdefault("events", []).append({"phase": phase, "at": time.time(), "detail": detail})


def in_flight(journal):
    return journal is not None and journal.get("phase") not in TERMINAL


def touch(path):
    with open(path, "a"):
        pass
    os.utime(path, None)


def lease_age(journal):
    try:
        return time.time() - os.path.getmtime(journal["lease"])
    except (OSError, KeyError):
        return None


def alive(pid):
    if not pid:
        return False
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("State:"):
                    return "Z" not in line.split(":", 1)[1]
    except OSError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def spawn_guard(folder):
    """Start guard.py detached (its own session), so it outlives the SSH session and the controller."""
    log = open(os.path.join(folder, "guard.log"), "ab")
    try:
        child = subprocess.Popen([sys.executable, os.path.join(folder, "guard.py"), folder], cwd=folder,
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, close_fds=True)
    finally:
        log.close()
    return child.pid


# -- rolling back ------------------------------------------------------------------------

def _run_payload(path, timeout=3600):
    with open(path) as f:
        payload = f.read()
    try:
        done = subprocess.run([sys.executable, "-"], input=payload.encode(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"_error": "no answer after %g s" % timeout}
    text = done.stdout.decode(errors="replace")
    for line in reversed(text.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    return {"_error": "no answer (exit %d): %s" % (done.returncode, text[-800:])}


def _recorded_server(journal):
    """server.json of the server recorded as running on the host (active.json names it), or None."""
    root = os.path.join(journal["state_dir"], "server")
    try:
        with open(os.path.join(root, "active.json")) as f:
            profile = json.load(f).get("profile")
        with open(os.path.join(root, profile, "server.json")) as f:
            return json.load(f)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _server_unchanged(journal):
    """The server that ran before the rollout still runs, the same start (so it was never restarted)."""
    before = journal["before"].get("server")
    record = _recorded_server(journal)
    if record is None:
        return before is None, None
    if before is None:
        return False, record
    same = record.get("started_at") == before.get("started_at") and alive(record.get("pid"))
    return same, record


def restore_files(journal):
    """Every file back to the bytes it had before the rollout, and the patch state file too."""
    site = journal["site"]
    sd = StateDir(journal["state_dir"])
    restored, failed = [], {}
    with Lock(sd, RESTORE_LOCK_WAIT_S):
        recovered = recover(sd, site)
        for rel, sha in sorted(journal["before"]["files"].items()):
            if sha256_file(full_path(site, rel)) == sha:
                continue
            try:
                if restore_from_backup(sd, site, rel, sha):
                    restored.append(rel)
                else:
                    failed[rel] = "its backup %s is missing or corrupt" % (sha or "")[:12]
            except OSError as exc:
                failed[rel] = str(exc)
        text = journal["before"].get("state")
        current = None
        try:
            with open(sd.state) as f:
                current = f.read()
        except OSError:
            pass
        if text is None and current is not None:
            os.unlink(sd.state)
        elif text is not None and current != text:
            write_atomic(sd.state, text.encode())
        pycache = remove_stale_pycache(site, restored)
    return {"restored": restored, "failed": failed, "recovered": recovered, "pycache_removed": len(pycache)}


def bring_back_server(journal):
    """Stop whatever runs now and start the recorded server again, unless it never stopped."""
    same, record = _server_unchanged(journal)
    if same:
        return {"server": "unchanged", "pid": record and record.get("pid")}
    payloads = journal["payloads"]
    answer = {"stopped": _run_payload(payloads["stop"])}
    stopped = answer["stopped"]
    trouble = stopped.get("_error") or (stopped.get("stopped") is False and stopped.get("was_running")
                                        and stopped.get("reason"))
    # Processes that outlived the stop keep the old server from starting again. A stop that failed
    # otherwise (GPU memory not idle yet, nvidia-smi broken) leaves that to the start's own checks.
    left = stopped.get("survivors") or (stopped.get("_error") and alive((_recorded_server(journal) or {}).get("pid")))
    if left or (trouble and not payloads.get("start")):
        answer["server"] = "failed"
        answer["reason"] = "the server did not stop: %s" % trouble
        return answer
    if not payloads.get("start"):
        answer["server"] = "none (none ran before)"
        return answer
    started = _run_payload(payloads["start"])
    while started.get("status") == "waiting":
        started = _run_payload(payloads["wait"])
    answer["started"] = {k: started.get(k) for k in ("status", "reason")}
    if started.get("status") == "ready":
        answer["server"] = "restarted"
        answer["pid"] = (started.get("record") or {}).get("pid")
    else:
        answer["server"] = "failed"
        answer["reason"] = "the old server did not start again: %s" % (started.get("_error") or started.get("reason"))
        answer["log_tail"] = started.get("log_tail", "")
    return answer


def roll_back(folder, journal):
    """Restore the files, then the server; ends the journal rolled-back or rollback-failed, never
    cut by an exception (a guard that died here would be started again and fail the same way)."""
    try:
        result = {"files": restore_files(journal)}
    except (Refused, OSError) as exc:   # a patch run holding the lock, a state dir that cannot be read
        result = {"files": {"restored": [], "failed": {}}, "server": "failed",
                  "reason": "files not restored, server left as it is: %s" % exc}
    else:
        try:
            result.update(bring_back_server(journal))
        except Exception as exc:   # whatever it was, the journal must say it
            result.update(server="failed", reason="the server was not brought back: %s: %s"
                          % (type(exc).__name__, exc))
    ok = not result["files"]["failed"] and result.get("server") != "failed"
    with journal_lock(folder):
        current = read_journal(folder) or journal
        current["result"] = result
        why = result.get("reason") or "files not restored: %s" % ", ".join(result["files"]["failed"])
        add_event(current, "rolled-back" if ok else "rollback-failed", "" if ok else why)
        write_journal(folder, current)
    return current


def claim(folder, reason):
    """Move an in-flight rollout to rolling-back (once: whoever claims it first does the work)."""
    with journal_lock(folder):
        journal = read_journal(folder)
        if not in_flight(journal) or journal["phase"] == "rolling-back":
            return None
        journal["rolled_back_by"] = reason
        # the phase the rollout had reached, not a later controller's request to roll it back
        journal["interrupted_phase"] = next(
            (e["phase"] for e in reversed(journal.get("events", [])) if e["phase"] != "rollback-requested"),
            journal["phase"])
        add_event(journal, "rolling-back", reason)
        journal["guard_pid"] = os.getpid()
        write_journal(folder, journal)
        return journal


def guard_main(folder, poll=0.5):
    """Wait until the rollout is kept or rolled back; roll it back when asked or when the lease runs out."""
    me = os.getpid()
    while True:
        journal = read_journal(folder)
        if not in_flight(journal):
            return 0
        if journal.get("guard_pid") not in (None, me) and alive(journal.get("guard_pid")):
            return 0   # another guard (started again by a later command) watches this rollout
        reason = None
        if journal["phase"] == "rollback-requested":
            reason = "asked by the controller: %s" % journal["events"][-1].get("detail", "")
        elif journal["phase"] == "rolling-back":
            reason = "resumed a rollback that was cut"
        else:
            age = lease_age(journal)
            if age is None or age > journal["lease_s"]:
                reason = ("the controller went away during %s (no heartbeat for %s s)"
                          % (journal["phase"], "?" if age is None else int(age)))
        if reason:
            if journal["phase"] == "rolling-back":
                claimed = journal
            else:
                claimed = claim(folder, reason)
            if claimed is not None:
                roll_back(folder, claimed)
            return 0
        time.sleep(poll)

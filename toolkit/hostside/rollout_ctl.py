# The host side of `invoke rollout`: arm a rollout (record the state before it, back up every file
# it may touch, start the guard), move it from phase to phase, ask the guard to roll it back, and
# say where it stands. One round trip per action; the journal and the guard are in rollout_hostlib.
import json
import os
import time

from ._lib import sha256_file
from .patch_hostlib import Lock, Refused, StateDir, find_site, full_path, recover, write_atomic
from .rollout_hostlib import (ROLLOUT_FORMAT, add_event, alive, in_flight, journal_lock, lease_age, read_journal,
                              rollout_dir, spawn_guard, touch, write_journal)


def _status(folder):
    journal = read_journal(folder)
    if journal is None:
        return {"journal": None}
    return {"journal": journal, "guard_alive": alive(journal.get("guard_pid")),
            "lease_age_s": lease_age(journal)}


def arm(args):
    folder = rollout_dir(args["state_dir"])
    site = find_site(args)
    sd = StateDir(args["state_dir"])
    with journal_lock(folder):
        previous = read_journal(folder)
        if in_flight(previous):
            raise Refused("rollout %s is still in flight on this host (phase %s); it is finished or "
                          "rolled back first" % (previous["id"], previous["phase"]))
        if previous is not None:
            with open(os.path.join(folder, "history.jsonl"), "a") as f:
                f.write(json.dumps(previous) + "\n")
        os.makedirs(sd.backups, exist_ok=True)
        with Lock(sd, args.get("lock_timeout", 30)):
            recover(sd, site)
            files = {}
            for rel in args["paths"]:
                path = full_path(site, rel)
                sha = sha256_file(path)
                files[rel] = sha
                if sha is not None and sha256_file(sd.backup_path(sha)) != sha:
                    with open(path, "rb") as f:
                        write_atomic(sd.backup_path(sha), f.read())
            try:
                with open(sd.state) as f:
                    state_text = f.read()
            except OSError:
                state_text = None
        payloads = os.path.join(folder, "payloads")
        os.makedirs(payloads, exist_ok=True)
        names = {}
        for name, text in sorted(args["payloads"].items()):
            if text is None:
                names[name] = None
                continue
            names[name] = os.path.join(payloads, name + ".py")
            write_atomic(names[name], text.encode())
        write_atomic(os.path.join(folder, "guard.py"), args["guard_source"].encode())
        lease = os.path.join(folder, "lease")
        touch(lease)
        journal = {"format": ROLLOUT_FORMAT, "id": args["id"], "change": args["change"],
                   "controller": args["controller"], "lease": lease, "lease_s": args["lease_s"],
                   "site": site, "state_dir": args["state_dir"], "package": args["package"],
                   "before": {"files": files, "state": state_text, "stack": args["stack"],
                              "server": args["server"]},
                   "after": args["after"], "payloads": names, "guard_pid": None, "events": []}
        add_event(journal, "armed")
        write_journal(folder, journal)
        journal["guard_pid"] = spawn_guard(folder)
        write_journal(folder, journal)
    return {"journal": journal}


def phase(args):
    """Move the rollout to args["phase"] if it is still in one of args["from"] (else say where it is)."""
    folder = rollout_dir(args["state_dir"])
    with journal_lock(folder):
        journal = read_journal(folder)
        if journal is None or journal.get("id") != args["id"] or journal["phase"] not in args["from"]:
            return {"ok": False, "journal": journal}
        add_event(journal, args["phase"], args.get("detail", ""))
        if args.get("data"):
            journal.update(args["data"])
        write_journal(folder, journal)
        touch(journal["lease"])
    return {"ok": True, "journal": journal}


def request(args):
    """Ask the guard to roll the in-flight rollout back; start a guard again if none runs."""
    folder = rollout_dir(args["state_dir"])
    with journal_lock(folder):
        journal = read_journal(folder)
        if not in_flight(journal):
            return _status(folder)
        if journal["phase"] != "rolling-back":
            add_event(journal, "rollback-requested", args.get("reason", ""))
        if not alive(journal.get("guard_pid")):
            write_journal(folder, journal)
            journal["guard_pid"] = spawn_guard(folder)
        write_journal(folder, journal)
    return _status(folder)


def wait(args):
    """Wait up to wait_s for the rollout to reach a final phase (kept / rolled back)."""
    folder = rollout_dir(args["state_dir"])
    deadline = time.time() + args.get("wait_s", 15)
    while True:
        answer = _status(folder)
        journal = answer["journal"]
        if not in_flight(journal) or time.time() >= deadline:
            return answer
        if not answer["guard_alive"] and journal["phase"] in ("rollback-requested", "rolling-back"):
            return request({"state_dir": args["state_dir"], "reason": "guard gone; started again"})
        time.sleep(0.25)


def status(args):
    return _status(rollout_dir(args["state_dir"]))


def main(args):
    handlers = {"arm": arm, "phase": phase, "request": request, "wait": wait, "status": status}
    return handlers[args["action"]](args)

# Carry out one plan of file writes in one run, so that a cut at any point leaves a host
# that the next run brings back to "no file half-patched, state agrees with files".
# Steps: check the state folder can be written, lock, remove temporaries of dead runs, recover
# any journal, check the host is still as probed, that every target can be replaced and that
# every file system has the space the run needs, back up the current bytes
# (content-addressed), journal "prepare" (temporary names), write the new files beside the
# old and fsync (a full disk up to here: temporaries and journal removed, nothing changed),
# journal "commit", rename one by one (a rename that fails puts back the
# files already replaced at once), write the state, remove stale __pycache__ entries,
# remove the journal.
import base64
import hashlib
import os
import time

from ._lib import sha256_file
from .patch_hostlib import (TMP_SUFFIX, Lock, Refused, StateDir, checkpoint, find_dist, find_site, fs_space,
                            fsync_dir, full_path, is_no_space, meta_estimate, no_space_message, recover,
                            remove_files, remove_stale_pycache, remove_stale_tmp, replace_blockers, space_needs,
                            space_shortfalls, state_dir_blocker, write_atomic, write_json_atomic)


class Failed(Exception):
    """The run changed files and could not put all of them back (the message says which)."""


def _check_still_as_probed(args, site, sd):
    dist, version = find_dist(site, args["package"])
    if version != args["version"]:
        raise Refused("installed %s is %s, the plan is for %s; nothing written" % (
            args["package"], version, args["version"]))
    _, state_sha = sd.read_state()
    if state_sha != args.get("expect_state_sha"):
        raise Refused("the patch state on this host changed since it was probed (another run?);"
                      " nothing written; run the command again")
    changed = [p for p, sha in sorted(args["expect"].items()) if sha256_file(full_path(site, p)) != sha]
    if changed:
        raise Refused("files changed since they were probed (another run?): %s; nothing written;"
                      " run the command again" % ", ".join(changed))


def _check_replaceable(site, writes):
    blocked = replace_blockers(site, [w["path"] for w in writes])
    if blocked:
        raise Refused("cannot replace %s; nothing written" % "; ".join(
            "%s: %s" % item for item in sorted(blocked.items())))


def _new_bytes(write, sd):
    if write.get("content") is not None:
        data = base64.b64decode(write["content"])
    else:
        try:
            with open(sd.backup_path(write["from_backup"]), "rb") as f:
                data = f.read()
        except OSError:
            data = b""
    if hashlib.sha256(data).hexdigest() != write["sha256"]:
        raise Refused("new content for %s does not hash to %s (backup missing or corrupt?); nothing written"
                      % (write["path"], write["sha256"]))
    return data


def _back_up(sd, site, paths, space):
    """Keep the current bytes of every path under backups/<sha256>; {path: backup file}."""
    os.makedirs(sd.backups, exist_ok=True)
    saved = {}
    for rel in paths:
        path = full_path(site, rel)
        if not os.path.exists(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        sha = hashlib.sha256(data).hexdigest()
        if sha256_file(sd.backup_path(sha)) != sha:
            try:
                write_atomic(sd.backup_path(sha), data)
            except OSError as exc:
                if not is_no_space(exc):
                    raise
                raise Refused(space.message(exc, sd.backup_path(sha), "the backup of %s" % rel)
                              + "; no file changed (the backups already made are kept)")
        saved[rel] = sd.backup_path(sha)
    return saved


class _Space(object):
    """What the run needs on each file system, checked before anything is written; the
    message for a write that still finds a file system full."""

    def __init__(self, site, sd, writes, new_data, state):
        self.site_space, self.state_space = fs_space(site), fs_space(sd.root)
        backups = []
        for w in writes:
            path = full_path(site, w["path"])
            sha = sha256_file(path)
            if sha is not None and sha256_file(sd.backup_path(sha)) != sha:
                backups.append(os.path.getsize(path))
        new_sizes = [len(data) for data in new_data.values() if data is not None]
        meta = meta_estimate(state, sd.read_state()[0], writes)[:-1]
        sizes = (self.site_space, self.state_space, new_sizes, backups, meta)
        self.short = space_shortfalls(*sizes)
        self.need = dict((space["dev"], need) for space, need in space_needs(*sizes))

    def refuse_short(self):
        if self.short:
            raise Refused("not enough free space; nothing written: %s" % "; ".join(
                "%s has %d bytes free, the run needs %d there" % (folder, free, need)
                for folder, need, free in self.short))

    def message(self, exc, path, what):
        folder = os.path.dirname(path) or "."
        need = self.need.get(os.stat(folder).st_dev, 0)
        return no_space_message(exc, path, need, what)


def _drop_prepared(sd, site, entries):
    """Undo a run still in phase prepare (no target touched): its temporaries, then its journal."""
    remove_files([full_path(site, e["tmp"]) for e in entries if e["tmp"]])
    remove_files([sd.journal])
    fsync_dir(sd.root)


def _verify_command(args):
    return "invoke patch verify --host %s" % args["host"] if args.get("host") else "invoke patch verify"


def _rename_all(entries, site, journal, sd, verify):
    """Rename every new file over its target; if one cannot be, put back those already done."""
    done = 0
    try:
        for done, entry in enumerate(entries, 1):
            target = full_path(site, entry["path"])
            if entry["tmp"]:
                os.replace(full_path(site, entry["tmp"]), target)
            elif os.path.lexists(target):
                os.unlink(target)
            checkpoint("after-rename-%d" % done)
    except OSError as exc:
        journal["phase"] = "rollback"
        journal["failure"] = "%s could not be replaced: %s" % (entries[done - 1]["path"], exc)
        write_json_atomic(sd.journal, journal)
        outcome = recover(sd, site)
        what = "could not replace %s (%s) after %d of %d renames" % (entries[done - 1]["path"], exc, done - 1,
                                                                    len(entries))
        if outcome["damaged"]:
            raise Failed("%s; %s; `%s` shows what each file holds" % (what, outcome["outcome"], verify))
        raise Refused("%s; put the %d file(s) already replaced back: nothing changed" % (what, done - 1))


def _transaction(args, site, sd):
    _check_still_as_probed(args, site, sd)
    writes = args["writes"]
    if not writes:
        if args.get("state_changed"):
            os.makedirs(sd.root, exist_ok=True)
            write_json_atomic(sd.state, args["state"])
        return {"changed": [], "hashes": {}, "pycache_removed": [], "kept": {}}
    _check_replaceable(site, writes)
    new_data = {w["path"]: (None if w["sha256"] is None else _new_bytes(w, sd)) for w in writes}
    space = _Space(site, sd, writes, new_data, args["state"])
    space.refuse_short()
    checkpoint("after-checks")
    kept = _back_up(sd, site, [w["path"] for w in writes], space)
    checkpoint("after-backups")
    run_id = "%d-%d" % (int(time.time()), os.getpid())
    entries = []
    for w in writes:
        folder, name = os.path.split(w["path"])
        tmp_name = ".%s.%s%s" % (name, run_id, TMP_SUFFIX)
        tmp = None if w["sha256"] is None else (folder + "/" if folder else "") + tmp_name
        entries.append({"path": w["path"], "tmp": tmp, "old": args["expect"].get(w["path"]), "new": w["sha256"]})
    old_state, _ = sd.read_state()
    journal = {"run": run_id, "phase": "prepare", "site": site, "entries": entries,
               "old_state": old_state, "new_state": args["state"]}
    what = "the journal"
    try:
        write_json_atomic(sd.journal, journal)
        checkpoint("after-prepare")
        for entry in entries:
            if entry["tmp"]:
                target = full_path(site, entry["path"])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                tmp = full_path(site, entry["tmp"])
                what = "the new %s" % entry["path"]
                with open(tmp, "wb") as f:
                    f.write(new_data[entry["path"]])
                    f.flush()
                    os.fsync(f.fileno())
                if os.path.exists(target):
                    os.chmod(tmp, os.stat(target).st_mode & 0o7777)
        for folder in {os.path.dirname(full_path(site, e["path"])) for e in entries if e["tmp"]}:
            fsync_dir(folder)
        checkpoint("after-new-files")
        journal["phase"] = "commit"
        what = "the journal"
        write_json_atomic(sd.journal, journal)
    except OSError as exc:
        if not is_no_space(exc):
            raise
        # still phase prepare on disk (a failed write_atomic leaves the old journal): no target
        # was touched, so the run is undone here rather than by the next command
        path = sd.journal if what == "the journal" else full_path(site, entry["tmp"])
        message = space.message(exc, path, what)
        _drop_prepared(sd, site, entries)
        raise Refused(message + "; no file changed, the temporary files and the journal are removed")
    checkpoint("after-rename-0")
    _rename_all(entries, site, journal, sd, _verify_command(args))
    for folder in {os.path.dirname(full_path(site, e["path"])) for e in entries}:
        fsync_dir(folder)
    try:
        write_json_atomic(sd.state, args["state"])
    except OSError as exc:
        if not is_no_space(exc):
            raise
        raise Failed("%s; all %d file(s) hold the new content and the journal says so: once space is free,"
                     " the next `%s`, apply or revert finishes the run (rolls it forward)"
                     % (space.message(exc, sd.state, "the state"), len(entries), _verify_command(args)))
    checkpoint("after-state")
    removed = remove_stale_pycache(site, [e["path"] for e in entries])
    os.unlink(sd.journal)
    fsync_dir(sd.root)
    hashes = {e["path"]: sha256_file(full_path(site, e["path"])) for e in entries}
    return {"changed": [e["path"] for e in entries], "hashes": hashes, "pycache_removed": removed, "kept": kept}


def main(args):
    try:
        site = find_site(args)
        sd = StateDir(args["state_dir"])
        base = args.get("venv") or site
        blocked = state_dir_blocker(sd, base)
        if blocked:
            raise Refused("%s; nothing written" % blocked)
        with Lock(sd, args.get("lock_timeout", 30), base):
            cleaned = remove_stale_tmp(sd)
            recovered = recover(sd, site)
            if args.get("mode") == "recover":
                return {"recovered": recovered, "changed": [], "hashes": {}, "cleaned": cleaned}
            if recovered is not None:
                raise Refused("finished an interrupted earlier run first (%s); the plan was made before that;"
                              " nothing else written; run the command again" % recovered["outcome"])
            checkpoint("after-lock")
            answer = _transaction(args, site, sd)
            answer["recovered"], answer["cleaned"] = recovered, cleaned
            return answer
    except Refused as exc:
        return {"refused": str(exc)}
    except Failed as exc:
        return {"failed": str(exc)}

# Carry out one plan of file writes in one run, so that a cut at any point leaves a host
# that the next run brings back to "no file half-patched, state agrees with files".
# Steps: lock, remove temporaries of dead runs, recover any journal, check the host is still
# as probed and that every target can be replaced, back up the current bytes
# (content-addressed), journal "prepare" (temporary names), write the new files beside the
# old and fsync, journal "commit", rename one by one (a rename that fails puts back the
# files already replaced at once), write the state, remove stale __pycache__ entries,
# remove the journal.
# hostrun-uses: patch_hostlib
import base64
import hashlib
import os
import time


class Failed(Exception):
    """The run changed files and could not put all of them back (the message says which)."""


def _check_still_as_probed(args, site, sd):
    dist, version = find_dist(site, args["package"])  # noqa: F821
    if version != args["version"]:
        raise Refused("installed %s is %s, the plan is for %s; nothing written" % (  # noqa: F821
            args["package"], version, args["version"]))
    _, state_sha = sd.read_state()
    if state_sha != args.get("expect_state_sha"):
        raise Refused("the patch state on this host changed since it was probed (another run?);"  # noqa: F821
                      " nothing written; run the command again")
    changed = [p for p, sha in sorted(args["expect"].items()) if sha256_file(full_path(site, p)) != sha]  # noqa: F821
    if changed:
        raise Refused("files changed since they were probed (another run?): %s; nothing written;"  # noqa: F821
                      " run the command again" % ", ".join(changed))


def _check_replaceable(site, writes):
    blocked = replace_blockers(site, [w["path"] for w in writes])  # noqa: F821
    if blocked:
        raise Refused("cannot replace %s; nothing written" % "; ".join(  # noqa: F821
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
        raise Refused("new content for %s does not hash to %s (backup missing or corrupt?); nothing written"  # noqa: F821
                      % (write["path"], write["sha256"]))
    return data


def _back_up(sd, site, paths):
    """Keep the current bytes of every path under backups/<sha256>; {path: backup file}."""
    os.makedirs(sd.backups, exist_ok=True)
    saved = {}
    for rel in paths:
        path = full_path(site, rel)  # noqa: F821
        if not os.path.exists(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        sha = hashlib.sha256(data).hexdigest()
        if sha256_file(sd.backup_path(sha)) != sha:  # noqa: F821
            write_atomic(sd.backup_path(sha), data)  # noqa: F821
        saved[rel] = sd.backup_path(sha)
    return saved


def _rename_all(entries, site, journal, sd):
    """Rename every new file over its target; if one cannot be, put back those already done."""
    done = 0
    try:
        for done, entry in enumerate(entries, 1):
            target = full_path(site, entry["path"])  # noqa: F821
            if entry["tmp"]:
                os.replace(full_path(site, entry["tmp"]), target)  # noqa: F821
            elif os.path.lexists(target):
                os.unlink(target)
            checkpoint("after-rename-%d" % done)  # noqa: F821
    except OSError as exc:
        journal["phase"] = "rollback"
        journal["failure"] = "%s could not be replaced: %s" % (entries[done - 1]["path"], exc)
        write_json_atomic(sd.journal, journal)  # noqa: F821
        outcome = recover(sd, site)  # noqa: F821
        what = "could not replace %s (%s) after %d of %d renames" % (entries[done - 1]["path"], exc, done - 1,
                                                                    len(entries))
        if outcome["damaged"]:
            raise Failed("%s; %s; `invoke patch verify` shows what each file holds" % (what, outcome["outcome"]))
        raise Refused("%s; put the %d file(s) already replaced back: nothing changed" % (what, done - 1))  # noqa: F821


def _transaction(args, site, sd):
    _check_still_as_probed(args, site, sd)
    writes = args["writes"]
    if not writes:
        if args.get("state_changed"):
            os.makedirs(sd.root, exist_ok=True)
            write_json_atomic(sd.state, args["state"])  # noqa: F821
        return {"changed": [], "hashes": {}, "pycache_removed": [], "kept": {}}
    _check_replaceable(site, writes)
    new_data = {w["path"]: (None if w["sha256"] is None else _new_bytes(w, sd)) for w in writes}
    kept = _back_up(sd, site, [w["path"] for w in writes])
    checkpoint("after-backups")  # noqa: F821
    run_id = "%d-%d" % (int(time.time()), os.getpid())
    entries = []
    for w in writes:
        folder, name = os.path.split(w["path"])
        tmp_name = ".%s.%s%s" % (name, run_id, TMP_SUFFIX)  # noqa: F821
        tmp = None if w["sha256"] is None else (folder + "/" if folder else "") + tmp_name
        entries.append({"path": w["path"], "tmp": tmp, "old": args["expect"].get(w["path"]), "new": w["sha256"]})
    old_state, _ = sd.read_state()
    journal = {"run": run_id, "phase": "prepare", "site": site, "entries": entries,
               "old_state": old_state, "new_state": args["state"]}
    write_json_atomic(sd.journal, journal)  # noqa: F821
    checkpoint("after-prepare")  # noqa: F821
    for entry in entries:
        if entry["tmp"]:
            target = full_path(site, entry["path"])  # noqa: F821
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = full_path(site, entry["tmp"])  # noqa: F821
            with open(tmp, "wb") as f:
                f.write(new_data[entry["path"]])
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(target):
                os.chmod(tmp, os.stat(target).st_mode & 0o7777)
    for folder in {os.path.dirname(full_path(site, e["path"])) for e in entries if e["tmp"]}:  # noqa: F821
        fsync_dir(folder)  # noqa: F821
    checkpoint("after-new-files")  # noqa: F821
    journal["phase"] = "commit"
    write_json_atomic(sd.journal, journal)  # noqa: F821
    checkpoint("after-rename-0")  # noqa: F821
    _rename_all(entries, site, journal, sd)
    for folder in {os.path.dirname(full_path(site, e["path"])) for e in entries}:  # noqa: F821
        fsync_dir(folder)  # noqa: F821
    write_json_atomic(sd.state, args["state"])  # noqa: F821
    checkpoint("after-state")  # noqa: F821
    removed = remove_stale_pycache(site, [e["path"] for e in entries])  # noqa: F821
    os.unlink(sd.journal)
    fsync_dir(sd.root)  # noqa: F821
    hashes = {e["path"]: sha256_file(full_path(site, e["path"])) for e in entries}  # noqa: F821
    return {"changed": [e["path"] for e in entries], "hashes": hashes, "pycache_removed": removed, "kept": kept}


def main(args):
    try:
        site = find_site(args)  # noqa: F821
        sd = StateDir(args["state_dir"])  # noqa: F821
        with Lock(sd, args.get("lock_timeout", 30)):  # noqa: F821
            cleaned = remove_stale_tmp(sd)  # noqa: F821
            recovered = recover(sd, site)  # noqa: F821
            if args.get("mode") == "recover":
                return {"recovered": recovered, "changed": [], "hashes": {}, "cleaned": cleaned}
            if recovered is not None:
                raise Refused("finished an interrupted earlier run first (%s); the plan was made before that;"  # noqa: F821
                              " nothing else written; run the command again" % recovered["outcome"])
            answer = _transaction(args, site, sd)
            answer["recovered"], answer["cleaned"] = recovered, cleaned
            return answer
    except Refused as exc:  # noqa: F821
        return {"refused": str(exc)}
    except Failed as exc:
        return {"failed": str(exc)}

# One round trip that tells the control machine everything a patch command needs:
# where site-packages is, the installed version (METADATA) and RECORD hashes, the sha256
# of the files asked for and of the files the state lists, which of them cannot be
# replaced and why, whether the state folder can be written, the free space where a run
# writes, the state, the backups, and (with "recover") the outcome of finishing
# a run that was cut and the temporaries of dead runs it removed. Reads dist-info files
# directly; never imports the package.
import base64
import os
import platform

from ._lib import sha256_file
from .patch_hostlib import (Lock, Refused, StateDir, find_dist, find_site, fs_space, full_path, read_record, recover,
                            remove_stale_tmp, replace_blockers, stale_tmp_files, state_dir_blocker)


def main(args):
    try:
        return _probe(args)
    except Refused as exc:
        return {"refused": str(exc)}


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _probe(args):
    site = find_site(args)
    dist, version = find_dist(site, args["package"])
    sd = StateDir(args["state_dir"])
    recovered, cleaned = None, []
    base = args.get("venv") or site
    if args.get("recover") and (sd.read_journal() is not None or stale_tmp_files([sd.root, sd.backups])):
        with Lock(sd, args.get("lock_timeout", 30), base):
            cleaned = remove_stale_tmp(sd)
            recovered = recover(sd, site)
    state, state_sha = sd.read_state()
    record = read_record(dist) if dist else {}
    wanted = set(args.get("paths", []))
    if state:
        wanted.update(state.get("files", {}))
        wanted.update(state.get("damaged", []))
    answer = {
        "site": site,
        "python": platform.python_version(),
        "dist_info": os.path.basename(dist) if dist else None,
        "version": version,
        "record": {p: record.get(p) for p in sorted(wanted)},
        "files": {p: sha256_file(full_path(site, p)) for p in sorted(wanted)},
        "state": state,
        "state_sha": state_sha,
        "journal": sd.read_journal(),
        "recovered": recovered,
        "cleaned": cleaned,
        "blocked": replace_blockers(site, sorted(wanted)),
        "state_blocked": state_dir_blocker(sd, base),
        "space": {"site": fs_space(site), "state": fs_space(sd.root)},
        "sizes": {p: _size(full_path(site, p)) for p in sorted(wanted)},
        "backups": sd.backup_status(),
        "backup_dir": sd.backups,
    }
    if args.get("fetch"):
        answer["contents"] = {}
        for p in args["fetch"]:
            try:
                with open(full_path(site, p), "rb") as f:
                    answer["contents"][p] = base64.b64encode(f.read()).decode()
            except OSError:
                answer["contents"][p] = None
    if args.get("all_files"):
        mismatch, checked = {}, 0
        for p, expected in sorted(record.items()):
            if expected is None or p.startswith("..") or os.path.isabs(p) or p.endswith("/"):  # a folder row
                continue
            checked += 1
            found = sha256_file(full_path(site, p))
            if found != expected:
                mismatch[p] = found
        answer["all_files"] = {"checked": checked, "mismatch": mismatch}
    return answer

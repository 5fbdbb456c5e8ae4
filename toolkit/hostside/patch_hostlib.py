# What patch_probe.py, patch_apply.py and the rollout share: the patch state folder, its lock,
# atomic writes, recovery of a cut run. Standard library only, Python 3.8+.
# Host state lives in <state_dir>/patch/:
#   state.json    what is applied: package, version, site, stack, expected sha256 per file
#   journal.json  present only while a run changes files (see recover() for the rule)
#   lock          flock'ed by every run that writes or recovers
#   backups/<sha256>  original bytes, content-addressed
import base64
import errno
import fcntl
import glob
import hashlib
import json
import os
import re
import stat
import struct
import time

from ._lib import owner_name, sha256_file, user_name
from .locks import FileLock, LockBusy

STATE_FORMAT = 1
TMP_SUFFIX = ".toolkit-new"


class Refused(Exception):
    """The run refuses and has written nothing (the message says why)."""


def record_hex(value):
    if not value or not value.startswith("sha256="):
        return None
    digest = value[len("sha256="):]
    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()


def find_site(args):
    if args.get("pythonpath"):
        return args["pythonpath"].split(os.pathsep)[0]
    venv = args.get("venv")
    if not venv:
        raise Refused("host has neither venv nor pythonpath set: cannot find site-packages")
    normal = args["package"].replace("-", "_").lower()
    candidates = sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages")))
    for site in candidates:
        if glob.glob(os.path.join(site, normal + "-*.dist-info")):
            return site
    if candidates:
        return candidates[0]
    raise Refused("no site-packages under %s/lib/python*/ (is the venv there?)" % venv)


def find_dist(site, package):
    """(dist-info folder, installed version) or (None, None) when the package is not installed."""
    normal = package.replace("-", "_").lower()
    for dist in sorted(glob.glob(os.path.join(site, "*.dist-info"))):
        base = os.path.basename(dist)[:-len(".dist-info")]
        name, _, version = base.rpartition("-")
        if name.replace("-", "_").lower() != normal:
            continue
        try:
            with open(os.path.join(dist, "METADATA"), encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("Version:"):
                        version = line.split(":", 1)[1].strip()
                        break
                    if not line.strip():
                        break
        except OSError:
            pass
        return dist, version
    return None, None


def read_record(dist):
    import csv
    record = {}
    try:
        with open(os.path.join(dist, "RECORD"), newline="", encoding="utf-8") as f:
            for row in csv.reader(f):
                if row:
                    record[row[0]] = record_hex(row[1] if len(row) > 1 else "")
    except OSError:
        pass
    return record


class StateDir(object):
    def __init__(self, root):
        self.root = os.path.join(root, "patch")
        self.state = os.path.join(self.root, "state.json")
        self.journal = os.path.join(self.root, "journal.json")
        self.lock = os.path.join(self.root, "lock")
        self.backups = os.path.join(self.root, "backups")

    def exists(self):
        return os.path.isdir(self.root)

    def read_state(self):
        try:
            with open(self.state, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None, None
        return json.loads(raw.decode()), hashlib.sha256(raw).hexdigest()

    def read_journal(self):
        try:
            with open(self.journal) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def backup_path(self, sha):
        return os.path.join(self.backups, sha)

    def backup_status(self):
        found = {}
        for name in sorted(os.listdir(self.backups)) if os.path.isdir(self.backups) else []:
            if len(name) == 64:
                found[name] = "ok" if sha256_file(self.backup_path(name)) == name else "corrupt"
        return found


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, data, mode=None):
    """Write beside, fsync, rename over, fsync the folder: readers see old or new, never half.
    `mode`: the new file's permission bits (else 0666 less the umask, as open() makes it)."""
    tmp = "%s.tmp%d" % (path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        remove_files([tmp])
        raise
    fsync_dir(os.path.dirname(path) or ".")


def write_json_atomic(path, data):
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())


_ATOMIC_TMP = re.compile(r"\.tmp([0-9]+)$")   # write_atomic's temporary names


def pid_alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def stale_tmp_files(folders, only=None):
    """write_atomic temporaries (`NAME.tmp<pid>`) in `folders` whose writer is dead; with
    `only`, just those of the files named there. A live run's temporaries are left alone."""
    found = []
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            match = _ATOMIC_TMP.search(name)
            if not match or (only is not None and name[:match.start()] not in only):
                continue
            if not pid_alive(int(match.group(1))):
                found.append(os.path.join(folder, name))
    return sorted(found)


def remove_files(paths):
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def remove_stale_tmp(sd):
    """Temporaries that a killed run left in the state folder (state, journal, backups)."""
    return remove_files(stale_tmp_files([sd.root, sd.backups]))


FS_IMMUTABLE_FL, FS_APPEND_FL = 0x10, 0x20
FS_IOC_GETFLAGS = 0x80006601 | (struct.calcsize("l") << 16)   # _IOR('f', 1, long)


def _linux_inode_flags(path):
    """The chattr flags of `path` (Linux), or 0 where the file system has none or they cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, b"\0" * 8)[:4])[0]  # the kernel writes an int
    except (OSError, ValueError):
        return 0
    finally:
        os.close(fd)


def _flag_blocker(path, what):
    flags = getattr(os.lstat(path), "st_flags", None)
    if flags is not None:  # BSD, macOS
        if flags & (stat.UF_IMMUTABLE | stat.SF_IMMUTABLE | stat.UF_APPEND | stat.SF_APPEND):
            return "%s %s has the immutable or append-only flag (`ls -lO` shows it); clear it with" \
                   " `chflags nouchg,noschg,nouappnd,nosappnd %s`" % (what, path, path)
        return None
    flags = _linux_inode_flags(path)
    if flags & FS_IMMUTABLE_FL:
        return "%s %s has the immutable attribute (`lsattr` shows 'i'); clear it with `chattr -i %s`" % (
            what, path, path)
    if flags & FS_APPEND_FL:
        return "%s %s has the append-only attribute (`lsattr` shows 'a'); clear it with `chattr -a %s`" % (
            what, path, path)
    return None


def replace_blockers(site, rels):
    """{rel: why} for every file of `rels` that a rename could not replace (or unlink could not
    delete), judged without writing anything: a symbolic link (never replaced, see
    docs/patching.md), a folder that is not writable, an immutable or append-only file or
    folder, a sticky folder owned by someone else, a mount point."""
    blocked = {}
    euid = os.geteuid()
    for rel in rels:
        path = full_path(site, rel)
        folder = os.path.dirname(path)
        while folder and not os.path.isdir(folder):  # a new file: judge the nearest folder that exists
            folder = os.path.dirname(folder)
        reason = None
        if os.path.islink(path):
            reason = ("%s is a symbolic link (to %s); the toolkit replaces files by rename and never turns a link"
                      " into a regular file nor changes the file behind it: replace the link by a copy first"
                      " (`cp --remove-destination \"$(readlink -f %s)\" %s`)" % (path, os.readlink(path), path, path))
        elif os.path.isdir(path):
            reason = "%s is a folder, the patch needs a file there" % path
        elif not os.access(folder, os.W_OK | os.X_OK):
            reason = "folder %s is not writable by %s (read-only folder or file system)" % (folder, user_name())
        else:
            reason = _flag_blocker(folder, "folder")
            if reason is None and os.path.lexists(path):
                info, folder_info = os.lstat(path), os.stat(folder)
                reason = _flag_blocker(path, "file")
                if reason is None and folder_info.st_mode & stat.S_ISVTX and euid not in (
                        0, info.st_uid, folder_info.st_uid):
                    reason = "folder %s is sticky and %s belongs to uid %d, not to %s" % (
                        folder, path, info.st_uid, user_name())
                if reason is None and info.st_dev != folder_info.st_dev:
                    reason = "%s is a mount point (bind-mounted file); a rename cannot replace it" % path
        if reason:
            blocked[rel] = reason
    return blocked


def _nearest_existing(path):
    while path and not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def state_dir_blocker(sd, base=None):
    """Why this user could not take the lock and write state, journal and backups under
    <state>/patch (None: it can), judged without writing anything. `base` is the venv (or
    site folder) the state belongs to: where another user owns it, the reason names that user."""
    blocked, why = None, None
    if os.path.lexists(sd.lock) and not os.access(sd.lock, os.R_OK | os.W_OK):
        blocked, why = sd.lock, "file"
    for folder in (sd.backups, sd.root):
        if blocked is None and os.path.isdir(folder) and not os.access(folder, os.W_OK | os.X_OK):
            blocked, why = folder, "folder"
    if blocked is None and not os.path.isdir(sd.root):
        nearest = _nearest_existing(os.path.dirname(sd.root))
        if not os.path.isdir(nearest):
            blocked, why = nearest, "not a folder"
        elif not os.access(nearest, os.W_OK | os.X_OK):
            blocked, why = nearest, "folder"
    if blocked is None:
        return None
    user = user_name()
    if why == "not a folder":
        return "the toolkit's state folder %s cannot be made: %s is not a folder" % (sd.root, blocked)
    flag = _flag_blocker(blocked, why) if os.path.exists(blocked) else None
    if flag:
        return "the toolkit's state folder %s cannot be written: %s" % (sd.root, flag)
    owner = owner_name(blocked)
    mode = os.stat(blocked).st_mode & 0o7777
    text = "the toolkit's state folder %s cannot be written by %s: %s %s belongs to %s (mode %o)" % (
        sd.root, user, why, blocked, owner, mode)
    base_owner = owner_name(base) if base and os.path.exists(base) else None
    if base_owner and base_owner not in (user, "?"):
        text += "; %s belongs to %s: run the patch commands as %s (`user = \"%s\"` in the inventory)" \
                " or give %s write access to %s" % (base, base_owner, base_owner, base_owner, user, blocked)
    else:
        text += "; give %s write access to %s (or set `state_dir` for the host)" % (user, blocked)
    return text


def fs_space(path):
    """{path, dev, free, block} of the file system that holds `path` (or would: its nearest folder)."""
    folder = _nearest_existing(path)
    st = os.statvfs(folder)
    return {"path": folder, "dev": os.stat(folder).st_dev, "free": st.f_bavail * st.f_frsize,
            "block": st.f_frsize or 4096}


def _blocks(size, block):
    return -(-size // block) * block if size else 0


def space_needs(site_space, state_space, new_sizes, backup_sizes, meta_sizes):
    """[(file system as fs_space gives it, bytes a run needs there)]: every new file is written
    beside its target (site), the files it replaces are backed up unless a backup exists
    (state), and the journal, state and lock take meta_sizes (state). Each file is rounded up to
    the file system's block size."""
    needs = {}
    for space, sizes in ((site_space, new_sizes), (state_space, list(backup_sizes) + list(meta_sizes))):
        entry = needs.setdefault(space["dev"], [space, 0])
        entry[1] += sum(_blocks(size, space["block"]) for size in sizes if size)
    return [tuple(entry) for entry in needs.values()]


def space_shortfalls(*sizes):
    """[(folder, bytes needed, bytes free)] for each file system a run would not fit on
    (arguments as space_needs)."""
    return [(space["path"], need, space["free"]) for space, need in space_needs(*sizes) if need > space["free"]]


def meta_estimate(new_state, old_state, writes):
    """Sizes of what a run writes in the state folder besides backups, at its fullest: the
    journal twice (its commit copy is written beside the prepare copy), the new state.json
    (written beside the old one) and the lock. The journal holds both states and one entry
    per file; its size is estimated with a margin over their JSON."""
    def size(data):
        return len(json.dumps(data, indent=1, sort_keys=True)) if data else 0
    journal = (size(new_state) + size(old_state)) * 5 // 4 + 400 * len(writes) + 600
    return [journal, journal, size(new_state), 64]   # the lock last: a host run has made it already


def no_space_message(exc, path, need, what):
    free = fs_space(os.path.dirname(path) or ".")
    return "no space left on the file system of %s (%s) while writing %s: the run needs about %d bytes" \
           " there, %d are free" % (free["path"], os.strerror(exc.errno), what, need, free["free"])


def is_no_space(exc):
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class Lock(FileLock):
    """flock on <state>/patch/lock; waits up to `timeout` seconds, then refuses clearly."""

    def __init__(self, sd, timeout, base=None):
        FileLock.__init__(self, sd.lock, timeout)
        self.sd, self.base = sd, base

    def __enter__(self):
        try:
            FileLock.__enter__(self)
        except LockBusy as busy:
            raise Refused("another toolkit patch run holds the lock on this host (%s); waited %ss,"
                          " nothing written; try again when it has finished" % (str(busy) or "unknown", self.timeout))
        except OSError as exc:
            if is_no_space(exc):
                raise Refused("cannot make the lock %s: %s; nothing written" % (self.sd.lock, os.strerror(exc.errno)))
            raise Refused("%s; nothing written" % (state_dir_blocker(self.sd, self.base) or
                                                   "cannot take the lock %s: %s" % (self.sd.lock, exc)))
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, ("pid %d since %s" % (os.getpid(), time.strftime("%H:%M:%S"))).encode(), 0)
        except OSError as exc:
            if not is_no_space(exc):
                FileLock.__exit__(self)
                raise  # a full disk only loses who holds the lock, which is shown to a waiting run
        return self


def checkpoint(point):
    """A named point of a host run: after-lock, after-checks, after-backups, after-prepare,
    after-new-files, after-rename-K (K = 0..n renames done) and after-state. It does nothing here. The fault
    tests put their own version in patch_apply's namespace from the payload (tests/patch/faults.py)
    to kill or hold a run at that point; nothing a user sets reaches it."""


def full_path(site, rel):
    return os.path.join(site, *rel.split("/"))


def remove_stale_pycache(site, rels):
    removed = []
    for rel in rels:
        if not rel.endswith(".py"):
            continue
        folder, name = os.path.split(full_path(site, rel))
        for pyc in glob.glob(os.path.join(folder, "__pycache__", name[:-3] + ".*.pyc")):
            try:
                os.unlink(pyc)
                removed.append(os.path.relpath(pyc, site))
            except OSError:
                pass
    return removed


def restore_from_backup(sd, site, rel, sha):
    path = full_path(site, rel)
    if sha is None:
        if os.path.lexists(path):
            os.unlink(path)
        return True
    if sha256_file(path) == sha:
        return True
    src = sd.backup_path(sha)
    if sha256_file(src) != sha:
        return False
    # keep the mode of the file it replaces, as apply does (a missing file gets open()'s default)
    mode = os.stat(path).st_mode & 0o7777 if os.path.exists(path) else None
    with open(src, "rb") as f:
        write_atomic(path, f.read(), mode=mode)
    return True


def _holds(path, entry):
    found = sha256_file(path)
    if found is None:
        return "nothing (the file is missing)"
    if found == entry["new"]:
        return "the new content of the cut run"
    if found == entry["old"]:
        return "its old content"
    return "other bytes (sha256 %s)" % found[:12]


def recover(sd, site):
    """Bring files and state back into agreement after a cut run; idempotent.

    The rule. A journal in phase "prepare" means no target file was touched yet: delete
    the listed temporary files, keep the state: rolled back. In phase "commit" every new
    file had been written and fsync'ed beside its target before the journal said so:
    roll forward (rename each remaining temporary file whose hash is the new one), then
    write the journal's new state. Only if a new file cannot be found any more, or a target
    cannot be replaced (an immutable file, say), switch the journal to phase "rollback" and
    restore every file to its old hash from the content-addressed backups, then write the
    old state. A file that cannot be restored either is listed in the state as damaged,
    with what it holds and why, so `verify` reports the real mixed state. The journal is
    removed last, so a recovery cut in turn is simply done again by the next run."""
    journal = sd.read_journal()
    if journal is None:
        return None
    phase = journal["phase"]
    entries = journal["entries"]
    site = journal.get("site", site)
    outcome = "rolled back"
    if phase == "commit":
        for entry in entries:
            path, tmp = full_path(site, entry["path"]), full_path(site, entry["tmp"]) if entry.get("tmp") else None
            try:
                if entry["new"] is None:
                    if os.path.lexists(path):
                        os.unlink(path)
                    continue
                if sha256_file(path) == entry["new"]:
                    continue
                if tmp and sha256_file(tmp) == entry["new"]:
                    os.replace(tmp, path)
                    continue
                why = "the new content of %s is gone" % entry["path"]
            except OSError as exc:
                why = "%s could not be replaced: %s" % (entry["path"], exc)
            phase = "rollback"
            journal["phase"], journal["failure"] = "rollback", why
            write_json_atomic(sd.journal, journal)
            break
        else:
            for folder in {os.path.dirname(full_path(site, e["path"])) for e in entries}:
                fsync_dir(folder)
            write_json_atomic(sd.state, journal["new_state"])
            outcome = "rolled forward"
    damaged = {}
    if phase == "rollback":
        if journal.get("failure"):
            outcome = "rolled back (%s)" % journal["failure"]
        for entry in entries:
            path = full_path(site, entry["path"])
            try:
                if restore_from_backup(sd, site, entry["path"], entry["old"]):
                    continue
                why = "its backup is missing or corrupt"
            except OSError as exc:
                why = "restoring it failed: %s" % exc
            damaged[entry["path"]] = "%s; it holds %s" % (why, _holds(path, entry))
        old_state = journal.get("old_state")
        if damaged:
            # verify fails on these files and says what each holds; once the cause is gone,
            # `invoke patch revert --all --force` restores them from the wheel
            if old_state is None:  # nothing was applied before: an empty stack for this release
                new_state = journal["new_state"]
                old_state = {"format": new_state.get("format"), "package": new_state.get("package"),
                             "version": new_state.get("version"), "site": site, "stack": [], "files": {}}
            old_state = dict(old_state, damaged=sorted(damaged), damaged_detail=damaged)
            outcome += "; could not restore %s" % "; ".join("%s (%s)" % item for item in sorted(damaged.items()))
        if old_state is None:
            if os.path.exists(sd.state):
                os.unlink(sd.state)
        else:
            write_json_atomic(sd.state, old_state)
    remove_files([full_path(site, e["tmp"]) for e in entries if e.get("tmp")])
    remove_files(stale_tmp_files({os.path.dirname(full_path(site, e["path"])) for e in entries},
                                 only={os.path.basename(e["path"]) for e in entries}))
    remove_stale_pycache(site, [e["path"] for e in entries])
    os.unlink(sd.journal)
    fsync_dir(sd.root)
    return {"outcome": outcome, "run": journal.get("run"), "files": [e["path"] for e in entries],
            "damaged": sorted(damaged)}

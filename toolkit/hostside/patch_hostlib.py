# Shared by patch_probe.py and patch_apply.py (toolkit.patching prepends it to both).
# Standard library only, Python 3.8+. Host state lives in <state_dir>/patch/:
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
import time

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


def write_atomic(path, data):
    """Write beside, fsync, rename over, fsync the folder: readers see old or new, never half."""
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def write_json_atomic(path, data):
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())


class Lock(object):
    """flock on <state>/patch/lock; waits up to `timeout` seconds, then refuses clearly."""

    def __init__(self, sd, timeout):
        self.sd, self.timeout, self.fd = sd, timeout, None

    def __enter__(self):
        os.makedirs(self.sd.root, exist_ok=True)
        self.fd = os.open(self.sd.lock, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip()
                    os.close(self.fd)
                    raise Refused("another toolkit patch run holds the lock on this host (%s); waited %ss,"
                                  " nothing written; try again when it has finished" % (holder or "unknown", self.timeout))
                time.sleep(0.05)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, ("pid %d since %s" % (os.getpid(), time.strftime("%H:%M:%S"))).encode(), 0)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # closing releases the flock; a killed process releases it too


def fault(point):
    """Test-only fault injection (docs/patching.md): TOOLKIT_FAULT_AT=<point> (or
    TOOLKIT_FAULT_AFTER_RENAMES=k for point after-rename-k) with TOOLKIT_FAULT_ACTION=exit
    (default: os._exit(137), like SIGKILL) or sleep:SECONDS (write the pid to
    $TOOLKIT_FAULT_PIDFILE, then sleep, so a test can cut the connection or kill it; the
    sleep ends early once the file $TOOLKIT_FAULT_RELEASE exists)."""
    wanted = os.environ.get("TOOLKIT_FAULT_AT")
    if os.environ.get("TOOLKIT_FAULT_AFTER_RENAMES"):
        wanted = "after-rename-%s" % os.environ["TOOLKIT_FAULT_AFTER_RENAMES"]
    if wanted != point:
        return
    action = os.environ.get("TOOLKIT_FAULT_ACTION", "exit")
    if action.startswith("sleep:"):
        pidfile = os.environ.get("TOOLKIT_FAULT_PIDFILE")
        if pidfile:
            write_atomic(pidfile, str(os.getpid()).encode())
        deadline = time.monotonic() + float(action.split(":", 1)[1])
        release = os.environ.get("TOOLKIT_FAULT_RELEASE")
        while time.monotonic() < deadline and not (release and os.path.exists(release)):
            time.sleep(0.05)
        return
    os._exit(137)


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
            except FileNotFoundError:
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
    with open(src, "rb") as f:
        write_atomic(path, f.read())
    return True


def recover(sd, site):
    """Bring files and state back into agreement after a cut run; idempotent.

    The rule. A journal in phase "prepare" means no target file was touched yet: delete
    the listed temporary files, keep the state: rolled back. In phase "commit" every new
    file had been written and fsync'ed beside its target before the journal said so:
    roll forward (rename each remaining temporary file whose hash is the new one), then
    write the journal's new state. Only if a new file cannot be found any more, switch
    the journal to phase "rollback" and restore every file to its old hash from the
    content-addressed backups, then write the old state. The journal is removed last, so
    a recovery cut in turn is simply done again by the next run."""
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
            if entry["new"] is None:
                if os.path.lexists(path):
                    os.unlink(path)
                continue
            if sha256_file(path) == entry["new"]:
                continue
            if tmp and sha256_file(tmp) == entry["new"]:
                os.replace(tmp, path)
                continue
            phase = "rollback"
            journal["phase"] = "rollback"
            write_json_atomic(sd.journal, journal)
            break
        else:
            for folder in {os.path.dirname(full_path(site, e["path"])) for e in entries}:
                fsync_dir(folder)
            write_json_atomic(sd.state, journal["new_state"])
            outcome = "rolled forward"
    damaged = []
    if phase == "rollback":
        for entry in entries:
            if not restore_from_backup(sd, site, entry["path"], entry["old"]):
                damaged.append(entry["path"])
        old_state = journal.get("old_state")
        if damaged:
            # a backup was lost as well: say so in the state, verify then fails on these files
            # and `invoke patch revert --all --force` restores them from the wheel
            old_state = dict(old_state or {}, damaged=damaged)
            outcome = "rolled back; could not restore %s (backup missing or corrupt)" % ", ".join(damaged)
        if old_state is None:
            if os.path.exists(sd.state):
                os.unlink(sd.state)
        else:
            write_json_atomic(sd.state, old_state)
    for entry in entries:
        if entry.get("tmp"):
            try:
                os.unlink(full_path(site, entry["tmp"]))
            except FileNotFoundError:
                pass
    remove_stale_pycache(site, [e["path"] for e in entries])
    os.unlink(sd.journal)
    fsync_dir(sd.root)
    return {"outcome": outcome, "run": journal.get("run"), "files": [e["path"] for e in entries]}

# Host side of `invoke server ...`: start, wait, stop, status and logs of the model server.
# Standard library only, Python 3.8+. Layout on the host (ROOT = <state_dir>/server):
#   ROOT/active.json              {"profile": NAME} while a server started by the toolkit is recorded
#   ROOT/NAME/launch.sh           the rendered launch script (rerunnable by hand)
#   ROOT/NAME/toolkit-server.service  the rendered systemd unit (not installed)
#   ROOT/NAME/logs/NAME-<UTC start time>.log   stdout+stderr of one start; the newest `keep_logs` are kept
#   ROOT/NAME/server.log          symlink to the newest of those (the current or last run)
#   ROOT/NAME/server.pid          pid of the process-group leader
#   ROOT/NAME/server.json         what was started, when, with which options and readiness rule, GPU idle levels
#   ROOT/lock                     flock'ed by start (its checks up to the record), stop and a failed start's cleanup
import errno
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

from .locks import FileLock, LockBusy

LOG_TAIL_LINES = 40
LOG_TAIL_BYTES = 4 * 1024 * 1024   # what `logs` reads of a log; before that, problem blocks only (scan)
SCAN_BLOCK_LINES = 200             # the most lines of one problem block (a traceback) from before the tail
SCAN_BYTES = 1024 * 1024           # the most bytes of problem blocks from before the tail
LOCK_WAIT_S = 180   # a start's checks (two nvidia-smi calls) or a stop's TERM grace + KILL wait


# -- files --------------------------------------------------------------------------------

def _read_json(path):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _write_json(path, data):
    tmp = "%s.tmp%d" % (path, os.getpid())   # per process, as patch_hostlib.write_atomic
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _write_text(path, text, mode=0o644):
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "w") as handle:
        handle.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _tail(path, lines=LOG_TAIL_LINES, rank=None):
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - LOG_TAIL_BYTES))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    rows = _rank_rows(text.splitlines(True), rank)
    rows = [row.rstrip("\n") for row in rows]
    if lines:
        rows = rows[-lines:]
    return "\n".join(rows)


_TRACEBACK = b"Traceback (most recent call last)"
_CHAINED = (b"During handling of the above exception", b"The above exception was the direct cause")


def _in_traceback(line):
    """Whether a line after a traceback's first one still belongs to it (else it is its exception line)."""
    return not line.strip() or line[:1].isspace() or line.startswith(_CHAINED) or _TRACEBACK in line


def _scan(path, problem):
    """A log too long to read whole: its last LOG_TAIL_BYTES as whole lines and, from the lines
    before them, only the blocks that the regex `problem` (the smoke's problem lines) flags, each
    with the line before it, a traceback through its exception line (as toolkit/check/smoke.py
    takes them). Returns None when the whole log fits in the tail, else {"text": the tail,
    "tail_line": its first line's number, "lines": the log's lines, "blocks": [[first line number,
    text], ...], "omitted": blocks beyond SCAN_BYTES}."""
    problem = re.compile(problem.encode())
    try:
        handle = open(path, "rb")
    except OSError:
        return None
    with handle:
        cut = os.fstat(handle.fileno()).st_size - LOG_TAIL_BYTES
        if cut <= 0:
            return None
        blocks, omitted, kept, last = [], 0, 0, 0
        pos, number, prev, block, traceback = 0, 0, None, None, False

        def finish(block):
            nonlocal kept, omitted, last
            last = block[0] + len(block[1]) - 1
            size = sum(len(line) for line in block[1])
            if kept + size > SCAN_BYTES:
                omitted += 1
                return
            kept += size
            blocks.append([block[0], b"".join(block[1]).decode("utf-8", "replace").rstrip("\n")])

        while pos < cut or (block and traceback):   # a traceback that began before the cut is read to its end
            line = handle.readline()
            if not line:
                break
            pos += len(line)
            number += 1
            if block and traceback and len(block[1]) < SCAN_BLOCK_LINES:
                block[1].append(line)
                traceback = _in_traceback(line)
                if not traceback:
                    finish(block)
                    block = None
                continue
            if block:
                finish(block)
                block = None
            if problem.search(line):
                before = [prev] if prev is not None and last < number - 1 else []
                block, traceback = [number - len(before), before + [line]], _TRACEBACK in line
                if not traceback:
                    finish(block)
                    block = None
            prev = line
        if block:
            finish(block)
        tail = handle.read().decode("utf-8", "replace")
    return {"text": tail.rstrip("\n"), "tail_line": number + 1, "lines": number + tail.count("\n"),
            "blocks": blocks, "omitted": omitted}


def _rank_pattern(rank):
    # SGLang prefixes a rank's lines as "[2026-01-01 10:00:00 DP0 TP3 EP3] ..."
    return re.compile(r"^\[[^\]]*\bTP%d\b[^\]]*\]" % int(rank))


_ANY_RANK = re.compile(r"^\[[^\]]*\bTP\d+\b[^\]]*\]")


def _rank_rows(rows, rank):
    """The lines of one TP rank; a single-rank server prints no TP prefix, so rank 0 is all of it."""
    if rank is None:
        return rows
    if int(rank) == 0 and not any(_ANY_RANK.search(row) for row in rows):
        return rows
    pattern = _rank_pattern(rank)
    return [row for row in rows if pattern.search(row)]


# -- processes ----------------------------------------------------------------------------

def _proc_stat(pid):
    """(state, pgid, sid, start time in clock ticks since boot) from /proc, or None when the
    process is gone."""
    try:
        with open("/proc/%d/stat" % pid) as handle:
            data = handle.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()   # fields[0] is field 3 of proc(5), state
    return fields[0], int(fields[2]), int(fields[3]), int(fields[19])


def _start_time(pid):
    stat = _proc_stat(pid) if pid else None
    return stat and stat[3]


def _reused(leader, started):
    """Whether the pid `leader` now names another process than the one started at `started`
    (its /proc start time; None, from a record of an older toolkit: cannot tell, so no). Linux
    frees a pid only once no process has it as pid, group or session, so then nothing of the
    recorded server is left."""
    if not leader or started is None:
        return False
    now = _start_time(leader)
    return now is not None and now != started


def _alive(pid):
    if not pid:
        return False
    if os.path.isdir("/proc"):
        stat = _proc_stat(pid)
        return stat is not None and stat[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
        return True
    except OSError as exc:
        return exc.errno == errno.EPERM


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]
    except OSError:
        return ""


_SCHEDULER_TITLE = re.compile(r"^sglang::scheduler(\S*)")


def _scheduler_ranks(members):
    """{tp rank: pid} of SGLang's scheduler processes among members: each sets its title to
    sglang::scheduler_TP<r> (plain sglang::scheduler at TP 1)."""
    ranks = {}
    for pid in members:
        title = _SCHEDULER_TITLE.match(_cmdline(pid))
        if title:
            tp = re.search(r"_TP(\d+)", title.group(1))
            ranks[str(int(tp.group(1)) if tp else 0)] = pid
    return ranks


def _group_members(leader, started=None):
    """Live pids whose process group or session is the leader's (TP workers, their helpers);
    none when the leader's pid was reused (`started`: its recorded start time)."""
    if not leader or _reused(leader, started):
        return []
    if not os.path.isdir("/proc"):
        return [leader] if _alive(leader) else []
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat and stat[0] not in ("Z", "X") and leader in (stat[1], stat[2]):
            members.append(int(entry))
    return sorted(members)


def _signal_group(leader, sig, started=None):
    members = _group_members(leader, started)
    if not members:
        return
    for pgid in sorted({leader} | {(_proc_stat(p) or (0, leader))[1] for p in members}):
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
    for pid in _group_members(leader, started):  # members that moved to a group of their own
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _reap(pid):
    """Collect the exit of our own child (start's launch); returns its exit code once, else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except (OSError, TypeError):
        return None
    if done != pid:
        return None
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _wait_gone(leader, seconds, started=None):
    deadline = time.monotonic() + seconds
    while True:
        _reap(leader)
        members = _group_members(leader, started)
        if not members or time.monotonic() >= deadline:
            return members
        time.sleep(0.1)


def _terminate(leader, grace, started=None):
    """TERM the group, KILL what is left after `grace` s; returns (signal that ended it, survivors).
    `started`: the leader's recorded start time (a reused pid is left alone)."""
    if not _group_members(leader, started):
        return None, []
    _signal_group(leader, signal.SIGTERM, started)
    if not _wait_gone(leader, grace, started):
        return "TERM", []
    _signal_group(leader, signal.SIGKILL, started)
    return "KILL", _wait_gone(leader, 10, started)


# -- GPUs ---------------------------------------------------------------------------------

def _nvidia_smi(binary, query):
    path = binary if os.sep in binary else shutil.which(binary)
    if not path or not os.access(path, os.X_OK):
        return None
    done = subprocess.run([path, query, "--format=csv,noheader,nounits"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError("%s %s failed (exit %d): %s" % (binary, query, done.returncode, done.stderr.strip()[:300]))
    return [[cell.strip() for cell in row.split(",")] for row in done.stdout.splitlines() if row.strip()]


def _gpu_memory(binary):
    rows = _nvidia_smi(binary, "--query-gpu=index,memory.used,memory.total")
    if rows is None:
        return None
    return [{"index": int(r[0]), "used_mib": int(float(r[1])), "total_mib": int(float(r[2]))} for r in rows]


SHARED_GPU_NOTE = ("server.shared_gpu: other servers use this GPU on purpose; "
                   "GPU memory checks skipped")


def _gpu_holders(binary):
    rows = _nvidia_smi(binary, "--query-compute-apps=pid,used_memory")
    if rows is None:
        return None
    holders = []
    for row in rows:
        if not row or not row[0].isdigit():
            continue
        used = row[1] if len(row) > 1 else ""
        holders.append({"pid": int(row[0]), "used_mib": int(float(used)) if used.replace(".", "").isdigit() else None,
                        "command": _cmdline(int(row[0]))})
    return holders


def _describe_holders(holders):
    parts = []
    for h in holders:
        text = "pid %d" % h["pid"]
        if h.get("used_mib") is not None:
            text += " (%d MiB)" % h["used_mib"]
        if h.get("command"):
            text += ": " + h["command"]
        parts.append(text)
    return "; ".join(parts)


# -- network ------------------------------------------------------------------------------

def _port_owner(port):
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                next(handle)
                for row in handle:
                    cells = row.split()
                    if int(cells[1].rsplit(":", 1)[1], 16) == port and cells[3] == "0A":
                        inodes.add(cells[9])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    if not inodes:
        return None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % entry):
                link = os.readlink("/proc/%s/fd/%s" % (entry, fd))
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(entry)
        except OSError:
            continue
    return None


def _port_problem(bind, port):
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind((bind, port))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            return "cannot bind %s:%d: %s" % (bind, port, exc.strerror)
        owner = _port_owner(port)
        who = " by pid %d (%s)" % (owner, _cmdline(owner) or "?") if owner else ""
        return "port %d on %s is already taken%s; stop that process or choose another port (--port)" % (port, bind, who)
    finally:
        probe.close()
    return None


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(url):
    try:
        with _NO_PROXY.open(url, timeout=3) as answer:
            return 200 <= answer.status < 300
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return False   # HTTPException: a malformed answer (BadStatusLine, LineTooLong) is not healthy


# -- readiness ----------------------------------------------------------------------------

def _missing_lines(log_path, record):
    try:
        with open(log_path, "rb") as handle:
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        text = ""
    missing = [line for line in record["log_lines"] if line not in text]
    rows = None
    for line in record["rank_log_lines"]:
        if record["tp_size"] <= 1:
            if line not in text:
                missing.append(line)
            continue
        if rows is None:
            rows = [row for row in text.splitlines() if row.startswith("[")]
        for rank in range(record["tp_size"]):
            pattern = _rank_pattern(rank)
            if not any(line in row and pattern.search(row) for row in rows):
                missing.append("TP%d: %s" % (rank, line))
    return missing


def _paths(root, profile):
    folder = os.path.join(root, profile)
    return {"dir": folder, "script": os.path.join(folder, "launch.sh"), "unit": os.path.join(folder, "toolkit-server.service"),
            "log": os.path.join(folder, "server.log"), "logs": os.path.join(folder, "logs"),
            "pid": os.path.join(folder, "server.pid"),
            "record": os.path.join(folder, "server.json"), "active": os.path.join(root, "active.json"),
            "lock": _lock_path(root)}


# -- one log per start ----------------------------------------------------------------------

_LOG_NAME = re.compile(r"^(.*Z)(?:-old-(\d+)|-(\d+))?\.log$")


def _log_order(name):
    """Sort key of a kept log's name: its start stamp; within one second the adopted old-layout
    logs (PROFILE-STAMP-old-N.log) first, then the starts (PROFILE-STAMP.log, -2.log, ...; plain
    name order would put -2 before the first)."""
    m = _LOG_NAME.match(name)
    if m.group(2):
        return (m.group(1), 0, int(m.group(2)))
    return (m.group(1), 1, int(m.group(3) or 1))


def _run_logs(p):
    """The kept logs of the profile's starts, oldest first (not PROFILE-systemd.log, which the
    rendered unit writes beside them once installed: it is neither a start's log nor pruned)."""
    try:
        names = [n for n in os.listdir(p["logs"]) if _LOG_NAME.match(n)]
    except OSError:
        return []
    return [os.path.join(p["logs"], n) for n in sorted(names, key=_log_order)]


def _stamp(when):
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))


def _adopt_old_layout(p, profile):
    """Logs of toolkits before per-start logs (a plain server.log and server.log.prev) move into logs/."""
    for order, name in enumerate(("server.log.prev", "server.log"), 1):
        old = os.path.join(p["dir"], name)
        if os.path.isfile(old) and not os.path.islink(old):
            target = os.path.join(p["logs"], "%s-%s-old-%d.log" % (profile, _stamp(os.path.getmtime(old)), order))
            if not os.path.exists(target):
                os.replace(old, target)


def _new_log(p, profile, keep):
    """Create this start's log file, point server.log at it, prune beyond `keep`; returns (path, pruned)."""
    if not os.path.isdir(p["logs"]):
        os.makedirs(p["logs"], mode=0o755)
    _adopt_old_layout(p, profile)
    base = "%s-%s" % (profile, _stamp(time.time()))
    for n in range(1, 1000):
        path = os.path.join(p["logs"], base + ("" if n == 1 else "-%d" % n) + ".log")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            break
        except FileExistsError:
            continue
    link_tmp = "%s.tmp%d" % (p["log"], os.getpid())
    try:
        os.unlink(link_tmp)
    except OSError:
        pass
    os.symlink(os.path.join("logs", os.path.basename(path)), link_tmp)
    os.replace(link_tmp, p["log"])
    pruned = []
    if keep and keep > 0:
        logs = _run_logs(p)
        for old in logs[:max(0, len(logs) - keep)]:
            try:
                os.unlink(old)
                pruned.append(old)
            except OSError:
                pass
    return path, pruned


def _current_log(p):
    """The log server.log points at (the newest run's), or None."""
    if os.path.islink(p["log"]) or os.path.isfile(p["log"]):
        return os.path.realpath(p["log"])
    logs = _run_logs(p)
    return logs[-1] if logs else None


# -- log lines that patchsets ask to be shown -------------------------------------------------

_LOG_PREFIX = re.compile(r"^\[([^\]]*)\]\s?")
_TP = re.compile(r"\bTP(\d+)\b")


def _patch_stack(state_path):
    state = _read_json(state_path) if state_path else None
    return [entry.get("name") for entry in (state or {}).get("stack", []) if isinstance(entry, dict)]


def _print_lines(log_path, record, limit=2000, kind="print_prefixes"):
    """[rank or None, text] for every log line whose text (after SGLang's `[time TPn]` prefix, if any)
    starts with a `[logs] print` (kind "refuse_prefixes": `[logs] refuse`) prefix of a patchset
    applied on this host."""
    stack = record.get("patch_stack") or []
    prefixes = [prefix for name in stack for prefix in (record.get(kind) or {}).get(name, [])]
    if not prefixes:
        return []
    found = []
    try:
        with open(log_path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 16 * 1024 * 1024))
            rows = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    for row in rows:
        head = _LOG_PREFIX.match(row)
        text, rank = row, None
        if head:
            text = row[head.end():]
            tp = _TP.search(head.group(1))
            rank = int(tp.group(1)) if tp else None
        text = text.rstrip()
        if any(text.startswith(prefix) or row.startswith(prefix) for prefix in prefixes):
            found.append([rank, text if any(text.startswith(x) for x in prefixes) else row.rstrip()])
            if len(found) >= limit:
                break
    return found


def _active(root):
    """(profile, record) of the recorded server, or (None, None)."""
    active = _read_json(os.path.join(root, "active.json"))
    if not active:
        return None, None
    profile = active.get("profile")
    return profile, _read_json(_paths(root, profile)["record"])


def _lock_path(root):
    return os.path.join(root, "lock")


def _lock(path):
    return FileLock(path, LOCK_WAIT_S)


def _busy_reason(path):
    return "another server start or stop on this host still held %s after %d s; try again once it is done" % (
        path, LOCK_WAIT_S)


def _same_launch(a, b):
    return bool(a and b) and (a.get("pid"), a.get("started_at")) == (b.get("pid"), b.get("started_at"))


def _failed(record, p, reason, grace=10):
    how, survivors = _terminate(record.get("pid"), grace, record.get("pid_start"))
    record.update(status="failed", failure=reason, stopped_at=time.time())
    try:
        with _lock(p["lock"]):
            # a start that came once this one's processes were gone may have recorded its own server
            if _same_launch(_read_json(p["record"]), record):
                _write_json(p["record"], record)
                if (_read_json(p["active"]) or {}).get("profile") == record.get("profile"):
                    os.unlink(p["active"])
    except LockBusy:
        pass   # left recorded as starting: status calls it dead, the next start clears it
    return {"status": "failed", "reason": reason, "log_tail": _tail(record.get("log_path") or p["log"]),
            "record": record, "killed_with": how, "survivors": survivors}


def _wait(root, profile, seconds, poll=0.25):
    p = _paths(root, profile)
    record = _read_json(p["record"])
    if record is None:
        raise RuntimeError("no server.json for profile %s under %s" % (profile, root))
    leader = record["pid"]
    until = min(time.time() + seconds, record["deadline"])
    url = record["base_url_on_host"] + record["health_endpoint"]
    healthy, missing = False, None
    exit_code = None
    while True:
        reaped = _reap(leader)
        exit_code = reaped if reaped is not None else exit_code
        if not _alive(leader) or _reused(leader, record.get("pid_start")):
            code = "" if exit_code is None else (" (exit code %d)" % exit_code if exit_code >= 0
                                                 else " (killed by signal %d)" % -exit_code)
            return _failed(record, p, "the server exited during startup%s; see the log tail" % code)
        healthy = _healthy(url)
        log_path = record.get("log_path") or p["log"]
        missing = _missing_lines(log_path, record)
        if healthy and not missing:
            record.update(status="ready", ready_at=time.time())
            _write_json(p["record"], record)
            return {"status": "ready", "record": record, "print_lines": _print_lines(log_path, record)}
        if healthy and missing:
            # a patched server that turned its patch's feature down says so: the lines waited for
            # will never come
            refused = _print_lines(log_path, record, limit=8, kind="refuse_prefixes")
            if refused:
                texts = []
                for _, text in refused:
                    if text not in texts:
                        texts.append(text)
                return _failed(record, p, "the server runs without what the profile needs, it logged: "
                               + " | ".join(texts))
        if time.time() >= record["deadline"]:
            what = [] if healthy else ["%s does not answer" % url]
            if missing:
                what.append("log lines never printed: " + "; ".join(missing[:16]) + (" ..." if len(missing) > 16 else ""))
            return _failed(record, p, "not ready after %ds: %s" % (record["timeout_s"], ", ".join(what)))
        if time.time() >= until:
            return {"status": "waiting", "healthy": healthy, "missing": missing,
                    "waited_s": round(time.time() - record["started_at"], 1), "record": record}
        time.sleep(poll)


# -- actions ------------------------------------------------------------------------------

def start(args):
    """Check, launch and record under the lock (so two starts cannot both launch), then wait."""
    root = args["root"]
    profile = args["plan"]["profile"]
    p = _paths(root, profile)
    try:
        with _lock(p["lock"]):
            answer = _launch(args)
    except LockBusy:
        return {"status": "refused", "reason": _busy_reason(p["lock"])}
    if answer["status"] != "launched":
        return answer
    waited = _wait(root, profile, args["wait_s"])
    waited["notes"] = answer["notes"]
    return waited


def _launch(args):
    root = args["root"]
    plan = args["plan"]
    profile = plan["profile"]
    p = _paths(root, profile)
    notes = []
    running_profile, running = _active(root)
    if running_profile:
        leader, started = (running or {}).get("pid"), (running or {}).get("pid_start")
        if _group_members(leader, started):
            return {"status": "refused", "reason": "a server is already running: profile %s, pid %s, port %s; "
                    "stop it first with: invoke server stop --host %s"
                    % (running_profile, leader, running.get("port"), args["meta"]["host"])}
        # a pid reused since: Linux gives it out again only once nothing of the group is left
        reused = " and its pid is now another process's" if _reused(leader, started) else ""
        notes.append("previous server %s (pid %s) had died%s; its record was cleared" % (running_profile, leader, reused))
        os.unlink(p["active"])
    for need in args.get("required_paths") or []:
        if not os.path.exists(need["path"]):
            return {"status": "refused", "reason": "%s %s does not exist on the host; %s"
                    % (need["what"], need["path"], need["advice"]), "missing_path": need["path"]}
    idle = None
    try:
        holders = None if args.get("shared_gpu") else _gpu_holders(args["nvidia_smi"])
        if args.get("shared_gpu"):
            notes.append(SHARED_GPU_NOTE)
        elif holders is None:
            notes.append("%s not found on the host: GPU memory check skipped" % args["nvidia_smi"])
        elif holders:
            pids = " ".join(str(h["pid"]) for h in holders)
            return {"status": "refused", "reason": "GPU memory is held by leftover process(es): %s. Clear them with: "
                    "kill %s (then kill -9 %s if they remain), and check with: nvidia-smi"
                    % (_describe_holders(holders), pids, pids), "holders": holders}
        else:
            idle = _gpu_memory(args["nvidia_smi"])
            slack = plan["idle_memory_slack_mib"]
            busy = [g for g in idle if g["used_mib"] > slack]
            if busy:
                return {"status": "refused", "reason": "%s in use although nvidia-smi lists no process "
                        "(held from another container or PID namespace?); free it, or raise "
                        "idle_memory_slack_mib (now %d) in the host's [server] table"
                        % (", ".join("GPU%d has %d MiB" % (g["index"], g["used_mib"]) for g in busy), slack),
                        "gpu_memory": idle}
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"status": "refused", "reason": "cannot read GPU state: %s" % exc}
    problem = _port_problem(plan["bind"], plan["port"])
    if problem:
        return {"status": "refused", "reason": problem}

    if not os.path.isdir(p["dir"]):
        os.makedirs(p["dir"], mode=0o755)
    _write_text(p["script"], args["script"], 0o755)
    if args.get("unit"):
        _write_text(p["unit"], args["unit"])
    log_path, pruned = _new_log(p, profile, args.get("keep_logs"))
    if pruned:
        notes.append("removed %d old log(s) of %s beyond the newest %d (server.keep_logs)"
                     % (len(pruned), profile, args.get("keep_logs")))
    log = open(log_path, "ab")
    try:
        child = subprocess.Popen(["/bin/bash", p["script"]], cwd=p["dir"], stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    finally:
        log.close()
    now = time.time()
    record = dict(args["meta"])
    record.update(profile=profile, pid=child.pid, pgid=child.pid, started_at=now, deadline=now + args["timeout_s"],
                  timeout_s=args["timeout_s"], status="starting", script_path=p["script"], log_path=log_path,
                  server_dir=p["dir"], idle_gpu_memory=idle, log_lines=plan["log_lines"],
                  rank_log_lines=plan["rank_log_lines"], tp_size=plan["tp_size"],
                  patch_stack=_patch_stack(args.get("patch_state")))
    try:
        record["pid_start"] = _start_time(child.pid)   # tells the leader from a later process given its pid
        _write_text(p["pid"], "%d\n" % child.pid)
        _write_json(p["record"], record)
        _write_json(p["active"], {"profile": profile})
    except BaseException:
        _terminate(child.pid, 5)   # never leave a server running that no record names
        raise
    return {"status": "launched", "notes": notes}


def wait(args):
    profile, record = _active(args["root"])
    if not profile or record is None:
        return {"status": "failed", "reason": "no server is recorded as starting (was it stopped?)", "log_tail": ""}
    return _wait(args["root"], profile, args["wait_s"])


def status(args):
    root = args["root"]
    profile, record = _active(root)
    if not profile:
        last = _last_record(root)
        return {"running": False, "record": None, "last": last}
    members = _group_members(record.get("pid"), record.get("pid_start")) if record else []
    answer = {"running": bool(members), "record": record, "members": members, "profile": profile}
    if record:
        answer["healthy"] = bool(members) and _healthy(record["base_url_on_host"] + record["health_endpoint"])
        answer["uptime_s"] = round(time.time() - record["started_at"], 1)
        answer["ranks"] = _scheduler_ranks(members)
    return answer


def _last_record(root):
    best = None
    if not os.path.isdir(root):
        return None
    for name in os.listdir(root):
        record = _read_json(os.path.join(root, name, "server.json"))
        if record and (best is None or record.get("started_at", 0) > best.get("started_at", 0)):
            best = record
    return best


def _memory_back_to_idle(binary, idle, slack, seconds):
    deadline = time.monotonic() + seconds
    while True:
        now = _gpu_memory(binary)
        if now is None:
            return None, []
        by_index = {g["index"]: g["used_mib"] for g in idle or []}
        over = [g for g in now if g["used_mib"] > by_index.get(g["index"], 0) + slack]
        if not over or time.monotonic() >= deadline:
            return over, now
        time.sleep(1)


def stop(args):
    root = args["root"]
    profile, record = _active(root)
    if not profile:
        return {"stopped": False, "reason": "no server is recorded as running", "notes": []}
    leader, started = (record or {}).get("pid"), (record or {}).get("pid_start")
    t0 = time.monotonic()
    try:
        with _lock(_lock_path(root)):
            profile, record = _active(root)   # again: a start may have been recording its server
            if not profile:
                return {"stopped": False, "reason": "no server is recorded as running", "notes": []}
            answer = _stop_recorded(root, profile, record, args["grace"], t0)
    except LockBusy:
        return {"stopped": False, "profile": profile, "pid": leader, "signal": None, "survivors": [],
                "was_running": bool(_group_members(leader, started)), "stop_s": round(time.monotonic() - t0, 2),
                "reason": _busy_reason(_lock_path(root)), "notes": []}
    if answer["survivors"]:
        return answer
    if args.get("shared_gpu"):
        answer["gpu_memory"] = None
        answer["notes"].append(SHARED_GPU_NOTE)
        return answer
    _check_memory_back(args, record, answer)
    return answer


def _stop_recorded(root, profile, record, grace, t0):
    """TERM/KILL the recorded server and clear its record (under the lock)."""
    p = _paths(root, profile)
    leader, started = (record or {}).get("pid"), (record or {}).get("pid_start")
    was_running = bool(_group_members(leader, started))
    how, survivors = _terminate(leader, grace, started)
    answer = {"stopped": not survivors, "profile": profile, "pid": leader, "was_running": was_running,
              "signal": how, "survivors": survivors, "stop_s": round(time.monotonic() - t0, 2), "notes": []}
    if survivors:
        answer["reason"] = "processes survived SIGKILL: %s" % ", ".join("%d %s" % (s, _cmdline(s)) for s in survivors)
        return answer
    try:
        os.unlink(p["active"])
    except OSError:
        pass
    if record:
        record.update(status="stopped", stopped_at=time.time(), stopped_with=how)
        _write_json(p["record"], record)
    return answer


def _check_memory_back(args, record, answer):
    """After the server is gone: wait for GPU memory back to idle; when it stays held, the stop
    failed. nvidia-smi failing or hanging (a wedged GPU) does not undo the stop: it is said, with
    `gpu_check_error`."""
    try:
        over, now = _memory_back_to_idle(args["nvidia_smi"], (record or {}).get("idle_gpu_memory"),
                                         args["slack_mib"], args["memory_wait_s"])
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        answer["gpu_memory"] = None
        answer["gpu_check_error"] = str(exc)
        answer["notes"].append("GPU memory not checked after the stop: %s" % exc)
        return
    if over is None:
        answer["gpu_memory"] = None
        answer["notes"].append("%s not found on the host: GPU memory check skipped" % args["nvidia_smi"])
    else:
        answer["gpu_memory"] = now
        if over:
            try:
                holders = _gpu_holders(args["nvidia_smi"]) or []
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                holders = []
                answer["notes"].append("cannot list the processes holding GPU memory: %s" % exc)
            answer["stopped"] = False
            answer["holders"] = holders
            idle = {g["index"]: g["used_mib"] for g in (record or {}).get("idle_gpu_memory") or []}
            gpus = ", ".join("GPU%d %d MiB (idle %d)" % (g["index"], g["used_mib"], idle.get(g["index"], 0)) for g in over)
            pids = " ".join(str(h["pid"]) for h in holders)
            answer["reason"] = ("GPU memory is not back to idle after %ds: %s; held by: %s%s" % (
                args["memory_wait_s"], gpus, _describe_holders(holders) or "no listed process",
                "; clear with: kill -9 %s" % pids if pids else ""))


def _log_for(args, p):
    """The log a `logs` call reads: an explicit one (follow), the Nth-last run's, or the current one."""
    if args.get("log_path"):
        return args["log_path"]
    run = int(args.get("run") or 0)
    if run:
        logs = _run_logs(p)
        current = _current_log(p)
        if current in logs:       # count back from the run server.log points at
            logs = logs[:logs.index(current) + 1]
        return logs[-1 - run] if run < len(logs) else None
    return _current_log(p)


def logs(args):
    root = args["root"]
    profile = args.get("profile")
    if not profile:
        profile, record = _active(root)
        if not profile:
            record = _last_record(root)
            profile = record and record.get("profile")
    if not profile:
        return {"profile": None, "text": "", "offset": 0, "reason": "no server has been started on this host"}
    p = _paths(root, profile)
    if args.get("list"):
        current = _current_log(p)
        return {"profile": profile, "logs": [{"path": path, "size": os.path.getsize(path),
                                              "modified": os.path.getmtime(path), "current": path == current}
                                             for path in _run_logs(p)]}
    path = _log_for(args, p)
    latest = _current_log(p)
    if path is None:
        kept = len(_run_logs(p))
        reason = ("profile %s has %d kept log(s); there is no run %s back" % (profile, kept, args.get("run")) if kept
                  else "no log of profile %s: it has not been started on this host" % profile)
        return {"profile": profile, "text": "", "offset": 0, "log_path": None, "latest": latest, "reason": reason}
    offset = args.get("offset")
    runs = int(args.get("runs") or 1)
    if offset is None:
        paths = [path]
        if runs > 1:
            logs = _run_logs(p)
            if path in logs:
                paths = logs[max(0, logs.index(path) - runs + 1):logs.index(path) + 1]
        scan = None
        if args.get("problems") and len(paths) == 1 and args.get("rank") is None and not args.get("lines"):
            scan = _scan(path, args["problems"])
        if scan:
            text = scan.pop("text")
        else:
            text = "\n".join(filter(None, (_tail(one, None, args.get("rank")) for one in paths)))
        if args.get("lines"):
            text = "\n".join(text.splitlines()[-int(args["lines"]):])
        try:
            offset = os.path.getsize(path)
        except OSError:
            offset = 0
        answer = {"profile": profile, "text": text, "offset": offset, "log_path": path, "latest": latest}
        if scan:
            answer["scan"] = scan
        return answer
    text, offset = _follow_chunk(path, offset, args.get("rank"))
    return {"profile": profile, "text": text, "offset": offset, "log_path": path, "latest": latest}


FOLLOW_CHUNK_BYTES = 1024 * 1024


def _follow_chunk(path, offset, rank=None):
    """(the whole lines written since `offset`, the offset after them); a partial last line comes
    with the next call, unless a whole chunk holds no line end (then it is handed back as it is, or
    the follower would stay at that offset for good)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < offset:  # truncated by hand
                offset = 0
            handle.seek(offset)
            chunk = handle.read(FOLLOW_CHUNK_BYTES)
    except OSError:
        return "", offset
    cut = chunk.rfind(b"\n") + 1 or (len(chunk) if len(chunk) == FOLLOW_CHUNK_BYTES else 0)
    text = chunk[:cut].decode("utf-8", "replace")
    return "".join(_rank_rows(text.splitlines(True), rank)), offset + cut


def main(args):
    action = args["action"]
    handlers = {"start": start, "wait": wait, "stop": stop, "status": status, "logs": logs}
    if action not in handlers:
        raise ValueError("unknown action %r" % action)
    return handlers[action](args)

# One provisioning step on the host, under the host's provision lock: check again, act only
# if the check says so, check once more, and report ok / changed / failed. The interpreter
# probes and version rules come from facts.py. Standard library only, Python 3.8+.
#
# The lock makes a second, concurrent `invoke provision` on the same host safe: it waits,
# then finds the work done and reports "ok". The full pip/apt output goes to the log file
# named by the control side; only its tail comes back, and only on failure.
import os
import shutil
import subprocess
import time

from ._lib import sha256_file
from .facts import describe_installed, installed_versions, probe_interpreter, run, site_dirs, version_matches
from .locks import FileLock, LockBusy

_TAIL_LINES = 40


def _log_command(log, argv, env=None):
    """Run argv with stdout+stderr appended to the log; (exit code, last lines of its output)."""
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "a") as f:
        f.write("\n== %s  $ %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S"), " ".join(argv)))
        f.flush()
        start = f.tell()
        try:
            code = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
        except OSError as exc:
            f.write("cannot run %s: %s\n" % (argv[0], exc))
            code = 127
        f.write("== exit %s\n" % code)
    with open(log, errors="replace") as f:
        f.seek(start)
        tail = f.read().splitlines()[-_TAIL_LINES:]
    return code, "\n".join(tail)


def _venv_python(args):
    return os.path.join(args["venv"], "bin", "python")


def _target_dirs(args):
    interpreter = args.get("python") or (_venv_python(args) if args.get("venv") else "python3")
    if args.get("venv") and not args.get("python") and not os.path.exists(interpreter):
        return interpreter, []
    target = probe_interpreter(interpreter, args.get("pythonpath"))
    return interpreter, site_dirs(target.get("path", [])) if target.get("runs") else []


def _mismatches(args):
    """(interpreter, [(pin, what is installed)]) for the pins that do not match."""
    interpreter, dirs = _target_dirs(args)
    found = installed_versions(dirs, [p["name"] for p in args["pins"]]) if dirs else {}
    wrong = []
    for pin in args["pins"]:
        entry = found.get(pin["name"], {})
        if not version_matches(entry.get("version"), pin["version"], entry.get("cuda")):
            wrong.append((pin, describe_installed(entry, pin["name"])))
    return interpreter, wrong


def step_venv(args):
    cfg = os.path.join(args["venv"], "pyvenv.cfg")
    if os.path.isfile(cfg) and os.path.exists(_venv_python(args)):
        return {"status": "ok", "detail": "venv exists"}
    code, tail = _log_command(args["log"], [args.get("creator", "python3"), "-m", "venv", args["venv"]])
    if code != 0 or not os.path.exists(_venv_python(args)):
        return {"status": "failed", "detail": "python3 -m venv failed (exit %s)" % code, "tail": tail}
    return {"status": "changed", "detail": "created %s" % args["venv"]}


def step_system(args):
    missing = [pkg for command, pkg in sorted(args.get("commands", {}).items()) if not shutil.which(command)]
    missing += [pkg for pkg in args.get("apt", []) if pkg not in missing]
    if not missing:
        return {"status": "ok", "detail": "all present"}
    if not shutil.which("apt-get"):
        return {"status": "failed", "detail": "missing %s and no apt-get here: install them by hand"
                % ", ".join(missing)}
    prefix = []
    if os.geteuid() != 0:
        if run(["sudo", "-n", "true"], timeout=30)[0] != 0:
            return {"status": "failed", "detail": "missing %s; not root and sudo needs a password: run"
                    " `sudo apt-get install -y %s` on the host, then provision again"
                    % (", ".join(missing), " ".join(missing))}
        prefix = ["sudo", "-n"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    code, tail = _log_command(args["log"], prefix + ["apt-get", "install", "-y", "-q"] + missing, env=env)
    if code != 0:  # the package lists may be missing or stale on a fresh host
        _log_command(args["log"], prefix + ["apt-get", "update", "-q"], env=env)
        code, tail = _log_command(args["log"], prefix + ["apt-get", "install", "-y", "-q"] + missing, env=env)
    if code != 0:
        return {"status": "failed", "detail": "apt-get install %s failed (exit %s)" % (" ".join(missing), code),
                "tail": tail}
    return {"status": "changed", "detail": "installed %s" % ", ".join(missing)}


def _pip_env(args):
    env = dict(os.environ)
    if args.get("wheelhouse"):
        # Only the wheelhouse may feed this install: no pip.conf, no extra index or link dirs.
        env["PIP_CONFIG_FILE"] = os.devnull
        for key in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
            env.pop(key, None)
    env.pop("PYTHONPATH", None)
    if args.get("pythonpath"):
        env["PYTHONPATH"] = args["pythonpath"]
    return env


def step_pip(args):
    interpreter, wrong = _mismatches(args)
    if not wrong:
        return {"status": "ok", "detail": "all pins match"}
    constraints = os.path.join(args["state_dir"], "provision-constraints.txt")
    with open(constraints, "w") as f:
        f.write(args["constraints"])
    argv = [interpreter, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
            "--progress-bar", "off", "--no-compile", "-c", constraints]
    pins = args["pins"]
    bare_site = args.get("pythonpath") and not args.get("venv")
    if bare_site:
        # A trimmed site over a system Python: add exactly the missing pins to that folder and
        # leave the system's packages alone (--target would otherwise copy every dependency in).
        argv += ["--target", args["pythonpath"], "--upgrade", "--no-deps"]
        pins = [pin for pin, _ in wrong]
    elif args.get("no_deps"):
        argv.append("--no-deps")
    if args.get("wheelhouse"):
        argv += ["--no-index", "--find-links", args["wheelhouse"]]
    elif args.get("index_url"):
        argv += ["--extra-index-url", args["index_url"]]
    argv += [p["spec"] for p in pins]
    code, tail = _log_command(args["log"], argv, env=_pip_env(args))
    if code != 0:
        return {"status": "failed", "detail": "pip install failed (exit %s)" % code, "tail": tail}
    _, still_wrong = _mismatches(args)
    if still_wrong:
        return {"status": "failed", "detail": "pip finished, but still: " + ", ".join(w for _, w in still_wrong),
                "tail": tail}
    return {"status": "changed", "detail": "installed " + ", ".join(p["spec"] for p in pins)
            + " (had: " + ", ".join(w for _, w in wrong) + ")"}


def take_incoming(incoming):
    """Move wheels that just arrived (as .part files) into the wheelhouse once their sha256
    checks out; a rename, so a concurrent run never installs from a half-sent file."""
    if incoming:  # parts of a run that was cut long ago are only clutter
        folder = os.path.dirname(incoming[0]["final"])
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith(".incoming-") and time.time() - os.path.getmtime(path) > 86400:
                os.unlink(path)
    for item in incoming:
        if not os.path.exists(item["part"]):
            continue  # a concurrent run already took it
        if sha256_file(item["part"]) != item["sha256"]:
            os.unlink(item["part"])
            raise RuntimeError("%s arrived corrupted (sha256 differs); run provision again"
                               % os.path.basename(item["final"]))
        os.rename(item["part"], item["final"])


STEPS = {"venv": step_venv, "system": step_system, "pip": step_pip}


def main(args):
    started = time.time()
    os.makedirs(args["state_dir"], exist_ok=True)
    path, timeout = os.path.join(args["state_dir"], "provision.lock"), args.get("lock_timeout", 1800)
    try:
        with FileLock(path, timeout, poll=0.5) as lock:
            take_incoming(args.get("incoming") or [])
            answer = STEPS[args["kind"]](args)
    except LockBusy:
        raise RuntimeError("another provision holds %s for more than %ss; try again later" % (path, timeout))
    answer["seconds"] = round(time.time() - started, 2)
    answer["waited_s"] = round(lock.waited, 2)
    return answer

"""The embedded sandbox host: a real sshd on 127.0.0.1 with its own keys.

Everything lives under `paths.sandbox_dir()` (git-ignored): the sshd config, its host
key, a client key, authorized_keys, a known_hosts entry for strict checking, the pid
file and the log. `up` is idempotent; `down` stops the model server recorded on the sandbox
host first (through the server engine, while sshd still answers), then only the sshd this folder
started.
What `up` changes beyond that folder (system packages through apt) and any change to the
known_hosts entry is reported through `note` before or as it happens.
"""
from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from toolkit.core import paths

DEFAULT_PORT = 2222
SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/bin/sshd", "/usr/local/sbin/sshd")


class SandboxError(RuntimeError):
    pass


@dataclass
class SandboxStatus:
    running: bool
    pid: int | None
    port: int
    folder: Path
    changed: bool = False
    dry_run: bool = False
    plan: list[str] = field(default_factory=list)   # dry run: what `up` or `down` would do, in order
    action: str = "up"
    server: str = ""       # down: what became of the sandbox host's model server

    def line(self) -> str:
        if self.dry_run:
            return f"sandbox {self.action} (dry run, nothing done) would, in {self.folder}:\n" + \
                "\n".join(f"  {n}. {step}" for n, step in enumerate(self.plan, 1))
        state = f"running (pid {self.pid})" if self.running else "stopped"
        return (f"{self.server}\n" if self.server else "") + \
            f"sandbox sshd on 127.0.0.1:{self.port}: {state}; files in {self.folder}"


def _files(folder: Path) -> dict[str, Path]:
    ssh = folder / "sshd"
    return {
        "dir": ssh,
        "config": ssh / "sshd_config",
        "host_key": ssh / "host_ed25519",
        "authorized_keys": ssh / "authorized_keys",
        "pid": ssh / "sshd.pid",
        "log": ssh / "sshd.log",
        "client_key": folder / "client_key",
        "known_hosts": folder / "known_hosts",
    }


def find_sshd() -> str | None:
    found = shutil.which("sshd")
    if found:
        return found
    return next((c for c in SSHD_CANDIDATES if os.path.exists(c)), None)


@dataclass
class AptPlan:
    """What `apt-get install` would do, from its own simulation (`apt-get install -s`)."""
    install: list[tuple[str, str]] = field(default_factory=list)         # (package, version)
    upgrade: list[tuple[str, str, str]] = field(default_factory=list)    # (package, from, to)
    update_first: bool = False     # the package lists were empty or stale: `apt-get update` runs first

    def describe(self) -> str:
        parts = []
        if self.install:
            parts.append("install " + ", ".join(f"{name} {version}" for name, version in self.install))
        if self.upgrade:
            parts.append("upgrade " + ", ".join(f"{name} {old} -> {new}" for name, old, new in self.upgrade))
        return "; ".join(parts) or "nothing to install"


_APT_LINE = re.compile(r"^Inst (\S+) (?:\[([^\]]+)\] )?\((\S+)")


def parse_apt_simulation(text: str) -> AptPlan:
    """`Inst NAME [OLD] (NEW ...)` lines of `apt-get install -s` -> packages it installs or upgrades."""
    plan = AptPlan()
    for row in text.splitlines():
        found = _APT_LINE.match(row)
        if found:
            name, old, new = found.groups()
            if old:
                plan.upgrade.append((name, old, new))
            else:
                plan.install.append((name, new))
    return plan


def apt_plan(packages: list[str]) -> AptPlan:
    """Ask apt what installing `packages` would install or upgrade; changes nothing."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C")
    done = subprocess.run(["apt-get", "install", "-s", "-q", *packages], env=env, capture_output=True, text=True)
    if done.returncode != 0:   # e.g. "Unable to locate package": the lists are empty, `update` first
        plan = AptPlan(update_first=True)
        plan.install = [(name, "(version after apt-get update)") for name in packages]
        return plan
    return parse_apt_simulation(done.stdout)


SSHD_PACKAGES = ["openssh-server"]


def install_sshd(note: Callable[[str], None] = lambda text: None) -> str:
    """Install Debian's openssh-server (needs root and apt); say what apt installs first; return the sshd path."""
    command = f"apt-get install -y {' '.join(SSHD_PACKAGES)}"
    if os.geteuid() != 0:
        raise SandboxError(f"sshd is not installed and this is not root: run `sudo {command}`, then retry")
    if not shutil.which("apt-get"):
        raise SandboxError("sshd is not installed and apt-get is missing: install OpenSSH's server by hand")
    plan = apt_plan(SSHD_PACKAGES)
    note(f"sandbox: sshd is not installed; running {'apt-get update, then ' if plan.update_first else ''}"
         f"{command} (system packages: {plan.describe()})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    steps = ([["apt-get", "update", "-q"]] if plan.update_first else []) + [
        ["apt-get", "install", "-y", "-q", *SSHD_PACKAGES]]
    for cmd in steps:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SandboxError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n"
                               f"{done.stdout[-1500:]}{done.stderr[-1500:]}")
    sshd = find_sshd()
    if not sshd:
        raise SandboxError(f"{command} finished but no sshd was found in {', '.join(SSHD_CANDIDATES)}")
    return sshd


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not a server
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _read_pid(pid_file: Path) -> int | None:
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _pid_alive(pid) else None


def free_loopback_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now (bound by the kernel, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def _configured_port(config: Path) -> int | None:
    try:
        for text in config.read_text().splitlines():
            if text.startswith("Port "):
                return int(text.split()[1])
    except (OSError, ValueError):
        pass
    return None


def sandbox_port(folder: Path | None = None) -> int:
    """The port of the sandbox as set up (its config), else TOOLKIT_SANDBOX_PORT, else 2222."""
    if "TOOLKIT_SANDBOX_PORT" in os.environ:
        return int(os.environ["TOOLKIT_SANDBOX_PORT"])
    return _configured_port(_files(folder or paths.sandbox_dir())["config"]) or DEFAULT_PORT


def up_command(port: int) -> str:
    """The command that brings the sandbox up on `port` (what advice prints)."""
    default = int(os.environ.get("TOOLKIT_SANDBOX_PORT", DEFAULT_PORT))
    return "invoke sandbox up" + ("" if port == default else f" --port {port}")


def status(folder: Path | None = None, port: int | None = None) -> SandboxStatus:
    folder = folder or paths.sandbox_dir()
    f = _files(folder)
    pid = _read_pid(f["pid"])
    if pid is not None:  # a running sshd answers on the port it was started with
        port = _configured_port(f["config"]) or port
    return SandboxStatus(running=pid is not None, pid=pid, port=port or sandbox_port(folder), folder=folder)


def _keygen(path: Path, comment: str) -> None:
    if not path.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                       check=True, capture_output=True)


def _write_config(f: dict[str, Path], port: int, sshd: str) -> None:
    sftp = next((p for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server")
                 if os.path.exists(p)), "internal-sftp")
    f["config"].write_text("\n".join([
        f"Port {port}",
        "ListenAddress 127.0.0.1",
        f"HostKey {f['host_key']}",
        f"PidFile {f['pid']}",
        f"AuthorizedKeysFile {f['authorized_keys']}",
        f"AllowUsers {getpass.getuser()}",
        "PermitRootLogin prohibit-password",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "MaxStartups 50:30:100",
        "MaxSessions 50",
        f"Subsystem sftp {sftp}",
        "",
    ]))


def _update_known_hosts(path: Path, port: int, key_type: str, key: str) -> str | None:
    """Make `path` hold the sandbox's own host key for [127.0.0.1]:port, keeping every other line.

    Returns what changed (None when the file already said so): a different key that was there
    before is named, since replacing a known_hosts entry is what an attacker would want too."""
    pattern = f"[127.0.0.1]:{port}"
    entry = f"{pattern} {key_type} {key}"
    try:
        old_lines = path.read_text().splitlines()
    except FileNotFoundError:
        old_lines = None
    ours = [line for line in old_lines or [] if line.split(" ", 1)[0] == pattern]
    if ours == [entry]:
        return None
    kept = [line for line in old_lines or [] if line.split(" ", 1)[0] != pattern]
    path.write_text("\n".join(kept + [entry]) + "\n")
    if old_lines is None:
        return f"wrote {path} with the sandbox's host key for {pattern}"
    if ours:
        before = "; ".join(" ".join(line.split()[1:3])[:60] + "..." for line in ours)
        return (f"replaced the known_hosts entry for {pattern} in {path}: it held a different key ({before}); "
                f"now the sandbox's own host key ({key_type} {key[:24]}...)")
    return f"added the sandbox's host key for {pattern} to {path}"


def up(folder: Path | None = None, port: int | None = None, *, timeout: float = 10.0, dry_run: bool = False,
       note: Callable[[str], None] = lambda text: None) -> SandboxStatus:
    """Start the sandbox sshd if it is not running; idempotent. `dry_run`: say what it would do, do nothing."""
    folder = folder or paths.sandbox_dir()
    asked = port
    port = port or (int(os.environ["TOOLKIT_SANDBOX_PORT"]) if "TOOLKIT_SANDBOX_PORT" in os.environ else DEFAULT_PORT)
    current = status(folder, port)
    if current.running:
        if asked is not None and asked != current.port:
            raise SandboxError(f"the sandbox already runs on 127.0.0.1:{current.port} (pid {current.pid}); to move it"
                               f" to port {asked}: invoke sandbox down && {up_command(asked)}")
        return current
    f = _files(folder)
    if port_open(port):
        raise SandboxError(f"port {port} on 127.0.0.1 is taken by another program; choose another with"
                           f" TOOLKIT_SANDBOX_PORT=NNNN or --port")
    if dry_run:
        return _plan_up(folder, port)
    sshd = find_sshd() or install_sshd(note)
    f["dir"].mkdir(parents=True, exist_ok=True)
    _keygen(f["host_key"], "toolkit-sandbox-host")
    _keygen(f["client_key"], "toolkit-sandbox-client")
    f["authorized_keys"].write_text(Path(str(f["client_key"]) + ".pub").read_text())
    host_pub = Path(str(f["host_key"]) + ".pub").read_text().split()
    changed = _update_known_hosts(f["known_hosts"], port, host_pub[0], host_pub[1])
    if changed:
        note(f"sandbox: {changed}")
    _write_config(f, port, sshd)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege-separation dir sshd insists on
    check = subprocess.run([sshd, "-t", "-f", str(f["config"])], capture_output=True, text=True)
    if check.returncode != 0:
        raise SandboxError(f"sshd rejected its config: {check.stderr.strip()}")
    subprocess.run([sshd, "-f", str(f["config"]), "-E", str(f["log"])], check=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = status(folder, port)
        if current.running and port_open(port):
            current.changed = True
            return current
        time.sleep(0.05)
    log = f["log"].read_text()[-1500:] if f["log"].exists() else ""
    raise SandboxError(f"sshd did not start within {timeout}s on port {port}:\n{log}")


def _plan_up(folder: Path, port: int) -> SandboxStatus:
    f = _files(folder)
    steps = []
    sshd = find_sshd()
    if sshd:
        steps.append(f"use {sshd}")
    elif os.geteuid() != 0 or not shutil.which("apt-get"):
        steps.append(f"stop: sshd is not installed and cannot be installed here (run `sudo apt-get install -y "
                     f"{' '.join(SSHD_PACKAGES)}`)")
    else:
        plan = apt_plan(SSHD_PACKAGES)
        steps.append(f"{'apt-get update, then ' if plan.update_first else ''}apt-get install -y "
                     f"{' '.join(SSHD_PACKAGES)}: {plan.describe()}")
    for key in ("host_key", "client_key"):
        if not f[key].exists():
            steps.append(f"make {f[key]} (ssh-keygen -t ed25519)")
    host_pub = Path(str(f["host_key"]) + ".pub")
    if host_pub.exists():
        key_type, key = host_pub.read_text().split()[:2]
        try:
            current = [line for line in f["known_hosts"].read_text().splitlines()
                       if line.split(" ", 1)[0] == f"[127.0.0.1]:{port}"]
        except FileNotFoundError:
            current = []
        if current != [f"[127.0.0.1]:{port} {key_type} {key}"]:
            steps.append(f"write the host key for [127.0.0.1]:{port} into {f['known_hosts']}"
                         + (" (replacing a different key there)" if current else ""))
    else:
        steps.append(f"write the new host key for [127.0.0.1]:{port} into {f['known_hosts']}")
    steps.append(f"write {f['config']} and start sshd on 127.0.0.1:{port}")
    return SandboxStatus(running=False, pid=None, port=port, folder=folder, dry_run=True, plan=steps)


def _model_server(folder: Path, port: int):
    """(sandbox Host, its running model server's ServerState or None, why it could not be told)."""
    from toolkit.core.inventory import sandbox_host   # above this module: it imports sandbox_port
    from toolkit.server import server

    host = sandbox_host(folder, port)
    try:
        return host, server.running_server(host), ""
    except Exception as exc:   # sshd answers but the host cannot be asked: say so, stop sshd anyway
        return host, None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def down(folder: Path | None = None, dry_run: bool = False) -> SandboxStatus:
    """Stop the model server recorded on the sandbox host (as `invoke server stop` does; after sshd
    is gone nothing could reach it), then the sandbox sshd (only the one whose pid file is in
    `folder`). A server that does not stop leaves sshd running and raises SandboxError. `dry_run`:
    say what it would stop, stop nothing."""
    from toolkit.server import server

    folder = folder or paths.sandbox_dir()
    current = status(folder)
    if not current.running:
        return current
    host, running, unknown = _model_server(folder, current.port)
    what = f"the sandbox host's {running.profile} server (pid {running.pid})" if running else ""
    if dry_run:
        steps = ([f"stop {what}, as `invoke server stop` does"] if running else
                 [f"leave the model server alone: cannot tell whether one runs ({unknown})"] if unknown else [])
        steps.append(f"stop sshd (pid {current.pid}) on 127.0.0.1:{current.port}")
        return SandboxStatus(True, current.pid, current.port, folder, dry_run=True, plan=steps, action="down")
    said = f"could not check the sandbox host for a model server ({unknown})" if unknown else ""
    if running:
        stopped = server.stop(host)
        if not stopped.stopped:
            raise SandboxError(f"{what} did not stop ({stopped.reason}); the sandbox sshd is left running so that"
                               f" `invoke server stop` can still reach it")
        said = f"stopped {what} first"
    os.kill(current.pid, signal.SIGTERM)
    for _ in range(100):
        if not _pid_alive(current.pid):
            break
        time.sleep(0.05)
    _files(folder)["pid"].unlink(missing_ok=True)
    return SandboxStatus(running=False, pid=None, port=current.port, folder=folder, changed=True, server=said)

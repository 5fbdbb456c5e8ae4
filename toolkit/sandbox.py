"""The embedded sandbox host: a real sshd on 127.0.0.1 with its own keys.

Everything lives under `paths.sandbox_dir()` (git-ignored): the sshd config, its host
key, a client key, authorized_keys, a known_hosts entry for strict checking, the pid
file and the log. `up` is idempotent; `down` stops only the sshd this folder started.
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import paths

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

    def line(self) -> str:
        state = f"running (pid {self.pid})" if self.running else "stopped"
        return f"sandbox sshd on 127.0.0.1:{self.port}: {state}; files in {self.folder}"


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


def install_sshd() -> str:
    """Install Debian's openssh-server (needs root and apt); return the sshd path."""
    if os.geteuid() != 0:
        raise SandboxError("sshd is not installed and this is not root: run"
                           " `sudo apt-get install -y openssh-server`, then retry")
    if not shutil.which("apt-get"):
        raise SandboxError("sshd is not installed and apt-get is missing: install OpenSSH's server by hand")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "install", "-y", "-q", "openssh-server"],
                ["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "openssh-server"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode == 0 and cmd[1] == "install":
            break
    sshd = find_sshd()
    if not sshd:
        raise SandboxError(f"installing openssh-server failed:\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
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


def up(folder: Path | None = None, port: int | None = None, *, timeout: float = 10.0) -> SandboxStatus:
    """Start the sandbox sshd if it is not running; idempotent."""
    folder = folder or paths.sandbox_dir()
    port = port or (int(os.environ["TOOLKIT_SANDBOX_PORT"]) if "TOOLKIT_SANDBOX_PORT" in os.environ else DEFAULT_PORT)
    current = status(folder, port)
    if current.running:
        return current
    f = _files(folder)
    if port_open(port):
        raise SandboxError(f"port {port} on 127.0.0.1 is taken by another program; choose another with"
                           f" TOOLKIT_SANDBOX_PORT=NNNN or --port")
    sshd = find_sshd() or install_sshd()
    f["dir"].mkdir(parents=True, exist_ok=True)
    _keygen(f["host_key"], "toolkit-sandbox-host")
    _keygen(f["client_key"], "toolkit-sandbox-client")
    f["authorized_keys"].write_text(Path(str(f["client_key"]) + ".pub").read_text())
    host_pub = Path(str(f["host_key"]) + ".pub").read_text().split()
    f["known_hosts"].write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
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


def down(folder: Path | None = None) -> SandboxStatus:
    """Stop the sandbox sshd (only the one whose pid file is in `folder`)."""
    folder = folder or paths.sandbox_dir()
    current = status(folder)
    if not current.running:
        return current
    os.kill(current.pid, signal.SIGTERM)
    for _ in range(100):
        if not _pid_alive(current.pid):
            break
        time.sleep(0.05)
    _files(folder)["pid"].unlink(missing_ok=True)
    return SandboxStatus(running=False, pid=None, port=current.port, folder=folder, changed=True)

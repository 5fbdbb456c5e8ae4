"""One interface for talking to a host: run a command, send or fetch a file.

Two implementations share it: `SSHTransport` (a Fabric `Connection`) for remote
hosts and `LocalTransport` (a subprocess shell) for this machine. Engine code only
sees `Transport`, so the same code path serves a far host, the sandbox on loopback
and the GPU machine in `--host local` mode.

Every `run` is one round trip; `round_trips` counts them so benchmarks can show that
a command's cost does not grow with the number of files it touches.
"""
from __future__ import annotations

import ipaddress
import os
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


# Set (to anything) to refuse every SSH host but loopback ones before a name is even resolved:
# what the tests run under, so that an example host in the inventory is never dialled.
LOOPBACK_ONLY_ENV = "TOOLKIT_LOOPBACK_ONLY"


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 or `localhost`; any other name is not loopback (it is not looked up)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class TransportError(RuntimeError):
    """The host could not be reached or the connection broke."""


class HostKeyError(TransportError):
    """The host's key is unknown or does not match known_hosts."""


@dataclass
class CommandResult:
    command: str
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def tail(self, lines: int = 30) -> str:
        text = (self.stdout + ("\n" if self.stdout and self.stderr else "") + self.stderr).rstrip()
        return "\n".join(text.splitlines()[-lines:])


class Transport:
    """Base class: subclasses provide `_run`, `put`, `get`."""

    name = "transport"

    def __init__(self) -> None:
        self.round_trips = 0

    def run(self, command: str, *, stdin: str | bytes | None = None,
            timeout: float | None = None, env: dict[str, str] | None = None) -> CommandResult:
        """Run `command` through the host's shell; never raises on a non-zero exit."""
        self.round_trips += 1
        if isinstance(stdin, bytes):
            stdin = stdin.decode()
        return self._run(command, stdin=stdin, timeout=timeout, env=env or {})

    def _run(self, command, *, stdin, timeout, env) -> CommandResult:  # pragma: no cover
        raise NotImplementedError

    def put(self, local: str | Path, remote: str) -> None:  # pragma: no cover
        raise NotImplementedError

    def get(self, remote: str, local: str | Path) -> None:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _with_env(command: str, env: dict[str, str]) -> str:
    if not env:
        return command
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return f"export {exports}; {command}"


class LocalTransport(Transport):
    """This machine, through /bin/sh: no SSH, the same code path."""

    name = "local"

    def _run(self, command, *, stdin, timeout, env):
        # subprocess rather than Invoke's Context.run: Invoke feeds stdin a byte at a
        # time, which makes a 1 MB plan take minutes; this is one pipe write.
        try:
            done = subprocess.run(["/bin/sh", "-c", _with_env(command, env)], input=stdin or "",
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TransportError(f"local command timed out after {timeout}s: {command[:80]}") from exc
        return CommandResult(command, done.returncode, done.stdout, done.stderr)

    def put(self, local, remote):
        self.round_trips += 1
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, remote)

    def get(self, remote, local):
        self.round_trips += 1
        shutil.copyfile(remote, local)


class SSHTransport(Transport):
    """A remote host through a Fabric Connection, with strict host-key checking."""

    name = "ssh"

    def __init__(self, address: str, *, port: int = 22, user: str | None = None,
                 key_filename: str | None = None, known_hosts: str | None = None,
                 connect_timeout: float = 10.0, advice: str | None = None) -> None:
        super().__init__()
        self.address, self.port, self.user = address, port, user
        self.known_hosts = known_hosts
        # What to do when the host does not answer or its files are missing (the sandbox: start it).
        self.advice = advice
        self._key_filename = key_filename
        self._connect_timeout = connect_timeout
        self._connection = None

    @property
    def connection(self):
        if self._connection is None:
            self._connection = self._connect()
        return self._connection

    @property
    def known_hosts_name(self) -> str:
        """The name OpenSSH files this host under: `address`, or `[address]:port` off port 22."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    def _check_files(self) -> None:
        if self.known_hosts and not os.path.isfile(self.known_hosts):
            folder = os.path.dirname(self.known_hosts) or "."
            raise HostKeyError(
                f"known_hosts file {self.known_hosts} does not exist; " + (self.advice or
                f"after checking the host's fingerprint, create it with: mkdir -p {shlex.quote(folder)} && "
                f"ssh-keyscan -p {self.port} {shlex.quote(self.address)} >> {shlex.quote(self.known_hosts)}"))
        if self._key_filename and not os.path.isfile(self._key_filename):
            raise TransportError(
                f"SSH key {self._key_filename} does not exist; " + (self.advice or
                "set `key` in the host's inventory table to an existing private key"))

    def _file_holding(self) -> str:
        """The known_hosts file whose entry for this host disagrees (the configured one, else ~/.ssh's)."""
        import paramiko

        if self.known_hosts:
            try:
                if paramiko.HostKeys(self.known_hosts).lookup(self.known_hosts_name):
                    return self.known_hosts
            except OSError:
                pass
        return os.path.expanduser("~/.ssh/known_hosts")

    def _connect(self):
        import paramiko
        from fabric import Config, Connection

        if os.environ.get(LOOPBACK_ONLY_ENV) and not is_loopback(self.address):
            raise TransportError(f"refused to dial {self.address}:{self.port}: {LOOPBACK_ONLY_ENV} is set,"
                                 " which allows loopback addresses only")
        self._check_files()
        connect_kwargs = {"look_for_keys": self._key_filename is None, "allow_agent": self._key_filename is None}
        if self._key_filename:
            connect_kwargs["key_filename"] = self._key_filename
        config = Config(overrides={"load_ssh_configs": False})
        conn = Connection(self.address, user=self.user, port=self.port, config=config,
                          connect_timeout=self._connect_timeout, connect_kwargs=connect_kwargs)
        client = conn.client
        client.load_system_host_keys()
        if self.known_hosts:
            client.load_host_keys(self.known_hosts)
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            conn.open()
        except paramiko.BadHostKeyException as exc:
            holder = self._file_holding()
            raise HostKeyError(
                f"host key of {self.address}:{self.port} does not match the entry in {holder}; if the host was"
                f" rebuilt, check its new fingerprint, then remove the old entry with: ssh-keygen -R"
                f" {shlex.quote(self.known_hosts_name)} -f {shlex.quote(holder)}") from exc
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                target = self.known_hosts or os.path.expanduser("~/.ssh/known_hosts")
                raise HostKeyError(
                    f"host {self.address}:{self.port} is not in known_hosts ({target}); after checking its"
                    f" fingerprint, accept it with: ssh-keyscan -p {self.port} {shlex.quote(self.address)}"
                    f" >> {shlex.quote(target)}") from exc
            raise TransportError(f"ssh to {self.address}:{self.port} failed: {exc}") from exc
        except (OSError, socket.timeout) as exc:
            raise TransportError(f"cannot reach {self.address}:{self.port}: {exc}"
                                 + (f"; {self.advice}" if self.advice else "")) from exc
        return conn

    def _run(self, command, *, stdin, timeout, env):
        import paramiko

        try:
            return self._exec(_with_env(command, env), command, stdin, timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._drop()
            raise TransportError(f"connection to {self.address}:{self.port} broke: {exc}") from exc

    def _exec(self, full_command, command, stdin, timeout):
        # One exec channel on the Fabric connection's paramiko transport: stdin is sent in
        # one go and closed, stdout and stderr are drained together so neither can stall.
        channel = self.connection.client.get_transport().open_session()
        try:
            channel.exec_command(full_command)
            if stdin:
                channel.sendall(stdin.encode())
            channel.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout if timeout else None
            while True:
                got = False
                while channel.recv_ready():
                    out += channel.recv(65536)
                    got = True
                while channel.recv_stderr_ready():
                    err += channel.recv_stderr(65536)
                    got = True
                if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                    break
                if channel.closed and not got:
                    raise EOFError("channel closed before the command finished")
                if deadline and time.monotonic() > deadline:
                    raise TransportError(f"command timed out after {timeout}s on {self.address}: {command[:80]}")
                if not got:
                    time.sleep(0.002)
            code = channel.recv_exit_status()
        finally:
            channel.close()
        return CommandResult(command, code, out.decode(errors="replace"), err.decode(errors="replace"))

    def put(self, local, remote):
        self.round_trips += 1
        self.connection.put(str(local), remote)

    def get(self, remote, local):
        self.round_trips += 1
        self.connection.get(remote, str(local))

    def _drop(self):
        try:
            if self._connection is not None:
                self._connection.close()
        finally:
            self._connection = None

    def close(self):
        self._drop()

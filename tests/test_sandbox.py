"""`sandbox up` says what it changes: the system packages apt would install (asked from apt itself,
before anything is installed) and every change to the sandbox's known_hosts entry."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.server.conftest import ref_model, ssh_host  # noqa: F401 (fixtures)
from toolkit.core import sandbox


def _not_installed_package() -> str:
    """A small Debian package that apt knows and this machine does not have."""
    for name in ("sl", "cowsay", "figlet", "toilet", "bsdgames"):
        installed = subprocess.run(["dpkg-query", "-W", "-f=${Status}", name], capture_output=True, text=True)
        known = subprocess.run(["apt-cache", "show", name], capture_output=True, text=True)
        if "install ok installed" not in installed.stdout and known.returncode == 0:
            return name
    raise AssertionError("apt knows none of the candidate packages: are the package lists there (apt-get update)?")


def test_apt_plan_names_what_apt_would_install_and_changes_nothing():
    name = _not_installed_package()
    plan = sandbox.apt_plan([name])
    assert name in dict(plan.install)
    assert f"install {name} " in plan.describe() and not plan.update_first
    installed = subprocess.run(["dpkg-query", "-W", "-f=${Status}", name], capture_output=True, text=True)
    assert "install ok installed" not in installed.stdout
    # an installed package: apt says there is nothing to do
    assert sandbox.apt_plan(["openssh-server"]).describe() == "nothing to install"


def test_apt_simulation_lines_are_read_as_installs_and_upgrades():
    # the shape of `apt-get install -s` output (Debian 12): new packages, then an upgrade
    text = ("Inst openssh-sftp-server (1:9.2p1-2+deb12u10 Debian:12.15/oldstable [amd64])\n"
            "Inst openssh-client [1:9.2p1-2+deb12u5] (1:9.2p1-2+deb12u10 Debian:12.15/oldstable [amd64])\n"
            "Conf openssh-client (1:9.2p1-2+deb12u10 Debian:12.15/oldstable [amd64])\n")
    plan = sandbox.parse_apt_simulation(text)
    assert plan.install == [("openssh-sftp-server", "1:9.2p1-2+deb12u10")]
    assert plan.upgrade == [("openssh-client", "1:9.2p1-2+deb12u5", "1:9.2p1-2+deb12u10")]
    assert plan.describe() == ("install openssh-sftp-server 1:9.2p1-2+deb12u10; "
                               "upgrade openssh-client 1:9.2p1-2+deb12u5 -> 1:9.2p1-2+deb12u10")


def test_dry_run_without_sshd_names_the_apt_install_and_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "find_sshd", lambda: None)    # as on a machine without openssh-server
    folder = tmp_path / "sandbox"
    plan = sandbox.up(folder, free_port(), dry_run=True)
    assert plan.dry_run and not plan.running and not folder.exists()
    first = plan.plan[0]
    assert first.startswith("apt-get install -y openssh-server: ") or first.startswith("stop: sshd is not installed")
    assert "start sshd on 127.0.0.1:" in plan.plan[-1]


@pytest.fixture
def private_sandbox(tmp_path):
    folder, port = tmp_path / "sandbox", free_port()
    yield folder, port
    sandbox.down(folder)


def test_known_hosts_changes_are_said_and_other_entries_kept(private_sandbox):
    folder, port = private_sandbox
    notes: list[str] = []
    sandbox.up(folder, port, note=notes.append)
    known_hosts = folder / "known_hosts"
    assert notes == [f"sandbox: wrote {known_hosts} with the sandbox's host key for [127.0.0.1]:{port}"]
    ours = known_hosts.read_text()

    notes.clear()
    sandbox.down(folder)
    sandbox.up(folder, port, note=notes.append)
    assert notes == [] and known_hosts.read_text() == ours          # same key: nothing rewritten, nothing said

    # someone's entry for another host, and a different key for the sandbox's address
    client_key = (folder / "client_key.pub").read_text().split()
    known_hosts.write_text(f"other.example {client_key[0]} {client_key[1]}\n"
                           f"[127.0.0.1]:{port} {client_key[0]} {client_key[1]}\n")
    sandbox.down(folder)
    sandbox.up(folder, port, note=notes.append)
    assert len(notes) == 1 and f"replaced the known_hosts entry for [127.0.0.1]:{port}" in notes[0]
    assert "it held a different key" in notes[0]
    assert known_hosts.read_text() == f"other.example {client_key[0]} {client_key[1]}\n" + ours
    ssh = shutil.which("ssh")
    assert ssh
    done = subprocess.run([ssh, "-p", str(port), "-i", str(folder / "client_key"), "-o", "BatchMode=yes",
                           "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
                           "127.0.0.1", "echo ok"], capture_output=True, text=True, timeout=30)
    assert done.stdout == "ok\n", done.stderr                      # OpenSSH itself accepts the entry


def test_down_stops_the_sandbox_hosts_model_server_first_and_its_dry_run_stops_nothing(tmp_path, cpu_ref_venv,
                                                                                        ref_model):  # noqa: F811
    """`invoke sandbox down` after `invoke server start cpu-ref`: the server goes first (through the
    server engine, while sshd answers), so nothing is left running that the toolkit cannot reach;
    `-n` says so and stops nothing; --port is refused where it cannot be honoured."""
    from tests.helpers import invoke
    from tests.rollout import conftest as rollout_fixtures

    folder, port = tmp_path / "sandbox", free_port()
    env = {"TOOLKIT_SANDBOX_DIR": str(folder), "TOOLKIT_SANDBOX_PORT": str(port)}
    done = invoke("sandbox", "up", "--port", str(port), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        (folder / "host" / "models").mkdir(parents=True)
        rollout_fixtures.private_venv(Path(cpu_ref_venv), folder / "host" / "venv")   # never writes the cached one
        (folder / "host" / "models" / "tiny-llama").symlink_to(ref_model)
        done = invoke("server", "start", "cpu-ref", "--port", str(free_port()), env=env, timeout=400)
        assert done.returncode == 0, done.stdout + done.stderr
        sshd = sandbox.status(folder).pid
        pid = int(re.search(r"│ cpu-ref\s+│ ready\s+│ (\d+)", done.stdout).group(1))

        done = invoke("sandbox", "up", "--port", str(free_port()), "-n", env=env)
        assert done.returncode == 1 and f"already runs on 127.0.0.1:{port}" in done.stderr, done.stderr
        assert "invoke sandbox down && invoke sandbox up --port" in done.stderr
        done = invoke("sandbox", "status", "--port", "9", env=env)
        assert done.returncode == 2 and "takes no --port" in done.stderr, done.stderr

        done = invoke("sandbox", "down", "-n", env=env)
        assert done.returncode == 0, done.stderr
        assert "sandbox down (dry run, nothing done) would" in done.stdout
        assert f"stop the sandbox host's cpu-ref server (pid {pid})" in done.stdout
        assert f"stop sshd (pid {sshd}) on 127.0.0.1:{port}" in done.stdout
        assert sandbox._pid_alive(pid) and sandbox.status(folder).pid == sshd

        done = invoke("sandbox", "down", env=env)
        assert done.returncode == 0, done.stderr
        assert f"stopped the sandbox host's cpu-ref server (pid {pid}) first" in done.stdout
        assert f"sandbox sshd on 127.0.0.1:{port}: stopped" in done.stdout
        assert not sandbox._pid_alive(pid) and not sandbox._pid_alive(sshd)
    finally:
        sandbox.down(folder)
        shutil.rmtree(folder / "host", ignore_errors=True)

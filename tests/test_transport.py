"""The transport layer against a real sshd on loopback and the local machine."""
import shlex
import subprocess

import pytest

from tests.helpers import invoke
from toolkit.core import hostrun, sandbox
from toolkit.core.inventory import Host, resolve_hosts
from toolkit.core.transport import HostKeyError, TransportError


@pytest.fixture(params=["sandbox", "local"])
def transport(request, sandbox_env):
    with resolve_hosts(request.param)[0].connect() as t:
        yield t


def test_run_reports_exit_code_stdout_and_stderr(transport):
    result = transport.run("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")


def test_stdin_and_env_reach_the_command(transport):
    payload = "x" * 2_000_000
    result = transport.run('printf "%s " "$GREETING"; wc -c', stdin=payload, env={"GREETING": "hello world"})
    assert result.stdout.split() == ["hello", "world", "2000000"]


def test_host_script_answers_json_in_one_round_trip(transport):
    before = transport.round_trips
    answer = hostrun.run_script(transport, "echo", {"files": ["a", "b"]})
    assert answer["echo"] == {"files": ["a", "b"]}
    assert transport.round_trips == before + 1


def test_host_script_failure_is_raised_with_the_reason(transport):
    with pytest.raises(hostrun.HostScriptError, match="KeyError: 'boom'"):
        hostrun.run_script(transport, "echo", {"raise": "boom"})


def test_unknown_host_key_is_refused_with_the_command_to_accept_it(sandbox_env, tmp_path):
    good = resolve_hosts("sandbox")[0]
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    stranger = Host(name="stranger", address="127.0.0.1", port=good.port, user=good.user,
                    key=good.key, known_hosts=str(empty))
    with pytest.raises(HostKeyError, match="ssh-keyscan"):
        stranger.connect().run("true")


def test_changed_host_key_is_refused(sandbox_env, tmp_path):
    good = resolve_hosts("sandbox")[0]
    wrong = tmp_path / "known_hosts"
    other_key = open(sandbox_env.folder / "client_key.pub").read().split()
    wrong.write_text(f"[127.0.0.1]:{good.port} {other_key[0]} {other_key[1]}\n")
    liar = Host(name="liar", address="127.0.0.1", port=good.port, user=good.user,
                key=good.key, known_hosts=str(wrong))
    with pytest.raises(HostKeyError, match="does not match"):
        liar.connect().run("true")


def test_closed_port_is_a_clear_transport_error(sandbox_env):
    from tests.conftest import free_port

    nobody = Host(name="nobody", address="127.0.0.1", port=free_port(), user="root")
    with pytest.raises(TransportError, match="cannot reach"):
        nobody.connect().run("true")


def test_sandbox_up_is_idempotent(sandbox_env):
    again = sandbox.up(sandbox_env.folder, sandbox_env.port)
    assert again.running and not again.changed and again.pid == sandbox_env.pid


def _stranger(sandbox_env, known_hosts) -> Host:
    good = resolve_hosts("sandbox")[0]
    return Host(name="stranger", address="127.0.0.1", port=good.port, user=good.user, key=good.key,
                known_hosts=str(known_hosts))


def test_a_missing_known_hosts_file_names_the_command_that_makes_it(sandbox_env, tmp_path):
    missing = tmp_path / "ssh" / "known_hosts"
    with pytest.raises(HostKeyError) as refused:
        _stranger(sandbox_env, missing).connect().run("true")
    message = str(refused.value)
    assert f"known_hosts file {missing} does not exist" in message and "Errno" not in message
    advice = message.split("create it with: ", 1)[1]
    assert advice == f"mkdir -p {missing.parent} && ssh-keyscan -p {sandbox_env.port} 127.0.0.1 >> {missing}"
    subprocess.run(advice, shell=True, check=True, capture_output=True, timeout=30)   # the advice works
    assert _stranger(sandbox_env, missing).connect().run("echo ok").stdout == "ok\n"


def test_a_changed_host_key_advice_names_the_file_and_works(sandbox_env, tmp_path):
    wrong = tmp_path / "known_hosts"
    other_key = open(sandbox_env.folder / "client_key.pub").read().split()
    wrong.write_text(f"example.invalid {other_key[0]} {other_key[1]}\n[127.0.0.1]:{sandbox_env.port} {other_key[0]} {other_key[1]}\n")
    with pytest.raises(HostKeyError) as refused:
        _stranger(sandbox_env, wrong).connect().run("true")
    removal = str(refused.value).split("remove the old entry with: ", 1)[1]
    assert removal == f"ssh-keygen -R '[127.0.0.1]:{sandbox_env.port}' -f {wrong}"
    subprocess.run(shlex.split(removal), check=True, capture_output=True, timeout=30)
    assert "example.invalid" in wrong.read_text() and "127.0.0.1" not in wrong.read_text()
    with pytest.raises(HostKeyError) as unknown:                    # now unknown: accept it as told
        _stranger(sandbox_env, wrong).connect().run("true")
    accept = str(unknown.value).split("accept it with: ", 1)[1]
    subprocess.run(accept, shell=True, check=True, capture_output=True, timeout=30)
    assert _stranger(sandbox_env, wrong).connect().run("echo ok").stdout == "ok\n"


def sandbox_cli(folder, port, *args) -> subprocess.CompletedProcess:
    return invoke(*args, env={"TOOLKIT_SANDBOX_DIR": str(folder), "TOOLKIT_SANDBOX_PORT": str(port)}, columns=200,
                  timeout=120)


def test_a_sandbox_that_is_not_up_says_to_start_it_and_that_works(tmp_path):
    """A fresh checkout (no .sandbox/ at all), then a sandbox that was stopped: both name `invoke sandbox up`."""
    from tests.conftest import free_port

    folder, port = tmp_path / "sandbox", free_port()
    fresh = sandbox_cli(folder, port, "server", "status")
    assert fresh.returncode == 1
    assert "known_hosts" in fresh.stderr and "start it with: invoke sandbox up" in fresh.stderr
    assert "Errno 2" not in fresh.stderr
    try:
        up = sandbox_cli(folder, port, "sandbox", "up")
        assert up.returncode == 0, up.stderr
        assert "wrote" in up.stderr and "known_hosts" in up.stderr
        works = sandbox_cli(folder, port, "server", "status")
        assert works.returncode == 0 and "not running" in works.stdout, works.stderr
        assert sandbox_cli(folder, port, "sandbox", "down").returncode == 0
        down = sandbox_cli(folder, port, "server", "status")
        assert down.returncode == 1
        assert f"cannot reach 127.0.0.1:{port}" in down.stderr
        assert "is the sandbox up? start it with: invoke sandbox up" in down.stderr
    finally:
        sandbox.down(folder)

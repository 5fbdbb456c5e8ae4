"""The transport layer against a real sshd on loopback and the local machine."""
import pytest

from toolkit import hostrun, sandbox
from toolkit.inventory import Host, resolve_hosts
from toolkit.transport import HostKeyError, TransportError


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

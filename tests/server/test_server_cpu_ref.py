"""`server start/stop/status/logs` with the real CPU reference server (`transformers serve`)
on the sandbox host, over a real SSH connection on loopback."""
from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.conftest import process_alive
from toolkit.server import server

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def chat(base_url: str, model: str, prompt: str) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "temperature": 0, "max_tokens": 16}).encode()
    request = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with NO_PROXY.open(request, timeout=60) as answer:
        return json.loads(answer.read())


class TestRunningServer:
    """Tests that only look at one running server share it (module fixture)."""

    def test_started_server_is_ready_and_recorded(self, running_cpu_ref):
        host, state = running_cpu_ref
        assert state.profile == "cpu-ref" and state.status == "ready"
        assert state.bind == "127.0.0.1" and state.port == host.server["port"]
        assert state.base_url_on_host == f"http://127.0.0.1:{state.port}"
        assert state.expected_log_lines == ["Application startup complete"]
        assert state.tp_size == 1 and state.dyn_threshold is None
        assert re.search(r"/server/cpu-ref/logs/cpu-ref-\d{8}T\d{6}Z\.log$", state.log_path), state.log_path
        with host.connect() as transport:     # server.log points at this start's log
            assert transport.run(f"readlink -f {posixpath.dirname(posixpath.dirname(state.log_path))}/server.log"
                                 ).stdout.strip() == state.log_path

    def test_chat_completion_through_the_ssh_tunnel(self, running_cpu_ref):
        host, state = running_cpu_ref
        with server.endpoint(host, state) as url:
            assert url.startswith("http://127.0.0.1:")
            first = chat(url, state.model, "Write a Python function that returns the n-th Fibonacci number.")
            second = chat(url, state.model, "Write a Python function that returns the n-th Fibonacci number.")
        text = first["choices"][0]["message"]["content"]
        assert text.strip(), "the reference model must answer with visible text at temperature 0"
        assert first["usage"]["completion_tokens"] == 16
        assert second["choices"][0]["message"]["content"] == text

    def test_the_tunnel_carries_concurrent_and_streamed_requests(self, running_cpu_ref):
        host, state = running_cpu_ref
        prompts = [f"Tell me about item {n}" for n in range(16)]
        with server.endpoint(host, state) as url:
            with ThreadPoolExecutor(max_workers=16) as pool:
                answers = list(pool.map(lambda p: chat(url, state.model, p), prompts))
            body = json.dumps({"model": state.model, "stream": True, "max_tokens": 8, "temperature": 0,
                               "messages": [{"role": "user", "content": "Hello"}]}).encode()
            request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with NO_PROXY.open(request, timeout=60) as stream:
                events = [line for line in stream.read().decode().splitlines() if line.startswith("data:")]
        assert all(a["choices"][0]["message"]["content"].strip() for a in answers)
        assert len(events) >= 8

    def test_the_tunnel_closes_with_the_block(self, running_cpu_ref):
        host, state = running_cpu_ref
        with server.endpoint(host, state) as url:
            port = int(url.rsplit(":", 1)[1])
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()

    def test_second_start_is_refused_and_leaves_the_first_alone(self, running_cpu_ref):
        host, state = running_cpu_ref
        with pytest.raises(server.ServerRefused, match=rf"already running: profile cpu-ref, pid {state.pid}"):
            server.start(host, "cpu-ref", timeout=60)
        current = server.status(host)
        assert current is not None and current.pid == state.pid and current.healthy is True

    def test_restart_onto_a_missing_model_stops_nothing(self, running_cpu_ref, tmp_path):
        host, state = running_cpu_ref
        missing = str(tmp_path / "gone")
        with pytest.raises(server.ServerRefused, match=rf"model folder {missing} does not exist on the host; .*"
                                                       rf"invoke server model --host {host.name} --out {missing}; "
                                                       rf"nothing was stopped"):
            server.restart(host, overrides={"model": missing})
        current = server.status(host)
        assert current.pid == state.pid and current.healthy is True

    def test_status_reports_pid_port_uptime_health(self, running_cpu_ref):
        host, state = running_cpu_ref
        current = server.status(host)
        assert (current.profile, current.pid, current.port, current.status) == ("cpu-ref", state.pid, state.port, "ready")
        assert current.healthy is True and current.uptime_s >= 0

    def test_logs_show_the_run_and_honour_lines(self, running_cpu_ref):
        host, _ = running_cpu_ref
        text = server.read_log(host)
        assert "launch.sh: starting profile cpu-ref" in text and "Application startup complete" in text
        assert len(server.read_log(host, lines=3).splitlines()) == 3

    def test_rendered_script_is_kept_beside_the_log(self, running_cpu_ref):
        host, state = running_cpu_ref
        with host.connect() as transport:
            script = transport.run(f"cat {state.script_path}").stdout
        assert "exec " in script and "serve" in script and "--cb-num-blocks 256" in script.replace(" \\\n    ", " ")
        assert "export HF_HUB_OFFLINE=1" in script


def test_a_missing_model_folder_is_refused_before_launch_naming_the_command_that_makes_it(cpu_host, tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(server.ServerRefused) as refused:
        server.start(cpu_host, "cpu-ref", timeout=120, overrides={"model": missing})
    assert str(refused.value) == (
        f"{cpu_host.name}: not starting cpu-ref: model folder {missing} does not exist on the host; check the "
        f"path given with --model, or make the reference model there first: invoke server model "
        f"--host {cpu_host.name} --out {missing}")
    assert server.status(cpu_host) is None
    assert server.list_logs(cpu_host)["logs"] == []          # nothing was launched, no log was begun


def test_an_unprovisioned_venv_is_refused_before_launch_naming_provision(cpu_host, tmp_path):
    bare = dataclasses.replace(cpu_host, venv=str(tmp_path / "venv"))
    with pytest.raises(server.ServerRefused) as refused:
        server.start(bare, "cpu-ref", timeout=60)
    assert str(refused.value).endswith(f"server program {tmp_path}/venv/bin/transformers does not exist on the host; "
                                       f"install the stack first: invoke provision --host {cpu_host.name}")
    assert server.status(bare) is None


def test_a_model_folder_the_server_cannot_load_fails_with_its_error_and_nothing_left(cpu_host, tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(server.ServerError) as failure:
        server.start(cpu_host, "cpu-ref", timeout=120, overrides={"model": str(empty)})
    error = failure.value
    assert not isinstance(error, server.ServerRefused)
    assert "exited during startup" in str(error) and "nothing of it is left running" in str(error)
    assert f"Unrecognized processing class in {empty}" in error.log_tail   # transformers' own words
    assert server.status(cpu_host) is None
    assert not process_alive(cpu_host, error.details["record"]["pid"])


def test_port_already_taken_is_refused_before_launch(cpu_host):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", cpu_host.server["port"]))
        squatter.listen(1)
        with pytest.raises(server.ServerRefused, match=rf"port {cpu_host.server['port']} on 127.0.0.1 is already taken by pid \d+"):
            server.start(cpu_host, "cpu-ref", timeout=60)
    assert server.status(cpu_host) is None

"""`invoke rollout` with bad or contradictory input, as the user types it, on a sandbox alias whose
cpu-ref server runs: every such command exits 2 (a dry run too) and leaves the host as it was (same
server process, nothing applied, no journal); a host with no server and no --profile is refused and
no server is started."""
from __future__ import annotations

from toolkit.patch import patching
from toolkit import rollout
from toolkit.server import server

from .conftest import invoke_cli, write_inventory


def test_bad_input_is_refused_before_the_host_changes(make_cpu_host, tmp_path):
    host = make_cpu_host("b1")
    before = server.start(host, "cpu-ref", timeout=300)
    env = {"TOOLKIT_INVENTORY": str(write_inventory(tmp_path / "hosts.toml", [host]))}

    bad = {("cpu-quiet", "--profile", "nosuch"): "unknown profile 'nosuch'",
           ("cpu-quiet", "--threshold", "abc"): "--threshold takes an integer or auto, got 'abc'",
           # cpu-ref has no threshold: any value for one is refused before its range is looked at
           ("cpu-quiet", "--threshold", "0"): "profile cpu-ref has no dyn-disable threshold",
           ("cpu-quiet", "--threshold", "auto", "--hysteresis", "2"): "profile cpu-ref has no dyn-disable threshold",
           ("nosuch",): "unknown patchset 'nosuch'; known: cpu-breaks, cpu-quiet"}
    for args, words in bad.items():
        for dry in ([], ["--dry-run"]):
            done = invoke_cli("rollout", *args, *dry, "--host", "b1", env=env)
            assert done.returncode == 2 and words in done.stderr, (args, dry, done.stdout + done.stderr)
            assert "step:" not in done.stdout and "result" not in done.stdout
    for args, named in ((["cpu-quiet", "--status"], "PATCHSET"), (["--status", "--revert"], "--revert"),
                        (["--status", "--dry-run"], "--dry-run")):
        done = invoke_cli("rollout", *args, "--host", "b1", env=env)
        assert done.returncode == 2 and "takes only --host and --json" in done.stderr, done.stderr
        assert f"not {named}:" in done.stderr, done.stderr

    now = server.status(host)
    assert now.pid == before.pid and now.started_at == before.started_at and now.status == "ready"
    verified = patching.verify(host, package="transformers")
    assert verified.ok and verified.stack == []
    assert rollout.ctl(host, "status")["journal"] is None

    # the same host named twice (or by name and label) is planned once
    done = invoke_cli("rollout", "cpu-quiet", "--host", "b1,b1", "--dry-run", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("b1: apply cpu-quiet: roll out") == 1
    assert "waves: b1   (dry run: nothing changed)" in done.stdout


def test_no_server_and_no_profile_is_refused_and_starts_nothing(make_cpu_host, tmp_path):
    host = make_cpu_host("n1")
    server.start(host, "cpu-ref", timeout=300)
    assert server.stop(host, grace=5, memory_wait=0).stopped
    env = {"TOOLKIT_INVENTORY": str(write_inventory(tmp_path / "hosts.toml", [host]))}
    for dry in (["--dry-run"], []):
        done = invoke_cli("rollout", "cpu-quiet", *dry, "--host", "n1", env=env)
        out = done.stdout + done.stderr
        assert done.returncode == 1, out
        assert "no server runs on n1 and no --profile was given" in out and "--profile cpu-ref" in out
    assert server.status(host) is None
    assert patching.verify(host, package="transformers").stack == []

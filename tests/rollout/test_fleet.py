"""A fleet of sandbox aliases (hosts entries on the one sshd, each with its own venv copy, state and port)
with one host made to fail: the canary stops the rest, or --max-failures does; --dry-run changes nothing."""
from __future__ import annotations

import json
from pathlib import Path

from toolkit.patch import patching
from toolkit import rollout
from toolkit.server import server
from toolkit.rollout import Change, Options

from .conftest import SERVE_FILE, SMOKE_TOKENS, invoke_cli, sha256, site_of, write_inventory


def _hand_edit(host) -> None:
    path = site_of(Path(host.venv)) / SERVE_FILE
    data = path.read_bytes()
    path.unlink()   # a hard link to the shared venv: replace it, never write through it
    path.write_bytes(data + b"# edited by hand\n")


def test_a_failing_canary_stops_the_rest_and_dry_run_changes_nothing(make_cpu_host, tmp_path, transformers_wheel):
    hosts = [make_cpu_host(name) for name in ("f1", "f2", "f3")]
    _hand_edit(hosts[0])
    env = {"TOOLKIT_INVENTORY": str(write_inventory(tmp_path / "hosts.toml", hosts))}

    done = invoke_cli("rollout", "cpu-quiet", "--profile", "cpu-ref", "--host", "f1,f2,f3", "--parallel", "2",
                      "--dry-run", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "f1: apply cpu-quiet: refused (files differ from the patch state" in done.stdout
    assert "f2: apply cpu-quiet: roll out" in done.stdout
    assert "stack:  (nothing applied) -> cpu-quiet" in done.stdout
    assert "step:   invoke server start cpu-ref --host f2" in done.stdout
    assert "gate:   smoke" in done.stdout
    assert "waves: f1 | f2,f3   (dry run: nothing changed)" in done.stdout

    done = invoke_cli("rollout", "cpu-quiet", "--profile", "cpu-ref", "--host", "f1,f2,f3", "--json", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    answer = json.loads(done.stdout)
    assert [(h["host"], h["outcome"]) for h in answer["hosts"]] == [
        ("f1", "refused"), ("f2", "not started"), ("f3", "not started")]
    assert answer["stopped"] == "the canary failed (1 of 1 host(s))"
    for host in hosts[1:]:
        assert sha256(site_of(Path(host.venv)) / SERVE_FILE) == transformers_wheel.record[SERVE_FILE]
        assert rollout.ctl(host, "status")["journal"] is None and server.status(host) is None
    journal = json.loads(Path(answer["journal"]).read_text())
    assert {name: h["outcome"] for name, h in journal["hosts"].items()} == {
        "f1": "refused", "f2": "not started", "f3": "not started"}


def test_max_failures_stops_starting_new_hosts_and_the_failed_one_is_rolled_back(make_cpu_host, transformers_wheel):
    good = make_cpu_host("g1")
    bad = make_cpu_host("g2", model="/nonexistent/tiny-llama")   # its server cannot start
    never = make_cpu_host("g3")
    fleet = rollout.run_fleet([good, bad, never], Change("cpu-quiet"),
                              Options(profile="cpu-ref", canary=1, parallel=1, max_failures=0, gate_bench=True,
                                      bench_levels=(1, 2), smoke_max_tokens=SMOKE_TOKENS))
    outcomes = [(r.host, r.outcome) for r in fleet.results]
    assert outcomes == [("g1", "kept"), ("g2", "rolled back"), ("g3", "not started")], fleet.results
    assert fleet.stopped == "1 host(s) failed after the canary, more than --max-failures 0"
    failed = fleet.results[1]
    assert failed.failed_check.startswith("restart cpu-ref: g2: not starting cpu-ref: model folder "
                                          "/nonexistent/tiny-llama does not exist"), failed.failed_check
    assert [(g.name, g.status) for g in failed.gates] == [
        ("apply cpu-quiet", "pass"), ("restart cpu-ref", "fail"), ("files restored", "pass")]
    # the failed host is back on the wheel's files with no server, as before; the third was never touched
    for host in (bad, never):
        assert sha256(site_of(Path(host.venv)) / SERVE_FILE) == transformers_wheel.record[SERVE_FILE]
        assert server.running_server(host) is None
    assert patching.verify(bad, package="transformers").stack == []
    assert rollout.ctl(never, "status")["journal"] is None
    # the canary's bench gate had no record to compare with: it passed, and its bench is the record now
    bench = fleet.results[0].gates[-1]
    assert (bench.name, bench.status) == ("bench", "pass") and "recorded as the reference" in bench.detail
    record = json.loads((Path(good.state_dir) / "rollout" / "bench" / "cpu-ref.json").read_text())
    assert set(record["output_throughput"]) == {"1", "2"} and all(v > 0 for v in record["output_throughput"].values())
    assert record["stack"] == ["cpu-quiet"] and record["rollout"] == fleet.rollout_id
    assert patching.verify(good, package="transformers").stack == ["cpu-quiet"]
    assert server.running_server(good).profile == "cpu-ref"

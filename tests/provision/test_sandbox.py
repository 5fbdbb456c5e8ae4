"""cpu-ref provisioning for real on the sandbox host (sshd on loopback), with real downloads:
first run, an idempotent second run, a dry run, a failing step, concurrent runs, the
wheelhouse with the index unreachable, and patches replaced by a reinstall."""
from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

import pytest

from toolkit.provision import facts, provision, stack
from toolkit.patch import patching
from toolkit.provision.stack import Pin, Step

from .conftest import closed_port, pip_env

pytestmark = pytest.mark.slow
PATCH_DATA = Path(__file__).parents[1] / "patch" / "data" / "patchsets"


def statuses(result) -> dict[str, str]:
    """Step -> status; `system` is ok, or changed where the machine lacked g++ and apt installed it."""
    found = {s.name: s.status for s in result.steps}
    if found.get("system") == "changed":
        found["system"] = "ok"
    return found


def host_run(host, command: str) -> str:
    with host.connect() as transport:
        done = transport.run(command)
    assert done.ok, done.tail()
    return done.stdout


def test_first_run_installs_the_stack(provisioned, cpu_ref):
    host, first = provisioned
    assert not first.failed, [(s.name, s.status, s.detail, s.tail) for s in first.steps]
    assert statuses(first) == {"venv": "changed", "system": "ok", "cuda-compiler": "changed", "torch": "changed",
                               "cpu-server": "changed", "flashinfer": "changed", "sglang": "changed"}
    after = facts.gather(host, cpu_ref)
    assert after.nvcc["runs"] and after.nvcc["release"] == "13.0"
    assert after.version("flashinfer-python") == "0.6.8.post1"
    assert after.version("sglang") == "0.5.11" and after.version("torch").startswith("2.13.0")
    # nvcc from the installed wheels, run on the host by hand as well
    out = host_run(host, f"{after.nvcc['path']} --version")
    assert "release 13.0" in out
    # the full pip output stayed on the host, in the log the report names
    log = host_run(host, f"cat {first.log}")
    assert "Successfully installed" in log and "sglang==0.5.11" in log


def test_second_run_changes_nothing_in_one_round_trip(provisioned, cpu_ref):
    host, _ = provisioned
    again = provision.provision(host, cpu_ref, env=pip_env())
    assert again.changed == 0 and not again.failed
    assert set(statuses(again).values()) == {"ok"}
    assert again.round_trips == 1 and again.log is None


def test_dry_run_on_a_fresh_host_changes_nothing(fresh_host, cpu_ref):
    result = provision.provision(fresh_host, cpu_ref, dry_run=True)
    assert statuses(result)["venv"] == "would change"
    assert result.changed == len(cpu_ref.steps) + 1          # venv + every pip step
    assert result.round_trips == 1
    assert not Path(fresh_host.venv).parent.exists()          # not even the state folder


def _tiny_stack(cpu_ref, *steps: Step) -> stack.Stack:
    return dataclasses.replace(cpu_ref, steps=tuple(steps))


def test_first_failure_stops_the_host_with_its_output(fresh_host, cpu_ref):
    broken = _tiny_stack(cpu_ref, Step("bogus", "", (Pin("sglang", "0.0.999"),), no_deps=True),
                         cpu_ref.step("flashinfer"))
    result = provision.provision(fresh_host, broken, env=pip_env())
    assert statuses(result) == {"venv": "changed", "system": "ok", "bogus": "failed", "flashinfer": "skipped"}
    failed = result.steps[2]
    assert "pip install failed" in failed.detail
    assert "sglang==0.0.999" in failed.tail                  # pip's own words come back
    assert result.failed and result.log
    assert facts.gather(fresh_host, cpu_ref).version("flashinfer-python") is None


def test_two_provisions_at_once_do_the_work_once(fresh_host, cpu_ref):
    small = _tiny_stack(cpu_ref, cpu_ref.step("sglang"))
    results = [None, None]

    def run(i):
        results[i] = provision.provision(fresh_host, small, env=pip_env())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert all(r is not None and not r.failed for r in results)
    # each step acted once: the run that waited for the lock found it done
    for step in ("venv", "sglang"):
        assert sorted(statuses(r)[step] for r in results) == ["changed", "ok"], [r.steps for r in results]
    assert facts.gather(fresh_host, cpu_ref).version("sglang") == "0.5.11"


def test_wheelhouse_install_with_the_index_unreachable(fresh_host, cpu_ref, cpu_ref_wheelhouse, monkeypatch):
    offline = {"PIP_INDEX_URL": f"http://127.0.0.1:{closed_port()}/simple", **pip_env()}
    folder = cpu_ref_wheelhouse.folder
    preview = provision.provision(fresh_host, cpu_ref, dry_run=True, wheelhouse=folder, env=offline)
    assert not Path(fresh_host.venv).parent.exists()          # a dry run sends nothing
    assert len(preview.wheels_sent) == len(cpu_ref_wheelhouse.wheels)

    first = provision.provision(fresh_host, cpu_ref, wheelhouse=folder, env=offline)
    assert not first.failed, [(s.name, s.detail, s.tail) for s in first.steps]
    assert sorted(first.wheels_sent) == sorted(w.file for w in cpu_ref_wheelhouse.wheels)
    log = host_run(fresh_host, f"cat {first.log}")
    assert "--no-index" in log and "--find-links" in log
    after = facts.gather(fresh_host, cpu_ref)
    assert after.nvcc["release"] == "13.0" and after.version("sglang") == "0.5.11"

    # a patch applied, then a reinstall of sglang: the wheelhouse sends nothing the host has,
    # and provision says the patched file was replaced and how to re-apply
    patchsets = Path(fresh_host.venv).parent / "patchsets"
    shutil.copytree(PATCH_DATA / "one-file", patchsets / "one-file")
    monkeypatch.setenv("TOOLKIT_PATCHSETS", str(patchsets))
    patching.apply(fresh_host, "one-file")
    python = f"{fresh_host.venv}/bin/python"
    host_run(fresh_host, f"{python} -m pip uninstall -y -q sglang flashinfer-python")
    second = provision.provision(fresh_host, cpu_ref, wheelhouse=folder, env=offline)
    assert second.wheels_sent == [] and second.wheels_present == len(cpu_ref_wheelhouse.wheels)
    assert statuses(second)["sglang"] == "changed" and statuses(second)["flashinfer"] == "changed"
    assert statuses(second)["torch"] == "ok"
    assert second.reapply == "invoke patch apply one-file --host sandbox", second.notes
    assert any("replaced 1 patched file" in note for note in second.notes), second.notes
    patching.apply(fresh_host, "one-file")                    # the advice works
    assert patching.verify(fresh_host).ok

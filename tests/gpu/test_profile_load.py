"""gpu/profile_load.py against a loopback stand-in of SGLang's batch loop and profiler
(tests/gpu/profile_standin.py): its prefill mode puts prefill steps into the profiled window,
and what it says when the server refuses the prompts or the profile."""
import asyncio
import json
import random
import sys
import time

import pytest

from . import accept_standin
from .profile_standin import ProfileStandIn
from .scripts import ROOT, load_gpu_script

DRIVER = str(ROOT / "gpu" / "profile_load.py")


async def drive(standin, out_dir, *args):
    handle = await accept_standin.serve("s", standin, "")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, DRIVER, handle.base, str(out_dir), *map(str, args),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if standin.loop_task:
            standin.loop_task.cancel()
        await handle.runner.cleanup()
    return proc.returncode, json.loads(out.decode().strip().splitlines()[-1]), err.decode()


@pytest.fixture(scope="module")
def trace_steps():
    return load_gpu_script("trace_steps")


def test_prefill_mode_profiles_the_second_waves_prefills_among_decodes(tmp_path, trace_steps):
    standin = ProfileStandIn(chunk=256)
    rc, report, err = asyncio.run(drive(standin, tmp_path / "t", "--concurrency", 8, "--prompt-tokens", 100,
                                        "--max-tokens", 20, "--rounds", 3, "--steps", 40, "--timeout", 60,
                                        "--no-stack"))
    assert rc == 0, err
    assert report["mode"] == "prefill" and report["errors"] == 0 and report["answered"] == 24
    # the profile started once the first wave's first answer came, and no client sent its
    # second request before it had started (the prompts drawn as profile_load.py draws them)
    assert report["answered_before_profile"] >= 1
    rnd = random.Random(0)
    drawn = [[load_gpu_script("profile_load").prompt_ids(rnd, 100) for _ in range(3)] for _ in range(8)]
    arrived = {tuple(p): t for p, t in zip(standin.prompts, standin.arrived)}
    assert all(arrived[tuple(client[1])] > standin.profile_started for client in drawn)
    # every prompt is 100 token ids of its own: nothing for a prefix cache to reuse
    assert [len(p) for p in standin.prompts] == [100] * 24
    assert len({tuple(p) for p in standin.prompts}) == 24
    (trace,) = report["files"]
    rows = trace_steps.forwards(trace_steps.load(trace))
    assert len(rows) == 40
    # the second wave was held until the profile ran, so the window holds its prefill steps
    # among decode steps (a first-wave straggler's decode steps may come first)
    prefills = [r for r in rows if r["mode"] == "EXTEND"]
    assert prefills and any(r["mode"] == "DECODE" for r in rows)
    assert all(r["toks"] == 100 * r["bs"] and r["attention"] == {"_fwd_kernel": 1} for r in prefills)
    assert trace_steps.prefill_cost(rows)[0] == 100 * sum(r["bs"] for r in prefills)


def test_the_decode_mode_still_profiles_decode_steps_only(tmp_path, trace_steps):
    """Without --prompt-tokens: a dozen-token prompt to /v1/completions, profiled after --settle,
    when every prefill is long over (the 2026-12-02 call's windows)."""
    standin = ProfileStandIn()
    rc, report, err = asyncio.run(drive(standin, tmp_path / "t", "--concurrency", 4, "--max-tokens", 1000,
                                        "--steps", 5, "--timeout", 60, "--no-stack"))
    assert rc == 0, err
    assert report["mode"] == "decode" and report["answered"] == 4
    assert all(isinstance(p, str) for p in standin.prompts)
    (trace,) = report["files"]
    assert [r["mode"] for r in trace_steps.forwards(trace_steps.load(trace))] == ["DECODE"] * 5


def test_refused_prompts_end_the_run_with_the_error_and_no_wait_for_a_profile(tmp_path):
    standin = ProfileStandIn(context=64)
    t0 = time.monotonic()
    rc, report, _ = asyncio.run(drive(standin, tmp_path / "t", "--concurrency", 4, "--prompt-tokens", 100,
                                      "--max-tokens", 8, "--steps", 5, "--timeout", 60))
    elapsed = time.monotonic() - t0
    assert report["errors"] == 4 and "400" in report["first_error"][0]
    assert report["answered"] == 0 and report["files"] == [] and "no trace" in report["hint"]
    # no client got an answer, yet the profile was asked for (and no trace awaited) without
    # waiting out --timeout
    assert report["profile_at_s"] < 30 and elapsed < 30


def test_a_refused_profile_is_reported_and_the_clients_still_finish(tmp_path):
    standin = ProfileStandIn(refuse_profile=True)
    rc, report, _ = asyncio.run(drive(standin, tmp_path / "t", "--concurrency", 4, "--prompt-tokens", 50,
                                      "--max-tokens", 8, "--rounds", 2, "--steps", 5, "--timeout", 60))
    assert rc == 1 and "503" in report["profile_error"]
    assert report["answered"] == 8 and report["files"] == []

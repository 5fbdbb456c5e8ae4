"""Profiles (profiles/*.toml) resolved against hosts, and the launch script / unit they render."""
from __future__ import annotations

import subprocess

import pytest

from toolkit.server import profiles, server
from toolkit.core.inventory import Host

GPU_HOST = Host(name="blackwell-01", address="blackwell-01.example", venv="/opt/sglang/venv", gpus=8,
                server={"model": "/models/Kimi-K2.5", "draft_model": "/models/Kimi-K2.5-eagle3"})


def test_every_shipped_profile_loads():
    names = set(profiles.load_profiles())
    assert {"baseline", "eagle3", "eagle3-dyn", "eagle3-v2", "eagle3-v2-dyn", "cpu-ref"} <= names


def test_baseline_is_plain_sglang_with_per_rank_readiness():
    plan = server.plan(GPU_HOST, "baseline")
    assert plan.argv[:3] == ["/opt/sglang/venv/bin/python", "-m", "sglang.launch_server"]
    assert "--speculative-algorithm" not in plan.argv
    assert plan.argv[plan.argv.index("--tp-size") + 1] == "8"
    assert plan.argv[plan.argv.index("--host") + 1] == "127.0.0.1"
    assert plan.expected_log_lines()[0] == "The server is fired up and ready to roll!"
    assert plan.expected_log_lines()[1:] == [f"TP{r}: Load weight end" for r in range(8)]


def test_eagle3_uses_the_v1_worker_settings_and_the_hosts_draft():
    argv = server.plan(GPU_HOST, "eagle3").argv
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--speculative-algorithm"] == "EAGLE3"
    assert flags["--speculative-draft-model-path"] == "/models/Kimi-K2.5-eagle3"
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"],
            flags["--speculative-num-draft-tokens"]) == ("2", "4", "16")


def test_eagle3_dyn_sets_the_threshold_requires_the_patchset_and_waits_for_every_rank():
    plan = server.plan(GPU_HOST, "eagle3-dyn")
    assert plan.env["SGLANG_SPEC_DISABLE_THRESHOLD"] == "5" and plan.dyn_threshold == 5
    assert plan.requires_patchsets == ["dyn-disable"]
    lines = plan.expected_log_lines()
    for rank in range(8):
        assert f"TP{rank}: Dynamic speculation disable enabled: threshold=5 hysteresis=1" in lines
    assert "--speculative-eagle-topk" in plan.argv and "SGLANG_ENABLE_SPEC_V2" not in plan.env
    # its flags replace eagle3's: the same v1 worker settings, and the lifted request cap after them
    assert plan.argv == server.plan(GPU_HOST, "eagle3").argv + ["--max-running-requests", "4096"]


def test_threshold_override_reaches_env_and_expected_lines():
    plan = server.plan(GPU_HOST, "eagle3-dyn", {"dyn_threshold": 12, "dyn_hysteresis": 3})
    assert plan.env["SGLANG_SPEC_DISABLE_THRESHOLD"] == "12"
    assert "TP7: Dynamic speculation disable enabled: threshold=12 hysteresis=3" in plan.expected_log_lines()


def test_eagle3_v2_dyn_is_topk_1_with_spec_v2_and_keeps_the_dyn_env():
    plan = server.plan(GPU_HOST, "eagle3-v2-dyn")
    flags = dict(zip(plan.argv[3::2], plan.argv[4::2]))
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"],
            flags["--speculative-num-draft-tokens"]) == ("3", "1", "4")
    assert plan.env == {"SGLANG_ENABLE_SPEC_V2": "1", "SGLANG_SPEC_DISABLE_THRESHOLD": "8",
                        "SGLANG_SPEC_DISABLE_HYSTERESIS": "2"}


# The dyn-disable patch's documented default (patchset.toml [env]): max(1, threshold // 4), capped
# at threshold - 1; written out here, not computed, so that a change of rule shows.
DEFAULT_HYSTERESIS = {5: 1, 8: 2, 18: 4, 2: 1, 1: 0, 100: 25}


def test_the_profile_hysteresis_is_the_patchs_documented_default():
    assert server.plan(GPU_HOST, "eagle3-dyn").env["SGLANG_SPEC_DISABLE_HYSTERESIS"] == "1"      # threshold 5
    assert server.plan(GPU_HOST, "eagle3-v2-dyn").env["SGLANG_SPEC_DISABLE_HYSTERESIS"] == "2"   # threshold 8
    for threshold, hysteresis in DEFAULT_HYSTERESIS.items():
        plan = server.plan(GPU_HOST, "eagle3-v2-dyn", {"dyn_threshold": threshold})
        assert plan.env["SGLANG_SPEC_DISABLE_HYSTERESIS"] == str(hysteresis), threshold
        assert profiles.default_hysteresis(threshold) == hysteresis
    plan = server.plan(GPU_HOST, "eagle3-v2-dyn", {"dyn_threshold": 18, "dyn_hysteresis": 2})
    assert plan.env["SGLANG_SPEC_DISABLE_HYSTERESIS"] == "2"
    assert "TP7: Dynamic speculation disable enabled: threshold=18 hysteresis=2" in plan.expected_log_lines()


def test_eagle3_v2_is_the_same_worker_without_dyn_disable():
    # the same argv but for the dyn profile's lifted request cap (next test)
    plan, dyn = server.plan(GPU_HOST, "eagle3-v2"), server.plan(GPU_HOST, "eagle3-v2-dyn")
    assert plan.argv + ["--max-running-requests", "4096"] == dyn.argv
    assert plan.env == {"SGLANG_ENABLE_SPEC_V2": "1"} and not plan.requires_patchsets
    assert not any("Dynamic speculation" in line for line in plan.expected_log_lines())


def last_value(argv, flag):
    """What sglang's argparse reads for a repeated flag: the last occurrence's value."""
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1] if flag in argv else None


@pytest.mark.parametrize("profile, cap", [("baseline", None), ("eagle3", None), ("eagle3-v2", None),
                                          ("eagle3-dyn", "4096"), ("eagle3-v2-dyn", "4096")])
def test_only_the_dyn_profiles_lift_sglangs_cap_of_48_for_speculative_servers(profile, cap):
    # sglang 0.5.11 resets an EAGLE server without --max-running-requests to 48; a dyn server runs
    # plain steps above its threshold, where that cap only costs it (docs/dyn-disable.md)
    argv = server.plan(GPU_HOST, profile).argv
    assert argv.count("--max-running-requests") == (0 if cap is None else 1)
    assert last_value(argv, "--max-running-requests") == cap


@pytest.mark.parametrize("profile", ["eagle3-dyn", "eagle3-v2-dyn"])
def test_a_hosts_own_request_cap_comes_after_the_profiles_and_wins(profile):
    host = Host(name="h", venv="/v", server={**GPU_HOST.server, "flags": ["--max-running-requests", "256"]})
    argv = server.plan(host, profile).argv
    assert argv.count("--max-running-requests") == 2
    assert last_value(argv, "--max-running-requests") == "256"
    # and an override's flags (server.plan's overrides, as the lab passes its own) come after the host's
    argv = server.plan(host, profile, {"flags": ["--max-running-requests", "48"]}).argv
    assert last_value(argv, "--max-running-requests") == "48"


def test_cpu_ref_runs_transformers_serve_from_the_venv_with_the_model_beside_it():
    host = Host(name="sandbox", address="127.0.0.1", venv="/srv/host/venv", server={"port": 18111})
    plan = server.plan(host, "cpu-ref")
    assert plan.argv[:3] == ["/srv/host/venv/bin/transformers", "serve", "/srv/host/models/tiny-llama"]
    assert plan.argv[plan.argv.index("--port") + 1] == "18111"
    assert {"--device", "cpu", "--continuous-batching", "--cb-num-blocks"} <= set(plan.argv)
    assert plan.env == {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"} and plan.expected_log_lines() == ["Application startup complete"]


def test_sglang_profile_without_a_model_says_where_to_set_it():
    with pytest.raises(profiles.ProfileError, match=r"set `model = .*` in its \[bare.server\] table, or pass --model"):
        server.plan(Host(name="bare", venv="/v"), "baseline")


def test_eagle3_without_a_draft_model_is_refused():
    with pytest.raises(profiles.ProfileError, match="needs a draft model"):
        server.plan(Host(name="h", venv="/v", server={"model": "/m"}), "eagle3")


def test_a_secret_in_inline_env_is_refused():
    host = Host(name="h", venv="/v", server={"model": "/m", "env": {"HF_TOKEN": "hf_abc"}})
    with pytest.raises(profiles.ProfileError, match="HF_TOKEN looks like a secret.*env_file") as refused:
        server.plan(host, "baseline")
    assert "hf_abc" not in str(refused.value)


def test_unknown_host_server_key_and_unknown_override_are_named():
    with pytest.raises(profiles.ProfileError, match="unknown keys in \\[server\\]: modle"):
        server.plan(Host(name="h", venv="/v", server={"modle": "/m"}), "baseline")
    with pytest.raises(profiles.ProfileError, match="cannot override colour"):
        server.plan(GPU_HOST, "baseline", {"colour": "red"})


def test_bad_profiles_are_reported_with_their_name(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_PROFILES", str(tmp_path))
    (tmp_path / "loop-a.toml").write_text('extends = "loop-b"\nkind = "sglang"\n')
    (tmp_path / "loop-b.toml").write_text('extends = "loop-a"\n')
    with pytest.raises(profiles.ProfileError, match="cycle"):
        profiles.load_profile("loop-a")
    (tmp_path / "loop-a.toml").unlink()
    (tmp_path / "loop-b.toml").unlink()
    (tmp_path / "typo.toml").write_text('kind = "sglang"\ntp_sise = 2\n')
    with pytest.raises(profiles.ProfileError, match="profile typo .*unknown keys tp_sise"):
        profiles.load_profile("typo")
    (tmp_path / "typo.toml").write_text('kind = "sglang"\nflags = ["{modle}"]\n')
    with pytest.raises(profiles.ProfileError, match=r"unknown placeholder \{modle\}"):
        server.plan(GPU_HOST, "typo")
    with pytest.raises(profiles.ProfileError, match="unknown profile 'nope'"):
        profiles.load_profile("nope")
    (tmp_path / "broken.toml").write_text("kind = \n")
    with pytest.raises(profiles.ProfileError) as broken:
        profiles.load_profile("typo")
    assert str(broken.value).startswith(f"cannot read profile {tmp_path / 'broken.toml'} (from TOOLKIT_PROFILES): ")


def test_a_profiles_folder_that_does_not_exist_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_PROFILES", str(tmp_path / "nowhere"))
    with pytest.raises(profiles.ProfileError, match="TOOLKIT_PROFILES names .*nowhere, which is not a folder"):
        profiles.load_profile("baseline")


def test_launch_script_sources_secrets_quotes_arguments_and_is_valid_bash(tmp_path):
    host = Host(name="h", venv="/opt/venv", server={"model": "/models/with space", "draft_model": "/d",
                                                     "env_file": "/etc/toolkit/hf.env", "env": {"NCCL_DEBUG": "WARN"}})
    plan = server.plan(host, "eagle3-dyn")
    script = server.render_launch_script(plan)
    assert ". /etc/toolkit/hf.env" in script and "set -a" in script
    assert "--model-path '/models/with space'" in script
    assert "export NCCL_DEBUG=WARN" in script and "export SGLANG_SPEC_DISABLE_THRESHOLD=5" in script
    path = tmp_path / "launch.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_launch_script_refuses_to_run_without_its_env_file(tmp_path):
    host = Host(name="h", venv=str(tmp_path / "venv"), state_dir=str(tmp_path / "state"),
                server={"model": "/m", "env_file": str(tmp_path / "missing.env")})
    plan = server.plan(host, "baseline")
    path = tmp_path / "launch.sh"
    path.write_text(server.render_launch_script(plan))
    done = subprocess.run(["bash", str(path)], capture_output=True, text=True)
    assert done.returncode == 78 and "missing.env is missing or unreadable" in done.stderr


def test_systemd_unit_runs_the_launch_script_and_kills_the_group():
    unit = server.render_unit(server.plan(GPU_HOST, "baseline"), grace=45)
    assert "ExecStart=/bin/bash /opt/sglang/venv/.toolkit/server/baseline/launch.sh" in unit
    assert "KillMode=control-group" in unit and "TimeoutStopSec=45" in unit


def test_a_wildcard_bind_is_noted_and_probed_on_loopback():
    plan = server.plan(Host(name="h", venv="/v", server={"model": "/m", "bind": "0.0.0.0"}), "baseline")
    assert plan.base_url_on_host == "http://127.0.0.1:30000"
    assert any("reachable beyond this host" in note for note in plan.notes)


def test_a_profile_that_needs_the_venv_says_so_on_a_host_without_one():
    with pytest.raises(profiles.ProfileError, match=r"cpu-ref uses \{venv\}, but the host has no venv"):
        server.plan(Host(name="h"), "cpu-ref")


def test_sglang_profiles_use_flags_and_env_that_sglang_0_5_11_knows():
    # Read from the real pinned wheel (no import: SGLang needs a GPU stack to import).
    from toolkit.patch import wheels

    wheel = wheels.pristine("sglang", "0.5.11")
    server_args = wheel.read("sglang/srt/server_args.py").decode()
    environ = wheel.read("sglang/srt/environ.py").decode()
    for name in ("baseline", "eagle3", "eagle3-dyn", "eagle3-v2-dyn"):
        plan = server.plan(GPU_HOST, name)
        for flag in (a for a in plan.argv if a.startswith("--")):
            assert f'"{flag}"' in server_args, f"{name}: {flag} is not an option of sglang 0.5.11"
        for variable in plan.env:
            if not variable.startswith("SGLANG_SPEC_DISABLE_"):  # added by the dyn-disable patchset
                assert variable in environ, f"{name}: {variable} is not read by sglang 0.5.11"
    assert '"EAGLE3"' in server_args


def test_shared_gpu_is_a_host_switch_and_must_be_a_boolean():
    shared = Host(name="gpu-a", venv="/v", server={"model": "/m", "shared_gpu": True})
    assert server.plan(shared, "baseline").shared_gpu and not server.plan(GPU_HOST, "baseline").shared_gpu
    with pytest.raises(profiles.ProfileError, match=r"host gpu-b: \[server\] shared_gpu must be true or false, not 'yes'"):
        server.plan(Host(name="gpu-b", venv="/v", server={"model": "/m", "shared_gpu": "yes"}), "baseline")
    # stop reads the same switch: a string is refused before any connection, not taken as true
    with pytest.raises(profiles.ProfileError, match="shared_gpu must be true or false"):
        server.stop(Host(name="gpu-b", venv="/v", server={"model": "/m", "shared_gpu": "false"}))

"""Every bench record says which attention backend, TP size, architecture, speculative and
dyn-disable settings its server ran with, and where each value came from.

SGLang servers are the stand-in answering /server_info and /model_info as SGLang 0.5.11 does
(field names and defaults from the real wheel: sglang_info.py); the CPU reference server is
the real `transformers serve`, which has neither endpoint.
"""
from __future__ import annotations

import contextlib

from toolkit.bench import serverconfig
from toolkit.bench.prompts import PromptSource
from toolkit.bench.runner import BenchOptions, ServedProfile, run_sweep
from toolkit.core.inventory import Host
from toolkit.server.profiles import resolve

from . import sglang_info

DYN = {"threshold": 5, "hysteresis": 1, "speculating": True, "spec_steps": 10, "plain_steps": 0,
       "forced_spec_steps": 0, "switches_off": 0, "switches_on": 0}
EAGLE3_V1 = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 2, "speculative_eagle_topk": 4,
             "speculative_num_draft_tokens": 16}


class OneServer:
    """A ServerControl over one running server, with the launch-plan fallback a host gives."""

    def __init__(self, url, fallback=None, sources=None):
        self.url, self.fallback, self.sources = url, fallback or {}, sources or {}

    @contextlib.contextmanager
    def serve(self, profile):
        yield ServedProfile(profile, self.url, {"kind": "test"}, self.fallback, self.sources)


def bench_once(url, profile="p", fallback=None, sources=None) -> dict:
    options = BenchOptions(concurrency=[1, 2], requests=2, prompts=PromptSource(output_len=4), warmup=1)
    records = []
    result = run_sweep([profile], options, OneServer(url, fallback, sources), on_level=records.append)
    assert not result.errors, result.errors
    assert len(records) == 2
    return records[-1]["server"]


def test_an_sglang_dyn_server_reports_its_own_config(fake_server):
    info = sglang_info.server_info({"attention_backend": "flashinfer", "tp_size": 2, **EAGLE3_V1},
                                   accept_length=2.4, dyn=DYN)
    server = fake_server(chunks=4, server_info=info,
                         model_info=sglang_info.model_info("/models/k2", ["DeepseekV3ForCausalLM"], "deepseek_v3"))
    # the launch plan says otherwise: the server's own word wins and is marked as such
    fallback = {"attention_backend": "triton", "tp_size": 1, "dyn_disable": {"threshold": 9, "hysteresis": 2}}
    got = bench_once(server.base_url, "eagle3-dyn", fallback)
    assert (got["attention_backend"], got["tp_size"], got["architecture"]) == ("flashinfer", 2, "DeepseekV3ForCausalLM")
    assert (got["speculative_algorithm"], got["speculative_num_steps"], got["speculative_eagle_topk"],
            got["speculative_num_draft_tokens"]) == ("EAGLE3", 2, 4, 16)
    assert got["dyn_disable"] == {"threshold": 5, "hysteresis": 1}
    assert got["config_source"] == {"attention_backend": "server_info", "tp_size": "server_info",
                                    "architecture": "model_info", "speculative_algorithm": "server_info",
                                    "speculative_num_steps": "server_info", "speculative_eagle_topk": "server_info",
                                    "speculative_num_draft_tokens": "server_info",
                                    "speculative_adaptive": "server_info", "dyn_disable": "server_info"}
    assert got["speculative_adaptive"] is False
    assert got["avg_spec_accept_length"] == 2.4 and got["version"] == "0.5.11"


def test_a_dyn_server_on_the_native_plain_path_says_so_in_the_record(fake_server):
    # /server_info of a 0.5.11 server with the native-path diff (0004): the record keeps which plain
    # path ran, so eagle3-v2-dyn and eagle3-v2-dyn-native records never group as one configuration
    native = {**DYN, "plain_path": "native", "plain_draft_kv": "defer"}
    server = fake_server(chunks=4, server_info=sglang_info.server_info({"tp_size": 8, **EAGLE3_V1}, dyn=native))
    got = bench_once(server.base_url, "eagle3-v2-dyn-native", {"dyn_disable": {"threshold": 8, "hysteresis": 2}})
    assert got["dyn_disable"] == {"threshold": 5, "hysteresis": 1, "plain_path": "native", "plain_draft_kv": "defer"}
    assert got["config_source"]["dyn_disable"] == "server_info"
    step = serverconfig.describe(sglang_info.server_info({}, dyn={**DYN, "plain_path": "step"}), None)
    assert step["dyn_disable"] == {"threshold": 5, "hysteresis": 1, "plain_path": "step"}


def test_the_scheduler_copy_of_the_server_args_wins_over_the_http_process_copy():
    # SGLang may settle the backend in the scheduler process (model-specific defaults)
    info = sglang_info.server_info({"attention_backend": "triton", "tp_size": 8},
                                   http_args={"attention_backend": None})
    got = serverconfig.describe(info, None)
    assert got["attention_backend"] == "triton" and got["tp_size"] == 8
    # neither copy names one: per-phase backends where set, else unknown (null) with no source
    split = sglang_info.server_info({"decode_attention_backend": "flashinfer", "prefill_attention_backend": "fa3"})
    assert serverconfig.describe(split, None)["attention_backend"] == "decode=flashinfer, prefill=fa3"
    unset = serverconfig.describe(sglang_info.server_info({}), None, {"attention_backend": None})
    assert unset["attention_backend"] is None and unset["config_source"]["attention_backend"] is None


def test_a_baseline_sglang_server_says_no_speculation_and_no_dyn_disable(fake_server):
    server = fake_server(chunks=4, server_info=sglang_info.server_info({"attention_backend": "fa3", "tp_size": 1}))
    got = bench_once(server.base_url, "baseline", {"dyn_disable": "off"})
    assert got["speculative_algorithm"] is None and got["config_source"]["speculative_algorithm"] == "server_info"
    assert got["dyn_disable"] == "off" and got["config_source"]["dyn_disable"] == "server_info"
    # no /model_info answer: the architecture stays unknown without a fallback
    assert got["architecture"] is None and got["config_source"]["architecture"] is None


def test_the_cpu_reference_server_records_what_the_profile_and_model_config_say(cpu_server, ref_model_dir):
    import json

    from toolkit.bench.hosts import model_config
    host = Host(name="here", transport="local")
    architecture = serverconfig.architecture_of(model_config(host, str(ref_model_dir)))
    assert architecture == json.loads((ref_model_dir / "config.json").read_text())["architectures"][0]
    fallback = serverconfig.from_launch(["transformers", "serve", "--device", "cpu"], tp_size=1,
                                        dyn_threshold=None, dyn_hysteresis=None)
    got = bench_once(cpu_server.base_url, "cpu-ref", {**fallback, "architecture": architecture},
                     {"architecture": "model_config"})
    assert got["attention_backend"] is None and got["config_source"]["attention_backend"] is None
    assert got["tp_size"] == 1 and got["config_source"]["tp_size"] == "profile"
    assert got["architecture"] == "LlamaForCausalLM" and got["config_source"]["architecture"] == "model_config"
    assert got["dyn_disable"] == "off" and got["config_source"]["dyn_disable"] == "profile"
    assert got["speculative_algorithm"] is None and got["config_source"]["speculative_algorithm"] is None
    assert model_config(host, str(ref_model_dir / "missing")) is None
    # no accept length to report, and no error for it
    assert got["accept_length"]["after_level"] is None
    assert got["accept_length"]["why_not"] == "the server has no native /generate"


def test_the_launch_plan_fallback_reads_the_shipped_profiles():
    host = Host(name="gpu-box", transport="local", venv="/opt/venv",
                server={"model": "/models/t", "draft_model": "/models/d", "tp_size": 2,
                        "flags": ["--attention-backend", "flashinfer"]})
    plan = resolve(host, "eagle3-dyn")
    got = serverconfig.from_launch(plan.argv, tp_size=plan.tp_size, dyn_threshold=plan.dyn_threshold,
                                   dyn_hysteresis=plan.dyn_hysteresis)
    assert got == {"attention_backend": "flashinfer", "tp_size": 2, **EAGLE3_V1,
                   "dyn_disable": {"threshold": 5, "hysteresis": 1}}
    baseline = resolve(host, "baseline")
    plain = serverconfig.from_launch(baseline.argv, tp_size=2, dyn_threshold=None, dyn_hysteresis=None)
    assert "speculative_algorithm" not in plain and plain["dyn_disable"] == "off"


def test_upstream_adaptive_mode_is_recorded_from_the_server_and_from_the_launch_plan(fake_server):
    # SGLang's own --speculative-adaptive (zero draft steps above a batch size on 0.5.14+, the
    # peer of dyn-disable): a record says whether the server ran it
    info = sglang_info.server_info({"attention_backend": "triton", "tp_size": 1, "speculative_algorithm": "EAGLE3",
                                    "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                                    "speculative_num_draft_tokens": 4, "speculative_adaptive": True})
    server = fake_server(chunks=4, server_info=info)
    got = bench_once(server.base_url, "eagle3-v2-adaptive", {"speculative_adaptive": None})
    assert got["speculative_adaptive"] is True and got["config_source"]["speculative_adaptive"] == "server_info"
    assert got["dyn_disable"] == "off"
    argv = ["--speculative-algorithm", "EAGLE3", "--speculative-adaptive",
            "--speculative-adaptive-config", "adaptive.json"]
    plan = serverconfig.from_launch(argv, tp_size=1, dyn_threshold=None, dyn_hysteresis=None)
    assert plan["speculative_adaptive"] is True and plan["speculative_algorithm"] == "EAGLE3"
    assert "speculative_adaptive" not in serverconfig.from_launch(argv[:2], tp_size=1, dyn_threshold=None,
                                                                  dyn_hysteresis=None)


def test_records_carry_the_accept_length_before_the_first_level_and_after_each(fake_server):
    # SGLang's native /generate answers with each request's accept length in meta_info: the
    # probe after the warm-up (2.61), then after each level: 2.56 after c=1, 1.6 after c=2
    verify = [49, 50, 80]
    server = fake_server(chunks=4, server_info=sglang_info.server_info(EAGLE3_V1, accept_length=2.4, dyn=DYN),
                         native=lambda n: {"spec_verify_ct": verify[n], "spec_accepted_drafts": 128 - verify[n]})
    options = BenchOptions(concurrency=[1, 2], requests=2, prompts=PromptSource(output_len=4), warmup=1)
    records = []

    class Simulated(OneServer):
        @contextlib.contextmanager
        def serve(self, profile):
            yield ServedProfile(profile, self.url, {"kind": "test", "simulated_accept_length": "2.6"})

    result = run_sweep(["eagle3-dyn"], options, Simulated(server.base_url), on_level=records.append)
    assert not result.errors, result.errors
    accepts = [r["server"]["accept_length"] for r in records]
    assert [a["before_first_level"] for a in accepts] == [128 / 49, 128 / 49]
    assert [a["after_level"] for a in accepts] == [128 / 50, 128 / 80]
    assert all(a["simulated"] == "2.6" and a["why_not"] is None for a in accepts)
    assert accepts[0]["source"] == "SGLang /generate meta_info (one request alone)"
    # the probes were one request each, alone, at temperature 0 with ignore_eos
    assert [r["sampling_params"] for r in server.native_requests] == [
        {"max_new_tokens": 128, "temperature": 0.0, "ignore_eos": True}] * 3
    from toolkit.bench.outputs import csv_row
    row = csv_row(records[1])
    assert (row["accept_length_before_first_level"], row["accept_length_after_level"],
            row["simulated_accept_length"]) == (round(128 / 49, 3), 1.6, "2.6")


def test_a_server_without_an_accept_length_records_none_and_why(fake_server):
    # a baseline SGLang server: /generate answers without speculative counters
    baseline = fake_server(chunks=4, server_info=sglang_info.server_info({"tp_size": 1}), native=lambda n: {})
    accept = bench_once(baseline.base_url, "baseline")["accept_length"]
    assert accept["before_first_level"] is None and accept["after_level"] is None
    assert accept["why_not"] == "the server reports no speculative verify steps" and accept["source"] is None
    # a server with no native endpoint at all (transformers serve, vLLM)
    plain = fake_server(chunks=4)
    accept = bench_once(plain.base_url, "cpu-ref")["accept_length"]
    assert accept["after_level"] is None and accept["why_not"] == "the server has no native /generate"

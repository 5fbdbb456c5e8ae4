"""SGLang 0.5.11's `/server_info` and `/model_info` answers, built from the real wheel.

`/server_info` is `{**asdict(server_args), **scheduler_info, "internal_states": [...], "version"}`
(sglang/srt/entrypoints/http_server.py), and `internal_states[0]` is the scheduler's
`vars(server_args)` plus `avg_spec_accept_length` while speculating (scheduler.py,
`get_internal_state`), plus `dyn_spec_disable` with the dyn-disable patch
(patchsets/dyn-disable). The field names and defaults are read from the wheel's `ServerArgs`
dataclass, so a name the bench reads that SGLang does not have shows up as a missing value.
"""
from __future__ import annotations

import ast

from toolkit.patch import wheels

VERSION = "0.5.11"


def server_arg_defaults() -> dict:
    """ServerArgs' fields with their literal defaults (None where the default is computed)."""
    source = wheels.pristine("sglang", VERSION).read("sglang/srt/server_args.py").decode()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
            fields = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    try:
                        fields[item.target.id] = ast.literal_eval(item.value) if item.value is not None else None
                    except ValueError:
                        fields[item.target.id] = None
            return fields
    raise AssertionError("no ServerArgs class in the wheel's server_args.py")


def server_info(args: dict, *, accept_length: float | None = None, dyn: dict | None = None,
                http_args: dict | None = None) -> dict:
    """The answer for a server started with `args` (ServerArgs field -> value); `http_args`
    overrides what the HTTP process's copy says (it may differ from the scheduler's)."""
    defaults = server_arg_defaults()
    unknown = set(args) - set(defaults)
    if unknown:
        raise AssertionError(f"not ServerArgs fields in SGLang {VERSION}: {sorted(unknown)}")
    scheduler_args = {**defaults, **args}
    state = {**scheduler_args, "last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": 64,
             "memory_usage": {"weight": 1.0, "kvcache": 2.0, "token_capacity": 100000, "graph": 0.1}}
    if accept_length is not None:
        state["avg_spec_accept_length"] = accept_length
    if dyn is not None:
        state["dyn_spec_disable"] = dyn
    return {**scheduler_args, **(http_args or {}), "max_total_num_tokens": 100000, "max_req_input_len": 8192,
            "internal_states": [state], "version": VERSION}


def model_info(model_path: str, architectures: list[str], model_type: str) -> dict:
    return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": model_type, "architectures": architectures}

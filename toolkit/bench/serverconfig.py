"""What a bench record says about the server's configuration, so results group without logs.

Every record's `server` carries: `attention_backend`, `tp_size`, `architecture`, the
speculative settings (`speculative_algorithm`, `speculative_num_steps`,
`speculative_eagle_topk`, `speculative_num_draft_tokens`, `speculative_adaptive`: SGLang's own
per-batch-size step choice, `--speculative-adaptive`) and `dyn_disable`
(`{"threshold": T, "hysteresis": H}` while the dyn-disable patch is active, with `plain_path` ("step"
or "native") and on the native path `plain_draft_kv` where the server reports them, "off" when it
is known not to be, null when unknown), and `config_source`: where each value came from.

Sources, best first:
- `server_info`: SGLang's `GET /server_info`: its server args (what the scheduler really ran
  with: `internal_states[0]` first, the HTTP process's copy second) and, with the dyn-disable
  patch, `internal_states[0].dyn_spec_disable`;
- `model_info`: SGLang's `GET /model_info` (`architectures`);
- `model_config`: the model's config.json on the host;
- `profile`: the launch plan (profile + host settings) the server was started from;
- null: nobody says (e.g. the attention backend of a server that is not SGLang).
"""
from __future__ import annotations

from typing import Any

SPECULATIVE_KEYS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                    "speculative_num_draft_tokens", "speculative_adaptive")
PLAIN_PATH_KEYS = ("plain_path", "plain_draft_kv")   # dyn_spec_disable fields of the native-path diff
CONFIG_KEYS = ("attention_backend", "tp_size", "architecture", *SPECULATIVE_KEYS, "dyn_disable")

# profile flag -> key (values as SGLang's CLI takes them)
_FLAG_KEYS = {"--attention-backend": "attention_backend", "--tp-size": "tp_size", "--tp": "tp_size",
              "--speculative-algorithm": "speculative_algorithm",
              "--speculative-num-steps": "speculative_num_steps",
              "--speculative-eagle-topk": "speculative_eagle_topk",
              "--speculative-num-draft-tokens": "speculative_num_draft_tokens"}
_INT_KEYS = {"tp_size", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"}
_SWITCH_KEYS = {"--speculative-adaptive": "speculative_adaptive"}  # flags without a value


def from_launch(argv: list[str], *, tp_size: int | None, dyn_threshold: int | None,
                dyn_hysteresis: int | None) -> dict:
    """The configuration a launch plan asks for: its command-line flags, TP size and
    dyn-disable settings. Keys the plan does not set are left out (SGLang picks them)."""
    config: dict[str, Any] = {}
    for i, arg in enumerate(argv):
        flag, _, inline = arg.partition("=")
        if flag in _SWITCH_KEYS:
            config[_SWITCH_KEYS[flag]] = True
            continue
        key = _FLAG_KEYS.get(flag)
        if key is None:
            continue
        value = inline if inline else (argv[i + 1] if i + 1 < len(argv) else None)
        if value is None:
            continue
        config[key] = _as_int(value) if key in _INT_KEYS else value
    if tp_size is not None:
        config["tp_size"] = tp_size
    config["dyn_disable"] = ({"threshold": dyn_threshold, "hysteresis": dyn_hysteresis}
                             if dyn_threshold is not None else "off")
    return config


def _as_int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return value


def architecture_of(model_config: dict | None) -> str | None:
    """The first of a Hugging Face config's `architectures`."""
    if not isinstance(model_config, dict):
        return None
    names = model_config.get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str):
        return names[0]
    return None


def describe(server_info: dict | None, model_info: dict | None, fallback: dict | None = None,
             fallback_sources: dict | None = None) -> dict:
    """The config keys and `config_source` for a record.

    `fallback` holds what the launch plan / host says (`from_launch`, `architecture`);
    `fallback_sources` names its source per key (default "profile")."""
    fallback = dict(fallback or {})
    fallback_sources = dict(fallback_sources or {})
    config: dict[str, Any] = {key: None for key in CONFIG_KEYS}
    source: dict[str, str | None] = {key: None for key in CONFIG_KEYS}

    def take(key, value, where):
        if value is not None and source[key] is None:
            config[key] = value
            source[key] = where

    if isinstance(server_info, dict):
        states = server_info.get("internal_states")
        scheduler = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
        for key in ("attention_backend", "tp_size", *SPECULATIVE_KEYS):
            take(key, scheduler.get(key), "server_info")
            take(key, server_info.get(key), "server_info")
        for key in SPECULATIVE_KEYS:
            if source[key] is None and (key in scheduler or key in server_info):
                source[key] = "server_info"     # reported as unset: no speculative decoding
        if config["attention_backend"] is None:
            # SGLang may leave `attention_backend` unset and pick per phase
            decode = scheduler.get("decode_attention_backend") or server_info.get("decode_attention_backend")
            prefill = scheduler.get("prefill_attention_backend") or server_info.get("prefill_attention_backend")
            if decode or prefill:
                take("attention_backend", f"decode={decode}, prefill={prefill}", "server_info")
        dyn = scheduler.get("dyn_spec_disable")
        if isinstance(dyn, dict) and dyn.get("threshold") is not None:
            # the plain path and its draft upkeep where the server reports them (0.5.11 with 0004)
            take("dyn_disable", {"threshold": dyn.get("threshold"), "hysteresis": dyn.get("hysteresis"),
                                 **{key: dyn[key] for key in PLAIN_PATH_KEYS if dyn.get(key) is not None}},
                 "server_info")
        elif "speculative_algorithm" in scheduler or "speculative_algorithm" in server_info:
            # a server that reports its state but no dyn_spec_disable: the patch is not active
            take("dyn_disable", "off", "server_info")
    take("architecture", architecture_of(model_info), "model_info")
    for key in CONFIG_KEYS:
        take(key, fallback.get(key), fallback_sources.get(key, "profile"))
    return {**config, "config_source": source}

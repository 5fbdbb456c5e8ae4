"""The dyn-disable patchset's hooks (toolkit/patchhooks.py): the hysteresis a server gets when
only a threshold is given is the patch's own default, computed by the policy module the patch
adds to SGLang (one source: the server applies the same function when
SGLANG_SPEC_DISABLE_HYSTERESIS is unset)."""
from __future__ import annotations

POLICY = "sglang/srt/speculative/dyn_disable.py"


def launch_values(ctx, values: dict) -> dict:
    threshold = values.get("dyn_threshold")
    if threshold is None or values.get("dyn_hysteresis") is not None:
        return {}
    return {"dyn_hysteresis": ctx.added_module(POLICY).default_hysteresis(threshold)}

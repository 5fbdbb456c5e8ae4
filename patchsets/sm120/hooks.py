"""The sm120 patchset's hooks (toolkit/patchhooks.py): which of its features a host will run,
predicted from its facts before a server starts.

The rule exists once: in the file the sm120 patchset adds to SGLang, `sglang/srt/sm120_gates.py`
(a pure function of plain data, standard library only). The hook loads that file out of the
patchset's diff (`ctx.added_module`), so this prediction and the patched server's own start-up
decision are the same code; this file only turns `invoke facts` (nvidia-smi's P2P matrices,
NVLink, the installed FlashInfer's and deep_gemm's files) into the rule's inputs. The server
decides again at start from its runtime probes (torch, the CUDA driver, NVML), with the same rule.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

RULE_FILE = "sglang/srt/sm120_gates.py"
# the rule needs the versions of these (facts look them up)
FACTS_PACKAGES = ["flashinfer-python", "sglang-kernel", "sglang"]


def _status_ok(value) -> bool | None:
    """nvidia-smi's P2P status word -> True (OK) / False (NS, CNS, GNS, TNS, DR) / None (unknown)."""
    if value is None or value in ("U", "unknown"):
        return None
    return value == "OK"


def _both(a, b):
    if a is False or b is False:
        return False
    if a is None or b is None:
        return None
    return True


def server_gpus(found, tp_size: int | None, env: dict | None) -> list[int]:
    """The GPUs a server with `tp_size` ranks uses: the first ones of CUDA_VISIBLE_DEVICES (or of
    all GPUs), in nvidia-smi's numbering."""
    indices = [g["index"] for g in found.gpus]
    visible = (env or {}).get("CUDA_VISIBLE_DEVICES")
    if visible:
        try:
            indices = [int(x) for x in visible.split(",") if x.strip()]
        except ValueError:
            pass
    return indices[:tp_size] if tp_size else indices


def inputs_from_facts(found, tp_size: int | None = None, env: dict | None = None) -> dict:
    """The rule's inputs (see the patch's sm120_gates.py) from one `invoke facts` answer."""
    env = env or {}
    gpus = server_gpus(found, tp_size, env)
    by_index = {g["index"]: g for g in found.gpus}
    capabilities = {by_index[g]["capability"] for g in gpus if g in by_index}
    capability = capabilities.pop() if len(capabilities) == 1 else ("mixed" if capabilities else None)
    ic = found.interconnect
    p2p = {}
    for a in gpus:
        for b in gpus:
            if a == b:
                continue
            pair = (ic.get("pairs") or {}).get(f"{a}-{b}") or {}
            link = str(pair.get("link") or "")
            nvlink = True if link.startswith("NV") else _status_ok(pair.get("nvlink"))
            p2p[f"{a}-{b}"] = {"access": _both(_status_ok(pair.get("read")), _status_ok(pair.get("write"))),
                               "atomics": _status_ok(pair.get("atomics")), "nvlink": nvlink}
    kernels = found.raw.get("kernels") or {}
    jit = str(env.get("SGLANG_ENABLE_JIT_DEEPGEMM", "true")).strip().lower() not in ("0", "false", "no", "off", "")
    deep_gemm = kernels.get("deep_gemm") or {"present": False}
    return {"capability": capability, "gpus": gpus, "world_size": tp_size or len(gpus), "nnodes": 1,
            "p2p": p2p, "multicast": ic.get("multicast"),
            "flashinfer": {"version": found.version("flashinfer-python"),
                           "trtllm_comm_majors": kernels.get("flashinfer_trtllm_comm_majors")},
            "deep_gemm": {"present": bool(deep_gemm.get("present")), "sm120_entry_point": deep_gemm.get("sm120_entry_point")},
            "jit_deepgemm": jit}


@dataclass
class Prediction:
    host: str
    applied: bool                    # sm120 is in the host's recorded patch stack
    gpus: list[int]
    world_size: int
    decisions: list                  # the rule's Decision tuples (feature, state, why, forced)
    rule: types.ModuleType = field(repr=False)
    notes: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return f"{self.host}: sm120 features for TP {self.world_size} on GPU {','.join(map(str, self.gpus)) or 'none'}"

    def rows(self) -> list[tuple[str, str, str]]:
        return [(self.rule.TITLES[d.feature], d.state + (" (forced)" if d.forced else ""), d.why)
                for d in self.decisions]

    def lines(self) -> list[str]:
        """What the patched server will log at start, one `sm120: ` line per feature."""
        return [self.rule.line(d) for d in self.decisions]

    def to_json(self) -> dict:
        return {"patchset": "sm120", "host": self.host, "applied": self.applied, "gpus": self.gpus,
                "world_size": self.world_size,
                "features": [{"feature": d.feature, "title": self.rule.TITLES[d.feature], "state": d.state,
                              "why": d.why, "forced": d.forced} for d in self.decisions],
                "notes": self.notes}


def predict(ctx, found, tp_size: int | None, env: dict) -> Prediction:
    """The sm120 decisions for a server with `tp_size` ranks and environment `env` on this host."""
    rule = ctx.added_module(RULE_FILE)
    inputs = inputs_from_facts(found, tp_size, env)
    state = found.raw.get("patch_state") or {}
    applied = ctx.name in (state.get("stack") or [])
    notes = []
    if not applied:
        notes.append(f"{ctx.name} is not applied on {found.host}: these gates only run once it is"
                     f" (invoke patch apply {ctx.name} --host {found.host})")
    if tp_size and len(inputs["gpus"]) < tp_size:
        notes.append(f"TP {tp_size} but only {len(inputs['gpus'])} GPU(s) found")
    return Prediction(host=found.host, applied=applied, gpus=inputs["gpus"], world_size=inputs["world_size"],
                      decisions=rule.decide(inputs, env), rule=rule, notes=notes)

"""Which `sm120` features a host will run, predicted from its facts before a server starts.

The rule exists once: in the file the sm120 patchset adds to SGLang, `sglang/srt/sm120_gates.py`
(a pure function of plain data, standard library only). `rule()` reads that file out of the
patchset's diff and loads it, so this prediction and the patched server's own start-up decision
are the same code; this module only turns `invoke facts` (nvidia-smi's P2P matrices, NVLink,
the installed FlashInfer's and deep_gemm's files) into the rule's inputs. The server decides
again at start from its runtime probes (torch, the CUDA driver, NVML), with the same rule.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field


from toolkit.provision import facts as facts_engine
from toolkit.patch import patchsets
from toolkit.core.inventory import Host
from toolkit.provision.stack import Stack, normalize

PATCHSET = "sm120"
RULE_FILE = "sglang/srt/sm120_gates.py"


class GateError(ValueError):
    """The sm120 patchset or its rule file cannot be read."""


def rule_source(known: dict | None = None) -> str:
    """The text of sglang/srt/sm120_gates.py as the sm120 patchset creates it."""
    try:
        return patchsets.added_file_text(PATCHSET, RULE_FILE, known)
    except patchsets.PatchsetError as exc:
        raise GateError(str(exc)) from None


def rule(known: dict | None = None) -> types.ModuleType:
    """The patch's rule module, loaded from its text (cached per content)."""
    try:
        return patchsets.added_module(PATCHSET, RULE_FILE, known)
    except patchsets.PatchsetError as exc:
        raise GateError(str(exc)) from None


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


def server_gpus(found: facts_engine.Facts, tp_size: int | None, env: dict | None) -> list[int]:
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


def inputs_from_facts(found: facts_engine.Facts, tp_size: int | None = None, env: dict | None = None) -> dict:
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
    titles: dict
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[str, str, str]]:
        return [(self.titles[d.feature], d.state + (" (forced)" if d.forced else ""), d.why) for d in self.decisions]

    def lines(self) -> list[str]:
        """What the patched server will log at start, one `sm120: ` line per feature."""
        module = rule()
        return [module.line(d) for d in self.decisions]

    def to_json(self) -> dict:
        return {"host": self.host, "applied": self.applied, "gpus": self.gpus, "world_size": self.world_size,
                "features": [{"feature": d.feature, "title": self.titles[d.feature], "state": d.state,
                              "why": d.why, "forced": d.forced} for d in self.decisions],
                "notes": self.notes}


def predict(found: facts_engine.Facts, tp_size: int | None = None, env: dict | None = None) -> Prediction:
    """The sm120 decisions for a server with `tp_size` ranks and environment `env` on this host."""
    module = rule()
    inputs = inputs_from_facts(found, tp_size, env)
    state = found.raw.get("patch_state") or {}
    applied = PATCHSET in (state.get("stack") or [])
    notes = []
    if not applied:
        notes.append(f"{PATCHSET} is not applied on {found.host}: these gates only run once it is"
                     f" (invoke patch apply {PATCHSET} --host {found.host})")
    if tp_size and len(inputs["gpus"]) < tp_size:
        notes.append(f"TP {tp_size} but only {len(inputs['gpus'])} GPU(s) found")
    return Prediction(host=found.host, applied=applied, gpus=inputs["gpus"], world_size=inputs["world_size"],
                      decisions=module.decide(inputs, env or {}), titles=dict(module.TITLES), notes=notes)


def predict_host(host: Host, tp_size: int | None = None, env: dict | None = None, stack: Stack | None = None,
                 transport=None) -> Prediction:
    """One facts round trip to `host`, then `predict`. The packages looked up are the stack's plus
    FlashInfer and sglang-kernel (the rule needs their versions)."""
    extra = [normalize(n) for n in ("flashinfer-python", "sglang-kernel", "sglang")]
    found = facts_engine.gather(host, stack, transport=transport, extra_packages=extra)
    return predict(found, tp_size or _host_tp(host), env)


def _host_tp(host: Host) -> int | None:
    server = host.server or {}
    value = server.get("tp_size")
    return int(value) if value else None

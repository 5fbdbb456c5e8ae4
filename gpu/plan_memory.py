"""Does a plan (gpu/plans/*.json) fit the GPU memory of the machine's GPUs (an H200 or an H100 may
come; GPU_CAPACITY_GIB overrides, and without a GPU an H200 is assumed)? An estimate, before any
server starts.

    python3 gpu/plan_memory.py PLAN.json [PLAN.json ...]     # prints each plan's peak per GPU
    python3 gpu/plan_memory.py --check PLAN.json             # exit 3 and one line if it does not fit

gpu/shapes_device.py calls refusal() first and starts nothing when it returns a message. Stdlib only,
except for a group that leaves "max_running" to the profile: its flags are read through toolkit.

A server's memory on each of its GPUs is
    target weights / tp + target KV pool
    + (speculative profiles) draft weights / tp - the embedding it shares with the target
                             + draft KV pool + the speculative worker's graphs and buffers
    + context, CUDA graphs and workspace (per TP size; more for a server above the lab's cap of 64:
      a baseline or dyn profile left to its own cap, or a larger --max-running-requests)
The weights and KV bytes per token come from the shapes gpu/make_models.py writes (layers and experts
from the KIMI_LAYERS / KIMI_EXPERTS / KIMI_DEEP_LAYERS / KIMI_DEEP_EXPERTS / HUGE_LAYERS / BIG_LAYERS knobs
of the plan's command, or from the model folders the device already holds); the constants below are
what the evidence logs measured (folders named under docs/evidence/) (sglang's "Load weight end ... mem usage", "KV Cache is allocated" lines,
and the per-process "GiB memory in use" that a CUDA OOM message lists).

Which servers hold memory at the same time: every server of a side-by-side sweep or of a check group;
one server at a time in a sweep without side_by_side; groups on the same GPU at once unless one runs
`after` the other (directly or through others); `start_after_healthy` orders their start, not their
lifetime. A server's KV pool with kv_tokens null is sized by sglang from the free memory it finds
(mem fraction of it, less the weights), so servers are placed in start order.
"""
import itertools
import json
import os
import sys

GIB = 1 << 30
# H200: "GPU 0 has a total capacity of 139.80 GiB" (kimi16-prefill-and-cap/1, kimi16-prefill-and-cap/2 and dyn-disable-4 OOM lines)
CAPACITY_GIB = 139.80
# what CUDA gives a process is about 0.6 GiB under nvidia-smi's memory.total: an H200's 143771 MiB
# (140.40 GiB) against the 139.80 above; an H100's 81559 MiB (79.65 GiB) against "a total capacity
# of 79.18 GiB" (plain-at-baseline/10-h100-spec-warmup, whose three-server plan died there)
SMI_OVERHEAD_GIB = 0.6

# left free for what a server allocates after start-up (the fused-MoE intermediate caches of its first
# large batches: dyn-disable-4/3's v1 server died asking for 98 MiB in its warm-up, 0.07 GiB short)
MARGIN_GIB = 2.0

# The weights: a parameter count from the config make_models.py writes (bf16) times this factor; the
# count falls short of sglang's "Load weight end ... mem usage" by 0.1 % (huge) to 1.9 % (kimideep16 TP2):
#   kimi 6 layers 64 experts TP1 33.13 GiB (dyn-disable-4/2, -5, -6, kimi16-prefill-and-cap/2), TP2 16.69 (dyn-disable-4/3, -6/3)
#   kimi 6 layers 128 experts TP1 59.38 (dyn-disable-4/1, KIMI_EXPERTS=128)
#   kimideep 16 layers 32 experts TP1 49.17 (kimi16-prefill-and-cap/1, kimi16-prefill-and-cap/2), TP2 24.84 (dyn-disable-6/2)
#   kimideep 32 layers 16 experts TP1 55.14 (dyn-disable-8/1)
#   huge 16 layers TP1 14.56 (dyn-disable-4/2, release-0.5.17/2)
WEIGHT_FACTOR = 1.02
MEASURED_WEIGHTS_GIB = {  # (pair, layers, experts, tp): GiB, the table above (tests hold the estimate to it)
    ("kimi", 6, 64, 1): 33.13, ("kimi", 6, 64, 2): 16.69, ("kimi", 6, 128, 1): 59.38,
    ("kimideep", 16, 32, 1): 49.17, ("kimideep", 16, 32, 2): 24.84, ("kimideep", 32, 16, 1): 55.14,
    ("huge", 16, None, 1): 14.56}

# EAGLE-3 drafts, "Load weight end. ... type=LlamaForCausalLMEagle3 ... mem usage" at TP1 (GiB): the
# Kimi draft (hidden 7168, target vocabulary 163840 for its embedding) 4.96 (kimi16-prefill-and-cap/1, kimi16-prefill-and-cap/2,
# dyn-disable-8/1; 2.66 per GPU at TP2, dyn-disable-4/3), the dense 32B-shape draft 2.00
# (dyn-disable-4/2); the tiny drafts 0.00-0.02. sglang then points the draft's embedding at the
# target's and frees its own: that is why a v2 server takes 3.81 GiB more than a baseline, not 4.96.
DRAFT_LOAD_GIB = {"kimi": 4.96, "huge": 2.00, "big": 2.00, "tiny": 0.05}
DRAFT_TP_FACTOR = 1.08  # 2.66 at TP2 against 4.96 / 2 = 2.48
# context, CUDA graphs, workspace of a server (GiB per GPU), beyond weights and KV pools:
#   TP1: kimi6 baseline 34.72 in use (kimi16-prefill-and-cap/2) - 33.13 - 0.42 = 1.17; kimideep16 capped at 48
#        54.81 (kimi16-prefill-and-cap/1) - 49.17 - 4.50 = 1.14
#   TP2: kimi6 baseline 24.80 in use (dyn-disable-4/3 OOM line) - 16.69 - 0.42 = 7.69 (NCCL and
#        all-reduce buffers; that baseline ran --enable-torch-symm-mem, the only TP=2 total measured)
BASE_OVERHEAD_GIB = {1: 1.2, 2: 7.7}
# a baseline with "max_running": null gets sglang's own cap (2048 requests: the req-to-token table
# of 2048 x 131072 positions is 1 GiB) and larger graphs; counted too for any server given more than
# the lab's 64 with --max-running-requests (the dyn profiles' own 4096 included, which sglang
# resolves as it does the baseline's): 56.58 against the capped 54.81 (kimi16-prefill-and-cap/1)
UNCAPPED_BASELINE_GIB = 1.8
# the speculative worker's graphs and buffers beyond the draft weights and KV (GiB per GPU):
#   TP1 v2: 38.53 (eagle3-v2) and 39.01 (eagle3-v2-dyn) in use (kimi16-prefill-and-cap/2) - 34.72 - 0.25 draft KV
#           - (4.96 - 2.19 shared embedding) = 0.79 and 1.27
#   TP2:    27.97 (v2), 28.33 (v2-dyn), 29.33 (eagle3), 29.34 (eagle3-dyn) (dyn-disable-4/3)
#           - 24.80 - 0.125 - (2.66 - 1.09) = 1.48, 1.84, 2.84, 2.85
#   TP1 v1: not measured alone; TP2's v1 - v2 difference (1.0) added to TP1's v2
SPEC_OVERHEAD_GIB = {("v2", 1): 1.3, ("v2", 2): 1.9, ("v1", 1): 2.3, ("v1", 2): 2.9}

KIMI_VOCAB = 163840
TINY = {"sharp", "random", "const", "tinymla", "mlasharp", "trained"}


def gpu_capacity_gib(env=os.environ, smi=None):
    """The GiB a process can have on the smallest GPU of this machine: GPU_CAPACITY_GIB when set,
    else nvidia-smi's memory.total less SMI_OVERHEAD_GIB, else (no GPU here: the dev machine)
    an H200's CAPACITY_GIB. Either kind may come for a call, so a plan is checked against the
    GPU that came."""
    if env.get("GPU_CAPACITY_GIB"):
        return float(env["GPU_CAPACITY_GIB"])
    if smi is None:
        import subprocess
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return CAPACITY_GIB
    totals = [float(x) for x in smi.split() if x.replace(".", "", 1).isdigit()]
    return round(min(totals) / 1024 - SMI_OVERHEAD_GIB, 2) if totals else CAPACITY_GIB


def model_shape(pair, env=None):
    """Layers and routed experts of a pair as make_models.py writes it under the knobs in env
    (run_shapes.sh's defaults: KIMI_LAYERS 6, KIMI_EXPERTS 64, KIMI_DEEP_EXPERTS 32, HUGE_LAYERS 64)."""
    env = os.environ if env is None else env
    if pair == "kimi":
        return {"layers": int(env.get("KIMI_LAYERS") or 6), "experts": int(env.get("KIMI_EXPERTS") or 64)}
    if pair == "kimideep":
        return {"layers": int(env.get("KIMI_DEEP_LAYERS") or 16), "experts": int(env.get("KIMI_DEEP_EXPERTS") or 32)}
    if pair == "huge":
        return {"layers": int(env.get("HUGE_LAYERS") or 64), "experts": None}
    if pair == "big":
        return {"layers": int(env.get("BIG_LAYERS") or 16), "experts": None}
    return {"layers": 4, "experts": 8 if pair in ("tinymla", "mlasharp") else None}


def shape_from_config(cfg):
    """The same from a target's config.json (what the device really holds)."""
    return {"layers": cfg["num_hidden_layers"], "experts": cfg.get("n_routed_experts")}


def shapes_for(pairs, env=None, models=None):
    """pair -> shape: from MODELS/target-PAIR/config.json where it exists (make_models.py keeps a
    folder an earlier call wrote, whatever the knobs say now), else from the knobs in env."""
    out = {}
    for pair in pairs:
        path = os.path.join(models, f"target-{pair}", "config.json") if models else None
        if path and os.path.exists(path):
            with open(path) as f:
                out[pair] = shape_from_config(json.load(f))
        else:
            out[pair] = model_shape(pair, env)
    return out


def _deepseek_params(layers, experts, hidden=7168, vocab=KIMI_VOCAB, heads=64, q_lora=1536, kv_lora=512,
                     rope=64, nope=128, v_dim=128, inter=18432, moe_inter=2048, shared=1, dense_layers=1):
    attn = (hidden * q_lora + q_lora * heads * (nope + rope) + hidden * (kv_lora + rope)
            + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden)
    moe = (experts + shared) * 3 * hidden * moe_inter + experts * hidden
    return 2 * vocab * hidden + layers * attn + dense_layers * 3 * hidden * inter + (layers - dense_layers) * moe


def _llama_params(layers, hidden, inter, heads, kv_heads, head_dim, vocab=1024):
    return 2 * vocab * hidden + layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
                                          + 3 * hidden * inter)


LLAMA = {"big": dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128),
         "huge": dict(hidden=5120, inter=27648, heads=40, kv_heads=8, head_dim=128),
         "tiny": dict(hidden=512, inter=1536, heads=8, kv_heads=4, head_dim=64)}


def family(pair):
    if pair in ("kimi", "kimideep"):
        return "kimi"
    return pair if pair in ("big", "huge") else "tiny"


def weights_gib(pair, shape, tp):
    if family(pair) == "kimi":
        params = _deepseek_params(shape["layers"], shape["experts"])
    elif pair in ("tinymla", "mlasharp"):
        params = _deepseek_params(shape["layers"], shape["experts"], hidden=512, vocab=1024, heads=8,
                                  q_lora=256, inter=1536, moe_inter=256)
    else:
        params = _llama_params(shape["layers"], **LLAMA[family(pair)])
    return WEIGHT_FACTOR * 2 * params / tp / GIB


def kv_bytes_per_token(pair, shape, tp):
    """Target KV bytes per token per GPU: MLA keeps one 576-wide latent per layer, the same on every
    rank (kimi6: 65536 tokens = 0.42 GiB at TP1 and TP2); Llama K and V split over the ranks."""
    if family(pair) == "kimi" or pair in ("tinymla", "mlasharp"):
        return shape["layers"] * (512 + 64) * 2
    llama = LLAMA[family(pair)]
    return 2 * shape["layers"] * llama["kv_heads"] * llama["head_dim"] * 2 // tp


def draft_kv_bytes_per_token(pair, tp):
    """One Llama layer: 8 KV heads of 128 (kimi, huge, big: 65536 tokens = 0.25 GiB), 4 of 64 (tiny)."""
    return (2 * 8 * 128 * 2 if family(pair) != "tiny" else 2 * 4 * 64 * 2) // tp


def is_speculative(profile):
    return profile != "baseline"


def last_cap(flags):
    """The value of the last --max-running-requests in flags (sglang's argparse keeps the last), or None."""
    if "--max-running-requests" not in flags:
        return None
    return int(flags[len(flags) - 1 - flags[::-1].index("--max-running-requests") + 1])


def profile_cap(profile):
    """The --max-running-requests a profile passes itself, or None (sglang's own cap): the dyn
    profiles pass 4096, lifting sglang's 48 for speculative servers. Read through the product's
    profile resolver (gpu/lab_launch.py), so the one import here that is not stdlib."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import lab_launch
    return last_cap(lab_launch.profile_flags(profile))


def server_gib(pair, shape, profile, tp, kv_tokens, max_running=64):
    """(GiB per GPU, parts) of one server; kv_tokens None: the KV pool is left out (sized later)."""
    tp_key = 1 if tp == 1 else 2
    parts = {"weights": weights_gib(pair, shape, tp),
             "kv": (kv_tokens or 0) * kv_bytes_per_token(pair, shape, tp) / GIB,
             "overhead": BASE_OVERHEAD_GIB[tp_key]}
    if is_speculative(profile):
        load = DRAFT_LOAD_GIB[family(pair)] / tp * (DRAFT_TP_FACTOR if tp > 1 else 1)
        shared = 2 * KIMI_VOCAB * 7168 / tp / GIB if family(pair) == "kimi" else 0.0
        parts["draft"] = load - shared
        parts["draft_kv"] = (kv_tokens or 0) * draft_kv_bytes_per_token(pair, tp) / GIB
        parts["spec"] = SPEC_OVERHEAD_GIB[("v2" if "v2" in profile else "v1", tp_key)]
    # sglang's own cap (no --max-running-requests at all) is 48 for a speculative server, 2048 for a baseline
    if (max_running is None and not is_speculative(profile)) or (max_running or 0) > 64:
        parts["overhead"] += UNCAPPED_BASELINE_GIB
    return sum(parts.values()), parts


def profile_spec(entry):
    """"eagle3-v2-dyn" or "eagle3-v2-dyn@flashinfer" (a profile on another attention backend), or
    a server's dict as written in the plan (shapes_device.py reads plan entries through this too)."""
    if isinstance(entry, dict):
        return entry
    profile, _, backend = entry.partition("@")
    return {"profile": profile, **({"backend": backend} if backend else {})}


def _servers(group):
    """The spec of every server a group describes, in start order."""
    return [profile_spec(entry) for entry in group.get("servers") or group.get("profiles") or []]


def _gpus(text):
    return [int(g) for g in str(text).split(",") if g.strip()]


def group_servers(group, shapes):
    """Every server of the group: dicts with label, gpus, gib (per GPU), kv_gib, mem, parts."""
    out = []
    for spec in _servers(group):
        pair = spec.get("pair", group.get("pair"))
        tp = int(spec.get("tp", group.get("tp", 1)))
        kv = spec.get("kv_tokens", group.get("kv_tokens", 65536))
        # the argv holds the profile's flags, then the lab's cap (a group's numeric max_running), then
        # the entry's flags; sglang's argparse keeps the last --max-running-requests
        max_running = group.get("max_running", 64)
        if max_running is None:
            max_running = profile_cap(spec["profile"])
        flags = spec.get("flags", [])
        if "--max-running-requests" in flags:
            max_running = last_cap(flags)
        gib, parts = server_gib(pair, shapes[pair], spec["profile"], tp, kv, max_running)
        out.append({"label": spec.get("label", spec["profile"]) + ("" if pair == group.get("pair") else f"/{pair}"),
                    "gpus": _gpus(spec.get("gpus", group["gpus"])), "gib": gib, "parts": parts,
                    "kv_sized": kv is None, "mem": float(spec.get("mem", group.get("mem", 0.8)))})
    return out


def _ordered_after(groups):
    """name -> names of the groups it runs after, directly or through others."""
    direct = {g["name"]: {g["after"]} if g.get("after") else set() for g in groups}
    closed = {}
    for name in direct:
        seen, todo = set(), list(direct[name])
        while todo:
            n = todo.pop()
            if n not in seen and n in direct:
                seen.add(n)
                todo.extend(direct[n])
        closed[name] = seen
    return closed


def _place(servers, capacity):
    """Per GPU: the servers in start order, each kv_tokens-null pool sized as sglang sizes it
    (its mem fraction of the free memory it finds at start, less its weights). Returns
    {gpu: [(label, gib)]}."""
    used = {}
    out = {}
    for srv in servers:
        gib = srv["gib"]
        if srv["kv_sized"]:
            free = min(capacity - used.get(g, 0.0) for g in srv["gpus"])
            gib += max(0.0, srv["mem"] * free - srv["parts"]["weights"] - srv["parts"]["overhead"])
        for g in srv["gpus"]:
            used[g] = used.get(g, 0.0) + gib
            out.setdefault(g, []).append((srv["label"], gib))
    return out


def estimate(plan, shapes, capacity=CAPACITY_GIB):
    """The worst set of servers resident at once, per GPU: a list of
    {"gpu", "groups", "servers": [(label, GiB)], "total"}, the largest total first."""
    groups = plan["groups"]
    after = _ordered_after(groups)
    per_group = {g["name"]: group_servers(g, shapes) for g in groups}
    worst = {}
    names = [g["name"] for g in groups]
    for k in range(1, len(names) + 1):
        for combo in itertools.combinations(groups, k):
            if any(a["name"] in after[b["name"]] or b["name"] in after[a["name"]]
                   for a, b in itertools.combinations(combo, 2)):
                continue  # one runs after the other: never resident together
            # groups that start once another is healthy go last; otherwise plan order
            combo = sorted(combo, key=lambda g: bool(g.get("start_after_healthy")))
            choices = []
            for g in combo:
                servers = per_group[g["name"]]
                if g.get("mode") == "sweep" and not g.get("side_by_side"):
                    choices.append([[s] for s in servers])  # one at a time
                else:
                    choices.append([servers])
            for pick in itertools.product(*choices):
                placed = _place([s for part in pick for s in part], capacity)
                for gpu, items in placed.items():
                    total = sum(v for _, v in items)
                    if gpu not in worst or total > worst[gpu]["total"]:
                        worst[gpu] = {"gpu": gpu, "groups": [g["name"] for g in combo],
                                      "servers": items, "total": total}
    return sorted(worst.values(), key=lambda w: -w["total"])


def refusal(plan, shapes, capacity=None, margin=MARGIN_GIB):
    """None when every GPU's estimate fits capacity - margin (default: this machine's GPU,
    gpu_capacity_gib()), else a one-line message."""
    capacity = gpu_capacity_gib() if capacity is None else capacity
    over = [w for w in estimate(plan, shapes, capacity) if w["total"] > capacity - margin]
    if not over:
        return None
    w = over[0]
    servers = " + ".join(f"{label} {gib:.1f}" for label, gib in w["servers"])
    return (f"plan refused: group {' + '.join(w['groups'])} on GPU {w['gpu']}: {servers} = {w['total']:.1f} GiB"
            f" > {capacity - margin:.1f} GiB ({capacity:.1f} less {margin:.1f} left free); nothing started."
            f" Split the group (\"after\") or set SKIP_MEMORY_CHECK=1 / --skip-memory-check to start it anyway")


def plan_pairs(plan):
    return {s.get("pair", g.get("pair")) for g in plan["groups"] for s in _servers(g)}


def main(argv):
    """Print each plan's peak per GPU; with --check print only refusals and return 3 if any
    (run_shapes.sh runs this before its setup, so a refused plan costs no device time)."""
    check = "--check" in argv
    status = 0
    capacity = gpu_capacity_gib()
    for path in [a for a in argv if a != "--check"]:
        with open(path) as f:
            plan = json.load(f)
        if not isinstance(plan, dict) or "groups" not in plan:   # e.g. an adaptive config beside the plans
            print(f"{os.path.basename(path)}: not a plan (no \"groups\"); skipped")
            continue
        shapes = shapes_for(plan_pairs(plan), os.environ, os.environ.get("MODELS_DIR", "/tmp/models"))
        msg = refusal(plan, shapes, capacity)
        if check:
            if msg and os.environ.get("SKIP_MEMORY_CHECK") != "1":
                print(f"{os.path.basename(path)}: {msg}")
                status = 3
            continue
        peaks = ", ".join(f"GPU {w['gpu']} {w['total']:.1f} GiB" for w in estimate(plan, shapes, capacity))
        print(f"{os.path.basename(path)}: {msg or 'fits'} (peak {peaks}; {capacity:.1f} GiB a GPU)")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

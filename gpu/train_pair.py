"""Train a small Llama target and its EAGLE-3 draft on text that ships offline (issue #24).

Usage: python3 gpu/train_pair.py OUT_DIR --corpus DIR [--corpus DIR ...] [--size small|tiny]
           [--arch llama|mla]
           [--bytes N] [--target-s S | --target-steps N] [--draft-s S | --draft-steps N]
           [--seed 0] [--device auto|cpu|cuda]

Writes under OUT_DIR: tok-trained/ (byte-level BPE + chat template), target-trained/ (LlamaForCausalLM),
draft-trained/ (LlamaForCausalLMEagle3), heldout.json (held-out prompts as token ids, with the
files they came from) and train_report.json (tokens/s, loss curve, held-out loss, the draft's
top-1 accuracy per position, a greedy-acceptance simulation). The pair name is "trained", so
the gpu/ drivers find it as /tmp/models/{target,draft}-trained.

--arch mla: the target is a small DeepseekV3ForCausalLM (Kimi K2.5's architecture: MLA attention,
first layer dense, then MoE layers of a few routed experts + 1 shared, sigmoid scores with
noaux_tc routing), trained with transformers' own DeepseekV3ForCausalLM and saved in the layout
SGLang 0.5.11's deepseek_v2.py loads (one tensor per expert, e_score_correction_bias in fp32, no
rope scaling). Same corpus, tokenizer, draft (LlamaForCausalLMEagle3) and recipe: SGLang's
DeepseekV2Model captures `hidden_states + residual` before layer id+1 exactly as its LlamaModel
does (deepseek_v2.py, set_eagle3_layers_to_capture), so the aux ids and hooks are the Llama ones.

The recipe is SpecForge's EAGLE-3 one (specforge 0.2.0 pins sglang 0.5.14, transformers 5.8.1,
wandb, datasets, accelerate: see gpu/README.md), written against what SGLang 0.5.11 serves:
- aux hidden states: with `eagle_aux_hidden_state_layer_ids` = ids, SGLang's LlamaModel captures
  `hidden_states + residual` before layer id+1, i.e. the residual stream leaving layer id; here a
  forward hook on transformers' layer id reads the same stream;
- the draft (`LlamaForCausalLMEagle3`): fc(3 aux) -> midlayer whose attention reads
  cat(input_layernorm(embed), hidden_norm(h)); residual = h; post_attention add+norm; MLP; the
  final add gives the hidden state fed to the next draft step (pre-norm) and norm(.) the logits;
  the embedding is the target's (SGLang shares it with an EAGLE-3 draft), lm_head the draft's own;
  full draft vocabulary (d2t zeros, t2d all true);
- training-time test: step k at row i embeds token i+1+k, takes the previous step's own hidden
  state, sits at position i+k (SGLang's draft decode positions are seq_lens, +1 per step),
  attends to step 0's keys at rows <= i and to steps 1..k's keys at row i, and learns the
  target's distribution at position i+1+k (soft cross-entropy), weighted 0.8**k.
"""
import argparse
import glob
import hashlib
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_models import CHAT_TEMPLATE, SPECIALS  # noqa: E402

SIZES = {
    # the device pair: make_models.py's tiny Llama shape (SGLang 0.5.11 loads it), vocabulary 2048
    "small": dict(vocab=2048, hidden=512, inter=1536, layers=4, heads=8, kv_heads=4, head_dim=64,
                  seq=256, batch=64, lr=1e-3, prompt=64, gen=96, gen_batch=256, gen_seqs=2048,
                  draft_batch=64),
    # CPU tests: seconds
    "tiny": dict(vocab=320, hidden=64, inter=128, layers=4, heads=4, kv_heads=2, head_dim=16,
                 seq=48, batch=8, lr=3e-3, prompt=16, gen=24, gen_batch=32, gen_seqs=64,
                 draft_batch=8),
}
# --arch mla: the attention and MoE dimensions on top of SIZES. "small" is make_models.py's
# tinymla shape (kv_lora_rank 512 + rope 64, the MLA head size SGLang's triton kernels serve for
# Kimi), so only the weights are new to the servers; "tiny" shrinks every rank for CPU tests.
MLA_SIZES = {
    "small": dict(moe_inter=256, experts=8, experts_per_tok=2, q_lora=256, kv_lora=512, rope_dim=64,
                  nope_dim=128, v_dim=128),
    "tiny": dict(moe_inter=32, experts=4, experts_per_tok=2, q_lora=32, kv_lora=32, rope_dim=8,
                 nope_dim=16, v_dim=16),
}
TTT = 4  # draft steps unrolled in training (SGLang runs 3 with --speculative-num-steps 3)
HELDOUT_FRACTION = 0.1
MAX_FILE_BYTES = 200_000
TOKENIZER_BYTES = 4_000_000  # generated tables and vendored blobs teach little


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- corpus

def heldout(rel_path):
    """Stable split by a hash of the path relative to its corpus root (the same on any machine)."""
    return hashlib.sha1(rel_path.encode()).digest()[0] < 256 * HELDOUT_FRACTION


def corpus_files(roots):
    """[(rel, abs)] of every .py file under the roots, sorted by (hash of rel, rel): spread over
    packages, so a byte budget takes a bit of each rather than the first ones alphabetically."""
    seen, out = set(), []
    for root in roots:
        for p in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            rel = os.path.relpath(p, root)
            if rel in seen or not os.path.isfile(p) or os.path.getsize(p) > MAX_FILE_BYTES:
                continue
            seen.add(rel)
            out.append((rel, p))
    return sorted(out, key=lambda rp: (hashlib.sha1(rp[0].encode()).hexdigest(), rp[0]))


def read_corpus(roots, budget_bytes):
    """{"train": [(rel, text)], "heldout": [(rel, text)]}, each side up to its share of the budget."""
    caps = {"train": budget_bytes * (1 - HELDOUT_FRACTION), "heldout": budget_bytes * HELDOUT_FRACTION}
    got = {"train": [], "heldout": []}
    size = {"train": 0, "heldout": 0}
    for rel, path in corpus_files(roots):
        side = "heldout" if heldout(rel) else "train"
        if size[side] >= caps[side]:
            if all(size[s] >= caps[s] for s in caps):
                break
            continue
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="ignore")
        if text.strip():
            got[side].append((rel, text))
            size[side] += len(text.encode())
    if not got["train"] or not got["heldout"]:
        raise SystemExit(f"corpus too small under {roots}: {[len(v) for v in got.values()]} files")
    return got


# ---------------------------------------------------------------- tokenizer

def train_tokenizer(out, texts, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", pad_token="<|end_of_text|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out)
    return tok, {s: tok.token_to_id(s) for s in SPECIALS}


def token_stream(tok, texts, bos):
    """One long id stream: each file starts with BOS."""
    ids = []
    for enc in tok.encode_batch(texts):
        ids.append(bos)
        ids.extend(enc.ids)
    return ids


# ---------------------------------------------------------------- models

def configs(sz, ids, vocab):
    tokens = {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<|eot_id|>"],
              "pad_token_id": ids["<|end_of_text|>"], "torch_dtype": "bfloat16"}
    target = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": sz["hidden"], "intermediate_size": sz["inter"],
              "num_hidden_layers": sz["layers"], "num_attention_heads": sz["heads"],
              "num_key_value_heads": sz["kv_heads"], "head_dim": sz["head_dim"],
              "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": False, "vocab_size": vocab, **tokens}
    layers = sz["layers"]
    # SGLang captures layer id+1's input, so an id must be <= layers - 2
    aux = [0, layers // 2 - 1, layers - 2] if layers >= 4 else [0, 0, layers - 2]
    draft = dict(target, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                 draft_vocab_size=vocab, target_hidden_size=sz["hidden"],
                 eagle_config={"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True})
    return target, draft


def mla_configs(sz, ids, vocab):
    """A DeepseekV3 target with every key SGLang 0.5.11's deepseek_v2.py reads, and the same
    Llama-shaped EAGLE-3 draft as configs() gives (its target_hidden_size is the MLA hidden)."""
    llama, draft = configs(sz, ids, vocab)
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "attention_bias",
            "tie_word_embeddings", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id",
            "torch_dtype")
    target = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
              **{k: llama[k] for k in keep},
              "num_key_value_heads": sz["heads"],  # MLA: every head reads the one latent
              "moe_intermediate_size": sz["moe_inter"], "n_routed_experts": sz["experts"],
              "n_shared_experts": 1, "num_experts_per_tok": sz["experts_per_tok"],
              "first_k_dense_replace": 1, "moe_layer_freq": 1,
              # Kimi K2.5's routing: sigmoid scores, the bias-corrected top-k, one group
              "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1,
              "norm_topk_prob": True, "routed_scaling_factor": 2.827,
              "q_lora_rank": sz["q_lora"], "kv_lora_rank": sz["kv_lora"],
              "qk_rope_head_dim": sz["rope_dim"], "qk_nope_head_dim": sz["nope_dim"],
              "v_head_dim": sz["v_dim"],
              # SGLang: is_neox_style = not rope_interleave; transformers: interleave when True
              "rope_interleave": True, "rope_scaling": None}
    return target, draft


def build_target(arch, tcfg):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM
    kw = {k: v for k, v in tcfg.items() if k not in ("architectures", "torch_dtype")}
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw))
    # the experts' plain loop: transformers' default grouped_mm is another kernel on the CPU (the
    # tests) than on CUDA, where under autocast it would run on the fp32 master weights
    return DeepseekV3ForCausalLM._from_config(DeepseekV3Config(**kw), experts_implementation="eager")


def target_tensors(target):
    """The target's weights as SGLang loads them, bf16 (a Llama's as they are). transformers 5 keeps a MoE layer's experts as
    two 3-D tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]); the HF
    checkpoint layout (and SGLang's loader) has one gate/up/down_proj.weight per expert."""
    import torch
    out = {}
    for k, v in target.state_dict().items():
        if k.endswith("rotary_emb.inv_freq") or k.endswith("rotary_emb.original_inv_freq"):
            continue
        v = v.detach().to("cpu")
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, 0)
                out[f"{base}{e}.gate_proj.weight"] = gate.to(torch.bfloat16)
                out[f"{base}{e}.up_proj.weight"] = up.to(torch.bfloat16)
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].to(torch.bfloat16)
        elif k.endswith("e_score_correction_bias"):
            out[k] = v.float()  # SGLang's noaux_tc gate keeps it in fp32
        else:
            out[k] = v.to(torch.bfloat16)
    return out


def rms(x, w, eps=1e-5):
    import torch
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x, pos, theta):
    """Neox-style rotary embedding (SGLang's Llama, transformers' rotate_half) on [B, h, S, D]."""
    import torch
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[..., None] * inv  # [B, S, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def make_draft(cfg, target_lm_head, seed):
    """The EAGLE-3 draft's parameters, named as in the checkpoint SGLang loads."""
    import torch
    g = torch.Generator().manual_seed(seed + 1)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd, nh, kvh = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def lin(o, i, scale=1.0):
        return torch.nn.Parameter(torch.randn(o, i, generator=g) * (scale / math.sqrt(i)))

    p = torch.nn.ParameterDict()
    shapes = {"fc.weight": (h, 3 * cfg["target_hidden_size"]),
              "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kvh * hd, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kvh * hd, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, nh * hd),
              "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h),
              "midlayer.mlp.down_proj.weight": (h, inter)}
    params = {k: lin(*s, scale=0.5 if k.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
              for k, s in shapes.items()}
    for k in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
              "midlayer.post_attention_layernorm.weight", "norm.weight"):
        params[k] = torch.nn.Parameter(torch.ones(h))
    params["lm_head.weight"] = torch.nn.Parameter(target_lm_head.detach().float().clone())
    for k, v in params.items():  # ParameterDict keys may not hold dots
        p[k.replace(".", "__")] = v
    return p


def P(p, name):
    return p[name.replace(".", "__")]


def draft_step(p, cfg, embeds, h_in, pos, cache, step):
    """One draft forward over all rows. cache: [(k, v)] of earlier steps (step 0's are attended
    causally, later steps' only on the diagonal). Returns (pre-norm hidden out, logits)."""
    import torch
    b, s, _ = embeds.shape
    hd, nh, kvh = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    x = torch.cat([rms(embeds, P(p, "midlayer.input_layernorm.weight")),
                   rms(h_in, P(p, "midlayer.hidden_norm.weight"))], -1)
    q = (x @ P(p, "midlayer.self_attn.q_proj.weight").T).view(b, s, nh, hd).transpose(1, 2)
    k = (x @ P(p, "midlayer.self_attn.k_proj.weight").T).view(b, s, kvh, hd).transpose(1, 2)
    v = (x @ P(p, "midlayer.self_attn.v_proj.weight").T).view(b, s, kvh, hd).transpose(1, 2)
    q, k = rope(q, pos, cfg["rope_theta"]), rope(k, pos, cfg["rope_theta"])
    cache.append((k, v))
    rep = nh // kvh
    k0, v0 = (t.repeat_interleave(rep, 1) for t in cache[0])
    scale = hd ** -0.5
    scores = [(q @ k0.transpose(-1, -2)) * scale]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores[0] = scores[0].masked_fill(~causal, float("-inf"))
    vals = [v0]
    for kk, vv in cache[1:]:
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        scores.append((q * kk).sum(-1, keepdim=True) * scale)
        vals.append(vv)
    w = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)
    att = w[..., :s] @ vals[0]
    for j, vv in enumerate(vals[1:]):
        att = att + w[..., s + j: s + j + 1] * vv
    att = att.transpose(1, 2).reshape(b, s, nh * hd) @ P(p, "midlayer.self_attn.o_proj.weight").T
    r = att + h_in
    y = rms(r, P(p, "midlayer.post_attention_layernorm.weight"))
    m = (torch.nn.functional.silu(y @ P(p, "midlayer.mlp.gate_proj.weight").T)
         * (y @ P(p, "midlayer.mlp.up_proj.weight").T)) @ P(p, "midlayer.mlp.down_proj.weight").T
    out = m + r
    return out, rms(out, P(p, "norm.weight")) @ P(p, "lm_head.weight").T


class AuxCapture:
    """Forward hooks on the target's layers named by the draft's aux ids: the residual stream
    leaving each, as SGLang captures it (hidden_states + residual at the next layer's input)."""

    def __init__(self, model, layer_ids):
        self.out = {}
        self.ids = layer_ids
        self.hooks = [model.model.layers[i].register_forward_hook(self._hook(n))
                      for n, i in enumerate(layer_ids)]

    def _hook(self, n):
        def f(_mod, _inp, output):
            self.out[n] = output[0] if isinstance(output, tuple) else output
        return f

    def cat(self):
        return __import__("torch").cat([self.out[n] for n in range(len(self.ids))], -1)


def target_forward(target, cap, ids):
    """(aux [B,S,3H], logits [B,S,V]) of the target on ids."""
    out = target(input_ids=ids, use_cache=False)
    return cap.cat(), out.logits


def ttt_loss(p, cfg, embed, ids, aux, tlogits, steps=TTT):
    """SpecForge's training-time test over `steps` unrolled draft steps. Returns (loss, [correct
    per step], [count per step])."""
    import torch
    b, s = ids.shape
    h = aux @ P(p, "fc.weight").T
    pos0 = torch.arange(s, device=ids.device)[None].expand(b, s)
    cache, loss, correct, count = [], 0.0, [], []
    tgt_ids = tlogits.argmax(-1)
    tp = torch.softmax(tlogits.float(), -1)
    for k in range(steps):
        shift = 1 + k
        inp = torch.nn.functional.pad(ids[:, shift:], (0, shift), value=0)
        h, logits = draft_step(p, cfg, embed(inp), h, pos0 + k, cache, k)
        valid = s - 1 - shift  # rows i with i+1+k <= s-1
        if valid <= 0:
            break
        lg = logits[:, :valid].float()
        target_p = tp[:, shift: shift + valid]
        loss = loss + (0.8 ** k) * -(target_p * torch.log_softmax(lg, -1)).sum(-1).mean()
        correct.append(int((lg.argmax(-1) == tgt_ids[:, shift: shift + valid]).sum()))
        count.append(b * valid)
    return loss, correct, count


def draft_chain(p, cfg, embed, ids, aux, next_token, steps):
    """The chain SGLang drafts with topk 1 after the target has read ids and chosen next_token:
    step 0 over every row (ids shifted by one, next_token last), then `steps`-1 decode steps
    from the last row, each fed the previous step's token and hidden state. Returns [B, steps]."""
    import torch
    b, s = ids.shape
    h = aux @ P(p, "fc.weight").T
    pos0 = torch.arange(s, device=ids.device)[None].expand(b, s)
    inp = torch.cat([ids[:, 1:], next_token[:, None]], 1)
    cache, out = [], []
    for k in range(steps):
        h, logits = draft_step(p, cfg, embed(inp), h, pos0 + k, cache, k)
        tok = logits[:, -1].argmax(-1)
        out.append(tok)
        inp = tok[:, None].expand(b, s)
    return torch.stack(out, 1)


def simulate_acceptance(target, cap, p, cfg, embed, prompts, new_tokens, steps=3):
    """Greedy speculative decoding in torch (chain, topk 1, `steps` draft tokens per verify):
    mean accepted tokens per verify (SGLang's accept length) over the prompts, and per prompt."""
    import torch
    per = []
    with torch.no_grad():
        for prompt in prompts:
            seq = torch.tensor([prompt], device=embed.weight.device)
            made, verifies = 0, 0
            while made < new_tokens:
                aux, logits = target_forward(target, cap, seq)
                nxt = logits[:, -1].argmax(-1)
                drafts = draft_chain(p, cfg, embed, seq, aux, nxt, steps)
                cand = torch.cat([seq, nxt[:, None], drafts], 1)
                _, vlog = target_forward(target, cap, cand)
                greedy = vlog[0, seq.shape[1]: seq.shape[1] + steps].argmax(-1)
                acc = 0
                while acc < steps and int(drafts[0, acc]) == int(greedy[acc]):
                    acc += 1
                # the verify yields nxt, the accepted drafts and the target's own next token
                take = [int(nxt)] + [int(t) for t in drafts[0, :acc]]
                seq = torch.cat([seq, torch.tensor([take], device=seq.device)], 1)
                made += len(take)
                verifies += 1
            per.append(made / verifies)
    return sum(per) / len(per), per


# ---------------------------------------------------------------- training

def pick_device(name):
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def windows(stream, seq, n, gen):
    import torch
    starts = torch.randint(0, len(stream) - seq - 1, (n,), generator=gen)
    return torch.stack([stream[s: s + seq] for s in starts.tolist()])


def plan_steps(step, planned, max_steps, seconds, t0, marks, what):
    """With a time budget, the step count is fixed once, from the pace of steps 10..30 (the
    first ones pay for CUDA/cuBLAS start-up): the cosine schedule needs its end."""
    if not seconds:
        return planned
    if step == 10:
        marks["t10"] = time.time()
    if step == 30:
        per = (time.time() - marks["t10"]) / 20
        planned = min(max_steps, max(step + 1, step + int((seconds - (time.time() - t0)) / per)))
        log(f"{what}: {per * 1000:.1f} ms/step, planning {planned} steps for {seconds} s")
    return planned


def train_target(target, stream, held, sz, dev, seconds, max_steps, gen, amp):
    import torch
    opt = torch.optim.AdamW(target.parameters(), lr=sz["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    curve, t0, step, tokens, marks = [], time.time(), 0, 0, {}
    planned = max_steps
    warm = 50 if max_steps > 200 else max(1, max_steps // 10)
    target.train()
    while step < planned:
        x = windows(stream, sz["seq"] + 1, sz["batch"], gen).to(dev)
        lr = sz["lr"] * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / planned)))
        for g_ in opt.param_groups:
            g_["lr"] = lr
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
            logits = target(input_ids=x[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x[:, :-1].numel()
        planned = plan_steps(step, planned, max_steps, seconds, t0, marks, "target")
        if step % max(1, planned // 20) == 0 or step == planned:
            curve.append([step, round(loss.item(), 4)])
            log(f"target step {step}/{planned} loss {loss.item():.3f} "
                f"{tokens / (time.time() - t0):.0f} tok/s")
    dt = time.time() - t0
    return {"steps": step, "seconds": round(dt, 1), "tokens": tokens,
            "tokens_per_s": round(tokens / dt), "loss_curve": curve,
            "train_loss": eval_loss(target, stream, sz, dev, gen, amp),
            "heldout_loss": eval_loss(target, held, sz, dev, gen, amp)}


def eval_loss(target, stream, sz, dev, gen, amp, batches=4):
    import torch
    target.eval()
    tot = 0.0
    with torch.no_grad():
        for _ in range(batches):
            x = windows(stream, sz["seq"] + 1, sz["batch"], gen).to(dev)
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
                logits = target(input_ids=x[:, :-1], use_cache=False).logits
            tot += float(torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))
    return round(tot / batches, 4)


def greedy_data(target, stream, sz, dev, gen, amp, n):
    """n sequences: a window of the stream, then the target's own greedy continuation."""
    import torch
    target.eval()
    out = []
    with torch.no_grad():
        for _ in range(0, n, sz["gen_batch"]):
            x = windows(stream, sz["prompt"], sz["gen_batch"], gen).to(dev)
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
                y = target.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                    max_new_tokens=sz["gen"], min_new_tokens=sz["gen"],
                                    do_sample=False, pad_token_id=0)
            out.append(y[:, : sz["prompt"] + sz["gen"]])
    return torch.cat(out)[:n]


def train_draft(target, cap, p, cfg, seqs, held_seqs, sz, dev, seconds, max_steps, gen, amp):
    import torch
    embed = target.model.embed_tokens
    opt = torch.optim.AdamW(list(p.values()), lr=sz["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    t0, step, planned, curve, marks = time.time(), 0, max_steps, [], {}
    while step < planned:
        idx = torch.randint(0, len(seqs), (sz["draft_batch"],), generator=gen)
        ids = seqs[idx.to(seqs.device)]
        with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
            aux, tl = target_forward(target, cap, ids)
        lr = sz["lr"] * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / planned)))
        for g_ in opt.param_groups:
            g_["lr"] = lr
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
            loss, _, _ = ttt_loss(p, cfg, embed, ids, aux.float(), tl.float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), 1.0)
        opt.step()
        step += 1
        planned = plan_steps(step, planned, max_steps, seconds, t0, marks, "draft")
        if step % max(1, planned // 10) == 0 or step == planned:
            curve.append([step, round(loss.item(), 4)])
            log(f"draft step {step}/{planned} loss {loss.item():.3f}")
    acc = draft_accuracy(target, cap, p, cfg, held_seqs, dev, amp)
    return {"steps": step, "seconds": round(time.time() - t0, 1), "loss_curve": curve,
            "heldout_top1_per_position": acc}


def draft_accuracy(target, cap, p, cfg, seqs, dev, amp):
    import torch
    corr, cnt = [0] * TTT, [0] * TTT
    with torch.no_grad():
        for i in range(0, len(seqs), 32):
            ids = seqs[i: i + 32]
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
                aux, tl = target_forward(target, cap, ids)
                _, c, n = ttt_loss(p, cfg, target.model.embed_tokens, ids, aux.float(), tl.float())
            for k in range(len(c)):
                corr[k] += c[k]
                cnt[k] += n[k]
    return [round(c / max(1, n), 4) for c, n in zip(corr, cnt)]


def save_pair(out, tok_dir, tcfg, dcfg, target, p, ids):
    import torch
    from make_models import write_model
    write_model(os.path.join(out, "target-trained"), tcfg, target_tensors(target), tok_dir, ids)
    dw = {k.replace("__", "."): v.detach().to("cpu", torch.bfloat16) for k, v in p.items()}
    vocab = dcfg["draft_vocab_size"]
    dw["d2t"] = torch.zeros(vocab, dtype=torch.int64)
    dw["t2d"] = torch.ones(dcfg["vocab_size"], dtype=torch.bool)
    write_model(os.path.join(out, "draft-trained"), dcfg, dw, tok_dir, ids)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--corpus", action="append", required=True)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--arch", choices=("llama", "mla"), default="llama",
                    help="the target: Llama, or DeepseekV3 (MLA + MoE)")
    ap.add_argument("--bytes", type=int, default=40_000_000)
    ap.add_argument("--target-s", type=float, default=0, help="time budget (0: --target-steps)")
    ap.add_argument("--target-steps", type=int, default=100_000)
    ap.add_argument("--draft-s", type=float, default=0)
    ap.add_argument("--draft-steps", type=int, default=100_000)
    ap.add_argument("--heldout-prompts", type=int, default=400)
    ap.add_argument("--sim-prompts", type=int, default=16)
    ap.add_argument("--sim-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args(argv)
    if not a.target_s and a.target_steps == 100_000 or not a.draft_s and a.draft_steps == 100_000:
        ap.error("give a time budget (--target-s/--draft-s) or a step count for both models")

    import torch

    T0 = time.time()
    sz = dict(SIZES[a.size], **(MLA_SIZES[a.size] if a.arch == "mla" else {}))
    dev = pick_device(a.device)
    amp = dev == "cuda" or os.environ.get("TRAIN_AMP") == "1"  # TRAIN_AMP=1: the bf16 path on the CPU
    torch.manual_seed(a.seed)
    if dev == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    if dev == "cpu":  # two threads on a shared 2-core machine ran 15x slower than one
        torch.set_num_threads(int(os.environ.get("TRAIN_THREADS", "1")))
    gen = torch.Generator().manual_seed(a.seed)

    corpus = read_corpus(a.corpus, a.bytes)
    train_texts = [t for _, t in corpus["train"]]
    held_texts = [t for _, t in corpus["heldout"]]
    log(f"corpus: {len(train_texts)} train files ({sum(map(len, train_texts))} chars), "
        f"{len(held_texts)} held-out files ({sum(map(len, held_texts))} chars)")
    tok_dir = os.path.join(a.out, "tok-trained")
    t1 = time.time()
    tok_texts, n = [], 0
    for t in train_texts:  # BPE merges settle on a few MB; training on all of it costs minutes
        if n >= TOKENIZER_BYTES:
            break
        tok_texts.append(t)
        n += len(t)
    tok, ids = train_tokenizer(tok_dir, tok_texts, sz["vocab"])
    vocab = tok.get_vocab_size()
    bos = ids["<|begin_of_text|>"]
    stream = torch.tensor(token_stream(tok, train_texts, bos))
    held = torch.tensor(token_stream(tok, held_texts, bos))
    log(f"tokenizer: vocab {vocab}, {len(stream)} train / {len(held)} held-out tokens "
        f"({time.time() - t1:.1f} s)")

    tcfg, dcfg = (configs if a.arch == "llama" else mla_configs)(sz, ids, vocab)
    target = build_target(a.arch, tcfg).to(dev)
    if a.arch == "mla":
        log(f"target: DeepseekV3ForCausalLM (MLA + MoE), {sum(q.numel() for q in target.parameters()) / 1e6:.1f} M "
            f"parameters, experts {tcfg['n_routed_experts']} top-{tcfg['num_experts_per_tok']} + 1 shared")
    rep = {"arch": a.arch, "size": a.size, "seed": a.seed, "device": dev, "vocab": vocab,
           "corpus": {"train_files": len(train_texts), "heldout_files": len(held_texts),
                      "train_tokens": len(stream), "heldout_tokens": len(held)}}
    rep["target"] = train_target(target, stream, held, sz, dev, a.target_s, a.target_steps, gen, amp)
    log(f"target: {rep['target']['steps']} steps in {rep['target']['seconds']} s, "
        f"{rep['target']['tokens_per_s']} tok/s, train loss {rep['target']['train_loss']}, "
        f"held-out loss {rep['target']['heldout_loss']}")
    target.eval()
    for q in target.parameters():
        q.requires_grad_(False)

    t2 = time.time()
    seqs = greedy_data(target, stream, sz, dev, gen, amp, sz["gen_seqs"]).to(dev)
    held_seqs = greedy_data(target, held, sz, dev, gen, amp, max(32, sz["gen_seqs"] // 16)).to(dev)
    log(f"draft data: {len(seqs)} greedy sequences of {seqs.shape[1]} tokens ({time.time() - t2:.1f} s)")
    cap = AuxCapture(target, dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    p = make_draft(dcfg, target.lm_head.weight, a.seed).to(dev)
    # the trivial baseline the trained draft must beat: the same draft untrained (its lm_head is
    # the target's, so it already guesses from the fc-projected target state)
    rep["draft_untrained_heldout_top1_per_position"] = draft_accuracy(target, cap, p, dcfg, held_seqs, dev, amp)
    rep["draft"] = train_draft(target, cap, p, dcfg, seqs, held_seqs, sz, dev, a.draft_s,
                               a.draft_steps, gen, amp)
    log(f"draft: {rep['draft']['steps']} steps in {rep['draft']['seconds']} s, held-out top-1 "
        f"per position {rep['draft']['heldout_top1_per_position']} (untrained: "
        f"{rep['draft_untrained_heldout_top1_per_position']})")

    # held-out prompts for the servers: windows of held-out files, as token ids
    pg = torch.Generator().manual_seed(a.seed + 7)
    prompts = windows(held, sz["prompt"], a.heldout_prompts, pg).tolist()
    sim_mean, sim_per = simulate_acceptance(target, cap, p, dcfg, target.model.embed_tokens,
                                            prompts[: a.sim_prompts], a.sim_tokens)
    rep["simulated_accept_len"] = {"steps": 3, "mean": round(sim_mean, 3),
                                   "per_prompt": [round(x, 3) for x in sim_per]}
    log(f"greedy acceptance simulation (steps 3, topk 1): accept length {sim_mean:.3f}")
    save_pair(a.out, tok_dir, tcfg, dcfg, target, p, ids)
    with open(os.path.join(a.out, "heldout.json"), "w") as f:
        json.dump({"prompt_tokens": sz["prompt"], "prompts": prompts,
                   "files": [r for r, _ in corpus["heldout"]][:50]}, f)
    rep["seconds_total"] = round(time.time() - T0, 1)
    with open(os.path.join(a.out, "train_report.json"), "w") as f:
        json.dump(rep, f, indent=1)
    log(f"pair written to {a.out} in {rep['seconds_total']} s")
    return rep


if __name__ == "__main__":
    main()

"""Make a tiny Llama target model and a matching EAGLE-3 draft model, offline.

Usage: python3 make_models.py OUT_DIR [--corpus DIR] [--no-weights] [--big LAYERS] [--huge]
                              [--kimi LAYERS] [--kimi-deep LAYERS] [--tiny-mla]

Writes, under OUT_DIR:
  tok/                      byte-level BPE tokenizer (1024 tokens) + chat template
  target-random/            LlamaForCausalLM, random weights (std 0.02)
  draft-random/             LlamaForCausalLMEagle3, random weights
  target-const/             LlamaForCausalLM whose greedy output is always token
                            CONST_TOKEN (EAGLE drafts are then always accepted)
  draft-const/              EAGLE-3 draft that always proposes CONST_TOKEN
  target-sharp/, draft-sharp/  the random pair with lm_head x50: context-dependent
                            greedy output with wide logit margins (exact-match tests)
  target-big/, draft-big/   with --big LAYERS: config only (hidden 4096), for
                            --load-format dummy throughput sweeps
  target-huge/, draft-huge/ with --huge: config only, Qwen2.5-32B's shape
  target-kimi/, draft-kimi/ with --kimi LAYERS: config only, Kimi K2.5's shape
                            (DeepseekV3 architecture: MLA + MoE, hidden 7168,
                            vocabulary 163840) with LAYERS layers and
                            KIMI_EXPERTS routed experts, and an EAGLE-3 draft of
                            the published Kimi drafts' shape (one layer, hidden
                            7168, draft vocabulary 32000); the tokenizer is padded
                            with plain-ASCII tokens "<tN>" to 163840 ids
  target-kimideep/, draft-kimideep/ with --kimi-deep LAYERS: the same shape
                            with more layers and KIMI_DEEP_EXPERTS (default 32)
                            routed experts, so a decode step is GPU-bound the
                            way the real model's is (more layers, about the
                            same GPU memory)
  target-tinymla/, draft-tinymla/ with --tiny-mla: config only, a small
                            DeepseekV3 (MLA + MoE) for correctness runs
Each model folder has config.json, model.safetensors, generation_config.json
and a copy of the tokenizer files. Weights need torch + safetensors; the
tokenizer needs `tokenizers` and `transformers`.

The "random" pair gives an acceptance length of about 1 (drafts almost never
accepted); the "const" pair gives the maximum acceptance length
(speculative_num_steps + 1). Both keep greedy outputs exactly those of the
target model alone, which is what EAGLE verification must preserve.
"""
import glob
import json
import os
import shutil
import sys

VOCAB = 1024
HIDDEN = 512
INTER = 1536
LAYERS = 4
HEADS = 8
KV_HEADS = 4
HEAD_DIM = 64
CONST_TOKEN = 300  # an ordinary (non-special) token id
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def make_tokenizer(out, corpus_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.join(corpus_dir, "**", "*.py"), recursive=True))[:400]
    if not files:
        raise SystemExit(f"no corpus files under {corpus_dir}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    return ids


def token_fields(ids):
    return {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<|eot_id|>"],
            "pad_token_id": ids["<|end_of_text|>"], "torch_dtype": "bfloat16"}


def llama_config(ids, **over):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
        **token_fields(ids),
    }
    cfg.update(over)
    return cfg


KIMI_VOCAB = 163840
# Kimi K2.5 has 384 routed experts; fewer keep the layers inside one H200 (KIMI_EXPERTS, default 64:
# three six-layer servers side by side)
KIMI_EXPERTS = int(os.environ.get("KIMI_EXPERTS", "64"))
KIMI_DEEP_EXPERTS = int(os.environ.get("KIMI_DEEP_EXPERTS", "32"))


def pad_tokenizer(tok_dir, out, size):
    """The tokenizer with plain-ASCII tokens "<tN>" up to `size` ids, so every id a
    random-weight model emits decodes to ASCII text. They go into the BPE vocabulary (no merge
    makes them, so encoding never yields them), not into added tokens: 160k added tokens made
    every load take seconds, and SGLang loads a tokenizer three times per process."""
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), out)
    path = os.path.join(out, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in spec.get("added_tokens", [])}
    for i in range(size):
        if i not in used:
            vocab[f"<t{i}>"] = i
    with open(path, "w") as f:
        json.dump(spec, f, ensure_ascii=False)


def kimi_draft_config(ids, target_layers):
    """An EAGLE-3 draft of the published Kimi K2.5 drafts' shape for a target of target_layers."""
    return llama_config(
        ids, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, vocab_size=KIMI_VOCAB,
        draft_vocab_size=32000, target_hidden_size=7168, hidden_size=7168,
        intermediate_size=18432, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        rope_theta=50000.0, max_position_embeddings=131072,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, target_layers // 2, target_layers - 2],
                      "use_aux_hidden_state": True})


def deepseek_v3_config(ids, **over):
    """A DeepseekV3ForCausalLM config (the architecture of Kimi K2.5's text model)."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": KIMI_VOCAB,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 6,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_shared_experts": 1,
        "n_routed_experts": KIMI_EXPERTS,
        "num_experts_per_tok": 8,
        "routed_scaling_factor": 2.827,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 32.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
        **token_fields(ids),
    }
    cfg.update(over)
    return cfg


def mla_weights(cfg, seed):
    """Random weights (std 0.02, lm_head x50) for a DeepseekV3 config, in the HF layout."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    t = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h),
         "model.norm.weight": ones(h),
         "lm_head.weight": rnd(cfg["vocab_size"], h) * 50}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_a_proj.weight": rnd(cfg["q_lora_rank"], h),
            p + "self_attn.q_a_layernorm.weight": ones(cfg["q_lora_rank"]),
            p + "self_attn.q_b_proj.weight": rnd(heads * qk_head, cfg["q_lora_rank"]),
            p + "self_attn.kv_a_proj_with_mqa.weight": rnd(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
            p + "self_attn.kv_a_layernorm.weight": ones(cfg["kv_lora_rank"]),
            p + "self_attn.kv_b_proj.weight": rnd(heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
                                                  cfg["kv_lora_rank"]),
            p + "self_attn.o_proj.weight": rnd(h, heads * cfg["v_head_dim"]),
        })
        if i < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            t.update({p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                      p + "mlp.down_proj.weight": rnd(h, inter)})
            continue
        inter = cfg["moe_intermediate_size"]
        t[p + "mlp.gate.weight"] = rnd(cfg["n_routed_experts"], h)
        t[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(cfg["n_routed_experts"], dtype=torch.float32)
        for e in range(cfg["n_routed_experts"]):
            q = f"{p}mlp.experts.{e}."
            t.update({q + "gate_proj.weight": rnd(inter, h), q + "up_proj.weight": rnd(inter, h),
                      q + "down_proj.weight": rnd(h, inter)})
        shared = inter * cfg["n_shared_experts"]
        t.update({p + "mlp.shared_experts.gate_proj.weight": rnd(shared, h),
                  p + "mlp.shared_experts.up_proj.weight": rnd(shared, h),
                  p + "mlp.shared_experts.down_proj.weight": rnd(h, shared)})
    return t


def write_model(d, cfg, tensors, tok_dir, ids):
    os.makedirs(d, exist_ok=True)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=2)
    json.dump(
        {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<|eot_id|>"],
         "do_sample": False},
        open(os.path.join(d, "generation_config.json"), "w"), indent=2)
    if tensors is not None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), d)


def make_weights(mode, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    const = mode == "const"
    sharp = mode == "sharp"
    out_scale = 0.1 if const else 1.0  # o_proj / down_proj scale

    def rnd(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    t = {}
    emb = rnd(VOCAB, HIDDEN)
    lm = rnd(VOCAB, HIDDEN)
    if const:
        emb[:, 0] = 1.0          # a direction every token shares
        lm[:, 0] = 0.0
        lm[CONST_TOKEN] = 0.0
        lm[CONST_TOKEN, 0] = 1.0  # the head reads that direction only for CONST_TOKEN
    if sharp:
        # wide logit margins: greedy argmax is not moved by the bf16 rounding
        # differences between decode, verify and batch shapes
        lm = lm * 50.0
    t["model.embed_tokens.weight"] = emb
    t["lm_head.weight"] = lm
    t["model.norm.weight"] = torch.ones(HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HEAD_DIM) * out_scale
        t[p + "mlp.gate_proj.weight"] = rnd(INTER, HIDDEN)
        t[p + "mlp.up_proj.weight"] = rnd(INTER, HIDDEN)
        t[p + "mlp.down_proj.weight"] = rnd(HIDDEN, INTER) * out_scale
        t[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    target = {k: v.to(bf) for k, v in t.items()}

    # EAGLE-3 draft, in the layout of published EAGLE-3 checkpoints
    # (midlayer.*, fc, norm, lm_head, d2t, t2d; no embed_tokens: the target's is used).
    d = {}
    fc = rnd(HIDDEN, 3 * HIDDEN)
    if const:
        fc = torch.zeros(HIDDEN, 3 * HIDDEN)
        fc[:, :HIDDEN] = torch.eye(HIDDEN)  # pass the first aux hidden state through
    d["fc.weight"] = fc
    d["midlayer.self_attn.q_proj.weight"] = rnd(HEADS * HEAD_DIM, 2 * HIDDEN)
    d["midlayer.self_attn.k_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, 2 * HIDDEN)
    d["midlayer.self_attn.v_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, 2 * HIDDEN)
    d["midlayer.self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HEAD_DIM) * out_scale
    d["midlayer.mlp.gate_proj.weight"] = rnd(INTER, HIDDEN)
    d["midlayer.mlp.up_proj.weight"] = rnd(INTER, HIDDEN)
    d["midlayer.mlp.down_proj.weight"] = rnd(HIDDEN, INTER) * out_scale
    d["midlayer.input_layernorm.weight"] = torch.ones(HIDDEN)
    d["midlayer.hidden_norm.weight"] = torch.ones(HIDDEN)
    d["midlayer.post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    d["norm.weight"] = torch.ones(HIDDEN)
    d["lm_head.weight"] = lm.clone()
    draft = {k: v.to(bf) for k, v in d.items()}
    draft["d2t"] = torch.zeros(VOCAB, dtype=torch.int64)  # draft id -> target id offset
    draft["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    return target, draft


def main():
    out = sys.argv[1]
    corpus = sys.argv[sys.argv.index("--corpus") + 1] if "--corpus" in sys.argv else os.path.dirname(
        os.path.dirname(os.path.abspath(__import__("json").__file__)))
    no_weights = "--no-weights" in sys.argv
    tok_dir = os.path.join(out, "tok")
    ids = make_tokenizer(tok_dir, corpus)
    tcfg = llama_config(ids)
    dcfg = llama_config(
        ids,
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        draft_vocab_size=VOCAB,
        target_hidden_size=HIDDEN,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                      "use_aux_hidden_state": True},
    )
    # config-only large targets + drafts for --load-format dummy (weights are random,
    # acceptance comes from SGLANG_SIMULATE_ACC_LEN): "big" has Llama-3-8B's layer shape
    # (N layers), "huge" Qwen2.5-32B's (64 layers, about 65 GB in bf16): a decode step long
    # enough on one H200 that the GPU, not the scheduler's CPU time, sets the pace, as with a
    # large model on the multi-GPU host.
    shapes = {"big": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128),
              "huge": dict(hidden_size=5120, intermediate_size=27648, num_attention_heads=40,
                           num_key_value_heads=8, head_dim=128)}
    for name, shape in shapes.items():
        if f"--{name}" not in sys.argv:
            continue
        layers = (int(sys.argv[sys.argv.index("--big") + 1]) if name == "big"
                  else int(os.environ.get("HUGE_LAYERS", "64")))
        write_model(os.path.join(out, f"target-{name}"), llama_config(ids, num_hidden_layers=layers, **shape),
                    None, tok_dir, ids)
        write_model(os.path.join(out, f"draft-{name}"), llama_config(
            ids, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
            draft_vocab_size=VOCAB, target_hidden_size=shape["hidden_size"],
            eagle_config={"eagle_aux_hidden_state_layer_ids": [1, layers // 2 - 1, layers - 4],
                          "use_aux_hidden_state": True}, **shape), None, tok_dir, ids)
    kimi_tok = os.path.join(out, "tok-kimi")
    if "--kimi" in sys.argv or "--kimi-deep" in sys.argv:
        pad_tokenizer(tok_dir, kimi_tok, KIMI_VOCAB)
    for flag, name, experts in (("--kimi", "kimi", KIMI_EXPERTS), ("--kimi-deep", "kimideep", KIMI_DEEP_EXPERTS)):
        if flag not in sys.argv:
            continue
        layers = int(sys.argv[sys.argv.index(flag) + 1])
        write_model(os.path.join(out, f"target-{name}"),
                    deepseek_v3_config(ids, num_hidden_layers=layers, n_routed_experts=experts),
                    None, kimi_tok, ids)
        write_model(os.path.join(out, f"draft-{name}"), kimi_draft_config(ids, layers), None, kimi_tok, ids)
    if "--tiny-mla" in sys.argv:
        write_model(os.path.join(out, "target-tinymla"), deepseek_v3_config(
            ids, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, moe_intermediate_size=256,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8,
            num_experts_per_tok=2, q_lora_rank=256, max_position_embeddings=4096,
            rope_scaling=None), None, tok_dir, ids)
        write_model(os.path.join(out, "draft-tinymla"), dict(dcfg, eagle_config={
            "eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}),
            None, tok_dir, ids)
    if "--tiny-mla" in sys.argv and not no_weights:
        # the same small DeepseekV3 with real random weights and a sharpened head: context-
        # dependent greedy output with wide logit margins, for exact-match checks on MLA
        cfg = json.load(open(os.path.join(out, "target-tinymla", "config.json")))
        write_model(os.path.join(out, "target-mlasharp"), cfg, mla_weights(cfg, 1234), tok_dir, ids)
    for mode, seed in (("random", 1234), ("const", 4321), ("sharp", 1234)):
        tw, dw = (None, None) if no_weights else make_weights(mode, seed)
        write_model(os.path.join(out, f"target-{mode}"), tcfg, tw, tok_dir, ids)
        write_model(os.path.join(out, f"draft-{mode}"), dcfg, dw, tok_dir, ids)
        if mode == "sharp" and os.path.isdir(os.path.join(out, "target-mlasharp")):
            write_model(os.path.join(out, "draft-mlasharp"), dcfg, dw, tok_dir, ids)
    print("models written to", out, "special ids", ids, "const token", CONST_TOKEN)


if __name__ == "__main__":
    main()

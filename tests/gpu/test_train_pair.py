"""gpu/train_pair.py on the CPU: a tiny trained pair (a Llama or, --arch mla, a DeepseekV3 target)
from the standard library's sources, loaded back the way transformers and SGLang 0.5.11 load it."""
import ast
import json
import sysconfig
import zipfile

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tests.gpu.scripts import load_gpu_script  # noqa: E402

tp = load_gpu_script("train_pair")
STDLIB = sysconfig.get_paths()["stdlib"]
ARGS = ["--corpus", STDLIB, "--size", "tiny", "--bytes", "300000", "--sim-prompts", "3",
        "--sim-tokens", "16", "--heldout-prompts", "8"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    rep = tp.main([str(out)] + ARGS + ["--target-steps", "60", "--draft-steps", "60"])
    return out, rep


def test_corpus_split_is_by_path_hash_and_stable(tmp_path):
    for i in range(40):
        (tmp_path / "pkg" / f"m{i}").mkdir(parents=True)
        (tmp_path / "pkg" / f"m{i}" / "x.py").write_text(f"def f{i}():\n    return {i}\n")
    files = tp.corpus_files([str(tmp_path)])
    assert [r for r, _ in files] == [r for r, _ in tp.corpus_files([str(tmp_path)])]
    got = tp.read_corpus([str(tmp_path)], 10_000)
    held = {r for r, _ in got["heldout"]}
    assert held and held == {r for r, _ in files if tp.heldout(r)}
    assert not held & {r for r, _ in got["train"]}
    small = tp.read_corpus([str(tmp_path)], 300)  # the byte budget caps each side
    assert sum(len(t) for _, t in small["train"]) < sum(len(t) for _, t in got["train"])


def test_report_has_loss_and_per_position_accuracy(pair):
    _, rep = pair
    t = rep["target"]
    assert t["steps"] == 60 and t["tokens_per_s"] > 0 and len(t["loss_curve"]) >= 5
    assert t["loss_curve"][-1][1] < t["loss_curve"][0][1]  # it learned something
    assert t["train_loss"] < 5.0 and t["heldout_loss"] < 5.5  # ln(320) = 5.77: better than uniform
    acc = rep["draft"]["heldout_top1_per_position"]
    assert len(acc) == tp.TTT and all(0 <= a <= 1 for a in acc)


def test_trained_draft_beats_the_untrained_one_and_drafts_get_accepted(pair):
    _, rep = pair
    trained = rep["draft"]["heldout_top1_per_position"]
    untrained = rep["draft_untrained_heldout_top1_per_position"]
    assert all(a > b + 0.1 for a, b in zip(trained, untrained)), (trained, untrained)
    # greedy speculative decoding with 3 draft tokens: more than one token per verify
    assert 1.5 < rep["simulated_accept_len"]["mean"] <= 4.0


def test_target_loads_with_transformers_and_tokenizer_has_the_chat_template(pair):
    from transformers import AutoTokenizer, LlamaForCausalLM
    out, _ = pair
    model, info = LlamaForCausalLM.from_pretrained(str(out / "target-trained"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = AutoTokenizer.from_pretrained(str(out / "target-trained"))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|>") and text.endswith("<|end_header_id|>\n\n")
    held = json.loads((out / "heldout.json").read_text())
    assert len(held["prompts"]) == 8 and all(len(p) == tp.SIZES["tiny"]["prompt"] for p in held["prompts"])
    assert max(max(p) for p in held["prompts"]) < model.config.vocab_size


def _wheel_source(name):
    from toolkit.patch import wheels
    w = wheels.pristine("sglang", "0.5.11")
    with zipfile.ZipFile(w.path) as z:
        return z.read(f"sglang/srt/models/{name}").decode()


def _assigned_attributes(*sources):
    names = set()
    for src in sources:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and isinstance(getattr(node, "ctx", None), ast.Store):
                names.add(node.attr)
    return names


def _stacked_mapping(src):
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "stacked_params_mapping":
            return ast.literal_eval(node.value)
    raise AssertionError("no stacked_params_mapping in llama_eagle3.py")


def test_draft_checkpoint_matches_what_sglang_0_5_11_loads(pair):
    out, _ = pair
    eagle, llama = _wheel_source("llama_eagle3.py"), _wheel_source("llama.py")
    cfg = json.loads((out / "draft-trained" / "config.json").read_text())
    tcfg = json.loads((out / "target-trained" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    # SGLang captures the input of layer id+1 (llama.py: layers_to_capture = [val + 1 ...]): every
    # id+1 must be a layer of the target, or that state is never captured
    assert "[val + 1 for val in layer_ids]" in llama
    assert len(ids) == 3 and all(0 <= i and i + 1 < tcfg["num_hidden_layers"] for i in ids)
    tensors = safetensors_torch.load_file(str(out / "draft-trained" / "model.safetensors"))
    h, th = cfg["hidden_size"], cfg["target_hidden_size"]
    assert tensors["fc.weight"].shape == (h, 3 * th)              # fc: Linear(hidden_size_in * 3, ...)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h  # QKVParallelLinear(2 * hidden)
    assert tensors["lm_head.weight"].shape == (cfg["draft_vocab_size"], h)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (cfg["draft_vocab_size"],)
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == cfg["draft_vocab_size"]
    # load_weights' renaming, as the wheel writes it: every other tensor must land on a module
    # attribute that LlamaForCausalLMEagle3 / its LlamaModel / the decoder layer assign
    mapping = _stacked_mapping(eagle)
    attrs = _assigned_attributes(eagle, llama) | {"weight"}
    for name in tensors:
        if "d2t" in name or "t2d" in name:
            continue
        for param, shard, _ in mapping:
            if shard in name:
                name = name.replace(shard, param)
                break
        parts = name.split(".")
        assert all(p in attrs for p in parts), (name, [p for p in parts if p not in attrs])
    assert "embed_tokens.weight" not in tensors  # SGLang gives an EAGLE-3 draft the target's embedding


def _tiny_draft():
    cfg = {"hidden_size": 32, "target_hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
           "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}
    torch.manual_seed(0)
    return cfg, tp.make_draft(cfg, torch.randn(50, 32), seed=0), torch.nn.Embedding(50, 32)


def test_draft_attention_is_causal_in_every_unrolled_step():
    cfg, p, embed = _tiny_draft()
    ids = torch.randint(0, 50, (1, 12))
    aux = torch.randn(1, 12, 96)
    later = ids.clone()
    later[0, 8:] = (later[0, 8:] + 1) % 50   # change tokens 8.. and the states of rows 8..
    aux2 = aux.clone()
    aux2[0, 8:] += 1.0
    with torch.no_grad():
        full_a = _ttt_logits(p, cfg, embed, ids, aux)
        full_b = _ttt_logits(p, cfg, embed, later, aux2)
    for k in range(3):  # row i of step k reads token i+1+k at most: rows < 7-k are untouched
        assert torch.allclose(full_a[k][:, : 7 - k], full_b[k][:, : 7 - k], atol=1e-6)
        assert not torch.allclose(full_a[k][:, 7 - k:], full_b[k][:, 7 - k:], atol=1e-6)


def test_the_serving_chain_is_the_training_unroll_fed_its_own_drafts():
    """draft_chain (SGLang's topk-1 drafting: extend, then decode steps from the last row) gives
    the tokens the training-time unroll predicts at that row when fed those same drafts."""
    cfg, p, embed = _tiny_draft()
    n = 8
    ids = torch.randint(0, 50, (1, n + 1))
    aux = torch.randn(1, n + 2, 96)
    with torch.no_grad():
        d = tp.draft_chain(p, cfg, embed, ids[:, :n], aux[:, :n], ids[:, n], steps=3)
        full = torch.cat([ids, d[:, :2]], 1)  # t_0..t_n, d1, d2
        logits = _ttt_logits(p, cfg, embed, full, torch.cat([aux, torch.zeros(1, 1, 96)], 1))
    assert [int(logits[k][0, n - 1].argmax()) for k in range(3)] == d[0].tolist()


def _ttt_logits(p, cfg, embed, ids, aux, steps=3):
    b, s = ids.shape
    h = aux @ tp.P(p, "fc.weight").T
    pos = torch.arange(s)[None]
    cache, outs = [], []
    for k in range(steps):
        inp = torch.nn.functional.pad(ids[:, 1 + k:], (0, 1 + k))
        h, logits = tp.draft_step(p, cfg, embed(inp), h, pos + k, cache, k)
        outs.append(logits)
    return outs


def test_same_seed_same_pair_other_seed_other_pair(tmp_path):
    args = ARGS + ["--target-steps", "6", "--draft-steps", "4", "--sim-prompts", "1", "--sim-tokens", "4"]
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        tp.main([str(tmp_path / name)] + args + ["--seed", seed])

    def tensors(name, model):
        return safetensors_torch.load_file(str(tmp_path / name / model / "model.safetensors"))

    for model in ("target-trained", "draft-trained"):
        a, b, c = tensors("a", model), tensors("b", model), tensors("c", model)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a if a[k].dtype.is_floating_point)
    assert (tmp_path / "a" / "heldout.json").read_text() == (tmp_path / "b" / "heldout.json").read_text()


def test_a_time_budget_becomes_a_step_count_from_the_pace_after_start_up(monkeypatch):
    clock = {"t": 100.0}
    monkeypatch.setattr(tp, "time", type("T", (), {"time": staticmethod(lambda: clock["t"])}))
    marks, planned = {}, 100_000
    t0 = clock["t"]
    for step in range(1, 31):
        clock["t"] += 5.0 if step <= 10 else 0.5  # slow first steps (start-up), then 0.5 s a step
        planned = tp.plan_steps(step, planned, 100_000, 60, t0, marks, "target")
        if step < 30:
            assert planned == 100_000
    # 60 s budget, 60 s spent (10 x 5 + 20 x 0.5): nothing left, so it ends at the next step
    assert planned == 31
    marks, planned, clock["t"] = {}, 100_000, t0
    for step in range(1, 31):
        clock["t"] += 0.25
        planned = tp.plan_steps(step, planned, 100_000, 60, t0, marks, "target")
    assert planned == 30 + 210  # (60 s - 7.5 s spent) / 0.25 s a step
    assert tp.plan_steps(30, 7, 7, 0, t0, {}, "target") == 7  # no budget: the step count given


# ---------------------------------------------------------------- --arch mla (DeepseekV3 target)

@pytest.fixture(scope="module")
def mla_pair(tmp_path_factory):
    """The tiny MLA pair, and the trained target as it was in memory when it was saved."""
    out = tmp_path_factory.mktemp("mla")
    kept = {}
    save = tp.save_pair

    def keep_target(*args):
        kept["target"] = args[4]  # save_pair(out, tok_dir, tcfg, dcfg, target, p, ids)
        return save(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tp, "save_pair", keep_target)
        rep = tp.main([str(out)] + ARGS + ["--arch", "mla", "--target-steps", "60", "--draft-steps", "60"])
    return out, rep, kept["target"]


# What SGLang 0.5.11's sglang/srt/models/deepseek_v2.py reads from the model's config (the
# PretrainedConfig transformers builds from config.json: a key the class does not define exists
# only when config.json has it). Line numbers are the 0.5.11 wheel's.
SGLANG_DSV2_KEYS = {
    "architectures": 2258,            # shared-experts fusion check
    "first_k_dense_replace": 1748,    # dense layers before the MoE ones (also 1905)
    "hidden_act": 415,
    "hidden_size": 285,
    "intermediate_size": 1693,        # the dense layers' MLP
    "kv_lora_rank": 1649,
    "max_position_embeddings": 1632,
    "moe_intermediate_size": 448,
    "moe_layer_freq": 1749,           # not a DeepseekV3Config field: config.json must carry it
    "n_group": 463,
    "n_routed_experts": 285,
    "n_shared_experts": 375,
    "norm_topk_prob": 461,
    "num_attention_heads": 1642,
    "num_experts_per_tok": 459,
    "num_hidden_layers": 1929,
    "pad_token_id": 1903,
    "q_lora_rank": 1647,
    "qk_nope_head_dim": 1643,
    "qk_rope_head_dim": 1644,
    "rms_norm_eps": 1303,
    "rope_interleave": 1306,          # getattr(..., True): is_neox_style = not rope_interleave
    "rope_scaling": 1631,             # read when the config has no rope_parameters
    "rope_theta": 1630,
    "routed_scaling_factor": 374,
    "tie_word_embeddings": 2194,
    "topk_group": 465,
    "topk_method": 287,               # "noaux_tc": the gate gets e_score_correction_bias
    "v_head_dim": 1645,
    "vocab_size": 1904,
}


def _config_reads(src):
    """Every `config.X` / `self.config.X` read and every getattr/hasattr(config, "X") in src."""
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "config") or (
                    isinstance(v, ast.Attribute) and v.attr == "config"
                    and isinstance(v.value, ast.Name) and v.value.id == "self"):
                names.add(node.attr)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            a = node.args[0]
            if (isinstance(a, ast.Name) and a.id == "config") or (
                    isinstance(a, ast.Attribute) and a.attr == "config"):
                names.add(node.args[1].value)
    return names


def test_mla_config_has_every_key_sglang_0_5_11_deepseek_v2_reads(mla_pair):
    from transformers import AutoConfig
    out, _, _ = mla_pair
    src = _wheel_source("deepseek_v2.py")
    lines = src.splitlines()
    for key, line in SGLANG_DSV2_KEYS.items():  # the list is the wheel's, line by line
        assert key in lines[line - 1], (key, line, lines[line - 1])
    # nothing it reads is missing from the list, save what this target does not reach: the
    # quantized shared experts' quantization_config, transformers' own rope_parameters, and the
    # DeepSeek-V3.2 indexer / Mistral-Large-3 / routing-method keys read with a default
    not_reached = {"quantization_config", "rope_parameters", "index_topk_freq", "index_topk_pattern",
                   "indexer_rope_interleave", "llama_4_scaling", "routing_method_type"}
    assert _config_reads(src) - not_reached <= set(SGLANG_DSV2_KEYS)
    cfg = json.loads((out / "target-trained" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert not set(SGLANG_DSV2_KEYS) - set(cfg), set(SGLANG_DSV2_KEYS) - set(cfg)
    hf = AutoConfig.from_pretrained(str(out / "target-trained"))
    # transformers 5.6 (SGLang 0.5.11's pin) folds rope_theta / rope_scaling into rope_parameters,
    # which SGLang takes first (line 1624): the else branch's keys are not attributes then
    assert [k for k in SGLANG_DSV2_KEYS if not hasattr(hf, k)] == ["rope_theta"]
    # "default": no yarn in SGLang, as transformers trained it
    assert hf.rope_parameters["rope_type"] == "default" and hf.rope_parameters["rope_theta"] == cfg["rope_theta"]
    # the routing transformers trained with (sigmoid, bias-corrected top-k in n_group groups)
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0 and cfg["topk_group"] <= cfg["n_group"]
    assert 0 < cfg["first_k_dense_replace"] < cfg["num_hidden_layers"]
    tensors = safetensors_torch.load_file(str(out / "target-trained" / "model.safetensors"))
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # the dense first layer
    for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        assert tensors[p + "gate.e_score_correction_bias"].dtype == torch.float32
        for e in range(cfg["n_routed_experts"]):  # one tensor per expert, as SGLang's loader maps them
            assert tensors[f"{p}experts.{e}.gate_proj.weight"].shape == (cfg["moe_intermediate_size"], cfg["hidden_size"])
            assert tensors[f"{p}experts.{e}.down_proj.weight"].shape == (cfg["hidden_size"], cfg["moe_intermediate_size"])
    assert not any("gate_up_proj" in k for k in tensors)


def test_mla_checkpoint_has_the_layout_of_the_mla_pair_the_h200_served(mla_pair):
    """make_models.mla_weights wrote mlasharp, which SGLang 0.5.11 loaded and served on the H200
    (docs/evidence/dyn-disable-4/3-mla-check-and-tp2-oom): the same names, shapes and dtypes."""
    out, _, _ = mla_pair
    cfg = json.loads((out / "target-trained" / "config.json").read_text())
    served = load_gpu_script("make_models").mla_weights(cfg, 0)
    ours = safetensors_torch.load_file(str(out / "target-trained" / "model.safetensors"))
    assert sorted(ours) == sorted(served)
    assert {k: (tuple(v.shape), v.dtype) for k, v in ours.items()} == \
        {k: (tuple(v.shape), v.dtype) for k, v in served.items()}


def test_mla_target_reloads_with_transformers_and_gives_the_same_logits(mla_pair):
    import copy
    from transformers import DeepseekV3ForCausalLM
    out, _, trained = mla_pair
    model, info = DeepseekV3ForCausalLM.from_pretrained(str(out / "target-trained"), output_loading_info=True,
                                                        dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref = copy.deepcopy(trained).cpu().float().eval()
    with torch.no_grad():
        for q in ref.parameters():  # the checkpoint is bf16: round the in-memory weights alike
            q.copy_(q.to(torch.bfloat16).float())
        ids = torch.tensor([json.loads((out / "heldout.json").read_text())["prompts"][0]])
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert got[0, -1].argmax() == want[0, -1].argmax()


def test_mla_draft_reads_the_layers_sglang_captures_for_this_target(mla_pair):
    import types
    import typing
    from transformers import DeepseekV3ForCausalLM
    out, _, trained = mla_pair
    tcfg = json.loads((out / "target-trained" / "config.json").read_text())
    dcfg = json.loads((out / "draft-trained" / "config.json").read_text())
    assert dcfg["architectures"] == ["LlamaForCausalLMEagle3"] and dcfg["target_hidden_size"] == tcfg["hidden_size"]
    ids = dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    # run the wheel's own DeepseekV2ForCausalLM.set_eagle3_layers_to_capture on a stand-in self
    tree = ast.parse(_wheel_source("deepseek_v2.py"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepseekV2ForCausalLM")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_layers_to_capture")
    ns = {"Optional": typing.Optional, "List": typing.List}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "deepseek_v2.py", "exec"), ns)
    me = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True),
                               config=types.SimpleNamespace(num_hidden_layers=tcfg["num_hidden_layers"]),
                               model=types.SimpleNamespace())
    ns["set_eagle3_layers_to_capture"](me, ids)
    captured = me.model.layers_to_capture
    # SGLang appends hidden_states + residual at the input of each captured layer i, so i must be a
    # layer after the first (layer 0 has no residual yet) and the state is the stream leaving i-1
    assert len(captured) == 3 and all(1 <= i < tcfg["num_hidden_layers"] for i in captured)
    model = DeepseekV3ForCausalLM.from_pretrained(str(out / "target-trained"), dtype=torch.float32).eval()
    cap = tp.AuxCapture(model, ids)
    prompt = torch.tensor([json.loads((out / "heldout.json").read_text())["prompts"][1]])
    with torch.no_grad():
        aux, _ = tp.target_forward(model, cap, prompt)
        hs = model(input_ids=prompt, output_hidden_states=True).hidden_states  # [i]: layer i's input
    want = torch.cat([hs[i] for i in captured], -1)
    assert torch.allclose(aux, want), (aux - want).abs().max()
    assert tuple(aux.shape[-1:]) == (3 * dcfg["target_hidden_size"],)


def test_mla_target_learns_and_its_trained_draft_beats_the_untrained_one(mla_pair):
    _, rep, _ = mla_pair
    assert rep["arch"] == "mla"
    t = rep["target"]
    assert t["steps"] == 60 and t["loss_curve"][-1][1] < t["loss_curve"][0][1]
    assert t["train_loss"] < 5.0 and t["heldout_loss"] < 5.5  # ln(320) = 5.77
    trained = rep["draft"]["heldout_top1_per_position"]
    untrained = rep["draft_untrained_heldout_top1_per_position"]
    assert len(trained) == tp.TTT and all(a > b + 0.05 for a, b in zip(trained, untrained)), (trained, untrained)
    assert 1.5 < rep["simulated_accept_len"]["mean"] <= 4.0


def test_mla_same_seed_same_pair(tmp_path):
    args = ARGS + ["--arch", "mla", "--target-steps", "6", "--draft-steps", "4", "--sim-prompts", "1",
                   "--sim-tokens", "4"]
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        tp.main([str(tmp_path / name)] + args + ["--seed", seed])
    for model in ("target-trained", "draft-trained"):
        a, b, c = (safetensors_torch.load_file(str(tmp_path / n / model / "model.safetensors")) for n in "abc")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a if a[k].dtype.is_floating_point)

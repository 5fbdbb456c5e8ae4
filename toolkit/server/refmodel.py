"""The sandbox's CPU reference model: a tiny Llama made locally, no model hub.

`make_model(out_dir)` writes a 2-layer Llama (hidden 128, 4 heads) with a byte-level BPE
tokenizer of about 400 tokens, trained here with the `tokenizers` library on a small
built-in corpus, a Llama-3-style chat template, and a generation config; all with
`save_pretrained`, so `transformers serve OUT_DIR` loads it like any checkpoint.

The weights are random but shaped so that greedy decoding never picks a special token
(EOS included) and prefers tokens that decode to visible text: every answer is non-empty
and runs to `max_tokens`, which is what smoke tests and benchmarks need.

On a host, toolkit.core.hostrun runs `make(args)` in the venv's Python out of its zip of host
code, so this module imports nothing of `toolkit`: the standard library plus torch,
transformers, tokenizers. Here it also runs on its own:

    python -m toolkit.server.refmodel OUT_DIR [--seed N]   (or python toolkit/server/refmodel.py ...)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Bump when the recipe changes: a different recipe must not be mistaken for a cached model.
RECIPE_VERSION = 1
STAMP_NAME = ".refmodel.json"

PARAMETERS = {
    "layers": 2,
    "hidden": 128,
    "heads": 4,
    "kv_heads": 4,
    "intermediate": 256,
    "vocab": 400,
    "max_positions": 4096,
}

BOS = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, END_OF_TEXT, START_HEADER, END_HEADER, EOT]

# Llama-3 layout. `content` may be a string or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + text | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "def fib_iter(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "class Server:\n    def __init__(self, host, port):\n        self.host = host\n        self.port = port\n\n"
    "    def start(self):\n        print(f'listening on {self.host}:{self.port}')\n",
    "import json\nimport os\n\nwith open(os.path.join('data', 'config.json')) as handle:\n"
    "    config = json.load(handle)\nfor key, value in sorted(config.items()):\n    print(key, value)\n",
    "for i in range(10):\n    if i % 2 == 0:\n        continue\n    result.append(i * i)\nreturn result\n",
    "Write a Python function that returns the n-th Fibonacci number.",
    "The Fibonacci sequence starts with zero and one, and every next number is the sum of the two before it.",
    "A language model reads a prompt and writes an answer one token at a time.",
    "The server listens on the loopback address and answers requests from the client.",
    "Speculative decoding lets a small draft model propose tokens that the large model then checks.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Please explain how the function works, then give an example of its output for small inputs.",
    "It is a truth universally acknowledged that a good test runs the real thing whenever it can.",
    "The host has eight GPUs, each with its own memory, and the model is split across all of them.",
    "Hello! How can I help you today? Here is the answer to your question about the code.",
]


def _stamp(seed: int) -> dict:
    corpus_hash = hashlib.sha256("\x00".join(CORPUS).encode()).hexdigest()[:16]
    return {"recipe": RECIPE_VERSION, "seed": seed, "parameters": PARAMETERS,
            "corpus": corpus_hash, "chat_template": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:16]}


def is_current(out_dir: Path, seed: int = 0) -> bool:
    stamp = Path(out_dir) / STAMP_NAME
    try:
        return json.loads(stamp.read_text()).get("made_with") == _stamp(seed)
    except (OSError, ValueError):
        return False


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=PARAMETERS["vocab"], min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tokenizer


def _visible_word_ids(tokenizer) -> list[int]:
    """Token ids that decode to printable ASCII with at least one letter or digit."""
    wanted = []
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        if text and text.isascii() and text.isprintable() and any(ch.isalnum() for ch in text):
            wanted.append(token_id)
    return wanted


def _build(out_dir: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = _train_tokenizer()
    vocab_size = raw.get_vocab_size()
    special_ids = [raw.token_to_id(t) for t in SPECIAL_TOKENS]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=BOS, eos_token=EOT, pad_token=END_OF_TEXT,
        model_max_length=PARAMETERS["max_positions"])
    tokenizer.chat_template = CHAT_TEMPLATE

    p = PARAMETERS
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=p["hidden"], intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
        max_position_embeddings=p["max_positions"], tie_word_embeddings=False,
        bos_token_id=special_ids[0], eos_token_id=[raw.token_to_id(EOT), raw.token_to_id(END_OF_TEXT)],
        pad_token_id=raw.token_to_id(END_OF_TEXT), torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()

    # A constant feature in dimension 0 of every embedding survives the residual stream and
    # the final RMSNorm; lm_head reads it as a per-token bias (Llama has no lm_head bias):
    # special tokens (EOS) far down, visible word pieces up, everything else slightly down.
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        bias_column = torch.full((vocab_size,), -0.5)
        bias_column[_visible_word_ids(raw)] = 0.5
        bias_column[special_ids] = -5.0
        model.lm_head.weight[:, 0] = bias_column

    generation = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, do_sample=False, max_new_tokens=64)

    model.save_pretrained(out_dir, safe_serialization=True)
    generation.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def make_model(out_dir, *, seed: int = 0) -> Path:
    """Write the tiny model to `out_dir` (idempotent: skipped when already made alike)."""
    out_dir = Path(out_dir).expanduser().absolute()
    if is_current(out_dir, seed):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / STAMP_NAME).exists():
        raise FileExistsError(
            f"{out_dir} exists and holds files that are not a reference model; choose an empty folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _build(scratch, seed)
        (scratch / STAMP_NAME).write_text(json.dumps({"made_with": _stamp(seed)}, indent=1) + "\n")
        for made in scratch.iterdir():
            os.chmod(made, 0o644)  # save_pretrained leaves the weights 0600; a server user may differ
        os.chmod(scratch, 0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(scratch, out_dir)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return out_dir


def make(args: dict) -> dict:
    """The host entry (toolkit.core.hostrun): {"out_dir", "seed"} -> {"model", "made", "seed"}."""
    seed = int(args.get("seed", 0))
    was_current = is_current(Path(args["out_dir"]).expanduser().absolute(), seed)
    path = make_model(args["out_dir"], seed=seed)
    return {"model": str(path), "made": not was_current, "seed": seed}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m toolkit.server.refmodel", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write the model to (created; reused when current)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights (default 0)")
    options = parser.parse_args(argv)
    print(json.dumps(make({"out_dir": options.out_dir, "seed": options.seed})))
    return 0


if __name__ == "__main__":
    sys.exit(main())

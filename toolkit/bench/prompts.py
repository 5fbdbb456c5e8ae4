"""What the bench sends: the built-in coding/agentic set, a synthetic fixed-length mode, or a file.

- `builtin`: coding questions and agentic turns (a system prompt with tools, tool results fed
  back), the workload EAGLE-3 is deployed for. Answers run to their natural end (no
  `ignore_eos`), capped at `output_len`.
- `synthetic`: prompts of `input_len` tokens (by the server's own `usage.prompt_tokens`, chat
  template included) made of seeded random words, answers of exactly `output_len` tokens where
  the server takes `ignore_eos` (SGLang, vLLM). No tokenizer is needed on the control machine:
  the warm-up asks the server what each word costs (`SyntheticCalibration`), and prompts are
  composed word by word to the exact count (see `compose`).
- a `.jsonl` path: one request a line, `{"messages": [...]}` or `{"prompt": "..."}`, optional
  `"max_tokens"`.

A seed fixes the order (and the synthetic words), so runs repeat.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

BUILTIN = "builtin"
SYNTHETIC = "synthetic"


class PromptError(ValueError):
    pass


@dataclass
class BenchRequest:
    messages: list[dict]
    max_tokens: int
    extra: dict = field(default_factory=dict)


_AGENT_SYSTEM = (
    "You are a coding agent working in a Python repository. You can call tools by answering with "
    "a JSON object {\"tool\": NAME, \"args\": {...}}. Tools: read_file(path), write_file(path, "
    "content), run(command), search(pattern). Think briefly, then act. When the task is done, "
    "answer with a short summary of what you changed."
)

_CODING = [
    "Write a Python function to compute fibonacci numbers. Be brief.",
    "Implement an LRU cache class in Python with get and put in O(1). Include type hints.",
    "Write a function that parses an ISO 8601 duration like 'P3DT4H12M' into seconds.",
    "Explain the difference between a process and a thread, then show a Python example of each.",
    "Write a SQL query that returns the top three customers by total order value per country.",
    "Refactor this into a list comprehension and explain why it is faster:\n"
    "result = []\nfor x in data:\n    if x % 3 == 0:\n        result.append(x * x)",
    "Write a bash script that finds the ten largest files under a directory, human-readable sizes.",
    "Implement binary search in Rust over a sorted slice of i64, returning Option<usize>.",
    "Write pytest tests for a function slugify(text) that lowercases, strips accents and joins words with '-'.",
    "Write an asyncio producer/consumer in Python with a bounded queue and graceful shutdown.",
    "Given a CSV with columns date,amount, write pandas code for a monthly sum and a 3-month rolling mean.",
    "Write a C function that reverses a singly linked list in place and returns the new head.",
    "Explain what this regular expression matches: ^(?=.*\\d)(?=.*[a-z])(?=.*[A-Z]).{8,}$",
    "Implement Dijkstra's algorithm in Python with heapq on an adjacency-list graph.",
    "Write a Dockerfile for a FastAPI app with a slim Python base image and a non-root user.",
    "Find the bug: def mean(xs): return sum(xs) / len(xs) - 1. Explain and fix it.",
]

_AGENTIC = [
    [{"role": "user", "content": "The test tests/test_parser.py::test_empty fails with IndexError. Fix it."},
     {"role": "assistant", "content": "{\"tool\": \"read_file\", \"args\": {\"path\": \"src/parser.py\"}}"},
     {"role": "user", "content": "Tool result:\ndef parse(line):\n    head = line.split(',')[0]\n"
      "    fields = line.split(',')[1:]\n    return {'head': head, 'first': fields[0]}\n"}],
    [{"role": "user", "content": "Add a --verbose flag to cli.py that sets the log level to DEBUG."},
     {"role": "assistant", "content": "{\"tool\": \"search\", \"args\": {\"pattern\": \"argparse\"}}"},
     {"role": "user", "content": "Tool result:\ncli.py:3:import argparse\ncli.py:12:    parser = "
      "argparse.ArgumentParser(prog='tool')\ncli.py:13:    parser.add_argument('path')\n"}],
    [{"role": "user", "content": "CI fails on the lint step. Find out why and fix it."},
     {"role": "assistant", "content": "{\"tool\": \"run\", \"args\": {\"command\": \"ruff check .\"}}"},
     {"role": "user", "content": "Tool result:\nsrc/util.py:4:1: F401 'os' imported but unused\n"
      "src/util.py:20:80: E501 line too long (97 > 79)\nFound 2 errors.\n"}],
    [{"role": "user", "content": "Write a function in src/retry.py that retries a callable with "
      "exponential backoff, then add a test for it."}],
    [{"role": "user", "content": "The service returns HTTP 500 on /orders when the cart is empty. Investigate."},
     {"role": "assistant", "content": "{\"tool\": \"read_file\", \"args\": {\"path\": \"app/orders.py\"}}"},
     {"role": "user", "content": "Tool result:\n@app.post('/orders')\ndef create(cart: Cart):\n"
      "    total = sum(i.price for i in cart.items) / len(cart.items)\n    return {'avg': total}\n"}],
    [{"role": "user", "content": "Rename the function get_usr to get_user everywhere in the repository."},
     {"role": "assistant", "content": "{\"tool\": \"search\", \"args\": {\"pattern\": \"get_usr\"}}"},
     {"role": "user", "content": "Tool result:\napi/users.py:8:def get_usr(uid):\napi/views.py:21:"
      "    user = get_usr(request.uid)\ntests/test_users.py:5:    assert get_usr(1).name == 'a'\n"}],
]


def builtin_conversations() -> list[list[dict]]:
    conversations = [[{"role": "user", "content": text}] for text in _CODING]
    conversations += [[{"role": "system", "content": _AGENT_SYSTEM}, *turns] for turns in _AGENTIC]
    return conversations


_WORDS = ("alpha beta gamma delta server model token cache queue thread batch kernel tensor "
          "layer value index graph node edge route table field record stream buffer socket "
          "python function class method return yield import module package version commit "
          # short words: one token in nearly every tokenizer, so a prompt can land exactly
          "a to of is in it on and").split()
LEAD_WORD = "request"          # every synthetic prompt starts with it (a word has no space before it)
CALIBRATION_REPEAT = 8         # copies of a word in its calibration prompt


@dataclass
class SyntheticCalibration:
    """What the server's tokenizer and chat template make of the synthetic words.

    Tokenizers split text at spaces before merging (byte-level BPE, SentencePiece with
    whitespace splitting), so a prompt's count is the template with the lead word plus what
    each further " word" adds; `compose` puts words together to the requested count."""
    base_tokens: int                 # the chat template around LEAD_WORD alone
    word_tokens: dict[str, float]    # prompt tokens each " word" adds

    @classmethod
    def fit(cls, base: int, counts: dict[str, int]) -> "SyntheticCalibration":
        """From the server's prompt_tokens for LEAD_WORD alone (`base`) and for LEAD_WORD plus
        CALIBRATION_REPEAT copies of each word (`counts`)."""
        costs = {}
        for word, count in counts.items():
            cost = (count - base) / CALIBRATION_REPEAT
            if cost > 0:
                costs[word] = float(round(cost)) if abs(cost - round(cost)) < 0.05 else cost
        if not costs:
            raise PromptError("calibration: no word adds prompt tokens on this server (its usage counts "
                              "do not change with the prompt)")
        return cls(base, costs)

    def to_dict(self) -> dict:
        return {"base_tokens": self.base_tokens,
                "word_tokens": {w: round(c, 3) for w, c in sorted(self.word_tokens.items())}}


def calibration_prompts() -> dict[str, str]:
    """The prompts `SyntheticCalibration.fit` needs: "" -> the lead word alone, word -> with copies."""
    prompts = {"": LEAD_WORD}
    for word in _WORDS:
        prompts[word] = LEAD_WORD + (" " + word) * CALIBRATION_REPEAT
    return prompts


def compose(tokens: int, calibration: SyntheticCalibration | None, rng: random.Random) -> str:
    """A prompt of `tokens` prompt tokens: the lead word, then random words whose costs add up to
    the rest. Near the end only words that keep an exact landing possible are drawn. Without a
    calibration every word counts as one token (an estimate, for tests and dry runs)."""
    base = calibration.base_tokens if calibration else 0
    costs = calibration.word_tokens if calibration else {w: 1.0 for w in _WORDS}
    vocabulary = sorted(costs)
    cheapest = min(costs.values())
    budget = tokens - base
    words = [LEAD_WORD]
    while True:
        fits = [w for w in vocabulary if costs[w] <= budget + 1e-6]
        if not fits:
            break
        exact = [w for w in fits if abs(budget - costs[w]) < 1e-6 or budget - costs[w] >= cheapest - 1e-6]
        word = rng.choice(exact or fits)
        words.append(word)
        budget -= costs[word]
    return " ".join(words)


@dataclass
class PromptSource:
    """Makes the requests of one level: `requests(n, seed)` is the same list for the same seed."""
    dataset: str = BUILTIN
    input_len: int = 256          # synthetic: prompt tokens, chat template included (usage.prompt_tokens)
    output_len: int = 256         # max_tokens; synthetic: exact where ignore_eos is honoured
    calibration: SyntheticCalibration | None = None   # synthetic: set by the warm-up
    file_requests: list[dict] | None = None

    def __post_init__(self):
        if self.input_len < 1 or self.output_len < 1:
            raise PromptError("--input-len and --output-len must be >= 1")
        if self.dataset not in (BUILTIN, SYNTHETIC):
            self.file_requests = _read_dataset_file(Path(self.dataset))

    @property
    def is_synthetic(self) -> bool:
        return self.dataset == SYNTHETIC

    def requests(self, count: int, seed: int) -> list[BenchRequest]:
        rng = random.Random(seed)
        if self.is_synthetic:
            return [BenchRequest([{"role": "user", "content": compose(self.input_len, self.calibration, rng)}],
                                 self.output_len, {"ignore_eos": True}) for _ in range(count)]
        if self.file_requests is not None:
            pool = [BenchRequest(item["messages"], int(item.get("max_tokens", self.output_len)))
                    for item in self.file_requests]
        else:
            pool = [BenchRequest(conversation, self.output_len) for conversation in builtin_conversations()]
        order: list[BenchRequest] = []
        while len(order) < count:
            batch = list(pool)
            rng.shuffle(batch)
            order.extend(batch)
        return order[:count]

    def describe(self) -> dict:
        out = {"dataset": self.dataset, "output_len": self.output_len}
        if self.is_synthetic:
            out.update(input_len=self.input_len)
        return out


def _read_dataset_file(path: Path) -> list[dict]:
    if not path.is_file():
        raise PromptError(f"--dataset {path}: not 'builtin', 'synthetic' or an existing .jsonl file")
    items = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise PromptError(f"{path}:{number}: not JSON ({exc})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            item = {**item, "messages": [{"role": "user", "content": item["prompt"]}]}
        if not (isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"]):
            raise PromptError(f"{path}:{number}: needs \"messages\" (a list) or \"prompt\" (a string)")
        items.append(item)
    if not items:
        raise PromptError(f"{path}: no requests in it")
    return items

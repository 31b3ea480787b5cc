"""Prompt sources for the load test: a built-in synthetic set, or files the user supplies.

* `synthetic`: a fixed set of short chat/code/math prompts (no download, deterministic).
* `random-ids`: seeded random token ids, for servers without a tokenizer (--skip-tokenizer-init).
* `code`: the shipped tiny pair's completion prompts (Python standard-library code held out of
  its training; `sglang_dflash.assets.tiny_pair_prompts`), the text that pair is good at.
* `jsonl`: one JSON object per line with `prompt` (a string) or `messages` (an OpenAI chat list).
* `gsm8k`: GSM8K-style lines with `question`; the math suffix z-lab's benchmark uses is added.
* `mt-bench`: MT-Bench-style lines with `turns` (or `prompt`) as a list of user turns; the first
  turn is used (a single-turn run: later turns depend on the model's own answers).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable, Optional

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

_TOPICS = [
    "a binary search tree",
    "the CAP theorem",
    "photosynthesis",
    "a JSON parser",
    "rate limiting in web servers",
    "the French revolution",
    "gradient descent",
    "TCP congestion control",
]
_TEMPLATES = [
    "Explain {t} to a new engineer in a few paragraphs.",
    "Write a Python function related to {t}, with a docstring and two unit tests.",
    "List five common misconceptions about {t} and correct each one.",
    "Summarize the history of {t} and why it matters today.",
    "Write a short story in which {t} plays a central role.",
    "Compare two different approaches to {t}; give pros and cons as a table.",
    "Give a step-by-step worked example involving {t}.",
    "Write an FAQ with six questions and answers about {t}.",
]
_MATH = [
    "A train travels {a} km at {b} km/h and then {c} km at {d} km/h. What is its average speed?",
    "Tom has {a} apples. He gives {b} to each of his {c} friends and buys {d} more. How many now?",
    "A rectangle is {a} cm by {b} cm. By how much does its area grow if each side grows {c} cm?",
    "Save {a} dollars a week for {b} weeks, then spend {c} dollars. What is left?",
]


@dataclass
class Prompt:
    """A text prompt or a chat conversation."""

    text: Optional[str] = None
    messages: Optional[list] = None
    input_ids: Optional[list] = None  # token ids, for servers without a tokenizer

    def as_messages(self) -> list:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.text}]

    def as_text(self, apply_chat_template: Optional[Callable[[list], str]] = None) -> str:
        if self.text is not None:
            return self.text
        if apply_chat_template is not None:
            return apply_chat_template(self.messages)
        return "".join(f"{m['role']}: {m['content']}\n" for m in self.messages) + "assistant: "


def synthetic(n: int = 64, seed: int = 0) -> list[Prompt]:
    """`n` varied prompts: explanations, code, lists, stories and word problems."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 4 == 3:
            nums = {k: rng.randint(2, 90) for k in "abcd"}
            out.append(Prompt(text=rng.choice(_MATH).format(**nums) + MATH_SUFFIX))
        else:
            out.append(Prompt(text=rng.choice(_TEMPLATES).format(t=rng.choice(_TOPICS))))
    return out


def _from_record(record: dict, kind: str) -> Prompt:
    if kind == "gsm8k":
        return Prompt(text=record["question"] + MATH_SUFFIX)
    if kind == "mt-bench":
        turns = record.get("turns") or record.get("prompt")
        if isinstance(turns, str):
            turns = [turns]
        return Prompt(text=turns[0])
    if "messages" in record:
        return Prompt(messages=record["messages"])
    return Prompt(text=record["prompt"])


def load_file(path: str, kind: str = "jsonl") -> list[Prompt]:
    """Prompts from a JSON-lines file; errors name the line and the missing field."""
    prompts = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(_from_record(json.loads(line), kind))
            except (KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
                want = {"gsm8k": "'question'", "mt-bench": "'turns'"}.get(kind, "'prompt' or 'messages'")
                raise ValueError(f"{path}:{line_no}: expected a {kind} record with {want} ({e!r})") from e
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def random_ids(n: int = 64, length: int = 256, vocab_size: int = 1000, seed: int = 0) -> list[Prompt]:
    """`n` prompts of `length` seeded random token ids in [10, vocab_size): for a server started
    with --skip-tokenizer-init, such as one serving --load-format dummy weights. Ids below 1000
    are valid in any model's vocabulary."""
    rng = random.Random(seed)
    return [Prompt(input_ids=[rng.randrange(10, vocab_size) for _ in range(length)]) for _ in range(n)]


def load(
    dataset: str, path: Optional[str] = None, limit: Optional[int] = None, input_len: int = 256
) -> list[Prompt]:
    if dataset == "synthetic":
        prompts = synthetic()
    elif dataset == "random-ids":
        prompts = random_ids(length=input_len)
    elif dataset == "code":
        from sglang_dflash.assets import tiny_pair_prompts

        prompts = [Prompt(text=t) for t in tiny_pair_prompts()]
    elif path is None:
        raise ValueError(f"--dataset {dataset} needs --dataset-path")
    else:
        prompts = load_file(path, dataset)
    return prompts[:limit] if limit else prompts

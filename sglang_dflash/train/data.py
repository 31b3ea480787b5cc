"""Training examples from a data file, and padded batches of them.

Accepted files:
  * `.txt`: the whole text, tokenized once and cut into sequences of `max_length` tokens.
  * `.jsonl`, one record per line, each with one of
      - `text`: a document, cut like a `.txt` file;
      - `messages`: a chat (`[{"role": ..., "content": ...}, ...]`), rendered with the
        tokenizer's chat template; only assistant tokens are labels;
      - `input_ids` (and optionally `loss_mask`): tokens used as they are. `--regenerate`
        writes its output in this form, so it can be reused as `--data`.

An `Example` carries a `loss_mask`: which tokens may be labels. Block anchors are drawn where
the next token is a label (see `objective.valid_anchors`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from sglang_dflash.train import atomic
from sglang_dflash.train.config import TrainConfigError

MIN_TOKENS = 3  # one context token, the anchor, and one label


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[bool]  # per token: may it be a label? (False for prompts)

    def to_json(self) -> str:
        return json.dumps({"input_ids": self.input_ids, "loss_mask": [int(m) for m in self.loss_mask]})


@dataclass
class Prompt:
    """The part of a record that `--regenerate` keeps; the target writes the rest."""

    input_ids: list[int]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [b, S] int64, right-padded with the pad id
    attention_mask: torch.Tensor  # [b, S] int64, 1 on real tokens
    loss_mask: torch.Tensor  # [b, S] bool, False on padding
    lengths: torch.Tensor  # [b] int64

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in vars(self).values()))


# ----------------------------------------------------------------------------------- reading


def read_records(path: str, flag: str = "--data") -> list[dict]:
    """The raw records of a data file: `.txt` -> one `text` record; `.jsonl` -> one per line."""
    if not path or not os.path.isfile(path):
        raise TrainConfigError(f"{flag} {path!r} does not exist or is not a file")
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not text.strip():
            raise TrainConfigError(f"{flag} {path!r} is empty")
        return [{"text": text}]
    if not path.endswith(".jsonl"):
        raise TrainConfigError(f"{flag} {path!r}: expected a .txt or .jsonl file")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrainConfigError(f"{flag} {path}:{lineno}: not valid JSON ({e})") from e
            if not isinstance(record, dict) or not {"messages", "text", "input_ids"} & set(record):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise TrainConfigError(
                    f"{flag} {path}:{lineno}: a record needs a 'messages', 'text' or 'input_ids' "
                    f"field, got {keys}"
                )
            record["_where"] = f"{path}:{lineno}"
            records.append(record)
    if not records:
        raise TrainConfigError(f"{flag} {path!r} is empty")
    return records


def load_examples(path: str, tokenizer, max_length: int, flag: str = "--data") -> list[Example]:
    """Every record of `path` as training examples of at most `max_length` tokens."""
    examples: list[Example] = []
    for record in read_records(path, flag):
        if "messages" in record:
            examples.append(_chat_example(record, tokenizer, max_length, flag))
        elif "text" in record:
            ids = _tokenize(tokenizer, record["text"], record, flag)
            examples.extend(Example(c, [True] * len(c)) for c in _chunks(ids, max_length))
        else:
            examples.append(_ids_example(record, max_length, flag))
    examples = [e for e in examples if len(e.input_ids) >= MIN_TOKENS and any(e.loss_mask[1:])]
    if not examples:
        raise TrainConfigError(
            f"{flag} {path!r} has no sequence of at least {MIN_TOKENS} tokens with a label to train on"
        )
    return examples


def load_prompts(
    path: str, tokenizer, *, max_length: int, prompt_tokens: int, flag: str = "--data"
) -> list[Prompt]:
    """The prompts that `--regenerate` continues: chats without their last assistant turn;
    for documents, the first `prompt_tokens` tokens of every `max_length` chunk."""
    prompts: list[Prompt] = []
    for record in read_records(path, flag):
        if "messages" in record:
            messages = _messages(record, flag)
            while messages and messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            if not messages:
                raise TrainConfigError(f"{flag} {record['_where']}: a chat needs a non-assistant message")
            text = _render(tokenizer, messages, record, flag, add_generation_prompt=True)
            prompts.append(Prompt(_tokenize(tokenizer, text, record, flag)))
        elif "text" in record:
            ids = _tokenize(tokenizer, record["text"], record, flag)
            prompts.extend(Prompt(c[:prompt_tokens]) for c in _chunks(ids, max_length))
        else:
            example = _ids_example(record, max_length, flag)
            n = example.loss_mask.index(True) if any(example.loss_mask) else prompt_tokens
            prompts.append(Prompt(example.input_ids[: max(n, 1)]))
    prompts = [p for p in prompts if 0 < len(p.input_ids) < max_length]
    if not prompts:
        raise TrainConfigError(f"{flag} {path!r} has no prompt shorter than --max-length {max_length}")
    return prompts


def _chunks(ids: list[int], size: int) -> list[list[int]]:
    # E.g., 10 tokens, size 4 -> [0:4], [4:8], [8:10].
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _tokenize(tokenizer, text, record: dict, flag: str) -> list[int]:
    if not isinstance(text, str):
        raise TrainConfigError(f"{flag} {record.get('_where', '')}: 'text' must be a string, got {text!r}")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _ids_example(record: dict, max_length: int, flag: str) -> Example:
    ids, mask = record["input_ids"], record.get("loss_mask")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise TrainConfigError(f"{flag} {record['_where']}: 'input_ids' must be a list of integers")
    if mask is None:
        mask = [True] * len(ids)
    if not isinstance(mask, list) or len(mask) != len(ids):
        raise TrainConfigError(
            f"{flag} {record['_where']}: 'loss_mask' must be a list as long as 'input_ids' ({len(ids)})"
        )
    return Example(ids[:max_length], [bool(m) for m in mask[:max_length]])


def _messages(record: dict, flag: str) -> list[dict]:
    messages = record["messages"]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise TrainConfigError(
            f"{flag} {record['_where']}: 'messages' must be a list of {{'role', 'content'}} objects"
        )
    return messages


def _render(tokenizer, messages: list[dict], record: dict, flag: str, add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise TrainConfigError(
            f"{flag} {record['_where']}: chat records need a chat template, but the target tokenizer has none"
        )
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _chat_example(record: dict, tokenizer, max_length: int, flag: str) -> Example:
    """A rendered chat whose labels are the assistant turns.

    Assistant turn i spans the characters between the rendering of messages[:i] (with the
    generation prompt) and the rendering of messages[:i+1]. E.g., with a template
    "<u>{user}<a>{assistant}<e>": "<u>hi<a>" | "yo<e>" -> the tokens of "yo<e>" are labels.
    A turn whose renderings are not prefixes of the full chat (templates that rewrite earlier
    turns) is kept as context but not used as labels.
    """
    messages = _messages(record, flag)
    full = _render(tokenizer, messages, record, flag, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], record, flag, add_generation_prompt=True) if i else ""
        end = _render(tokenizer, messages[: i + 1], record, flag, add_generation_prompt=False)
        if full.startswith(start) and full.startswith(end) and len(start) < len(end):
            spans.append((len(start), len(end)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_length]
    offsets = torch.tensor(enc["offset_mapping"][:max_length], dtype=torch.int64).view(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = torch.zeros(len(ids), dtype=torch.bool)
    # A token is a label if it overlaps the turn: E.g., "assistant: " + "return" may tokenize as
    # "assistant:" + " return", and " return" is the turn's first token.
    for lo, hi in spans:  # one pass per assistant turn, vectorised over tokens
        mask |= (ends > lo) & (starts < hi)
    return Example(ids, mask.tolist())


# ---------------------------------------------------------------------------------- batching


def collate(examples: list[Example], pad_id: int) -> Batch:
    lengths = torch.tensor([len(e.input_ids) for e in examples], dtype=torch.int64)
    b, s = len(examples), int(lengths.max())
    input_ids = torch.full((b, s), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((b, s), dtype=torch.bool)
    for i, e in enumerate(examples):
        input_ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids, dtype=torch.int64)
        loss_mask[i, : len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.bool)
    attention_mask = (torch.arange(s)[None, :] < lengths[:, None]).to(torch.int64)
    return Batch(input_ids, attention_mask, loss_mask, lengths)


class ExampleStream:
    """A reproducible stream of examples: epoch e visits them in randperm(seed + e), and each
    optimizer step takes the next `step_size` of them (the last step of an epoch may take fewer).

    The position (epoch, examples taken in it) is the whole state. It counts examples, not
    batches or ranks, so a resumed run, with any number of ranks, continues with exactly the
    examples the interrupted run would have seen next.
    """

    def __init__(self, num_examples: int, seed: int):
        self.num_examples = num_examples
        self.seed = seed
        self.epoch = 0
        self.taken = 0  # examples already taken in this epoch

    def steps_per_epoch(self, step_size: int) -> int:
        return -(-self.num_examples // step_size)

    def next_step(self, step_size: int) -> tuple[int, list[int]]:
        """(epoch, the example indices of the next optimizer step)."""
        if self.taken >= self.num_examples:
            self.epoch, self.taken = self.epoch + 1, 0
        order = torch.randperm(
            self.num_examples, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        picked = order[self.taken : self.taken + step_size].tolist()
        self.taken += len(picked)
        return self.epoch, picked

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.taken = int(state["epoch"]), int(state["taken"])


def shard(step: list[int], rank: int, world: int, micro_batches: int, batch_size: int) -> list[list[int]]:
    """This rank's micro-batches of one optimizer step: a strided share of the step's examples,
    cut into `micro_batches` lists of at most `batch_size` (empty lists where the step runs out).

    E.g., step [e0 .. e7], 2 ranks, 2 micro-batches of 2: rank 0 gets [[e0, e2], [e4, e6]], rank
    1 [[e1, e3], [e5, e7]]; one rank with micro-batches of 4 gets [[e0 .. e3], [e4 .. e7]]. Every
    run shape takes the same examples per step, so the step's summed loss is the same.
    """
    mine = step[rank::world]
    return [mine[m * batch_size : (m + 1) * batch_size] for m in range(micro_batches)]


def anchor_key(seed: int, epoch: int, index: int) -> int:
    """The seed of one example's anchors in one epoch: a function of (seed, epoch, example index)
    only, so an example's anchors depend on neither its batch, nor its rank, nor the number of
    ranks."""
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63


def write_examples(path: str, examples: list[Example]) -> None:
    with atomic.replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for e in examples:
            f.write(e.to_json() + "\n")

"""The base target: a tiny Qwen3 (`make_target`, the shapes of TARGETS) and the text shape of
target "a" that the other families share; and the helpers their builders share (`_favour`,
`_save_peaked`, `_edit_json`)."""

from __future__ import annotations

import json
import os
from typing import Sequence

import torch

from tests.support.tiny.tokenizer import EOS_ID, make_tokenizer


def make_target(
    path: str,
    *,
    seed: int = 0,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tokenizer: bool = True,
    architecture: str = "Qwen3ForCausalLM",
    lm_head_std: float = 0.15,
) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
    )
    model = Qwen3ForCausalLM(config)
    # Larger-than-default init gives peaked next-token distributions, so greedy argmax is far
    # from ties and deterministic across batch shapes.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
        model.lm_head.weight.mul_(lm_head_std / 0.15)
    model.save_pretrained(path)
    if architecture != "Qwen3ForCausalLM":
        _edit_json(os.path.join(path, "config.json"), architectures=[architecture])
    if tokenizer:
        make_tokenizer(path, vocab_size)
    return path


FAVOURED_ID = 7


# The text shape of target "a" (see TARGETS), which the other tiny families share so that they
# pair with draft "a".
TEXT_SHAPE_A = dict(
    vocab_size=384,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    eos_token_id=EOS_ID,
    bos_token_id=EOS_ID,
)


def _favour(embedding: torch.Tensor, head: torch.Tensor, favour: float) -> None:
    """With `favour` > 0, in place: every embedding row [V, H] carries 1.0 in dimension 0, and the
    LM head [V, H] reads it into token FAVOURED_ID's logit (see `make_hybrid_target`)."""
    if favour:
        embedding[:, 0] = 1.0
        head[FAVOURED_ID, 0] = favour


def _save_peaked(model, path: str, favour: float, rows_like_0: Sequence[int] = ()) -> None:
    """Larger-than-default init (peaked next-token distributions, far from greedy ties); with
    `favour`, the favoured token (see `make_hybrid_target`); the embedding rows `rows_like_0`
    equal to row 0; then the weights and a tokenizer."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
        _favour(model.get_input_embeddings().weight, model.lm_head.weight, favour)
        table = model.get_input_embeddings().weight
        for row in rows_like_0:
            table[row] = table[0]
    model.save_pretrained(path)
    make_tokenizer(path)


def _edit_json(file: str, **fields) -> None:
    with open(file) as f:
        data = json.load(f)
    data.update(fields)
    with open(file, "w") as f:
        json.dump(data, f, indent=2)

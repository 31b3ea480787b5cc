"""The draft's mask token: its id, resolved as SGLang's built-in resolves it, and a trained
embedding row for it saved beside the draft (`mask_embedding.pt`).

A block is `[bonus, MASK x (Bd-1)]`; the draft embeds it with the target's embedding table, so
the MASK id must be a row of the target's vocabulary. A checkpoint gives `mask_token_id`, or only
`mask_token` (a string, default `<|MASK|>`) for the target's tokenizer to resolve.

See docs/serving.md ("Draft checkpoints").
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Optional

from sglang_dflash.checkpoint.config import MASK_EMBEDDING, CheckpointError, DFlashDraftConfig

if TYPE_CHECKING:
    import torch


def resolve_mask_token_id(config: DFlashDraftConfig, tokenizer, vocab_size: int) -> DFlashDraftConfig:
    """The config with its mask token id, resolved as SGLang's built-in does: a given
    `mask_token_id` must not contradict the tokenizer's id for `mask_token`; without one, the
    tokenizer's mask token or vocabulary entry for `mask_token`, else the token is added to the
    tokenizer (as the reference demo does), and the id must fall inside the target's vocabulary.
    `tokenizer` may be None only when the id is given."""
    token, token_id = config.mask_token, config.mask_token_id
    if token_id is None:
        if tokenizer is None:
            raise CheckpointError(
                f"draft config has no 'mask_token_id': resolving its mask_token {token!r} needs the "
                "target's tokenizer (serve without --skip-tokenizer-init, or add mask_token_id)"
            )
        if getattr(tokenizer, "mask_token", None) == token:
            token_id = getattr(tokenizer, "mask_token_id", None)
        if token_id is None:
            token_id = tokenizer.get_vocab().get(token)
        if token_id is None:
            tokenizer.add_special_tokens({"mask_token": token})
            token_id = tokenizer.convert_tokens_to_ids(token)
    elif tokenizer is not None:
        vocab_id = tokenizer.get_vocab().get(token)
        if vocab_id is not None and vocab_id != token_id:
            raise CheckpointError(
                f"draft config field 'mask_token_id' is {token_id}, but the target's tokenizer gives "
                f"its mask_token {token!r} the id {vocab_id}"
            )
    if not 0 <= int(token_id) < vocab_size:
        raise CheckpointError(
            f"draft config's mask token {token!r} has the id {token_id}, at or beyond the target's "
            f"vocab_size {vocab_size} (the target's embedding cannot be resized for it)"
        )
    return dataclasses.replace(config, mask_token_id=int(token_id))


def load_mask_embedding(path: str, config: DFlashDraftConfig) -> Optional["torch.Tensor"]:
    """A trained mask-token embedding [H] saved beside the draft (`mask_embedding.pt`, holding
    `{"embedding": [H], "mask_token_id": int}`), checked as SGLang's built-in checks it; None if
    there is none. The draft embeds its MASK rows with it instead of the target's row."""
    import torch

    file = os.path.join(path, MASK_EMBEDDING)
    if not os.path.isfile(file):
        return None
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"draft {MASK_EMBEDDING} cannot be read: {error}") from error
    if not isinstance(saved, dict) or "embedding" not in saved or "mask_token_id" not in saved:
        raise CheckpointError(f"draft {MASK_EMBEDDING} must hold 'embedding' and 'mask_token_id'")
    if saved.get("per_position"):
        raise CheckpointError(
            f"draft {MASK_EMBEDDING} has per_position=True (one embedding per block position), "
            f"which neither sglang-dflash nor SGLang's built-in serves"
        )
    if int(saved["mask_token_id"]) != config.mask_token_id:
        raise CheckpointError(
            f"draft {MASK_EMBEDDING} was trained with mask_token_id={int(saved['mask_token_id'])}, "
            f"but the draft's mask token id is {config.mask_token_id}"
        )
    embedding = saved["embedding"]
    if not isinstance(embedding, torch.Tensor) or tuple(embedding.shape) != (config.hidden_size,):
        shape = tuple(embedding.shape) if isinstance(embedding, torch.Tensor) else type(embedding).__name__
        raise CheckpointError(
            f"draft {MASK_EMBEDDING}'s embedding has shape {shape}, expected ({config.hidden_size},)"
        )
    return embedding

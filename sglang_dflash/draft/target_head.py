"""The target's input embedding and LM head, as the draft borrows them.

A DFlash draft has neither: its block `[bonus, MASK ...]` is embedded by the target's embedding
layer and its hidden states are read out by the target's LM head. Both are resolved once, at
start-up, through what SGLang may have put around them:

- multimodal wrappers (the language model's head, when the wrapper has none of its own);
- LoRA wrappers (the base layer: adapters are per request, and the draft was trained on the
  base model, as SGLang's built-in DFLASH also unwraps them);
- a quantized head (its quant method computes the logits, as in SGLang's logits processor);
- scaled embeddings (Gemma's embedding module multiplies by sqrt(hidden) in its forward): the
  draft calls the module, so it gets what the target's first layer gets, which is also what
  the z-lab reference feeds its draft (`target.model.embed_tokens(ids)`).

Under tensor parallelism the embedding module does its own all-reduce, so `embed` is whole on
every rank. The LM head is vocab-parallel: `logits` gathers the full vocab (for structured
outputs), while `argmax` gathers one (max, id) pair per row and rank
(`tensor_parallel.vocab_parallel_argmax`), and `topk` k pairs (DFlash2's candidates), with one more
value per row for `topk_log_probs` (LiLiCorr's).

See README.md ("Supported targets").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_dflash.draft.tensor_parallel import (
    TensorParallel,
    vocab_parallel_argmax,
    vocab_parallel_logsumexp,
    vocab_parallel_topk,
)


def _find_lm_head(model):
    for owner in (model, getattr(model, "language_model", None), getattr(model, "model", None)):
        head = getattr(owner, "lm_head", None)
        if head is not None:
            return head
    raise ValueError(
        f"sglang-dflash cannot find the LM head of {type(model).__name__} (no lm_head on the model or "
        "its language_model); the draft reads its proposals out through the target's LM head"
    )


def _find_embedding(model):
    """The target's token embedding: `get_input_embeddings()`, or, on the classes without that
    method (SGLang 0.5.23's Qwen2-MoE) or whose method embeds ids instead (MiniMax-M2's takes
    `input_ids`), their inner model's `embed_tokens`."""
    import inspect

    method = getattr(model, "get_input_embeddings", None)
    if method is not None and not inspect.signature(method).parameters:
        return method()
    table = getattr(getattr(model, "model", None), "embed_tokens", None)
    if table is None:
        raise ValueError(
            f"sglang-dflash cannot find the token embedding of {type(model).__name__} (no "
            "get_input_embeddings, no model.embed_tokens); the draft embeds its blocks with the target's"
        )
    return table


class TargetHead:
    """`embed(ids [N]) -> [N, H]`, `logits(hidden [..., H]) -> [..., V]` (V: the real vocab,
    without padding rows) and `argmax(hidden [..., H]) -> [...]`, the same on every rank."""

    def __init__(self, model, vocab_size: int, tp: TensorParallel = TensorParallel()):
        from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
        from sglang.srt.lora.layers import unwrap_lora_layer

        self.vocab_size = vocab_size
        self.tp = tp
        self.embedding = unwrap_lora_layer(_find_embedding(model))
        self.embed = self.embedding  # replaced by `use_trained_mask_row`
        self.mask_row_kind = "target's"
        head = unwrap_lora_layer(_find_lm_head(model))
        # This rank's columns of the logits: tokens vocab_start + [0, num_valid); under TP the
        # slice is padded to the same width P on every rank (padding rows at the vocab's end).
        if tp.size > 1:
            self.vocab_start = head.shard_indices.org_vocab_start_index
            self.num_valid = head.shard_indices.num_org_elements
            rows = head.weight.shape[0]  # P
        else:
            self.vocab_start, self.num_valid, rows = 0, vocab_size, vocab_size
        quant_method = getattr(head, "quant_method", None)
        if should_apply_lm_head_quant_method(head, quant_method):
            self.head, self.quant_method, self.weight = head, quant_method, None
            self.kind = f"quantized ({type(quant_method).__name__})"
        else:
            self.head, self.quant_method = head, None
            self.weight = head.weight[:rows]  # [V, H] (or [P, H] per rank): padding rows dropped
            self.kind = "dense"
        self.local_width = rows

    @torch.no_grad()
    def use_draft_embedding(self, table: torch.nn.Embedding, mask_token_id: int, trained=None) -> None:
        """Embed the draft's blocks with the draft's own `table` (a Nemotron-3.5 draft's
        `embed_tokens`, whole on every rank), as SGLang's built-in does for such a draft. The
        target's embedding stays `embedding` (LiLiCorr's candidates read the target's). A trained
        mask row (`mask_embedding.pt`) is written into `table`, which only the draft reads."""
        if trained is not None:
            table.weight[mask_token_id] = trained.to(device=table.weight.device, dtype=table.weight.dtype)
        self.embed = table
        self.mask_row_kind = "trained, in the draft's own table" if trained is not None else "draft's own"

    @torch.no_grad()
    def use_trained_mask_row(self, mask_token_id: int, trained: torch.Tensor) -> None:
        """Embed `mask_token_id` with a trained row (`mask_embedding.pt`) in the draft's blocks.

        SGLang's built-in writes the row into the target's embedding table, which also changes
        what the target sees for that token. Here the target's table is left as it is: the row
        is written in only long enough to run the module's forward on it once (so the draft gets
        what the built-in's draft gets, any embedding scale and the TP all-reduce included),
        and `embed` then swaps that output in for the mask token's rows.
        """
        weight = self.embedding.weight
        shard = getattr(self.embedding, "shard_indices", None)
        start = shard.org_vocab_start_index if shard is not None else 0
        end = shard.org_vocab_end_index if shard is not None else weight.shape[0]
        local = mask_token_id - start if start <= mask_token_id < end else None  # on this rank?
        if local is not None:
            original = weight[local].clone()
            weight[local] = trained.to(device=weight.device, dtype=weight.dtype)
        ids = torch.tensor([mask_token_id], device=weight.device)
        row = self.embedding(ids)[0].clone()  # [H]; every rank takes part under TP
        if local is not None:
            weight[local] = original

        def embed(ids: torch.Tensor) -> torch.Tensor:
            # ids [N] -> [N, H]: the target's rows, and the trained row where ids is the mask.
            return torch.where((ids == mask_token_id)[:, None], row, self.embedding(ids))

        self.embed = embed
        self.mask_row_kind = "trained (mask_embedding.pt)"

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> this rank's logits [..., V] (or [..., P] per rank under TP).

        The rows go in as one contiguous [N, H] matrix: the draft's hidden states arrive as a
        strided view (block positions 1..W-1 of [bs, Bd, H]), and on CPU a linear over that
        view runs as a batched matmul: 2.8 ms against 1.3 ms over its copy for [16, 7, 256] x
        [2048, 256] in fp32 on one core (8.9 against 0.6 ms in bf16)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.quant_method is None:
            # In the head's dtype: a head may keep its own (Beam's is bf16 in a float32 engine), and
            # the target's logits processor reads its hidden states the same way.
            flat = flat.to(self.weight.dtype)
            logits = F.linear(flat, self.weight)  # (1.1 to 1.6x faster than `flat @ weight.T` on CPU)
        else:
            logits = self.quant_method.apply(self.head, flat, None)[:, : self.local_width]
        return logits.reshape(*hidden.shape[:-1], self.local_width)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self._local_logits(hidden)
        if self.tp.size == 1:
            return local
        # [size, ..., P] -> [..., size*P]: rank r's columns are tokens r*P .. (r+1)*P - 1.
        gathered = self.tp.all_gather(local).movedim(0, -2)
        return gathered.reshape(*hidden.shape[:-1], -1)[..., : self.vocab_size]

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self._local_logits(hidden)
        if self.tp.size == 1:
            return torch.argmax(local, dim=-1)
        return vocab_parallel_argmax(local, self.vocab_start, self.num_valid, self.tp)

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., H] -> the k best tokens' logits [..., k] float32 and ids [..., k]."""
        return vocab_parallel_topk(self._local_logits(hidden), k, self.vocab_start, self.num_valid, self.tp)

    def topk_log_probs(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., H] -> the k best tokens' log-probabilities (log_softmax over the whole
        vocab) [..., k] float32 and ids [..., k], from one pass of the head."""
        local = self._local_logits(hidden)
        values, ids = vocab_parallel_topk(local, k, self.vocab_start, self.num_valid, self.tp)
        return values - vocab_parallel_logsumexp(local, self.num_valid, self.tp)[..., None], ids

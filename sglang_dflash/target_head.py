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
"""

from __future__ import annotations

import torch


def _find_lm_head(model):
    for owner in (model, getattr(model, "language_model", None), getattr(model, "model", None)):
        head = getattr(owner, "lm_head", None)
        if head is not None:
            return head
    raise ValueError(
        f"sglang-dflash cannot find the LM head of {type(model).__name__} (no lm_head on the model or "
        "its language_model); the draft reads its proposals out through the target's LM head"
    )


class TargetHead:
    """`embed(ids [N]) -> [N, H]` and `logits(hidden [..., H]) -> [..., V]` (V: the real vocab,
    without padding rows)."""

    def __init__(self, model, vocab_size: int):
        from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
        from sglang.srt.lora.layers import unwrap_lora_layer

        self.vocab_size = vocab_size
        self.embed = unwrap_lora_layer(model.get_input_embeddings())
        head = unwrap_lora_layer(_find_lm_head(model))
        quant_method = getattr(head, "quant_method", None)
        if should_apply_lm_head_quant_method(head, quant_method):
            self.head, self.quant_method, self.weight = head, quant_method, None
            self.kind = f"quantized ({type(quant_method).__name__})"
        else:
            self.head, self.quant_method = head, None
            self.weight = head.weight[:vocab_size]  # [V, H]: vocab padding rows dropped
            self.kind = "dense"

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_method is None:
            return hidden @ self.weight.T
        flat = self.quant_method.apply(self.head, hidden.reshape(-1, hidden.shape[-1]), None)
        return flat[:, : self.vocab_size].reshape(*hidden.shape[:-1], self.vocab_size)

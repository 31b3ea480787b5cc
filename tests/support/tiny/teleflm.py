"""TeleFLM (`make_family_target(family="teleflm")`: Llama's weights with muP fields): its muP
multipliers and its oracle, transformers' Llama with them folded in (`teleflm_folded`)."""

from __future__ import annotations

import json
import os

import torch

# TeleFLM's muP fields: SGLang's model multiplies the embeddings by `input_mult` in its forward
# and the logits by `output_mult / mup_scale_factor` (`teleflm_folded` folds both into Llama).
TELEFLM_MUP = {"use_mup": True, "input_mult": 4.0, "output_mult": 3.0, "mup_scale_factor": 2.0}


def teleflm_folded(path: str):
    """Transformers' Llama on the TeleFLM target at `path`, with the muP multipliers folded into
    its embedding and LM head: the reference for TeleFLM's forward."""
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", *TELEFLM_MUP)}
    model = transformers.LlamaForCausalLM.from_pretrained(
        path, config=transformers.LlamaConfig(**fields), dtype=torch.float32
    )
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(raw["input_mult"])
        model.lm_head.weight.mul_(raw["output_mult"] / raw["mup_scale_factor"])
    return model.eval()

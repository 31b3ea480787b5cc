"""Hybrid linear-attention targets (`make_hybrid_target`): Qwen3-Next, Qwen3.5, Qwen3.5-MoE and
the two Qwen3.5 multimodal wrappers (Gated DeltaNet layers, then a full-attention one)."""

from __future__ import annotations

import os

import torch

from tests.support.tiny.qwen3 import TEXT_SHAPE_A, _edit_json, _save_peaked
from tests.support.tiny.vl import VL_TOKENS, VL_VISION, _save_vl_processor


def make_hybrid_target(path: str, *, family: str, seed: int = 0, favour: float = 0.0) -> str:
    """A tiny hybrid linear-attention target: three Gated DeltaNet layers, then one full-attention
    layer (`full_attention_interval` 4, as in the published checkpoints).

    family: "qwen3_next" (Qwen3NextForCausalLM, MoE with a shared expert), "qwen3_5"
    (Qwen3_5ForCausalLM, dense), "qwen3_5_moe" (Qwen3_5MoeForCausalLM), "qwen3_5_vl" (the
    multimodal wrapper Qwen3_5ForConditionalGeneration that Qwen3.5 checkpoints use, with a
    one-block vision tower and its processor, served here for text), or "qwen3_5_moe_vl" (the
    MoE checkpoints' wrapper, Qwen3_5MoeForConditionalGeneration, likewise).

    favour > 0 makes token FAVOURED_ID the greedy choice about half the time: every embedding
    carries 1.0 in dimension 0 and the LM head reads it into that token's logit. An untrained
    draft, which shares the embeddings and head, then proposes it too, so verifies accept runs
    of proposals while the other half of the choices still depend on the whole context.
    """
    import transformers

    torch.manual_seed(seed)
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    common = dict(
        TEXT_SHAPE_A,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=layer_types,
    )
    moe = dict(
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2
    )
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(**common, intermediate_size=128, **moe)
        model = transformers.Qwen3NextForCausalLM(config)
    elif family == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(**common, intermediate_size=128)
        model = transformers.Qwen3_5ForCausalLM(config)
    elif family == "qwen3_5_moe":
        config = transformers.Qwen3_5MoeTextConfig(**common, **moe)
        model = transformers.Qwen3_5MoeForCausalLM(config)
    elif family == "qwen3_5_vl":
        config = transformers.Qwen3_5Config(
            text_config=dict(common, intermediate_size=128, full_attention_interval=4),
            vision_config=VL_VISION,
            **VL_TOKENS,
        )
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    elif family == "qwen3_5_moe_vl":
        config = transformers.Qwen3_5MoeConfig(
            text_config=dict(common, **moe, full_attention_interval=4), vision_config=VL_VISION, **VL_TOKENS
        )
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        raise ValueError(f"unknown hybrid family {family!r}")
    _save_peaked(model, path, favour)
    if family in ("qwen3_5_vl", "qwen3_5_moe_vl"):
        _save_vl_processor(path)
    else:
        # SGLang's config classes read the layer pattern from full_attention_interval.
        _edit_json(os.path.join(path, "config.json"), full_attention_interval=4)
    return path

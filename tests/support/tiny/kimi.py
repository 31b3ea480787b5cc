"""Kimi-K2.5 (`make_kimi_k25_target`): a DeepSeek-V3 target wrapped as Kimi-K2.5's multimodal
checkpoint, without vision weights."""

from __future__ import annotations

import json
import os

from tests.support.tiny.converted import _copy_all_but_weights
from tests.support.tiny.qwen3 import TEXT_SHAPE_A
from tests.support.tiny.vl import VL_TOKENS

# Kimi-K2.5's vision tower and projector fields (SGLang's `KimiK25VisionConfig`), at a tiny size.
KIMI_K25_VISION = dict(
    patch_size=4, init_pos_emb_height=4, init_pos_emb_width=4, num_attention_heads=2, num_hidden_layers=1,
    hidden_size=32, vt_hidden_size=32, intermediate_size=64, mm_hidden_size=32,
    text_hidden_size=TEXT_SHAPE_A["hidden_size"],
)  # fmt: skip


def make_kimi_k25_target(path: str, source: str) -> str:
    """A tiny Kimi-K2.5 (`KimiK25ForConditionalGeneration`) at `path` around the DeepSeek-V3 target
    at `source`: its config as `text_config` beside a vision config, its weights under
    `language_model.`, as Kimi-K2.5's checkpoints name them. The checkpoint has no vision weights,
    so it serves text requests only (--enable-multimodal false)."""
    from safetensors.torch import load_file, save_file

    os.makedirs(path)
    _copy_all_but_weights(source, path)
    file = os.path.join(path, "config.json")
    with open(file) as f:
        text = json.load(f)
    with open(file, "w") as f:
        json.dump(
            {
                "model_type": "kimi_k25",
                "architectures": ["KimiK25ForConditionalGeneration"],
                "text_config": text,
                "vision_config": KIMI_K25_VISION,
                "media_placeholder_token_id": VL_TOKENS["image_token_id"],
                "pad_token_id": text["pad_token_id"],
                "torch_dtype": "float32",
            },
            f,
            indent=2,
        )
    weights = load_file(os.path.join(source, "model.safetensors"))
    weights = {f"language_model.{name}": tensor for name, tensor in weights.items()}
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path

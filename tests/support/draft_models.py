"""Tiny in-memory drafts for the op, fused-forward and draft-step tests: float32, with non-trivial norm
weights and biases."""

from __future__ import annotations

import torch

from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.model import DFlashDraftModel

# name -> (hidden, K captured layers, draft layers, heads, kv heads, head_dim)
SHAPES = {
    "qwen3-8b": (4096, 5, 5, 32, 8, 128),
    "small": (256, 3, 2, 4, 2, 64),
    # The GPU tests' small draft: head_dim 128, so FlashInfer's attention module is the one the
    # real drafts (and the GPU run's precompiled kernels, tests/gpu_kit/aot.py) use.
    "small-hd128": (512, 3, 2, 4, 2, 128),
}


def make_config(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    bias: bool = False,
    rope: dict = None,
    sliding_window: int = None,
) -> DFlashDraftConfig:
    """`sliding_window`: every layer a (causal) sliding one of that window."""
    raw = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 2 * hidden,
        "rms_norm_eps": 1e-6,
        "attention_bias": bias,
        "block_size": 16,
        "mask_token_id": 1,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
    }
    if rope is not None:
        raw["rope_scaling"] = rope
    if sliding_window is not None:
        raw.update(layer_types=["sliding_attention"] * layers, sliding_window=sliding_window)
    return DFlashDraftConfig.from_dict(raw)


def make_model(
    shape: str = "small",
    *,
    bias: bool = False,
    rope: dict = None,
    seed: int = 0,
    device="cpu",
    sliding_window: int = None,
) -> DFlashDraftModel:
    """A float32 draft with non-trivial norm weights and biases (so folding them matters)."""
    hidden, k, layers, heads, kv_heads, head_dim = SHAPES[shape]
    torch.manual_seed(seed)
    with torch.device(device):
        model = DFlashDraftModel(
            make_config(
                hidden, layers, heads, kv_heads, head_dim, bias=bias, rope=rope, sliding_window=sliding_window
            ),
            k,
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval().requires_grad_(False)

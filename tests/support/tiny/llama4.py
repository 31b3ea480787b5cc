"""Llama-4's text model (`make_family_target(family="llama4")`): its dense shape, the q/k row
order SGLang's NeoX RoPE reads (`_permute_llama4_qk`) and its oracle (`llama4_interleaved`)."""

from __future__ import annotations

import json
import os

import torch

# Llama-4's text class as SGLang builds it alone: Llama's loader, which reads no fused experts, so
# every layer dense (SGLang's `interleave_moe_layer_step` 0 with no experts, transformers' empty
# `moe_layers`).
LLAMA4_DENSE = dict(
    intermediate_size_mlp=128, moe_layers=[], interleave_moe_layer_step=0, num_local_experts=0
)


def _llama4_qk_order(head_dim: int, to_neox: bool) -> torch.Tensor:
    """The row order, within one head, that takes q/k projections between transformers' Llama-4
    RoPE (interleaved pairs: dims 2i and 2i+1 rotate together) and NeoX RoPE (dims i and
    i + d/2), which SGLang's Llama-4 layers apply. For d = 8, to NeoX: [0, 2, 4, 6, 1, 3, 5, 7];
    back: [0, 4, 1, 5, 2, 6, 3, 7]."""
    neox = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return neox if to_neox else torch.argsort(neox)


def _permute_llama4_qk(path: str, *, to_neox: bool) -> None:
    """Reorder the q/k projection rows of the Llama-4 checkpoint at `path`, head by head."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        head_dim = json.load(f)["head_dim"]
    order = _llama4_qk_order(head_dim, to_neox)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    for name, weight in state.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # [heads * d, H]
            heads = weight.reshape(-1, head_dim, weight.shape[-1])
            state[name] = heads[:, order].reshape(weight.shape).contiguous()
    save_file(state, file, metadata={"format": "pt"})


def llama4_interleaved(path: str):
    """Transformers' Llama-4 on the target at `path` with its q/k rows put back in transformers'
    order: the reference for SGLang's `Llama4ForCausalLM` on that checkpoint."""
    import shutil
    import tempfile

    import transformers

    with tempfile.TemporaryDirectory() as copy:
        for name in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(path, name), copy)
        _permute_llama4_qk(copy, to_neox=False)
        model = transformers.Llama4ForCausalLM.from_pretrained(copy, dtype=torch.float32)
    return model.eval()

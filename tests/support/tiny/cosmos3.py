"""Cosmos 3 (`make_cosmos3_target`): a Qwen3-VL target's weights in Cosmos 3's checkpoint layout."""

from __future__ import annotations

import os

import torch

from tests.support.tiny.converted import _copy_all_but_weights
from tests.support.tiny.qwen3 import _edit_json

# Cosmos 3's checkpoint layout: the language model under transformer/ and the vision tower under
# vision_encoder/, in names SGLang's `Cosmos3ForConditionalGeneration.hf_to_sglang_mapper` maps
# back to Qwen3-VL's (the text layers without a prefix, diffusers-style attention names).
COSMOS3_ATTENTION = {
    "q_proj": "to_q",
    "k_proj": "to_k",
    "v_proj": "to_v",
    "o_proj": "to_out",
    "q_norm": "norm_q",
    "k_norm": "norm_k",
}


def make_cosmos3_target(path: str, source: str) -> str:
    """A tiny Cosmos 3 (`Cosmos3ForConditionalGeneration`) at `path` with the weights of the
    Qwen3-VL target at `source`, in Cosmos 3's layout, plus two tensors of its generation tower,
    which SGLang drops when it loads the checkpoint."""
    from safetensors.torch import load_file, save_file

    os.makedirs(path)
    _copy_all_but_weights(source, path)
    _edit_json(
        os.path.join(path, "config.json"),
        model_type="cosmos3_omni",
        architectures=["Cosmos3ForConditionalGeneration"],
    )
    text, vision = {}, {}
    for name, tensor in load_file(os.path.join(source, "model.safetensors")).items():
        if name.startswith("model.visual."):
            vision[name[len("model.visual.") :]] = tensor
            continue
        name = name.removeprefix("model.language_model.")
        for hf, cosmos in COSMOS3_ATTENTION.items():
            name = name.replace(f".self_attn.{hf}.", f".self_attn.{cosmos}.")
        text[name] = tensor
    width = text["embed_tokens.weight"].shape[1]
    text["proj_in.weight"] = torch.zeros(width, width)  # the generation tower's
    text["layers.0.self_attn.add_q_proj.weight"] = torch.zeros(width, width)
    for folder, tensors in (("transformer", text), ("vision_encoder", vision)):
        os.makedirs(os.path.join(path, folder))
        save_file(tensors, os.path.join(path, folder, "model.safetensors"), metadata={"format": "pt"})
    return path

"""InternS2-Mobius (`make_interns2_mobius_target`): a Qwen3.5-MoE multimodal target whose layers
share banks of experts, written as Mobius's checkpoints are."""

from __future__ import annotations

import json
import os

import torch

from tests.support.tiny.converted import TRANSFORMERS_COPY, _copy_all_but_weights
from tests.support.tiny.hybrid import make_hybrid_target
from tests.support.tiny.qwen3 import _edit_json

# InternS2-Mobius: Qwen3.5-MoE's layers whose routed experts live in `num_blocks` banks of the
# model, layer i using bank i % num_blocks, in fused tensors (gate rows first).
MOBIUS_BLOCKS = 2


def make_interns2_mobius_target(path: str, *, seed: int = 0, favour: float = 0.0) -> str:
    """A tiny InternS2-Mobius (`InternS2MobiusForConditionalGeneration`) at `path`, from a
    Qwen3.5-MoE multimodal checkpoint (`make_hybrid_target`, kept in `path`/transformers for the
    oracle) whose layers i and i + 2 share their experts and router, written as Mobius's
    checkpoints are: one fused bank per block, the vision tower kept."""
    from safetensors.torch import load_file, save_file

    hf = os.path.join(path, TRANSFORMERS_COPY)
    make_hybrid_target(hf, family="qwen3_5_moe_vl", seed=seed, favour=favour)
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    text, vision = config["text_config"], config["vision_config"]
    file = os.path.join(hf, "model.safetensors")
    state = load_file(file)
    prefix = "model.language_model."

    def routed(name: str) -> bool:  # a layer's router or routed expert (per-expert names)
        return name.startswith(prefix + "layers.") and (".mlp.experts." in name or ".mlp.gate." in name)

    # Share the banks in the source checkpoint too: layer i's routed experts become layer
    # (i % blocks)'s. Per-expert names, as transformers saves Qwen3.5-MoE.
    for name in filter(routed, list(state)):
        i, rest = name[len(prefix + "layers.") :].split(".", 1)
        state[name] = state[f"{prefix}layers.{int(i) % MOBIUS_BLOCKS}.{rest}"].clone()
    save_file(state, file, metadata={"format": "pt"})
    experts = text["num_experts"]
    mobius = {}
    for name, tensor in state.items():
        if not routed(name):
            mobius[name] = tensor
            continue
        i = int(name[len(prefix + "layers.") :].split(".", 1)[0])
        if i >= MOBIUS_BLOCKS:  # the bank was written with layer i % blocks
            continue
        bank = f"{prefix}meta_mlp.{i}"
        if ".mlp.gate." in name:
            mobius[f"{bank}.gate.weight"] = tensor
        elif name.endswith(".experts.0.gate_proj.weight"):  # the whole bank, once
            layer = f"{prefix}layers.{i}.mlp.experts"
            gate_up = [
                torch.cat([state[f"{layer}.{e}.{p}_proj.weight"] for p in ("gate", "up")])
                for e in range(experts)
            ]
            mobius[f"{bank}.experts.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H]
            mobius[f"{bank}.experts.down_proj"] = torch.stack(
                [state[f"{layer}.{e}.down_proj.weight"] for e in range(experts)]
            )  # [E, H, I]
    save_file(mobius, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _copy_all_but_weights(hf, path)
    text.update(model_type="interns2_mobius_text", num_blocks=MOBIUS_BLOCKS)
    _edit_json(
        os.path.join(path, "config.json"),
        model_type="interns2_mobius",
        architectures=["InternS2MobiusForConditionalGeneration"],
        text_config=text,
        # SGLang's Mobius vision tower builds a merger per deepstack index; Qwen3.5's has none.
        vision_config=dict(vision, deepstack_visual_indexes=[]),
    )
    return path

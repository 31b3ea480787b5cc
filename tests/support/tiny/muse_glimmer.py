"""Muse Glimmer's text-only checkpoint (`make_family_target(family="muse_glimmer_lm")`): transformers'
multimodal checkpoint rewritten in SGLang's `MuseGlimmerForCausalLM` names and config."""

from __future__ import annotations

import json
import os

# Transformers' Muse Glimmer names -> SGLang's MuseGlimmerForCausalLM names (its own checkpoints'
# names; only the multimodal class reads transformers'), first match only.
MUSE_GLIMMER_NAMES = (
    ("post_attention_layernorm", "post_attn_norm"),
    ("pre_feedforward_layernorm", "post_attention_layernorm"),
    ("post_feedforward_layernorm", "post_ffn_norm"),
    ("self_attn.gate_proj", "self_attn.output_gate_proj"),
)


def _as_muse_glimmer_causal_lm(path: str) -> None:
    """Rewrite transformers' Muse Glimmer checkpoint at `path` as a text-only MuseGlimmerForCausalLM
    checkpoint, the same weights: a flat config in SGLang's fields and SGLang's weight names,
    without the vision tower."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        nested = json.load(f)
    text = nested["text_config"]
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "post_norm_eps",
            "sliding_window", "layer_types", "output_multiplier", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id")  # fmt: skip
    flat = {k: text[k] for k in keep}
    flat.update(
        architectures=["MuseGlimmerForCausalLM"],
        model_type="muse_glimmer",
        torch_dtype="float32",
        hidden_act=text["hidden_activation"],
        rope_theta=text["rope_parameters"]["rope_theta"],
        no_rope_layers=[1 if theta else 0 for theta in text["layer_rope_theta"]],
        # transformers scales queries by qk_scale_factor / sqrt(head_dim), SGLang by it / head_dim
        qk_scale_factor=text["qk_scale_factor"] * text["head_dim"] ** 0.5,
        rope_is_neox_style=True,  # transformers rotates the two halves of each head
        output_soft_cap_temp=text["final_logit_softcapping"],
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(flat, f, indent=2)
    file = os.path.join(path, "model.safetensors")
    renamed = {}
    for name, tensor in load_file(file).items():
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
            name = next((name.replace(a, b) for a, b in MUSE_GLIMMER_NAMES if a in name), name)
            renamed[name] = tensor
        elif name == "lm_head.weight":
            renamed[name] = tensor
    save_file(renamed, file)

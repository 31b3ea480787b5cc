"""MiMo-V2-Flash (`make_family_target(family="mimo_v2")`): its layer pattern, the config the
published checkpoints ship (`_as_mimo_v2_published`) and its oracle (`mimo_v2_transformers`)."""

from __future__ import annotations

import json
import os

import torch

MIMO_V2_LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
# The configuration class MiMo-V2-Flash checkpoints ship (`auto_map`, loaded with
# --trust-remote-code): flat fields, which SGLang's model reads.
MIMO_V2_CONFIG_CODE = """from transformers import PretrainedConfig


class MiMoV2FlashConfig(PretrainedConfig):
    model_type = "mimo_v2_flash"
"""
MIMO_V2_TRANSFORMERS_CONFIG = "transformers-config.json"


def _as_mimo_v2_published(path: str) -> None:
    """Give transformers' MiMo-V2-Flash checkpoint at `path` the configuration the published
    checkpoints ship: their own config class (`--trust-remote-code`) with flat fields. The weight
    names are already theirs (transformers saves per-expert weights and `attention_sink_bias`).
    Transformers' own config stays beside it (`MIMO_V2_TRANSFORMERS_CONFIG`), for the oracle."""
    file = os.path.join(path, "config.json")
    os.replace(file, os.path.join(path, MIMO_V2_TRANSFORMERS_CONFIG))
    with open(os.path.join(path, MIMO_V2_TRANSFORMERS_CONFIG)) as f:
        hf = json.load(f)
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "v_head_dim", "max_position_embeddings", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "attention_bias",
            "attention_value_scale", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")  # fmt: skip
    rope = hf["rope_parameters"]
    assert (
        rope["full_attention"]["partial_rotary_factor"] == rope["sliding_attention"]["partial_rotary_factor"]
    )
    flat = {k: hf[k] for k in keep}
    flat.update(
        architectures=hf["architectures"],
        model_type="mimo_v2_flash",
        auto_map={"AutoConfig": "configuration_mimo_v2_flash.MiMoV2FlashConfig"},
        torch_dtype="float32",
        layernorm_epsilon=hf["rms_norm_eps"],
        hybrid_layer_pattern=[int(t == "sliding_attention") for t in hf["layer_types"]],
        moe_layer_freq=[int(t == "sparse") for t in hf["mlp_layer_types"]],
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        # Transformers' sliding layers have twice the KV heads, and sinks; the same head dims.
        swa_num_attention_heads=hf["num_attention_heads"],
        swa_num_key_value_heads=2 * hf["num_key_value_heads"],
        swa_head_dim=hf["head_dim"],
        swa_v_head_dim=hf["v_head_dim"],
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
        # SGLang's window counts the keys before the query (a query sees sliding_window_size + 1
        # keys); transformers' `sliding_window` counts the query's own. With sliding_window_size
        # 8 here the plain engine differs from transformers on 4 of 4 prompts.
        sliding_window=hf["sliding_window"],
        sliding_window_size=hf["sliding_window"] - 1,
        rope_theta=rope["full_attention"]["rope_theta"],
        swa_rope_theta=rope["sliding_attention"]["rope_theta"],
        partial_rotary_factor=rope["full_attention"]["partial_rotary_factor"],
    )
    with open(file, "w") as f:
        json.dump(flat, f, indent=2)
    with open(os.path.join(path, "configuration_mimo_v2_flash.py"), "w") as f:
        f.write(MIMO_V2_CONFIG_CODE)


def mimo_v2_transformers(path: str):
    """Transformers' MiMo-V2-Flash over the checkpoint `_as_mimo_v2_published` wrote: the same
    weights, with transformers' own config."""
    import transformers

    config = transformers.MiMoV2FlashConfig.from_json_file(os.path.join(path, MIMO_V2_TRANSFORMERS_CONFIG))
    return transformers.MiMoV2FlashForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32
    ).eval()

"""Mistral Large 3 in Mistral's native format (`make_mistral_large_3_target`), built by
transformers' Mistral-4 class."""

from __future__ import annotations

import json
import os

import torch

from tests.support.tiny.converted import TRANSFORMERS_COPY
from tests.support.tiny.families import MLA_SHAPE, YARN
from tests.support.tiny.qwen3 import TEXT_SHAPE_A, _save_peaked
from tests.support.tiny.tokenizer import EOS_ID, make_tokenizer

# Mistral Large 3 as published: a Mistral-native checkpoint (params.json, consolidated.safetensors)
# that SGLang recognises by its folder's name and serves with `MistralLarge3ForCausalLM`, DeepSeek-V3's
# MLA and MoE with softmax routing and queries scaled by position (`llama_4_scaling`).
MISTRAL_LARGE_3_SCALING = {"original_max_position_embeddings": 16, "beta": 0.1}
# Transformers' Mistral-4 names (the oracle's class: the same layers) -> Mistral-native ones.
MISTRAL_NATIVE_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_a_proj": "attention.wq_a",
    "self_attn.q_a_layernorm": "attention.q_a_norm",
    "self_attn.q_b_proj": "attention.wq_b",
    "self_attn.kv_a_proj_with_mqa": "attention.wkv_a_with_mqa",
    "self_attn.kv_a_layernorm": "attention.kv_a_norm",
    "self_attn.kv_b_proj": "attention.wkv_b",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate.weight": "gate.weight",
    "mlp.shared_experts.gate_proj": "shared_experts.w1",
    "mlp.shared_experts.down_proj": "shared_experts.w2",
    "mlp.shared_experts.up_proj": "shared_experts.w3",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
}


def make_mistral_large_3_target(path: str, *, seed: int = 0, favour: float = 0.0) -> str:
    """A tiny Mistral Large 3 in Mistral's native format at `path` (whose name must contain
    "mistral-large-3", as SGLang recognises the format by name), built by transformers'
    Mistral-4 class (MLA, a dense first layer, then softmax-routed experts and a shared one),
    whose checkpoint is also kept in `path`/transformers for the oracle (`transformers_copy`)."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    mla = dict(TEXT_SHAPE_A, intermediate_size=128, num_key_value_heads=TEXT_SHAPE_A["num_attention_heads"])
    mla.update(MLA_SHAPE, pad_token_id=EOS_ID, max_position_embeddings=256)  # the YaRN factor x 16
    del mla["head_dim"]
    # YaRN, as published (transformers' Mistral-4 reads the rotary's width only on that path), with
    # the period of the query scaling as its original length.
    period = MISTRAL_LARGE_3_SCALING["original_max_position_embeddings"]
    rope = dict(YARN, factor=16.0, original_max_position_embeddings=period)
    rope["llama_4_scaling_beta"] = MISTRAL_LARGE_3_SCALING["beta"]
    config = transformers.Mistral4Config(
        **mla, q_lora_rank=48, routed_scaling_factor=1.5, rope_parameters=rope
    )
    hf = os.path.join(path, TRANSFORMERS_COPY)
    _save_peaked(transformers.Mistral4ForCausalLM(config), hf, favour)
    native = {}
    for name, tensor in load_file(os.path.join(hf, "model.safetensors")).items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: each expert's w1 (gate), w3 (up)
            layer = name[len("model.") : -len(".mlp.experts.gate_up_proj")]
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                native[f"{layer}.experts.{e}.w1.weight"] = gate.contiguous()
                native[f"{layer}.experts.{e}.w3.weight"] = up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]: each expert's w2
            layer = name[len("model.") : -len(".mlp.experts.down_proj")]
            for e, down in enumerate(tensor):
                native[f"{layer}.experts.{e}.w2.weight"] = down.contiguous()
        elif name in MISTRAL_NATIVE_NAMES:
            native[MISTRAL_NATIVE_NAMES[name]] = tensor
        else:  # model.layers.{i}.{module}.weight -> layers.{i}.{native module}.weight
            _, _, i, rest = name.split(".", 3)
            module = next(m for m in MISTRAL_NATIVE_NAMES if rest == m or rest.startswith(m + "."))
            native[f"layers.{i}.{MISTRAL_NATIVE_NAMES[module]}{rest[len(module) :]}"] = tensor
    save_file(native, os.path.join(path, "consolidated.safetensors"), metadata={"format": "pt"})
    # Mistral's own config names (SGLang maps them back: `mistral_utils.adapt_config_dict`).
    params = {
        "dim": mla["hidden_size"],
        "n_layers": mla["num_hidden_layers"],
        "n_heads": mla["num_attention_heads"],
        "n_kv_heads": mla["num_key_value_heads"],
        "hidden_dim": mla["intermediate_size"],
        "norm_eps": config.rms_norm_eps,
        "vocab_size": mla["vocab_size"],
        "max_position_embeddings": mla["max_position_embeddings"],
        "rope_theta": rope["rope_theta"],
        "q_lora_rank": config.q_lora_rank,
        "tied_embeddings": False,
        **{k: MLA_SHAPE[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")},
        "moe": {
            "num_experts": MLA_SHAPE["n_routed_experts"],
            "num_experts_per_tok": MLA_SHAPE["num_experts_per_tok"],
            "expert_hidden_dim": MLA_SHAPE["moe_intermediate_size"],
            "num_shared_experts": 1,
            "first_k_dense_replace": MLA_SHAPE["first_k_dense_replace"],
            "route_every_n": 1,
            "routed_scale": config.routed_scaling_factor,
            "num_expert_groups": 1,
            "num_expert_groups_per_tok": 1,
        },
        "llama_4_scaling": MISTRAL_LARGE_3_SCALING,
        "yarn": {
            "factor": rope["factor"],
            "original_max_position_embeddings": period,
            "beta": 32.0,
            "alpha": 1.0,
        },
    }
    with open(os.path.join(path, "params.json"), "w") as f:
        json.dump(params, f, indent=2)
    make_tokenizer(path)
    return path

"""Targets of many SGLang families shaped like target "a" (`make_family_target`): Llama, TeleFLM,
Nanbeige, Ministral 3, Llama-4, Mellum, Qwen3-MoE, Gemma-4 (text, multimodal, unified), gpt-oss,
Qwen3-VL, Qwen3-VL-MoE, Laguna, DeepSeek-V3, GLM-4.7-Flash, MiMo-V2-Flash and Muse Glimmer; with
the MLA and YaRN shapes they share."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from tests.support.tiny.llama4 import LLAMA4_DENSE, _permute_llama4_qk
from tests.support.tiny.mimo import MIMO_V2_LAYERS, _as_mimo_v2_published
from tests.support.tiny.muse_glimmer import _as_muse_glimmer_causal_lm
from tests.support.tiny.nanbeige import NANBEIGE_LOOPS
from tests.support.tiny.qwen3 import TEXT_SHAPE_A, _edit_json, _save_peaked
from tests.support.tiny.teleflm import TELEFLM_MUP
from tests.support.tiny.tokenizer import EOS_ID
from tests.support.tiny.vl import VL_TOKENS, VL_VISION, _save_vl_processor, _transpose_fused_experts

# MLA targets: a compressed K/V latent of rank 32 plus a 16-dim RoPE key, shared by 4 heads whose
# queries and keys are 32 + 16 wide and values 32; the first layer dense, then 4 routed experts
# (2 per token) and a shared one.
MLA_SHAPE = dict(
    kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1,
)  # fmt: skip
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
)


# Ministral 3's RoPE as published (YaRN, and queries scaled by 1 + beta * log(1 + floor(pos / P))),
# with a period P of 16 so that the prompts cross it several times.
MINISTRAL3_ROPE = dict(YARN, factor=16.0, original_max_position_embeddings=16, llama_4_scaling_beta=0.1)


# Gemma-4's multimodal configs' end-of-image and end-of-audio ids: their defaults lie past the tiny
# vocab, and SGLang masks them out of the logits.
GEMMA4_NO_SPECIAL_TOKENS = {"eoi_token_id": None, "eoa_token_index": None}


def _gemma4_text(common: dict) -> dict:
    """Gemma-4's text config at target "a"'s shape: three sliding-window layers of window 8, then a
    full one with its own RoPE theta, one head_dim for every layer, no per-layer inputs."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    return dict(
        common,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=8,
        per_layer_config={},  # one head_dim for every layer
        hidden_size_per_layer_input=0,  # written out: SGLang's text config defaults to 256
        vocab_size_per_layer_input=TEXT_SHAPE_A["vocab_size"],
        rope_parameters={"sliding_attention": rope, "full_attention": dict(rope, rope_theta=1e6)},
    )


def make_family_target(
    path: str,
    *,
    family: str,
    seed: int = 0,
    favour: float = 0.0,
    mla: Optional[dict] = None,
    head_dim: Optional[int] = None,
) -> str:
    """A tiny target of another family, shaped like target "a" (hidden 64, 4 layers, vocab 384) so
    that it pairs with draft "a": "llama", "qwen3_moe", "gemma4" (Gemma4ForCausalLM: three
    sliding-window layers of window 8, then a full one), "gpt_oss" (sliding and full layers
    alternating, window 8, attention sinks, MoE), "qwen3_vl" (the Qwen3-VL wrapper with a one-block
    vision tower, served here for text), "laguna" (sliding and full layers, attention gates,
    partial RoPE, MoE), and two MLA targets (`MLA_SHAPE`): "deepseek_v3" (no query LoRA, YaRN RoPE)
    and "glm4_moe_lite" (GLM-4.7-Flash's class: query LoRA, plain RoPE), whose MLA_SHAPE entries
    `mla` replaces; `head_dim` replaces target "a"'s 16 for the families that take one. `favour`
    as in `make_hybrid_target`."""
    import transformers

    torch.manual_seed(seed)
    common = dict(TEXT_SHAPE_A, intermediate_size=128, pad_token_id=EOS_ID)
    if head_dim is not None:
        common["head_dim"] = head_dim
    extra: dict = {}  # config.json fields SGLang reads that transformers' config does not write
    if family in ("llama", "nanbeige", "teleflm"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
        if family == "teleflm":  # Llama's weights and config, with the muP fields TeleFLM reads
            extra = dict(TELEFLM_MUP, architectures=["TeleFLMForCausalLM"])
        if family == "nanbeige":  # Llama's layers run twice, with no norm between the runs
            # SGLang's NanbeigeConfig reads the flat rope_theta (default 50000) Nanbeige's configs write.
            extra = {
                "architectures": ["NanbeigeForCausalLM"],
                "model_type": "nanbeige",
                "rope_theta": 10000.0,
            }
            extra.update(NANBEIGE_LOOPS)
    elif family == "ministral3":  # Llama's layers; queries scaled by position, YaRN RoPE past 16
        # As published, max_position_embeddings is the YaRN factor times the original period.
        config = transformers.Ministral3Config(
            **dict(common, max_position_embeddings=256), rope_parameters=MINISTRAL3_ROPE
        )
        model = transformers.Ministral3ForCausalLM(config)
        # SGLang reads the scaling's period from the flat field, transformers from rope_parameters.
        extra = {"original_max_position_embeddings": MINISTRAL3_ROPE["original_max_position_embeddings"]}
    elif family == "llama4":  # dense layers (see LLAMA4_DENSE), every fourth without RoPE
        config = transformers.Llama4TextConfig(**common, **LLAMA4_DENSE, use_qk_norm=False, floor_scale=8)
        model = transformers.Llama4ForCausalLM(config)
    elif family == "mellum":  # Qwen3-MoE's layers: sliding and full (a theta each), dense then MoE
        config = transformers.MellumConfig(
            **common,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=8,
            mlp_layer_types=["dense"] + ["sparse"] * 3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        )
        model = transformers.MellumForCausalLM(config)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    elif family == "qwen2":  # biased q/k/v projections
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif family == "qwen2_moe":  # routed experts and a gated shared one on every layer
        config = transformers.Qwen2MoeConfig(
            **common, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True,
        )  # fmt: skip
        model = transformers.Qwen2MoeForCausalLM(config)
    elif family == "glm4_moe":  # GLM-4.5's layers: partial RoPE, a dense first layer, then grouped MoE
        config = transformers.Glm4MoeConfig(
            **common, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True,
        )  # fmt: skip
        model = transformers.Glm4MoeForCausalLM(config)
        with torch.no_grad():  # the routing bias (zero at init) takes part in the choice
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    elif family == "minimax_m2":  # q/k RMSNorm over all heads, half RoPE, sigmoid-routed MoE
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        config = transformers.MiniMaxM2Config(
            **common, num_local_experts=4, num_experts_per_tok=2, rope_parameters=rope
        )
        model = transformers.MiniMaxM2ForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.e_score_correction_bias.normal_(0.0, 0.1)
        # The fields SGLang reads, as MiniMax-M2's published config writes them.
        half = TEXT_SHAPE_A["head_dim"] // 2
        extra = dict(
            use_qk_norm=True, qk_norm_type="per_layer", rotary_dim=half, scoring_func="sigmoid",
            use_routing_bias=True,
        )  # fmt: skip
    elif family == "gemma3":  # sliding layers of window 8 and a full one (a theta each), sandwich norms
        config = transformers.Gemma3TextConfig(
            **dict(common, tie_word_embeddings=True), sliding_window=8, query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        )  # fmt: skip
        model = transformers.Gemma3ForCausalLM(config)
    elif family == "gemma4":
        config = transformers.Gemma4TextConfig(**_gemma4_text(common))
        model = transformers.Gemma4ForCausalLM(config)
        extra = {"swa_num_key_value_heads": TEXT_SHAPE_A["num_key_value_heads"]}  # SGLang's SWA pool reads it
    elif family == "gemma4_mm":  # Gemma-4's text model in its multimodal class, a one-layer vision tower
        vision = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=1,
            position_embedding_size=64,
        )  # fmt: skip
        config = transformers.Gemma4Config(
            text_config=dict(_gemma4_text(common), tie_word_embeddings=True),
            vision_config=vision,
            audio_config=None,
            **GEMMA4_NO_SPECIAL_TOKENS,
            tie_word_embeddings=True,
        )
        model = transformers.Gemma4ForConditionalGeneration(config)
    elif family == "gemma4_unified":  # Gemma-4's text model behind an encoder-free image embedder
        # Tied, as released: SGLang's class reads its head from the embedding.
        text = dict(_gemma4_text(common), tie_word_embeddings=True)
        vision = dict(
            patch_size=4, pooling_kernel_size=1, mm_embed_dim=64, mm_posemb_size=16, output_proj_dims=64
        )
        config = transformers.Gemma4UnifiedConfig(
            text_config=text,
            vision_config=vision,
            audio_config=None,
            **GEMMA4_NO_SPECIAL_TOKENS,
            tie_word_embeddings=True,
        )
        model = transformers.Gemma4UnifiedForConditionalGeneration(config)
        # SGLang reads the embedder's patch size (a property in transformers, not saved).
        extra = {"vision_config": dict(config.vision_config.to_dict(), model_patch_size=4)}
    elif family == "gpt_oss":
        config = transformers.GptOssConfig(
            **common,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
        model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)  # sinks about as large as the scores
    elif family == "qwen3_vl":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        config = transformers.Qwen3VLConfig(
            text_config=dict(common, rope_parameters=dict(rope, mrope_interleaved=True)),
            vision_config=dict(VL_VISION, deepstack_visual_indexes=[]),
            **VL_TOKENS,
        )
        model = transformers.Qwen3VLForConditionalGeneration(config)
    elif family == "qwen3_vl_moe":  # the same wrapper around Qwen3-MoE's layers
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        text = dict(
            common,
            rope_parameters=dict(rope, mrope_interleaved=True),
            moe_intermediate_size=16,  # fused expert tensors that are not square (see below)
            num_experts=4,
            num_experts_per_tok=2,
        )
        config = transformers.Qwen3VLMoeConfig(
            text_config=text, vision_config=dict(VL_VISION, deepstack_visual_indexes=[]), **VL_TOKENS
        )
        model = transformers.Qwen3VLMoeForConditionalGeneration(config)
    elif family == "laguna":  # sliding and full layers alternating, window 8, gated attention, MoE
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        config = transformers.LagunaConfig(
            **common,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            # Both factors written out, as in the released config: SGLang's config falls back to the
            # full layers' factor for sliding ones without it, transformers to 1.0.
            rope_parameters={
                "sliding_attention": dict(rope, partial_rotary_factor=1.0),
                "full_attention": dict(rope, rope_theta=1e6, partial_rotary_factor=0.5),
            },
        )
        model = transformers.LagunaForCausalLM(config)
    elif family in ("deepseek_v3", "glm4_moe_lite"):
        mla = dict(
            common, num_key_value_heads=TEXT_SHAPE_A["num_attention_heads"], **dict(MLA_SHAPE, **(mla or {}))
        )
        del mla["head_dim"]  # MLA's head dims are the ranks above
        if family == "deepseek_v3":  # no query LoRA, YaRN RoPE stretched past the prompts
            yarn = dict(YARN, factor=4.0, original_max_position_embeddings=32)
            config = transformers.DeepseekV3Config(**mla, q_lora_rank=None, rope_parameters=yarn)
            model = transformers.DeepseekV3ForCausalLM(config)
            # Read by SGLang and written in DeepSeek-V3's own configs; transformers' config lacks them.
            extra = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
        else:  # query LoRA, plain RoPE
            config = transformers.Glm4MoeLiteConfig(**mla, q_lora_rank=48)
            model = transformers.Glm4MoeLiteForCausalLM(config)
    elif family == "mimo_v2":  # full and sliding layers (twice the KV heads, sinks), a smaller V head, MoE
        rope = {"rope_type": "default", "partial_rotary_factor": 0.5}
        config = transformers.MiMoV2FlashConfig(
            **common,
            v_head_dim=8,
            sliding_window=8,
            layer_types=MIMO_V2_LAYERS,
            mlp_layer_types=["dense"] + ["sparse"] * 3,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            rope_parameters={
                "full_attention": dict(rope, rope_theta=1e6),
                "sliding_attention": dict(rope, rope_theta=1e4),
            },
        )
        model = transformers.MiMoV2FlashForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                if layer.self_attn.sinks is not None:
                    layer.self_attn.sinks.normal_(0.0, 1.0)
    elif family in ("muse_glimmer", "muse_glimmer_lm"):  # built by transformers' multimodal class
        text = dict(
            common,
            hidden_activation="silu",
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            sliding_window=8,
            layer_rope_theta=[10000.0] * 3 + [0.0],  # the full layer without RoPE, as published
        )
        vision = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
            pos_emb_height=4, pos_emb_width=4, layer_types=["full_attention"],
        )  # fmt: skip
        tokens = {k: VL_TOKENS[k] for k in ("image_token_id", "video_token_id")}
        config = transformers.MuseGlimmerConfig(
            text_config=text, vision_config=vision, out_hidden_size=128, projector_hidden_size=64, **tokens
        )
        model = transformers.MuseGlimmerForConditionalGeneration(config)
    else:
        raise ValueError(f"unknown target family {family!r}")
    # Transformers' Muse Glimmer embeds token 0 in place of an image or video placeholder id even
    # without an image; SGLang's embeds the id itself. The untrained target can generate those
    # ids, so their rows copy row 0, and the two agree.
    placeholders = (
        [VL_TOKENS[k] for k in ("image_token_id", "video_token_id")]
        if family.startswith("muse_glimmer")
        else []
    )
    _save_peaked(model, path, favour, rows_like_0=placeholders)
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        _save_vl_processor(path)
    if family == "muse_glimmer":  # the image processor's settings SGLang reads at start-up
        with open(os.path.join(path, "processor_config.json"), "w") as f:
            json.dump({"image_processor": {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2}}, f)
    if family == "muse_glimmer_lm":
        _as_muse_glimmer_causal_lm(path)
    if family == "mimo_v2":
        _as_mimo_v2_published(path)
    if family == "llama4":
        _permute_llama4_qk(path, to_neox=True)
    if family == "qwen3_vl_moe":
        _transpose_fused_experts(path)
    if extra:
        _edit_json(os.path.join(path, "config.json"), **extra)
    return path

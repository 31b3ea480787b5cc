"""Tiny seeded random-weight models for tests: a Qwen3 target (HF format, with a small BPE
tokenizer) and a DFlash draft in the z-lab checkpoint format."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

EOS_ID, MASK_ID = 0, 1
CHAT_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


def make_tokenizer(path: str, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # A fixed corpus that exists on every machine: the json package's sources.
    corpus_dir = os.path.join(os.path.dirname(os.__file__), "json")
    files = sorted(os.path.join(corpus_dir, f) for f in os.listdir(corpus_dir) if f.endswith(".py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|MASK|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", mask_token="<|MASK|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def make_target(
    path: str,
    *,
    seed: int = 0,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tokenizer: bool = True,
    architecture: str = "Qwen3ForCausalLM",
    lm_head_std: float = 0.15,
) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
    )
    model = Qwen3ForCausalLM(config)
    # Larger-than-default init gives peaked next-token distributions, so greedy argmax is far
    # from ties and deterministic across batch shapes.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
        model.lm_head.weight.mul_(lm_head_std / 0.15)
    model.save_pretrained(path)
    if architecture != "Qwen3ForCausalLM":
        _edit_json(os.path.join(path, "config.json"), architectures=[architecture])
    if tokenizer:
        make_tokenizer(path, vocab_size)
    return path


FAVOURED_ID = 7


# The text shape of target "a" (see TARGETS), which the other tiny families share so that they
# pair with draft "a".
TEXT_SHAPE_A = dict(
    vocab_size=384,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    eos_token_id=EOS_ID,
    bos_token_id=EOS_ID,
)


# The multimodal wrappers' one-block vision tower and their special token ids (the top of the vocab).
VL_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
VL_TOKENS = dict(image_token_id=380, video_token_id=381, vision_start_token_id=382, vision_end_token_id=383)


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


# TeleFLM's muP fields: SGLang's model multiplies the embeddings by `input_mult` in its forward
# and the logits by `output_mult / mup_scale_factor` (`teleflm_folded` folds both into Llama).
TELEFLM_MUP = {"use_mup": True, "input_mult": 4.0, "output_mult": 3.0, "mup_scale_factor": 2.0}
# Ministral 3's RoPE as published (YaRN, and queries scaled by 1 + beta * log(1 + floor(pos / P))),
# with a period P of 16 so that the prompts cross it several times.
MINISTRAL3_ROPE = dict(YARN, factor=16.0, original_max_position_embeddings=16, llama_4_scaling_beta=0.1)


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


def _transpose_fused_experts(path: str) -> None:
    """Write the fused expert tensors of the Qwen3-VL-MoE checkpoint at `path` as published:
    gate_up_proj [E, H, 2I] and down_proj [E, I, H], which SGLang's loader reads (it transposes
    them). Transformers saves its own layout, [E, 2I, H] and [E, H, I], and reads either, by shape:
    so 2I must differ from H."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    for name, weight in state.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            assert weight.shape[1] != weight.shape[2], name
            state[name] = weight.transpose(1, 2).contiguous()
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


# Targets written in another checkpoint format keep the same weights in transformers' format in
# this sub-folder, for their oracle (`transformers_copy`).
TRANSFORMERS_COPY = "transformers"


def transformers_copy(path: str, cls: str):
    """Transformers' class `cls` on the copy of the weights kept in `path`/transformers."""
    import transformers

    model = getattr(transformers, cls).from_pretrained(
        os.path.join(path, TRANSFORMERS_COPY), dtype=torch.float32
    )
    return model.eval()


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


def teleflm_folded(path: str):
    """Transformers' Llama on the TeleFLM target at `path`, with the muP multipliers folded into
    its embedding and LM head: the reference for TeleFLM's forward."""
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", *TELEFLM_MUP)}
    model = transformers.LlamaForCausalLM.from_pretrained(
        path, config=transformers.LlamaConfig(**fields), dtype=torch.float32
    )
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(raw["input_mult"])
        model.lm_head.weight.mul_(raw["output_mult"] / raw["mup_scale_factor"])
    return model.eval()


# A Nanbeige loop model runs its layers `num_loops` times; without the norm between the runs its
# forward is that of a Llama with the layers repeated (`nanbeige_unrolled`).
NANBEIGE_LOOPS = {"num_loops": 2, "skip_loop_final_norm": True}


def nanbeige_unrolled(path: str):
    """Transformers' Llama with the layers of the Nanbeige target at `path` repeated
    `num_loops` times: the reference for its forward."""
    import transformers
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    layers, loops = raw["num_hidden_layers"], raw["num_loops"]
    skip = ("architectures", "model_type", "rope_theta", *NANBEIGE_LOOPS)
    fields = {k: v for k, v in raw.items() if k not in skip}
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**dict(fields, num_hidden_layers=layers * loops))
    )
    state = {}
    for name, tensor in load_file(os.path.join(path, "model.safetensors")).items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            for loop in range(loops):
                state[f"model.layers.{loop * layers + int(i)}.{rest}"] = tensor
        else:
            state[name] = tensor
    model.load_state_dict(state)
    return model.float().eval()


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


def _favour(embedding: torch.Tensor, head: torch.Tensor, favour: float) -> None:
    """With `favour` > 0, in place: every embedding row [V, H] carries 1.0 in dimension 0, and the
    LM head [V, H] reads it into token FAVOURED_ID's logit (see `make_hybrid_target`)."""
    if favour:
        embedding[:, 0] = 1.0
        head[FAVOURED_ID, 0] = favour


def _save_peaked(model, path: str, favour: float, rows_like_0: Sequence[int] = ()) -> None:
    """Larger-than-default init (peaked next-token distributions, far from greedy ties); with
    `favour`, the favoured token (see `make_hybrid_target`); the embedding rows `rows_like_0`
    equal to row 0; then the weights and a tokenizer."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
        _favour(model.get_input_embeddings().weight, model.lm_head.weight, favour)
        table = model.get_input_embeddings().weight
        for row in rows_like_0:
            table[row] = table[0]
    model.save_pretrained(path)
    make_tokenizer(path)


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


def _copy_all_but_weights(source: str, path: str) -> None:
    """Copy the config, tokenizer and processor files of the checkpoint at `source` into `path`."""
    import shutil

    for name in os.listdir(source):
        if os.path.isfile(os.path.join(source, name)) and not name.endswith(".safetensors"):
            shutil.copy(os.path.join(source, name), path)


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


def _save_vl_processor(path: str) -> None:
    """The image and video processors SGLang loads for a multimodal checkpoint."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    sizes = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(**sizes),
        video_processor=transformers.Qwen3VLVideoProcessor(**sizes),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    ).save_pretrained(path)


def draft_config_dict(
    *,
    hidden_size: int = 64,
    num_layers: int = 1,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    block_size: int = 8,
    target_layer_ids: Optional[list[int]] = None,
    num_target_layers: int = 4,
    mask_token_id: int = MASK_ID,
    vocab_size: int = 384,
) -> dict:
    dflash = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = target_layer_ids
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "layer_types": ["full_attention"] * num_layers,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": dflash,
    }


def make_draft(path: str, *, seed: int = 1, prefix: str = "", **config_kwargs) -> str:
    """A random draft in the z-lab format; `prefix="model."` exercises the prefixed names."""
    from sglang_dflash.checkpoint.config import DFlashDraftConfig
    from sglang_dflash.draft.model import DFlashDraftModel

    raw = draft_config_dict(**config_kwargs)
    config = DFlashDraftConfig.from_dict(raw)
    num_features = len(config.resolve_target_layer_ids(raw["num_target_layers"]))
    torch.manual_seed(seed)
    model = DFlashDraftModel(config, num_features)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path, raw)
    if prefix:
        from safetensors.torch import load_file, save_file

        file = os.path.join(path, "model.safetensors")
        save_file({prefix + k: v for k, v in load_file(file).items()}, file)
    return path


def add_selector(
    path: str,
    *,
    rank: int = 4,
    top_k: int = 4,
    scale: float = 0.1,
    seed: int = 2,
    architecture="DFlash2DraftModel",
) -> str:
    """Make the draft at `path` a DFlash2 draft: its class, `selector_rank` / `selector_top_k`,
    and random selector weights whose pair scores are `scale`-sized beside the unary logits."""
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = [architecture]
    config["dflash_config"].update(selector_rank=rank, selector_top_k=top_k)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    gen = torch.Generator().manual_seed(seed)
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["candidate_selector.predecessor_codebook"] = scale * torch.randn(vocab, rank, generator=gen)
    tensors["candidate_selector.successor_codebook"] = scale * torch.randn(vocab, rank, generator=gen)
    tensors["candidate_selector.hidden_projection.weight"] = (
        torch.randn(rank, hidden, generator=gen) / hidden**0.5
    )
    save_file(tensors, file)
    return path


def quantize_fp8(path: str, block: tuple[int, int] | None = (16, 24)) -> dict:
    """Rewrite draft `path` as an fp8 checkpoint, as SGLang's Fp8Config loads one: every 2-D
    projection weight (`*proj.weight`, `fc.weight`) in float8_e4m3fn with its scales (per block
    `weight_scale_inv`, or one `weight_scale`), and `quantization_config` in config.json. Returns
    the weights as dequantised from the fp8 ones, by the element rule (the reference)."""
    import math

    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors, reference = load_file(file), {}
    for name in [n for n in tensors if n.endswith(("proj.weight", "fc.weight"))]:
        w = tensors.pop(name).float()  # [N, K]
        n, k = w.shape
        bn, bk = block or (n, k)
        grid = torch.zeros(math.ceil(n / bn), math.ceil(k / bk))
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                amax = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max()
                grid[i, j] = amax.clamp_min(1e-8) / 448.0  # e4m3's largest value
        full = torch.stack([torch.stack([grid[r // bn, c // bk] for c in range(k)]) for r in range(n)])
        fp8 = (w / full).to(torch.float8_e4m3fn)
        tensors[name] = fp8
        scale_name = name[: -len("weight")] + ("weight_scale_inv" if block else "weight_scale")
        tensors[scale_name] = grid if block else grid.reshape(())
        reference[name] = fp8.float() * full
    save_file(tensors, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if block:
        quant["weight_block_size"] = list(block)
    config["quantization_config"] = quant
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return reference


def quantize_nvfp4(path: str, algo: str = "W4A16_NVFP4") -> None:
    """Rewrite draft `path` as a ModelOpt NVFP4 checkpoint: every 2-D projection weight
    (`*proj.weight`, `fc.weight`) [N, K] as e2m1 codes packed two a byte, the low nibble first
    [N, K/2], with fp8 scales per 16 elements (`weight_scale`) and a global one
    (`weight_scale_2`), as ModelOpt scales them (each group's largest value at 6, the largest
    group scale at 448); and `quantization_config` in config.json."""
    from safetensors.torch import load_file, save_file

    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("proj.weight", "fc.weight"))]:
        w = tensors.pop(name).float()  # [N, K]
        global_scale = w.abs().max() / (6.0 * 448.0)
        groups = w.view(w.shape[0], -1, 16)  # [N, K/16, 16]
        scale = (groups.abs().amax(-1) / 6.0 / global_scale).to(torch.float8_e4m3fn)  # [N, K/16]
        x = groups / (scale.float() * global_scale).clamp_min(1e-12)[..., None]
        code = (x.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (x < 0)  # nearest, sign bit 3
        code = code.view(w.shape).to(torch.uint8)
        tensors[name] = code[:, 0::2] | (code[:, 1::2] << 4)
        tensors[name[: -len("weight")] + "weight_scale"] = scale
        tensors[name[: -len("weight")] + "weight_scale_2"] = global_scale.reshape(1)
    save_file(tensors, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def make_nemotron_35(path: str, target: str) -> str:
    """Make the draft at `path` a Nemotron-3.5 draft as SGLang detects one
    (`is_nemotron_35_draft_config`): `has_embed_tokens` with its own `embed_tokens` (a copy of the
    target's table, as a draft trained with `train_embed_tokens: false` holds), no LM head, the
    captured layers' `eagle_aux_hidden_state_layer_ids` (= target_layer_ids + 1),
    `sample_from_anchor: false`, and W4A16_NVFP4 projections (`quantize_nvfp4`)."""
    import glob

    from safetensors.torch import load_file, save_file

    from sglang_dflash.checkpoint.config import DFlashDraftConfig

    config = DFlashDraftConfig.from_pretrained(path)
    ids = list(config.resolve_target_layer_ids(config.num_target_layers))
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["dflash_config"].update(target_layer_ids=ids, sample_from_anchor=False)
    raw.update(
        has_embed_tokens=True,
        has_lm_head=False,
        train_embed_tokens=False,
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids],
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    (weights,) = glob.glob(os.path.join(target, "*.safetensors"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["embed_tokens.weight"] = load_file(weights)["model.embed_tokens.weight"].clone()
    save_file(tensors, file)
    quantize_nvfp4(path, "W4A16_NVFP4")
    return path


def add_domino(
    path: str,
    *,
    gru_hidden_dim: int = 16,
    emb_dim: int = 24,
    shift_label: bool = False,
    scale: float = 0.1,
    seed: int = 3,
) -> str:
    """Give the draft at `path` Domino's projector: `projector_type: domino` and its fields, and
    random GRU and projection weights whose corrections are `scale`-sized beside the base logits."""
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["dflash_config"].update(
        projector_type="domino",
        shift_label=shift_label,
        pure_draft_prefix_len=1,
        gru_hidden_dim=gru_hidden_dim,
        emb_dim=emb_dim,
    )
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    gen = torch.Generator().manual_seed(seed)
    vocab, hidden, g = config["vocab_size"], config["hidden_size"], gru_hidden_dim
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["prefix_gru.weight_ih_l0"] = torch.randn(3 * g, hidden, generator=gen) / hidden**0.5
    tensors["prefix_gru.weight_hh_l0"] = torch.randn(3 * g, g, generator=gen) / g**0.5
    tensors["embed_proj.0.weight"] = torch.randn(emb_dim, hidden + g, generator=gen) / (hidden + g) ** 0.5
    tensors["embed_proj.2.weight"] = scale * torch.randn(vocab, emb_dim, generator=gen)
    save_file(tensors, file)
    return path


LILICORR_FIELDS = {
    "lilicorr_candidate_topk": 4,
    "lilicorr_hidden_size": 0,
    "lilicorr_num_layers": 1,
    "lilicorr_num_heads": 2,
    "lilicorr_mlp_ratio": 2.0,
    "lilicorr_factor_dim": 8,
    "lilicorr_vector_eps": 1e-6,
    "lilicorr_logit_scale": 4.0,
}


def lilicorr_weights(
    hidden: int, block_size: int, fields: dict, *, rank0: float = 0.0, seed: int = 5
) -> dict:
    """Random weights of a LiLiCorr head with `fields` (named as in a checkpoint, under
    `lilicorr.`): linear weights of unit gain, biases and norm scales near their defaults. With
    `rank0` > 0 the head leans to each slot's top candidate: the rank embedding pushes rank 0
    one way and the others the other, and the pair heads share their weights, so a candidate
    scores best after its own kind."""
    from sglang_dflash.checkpoint.fields import parse_lilicorr
    from sglang_dflash.propose.lilicorr import LiLiCorrHead

    shape = parse_lilicorr(fields, "LiLiCorrDraftModel", hidden)["lilicorr"]
    head = LiLiCorrHead(hidden, block_size, 1e-6, shape)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in head.named_parameters():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif p.dim() == 2 and not name.endswith("slot_bias"):
            value = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
        else:
            value = 0.1 * torch.randn(p.shape, generator=gen)
        tensors[name] = value
    if rank0:
        width = tensors["rank_embedding"].shape[-1]
        direction = torch.randn(width, generator=gen)
        direction *= rank0 * width**0.5 / direction.norm()
        tensors["rank_embedding"][..., 0, :] += direction
        tensors["rank_embedding"][..., 1:, :] -= direction
        tensors["in_head.weight"] = tensors["out_head.weight"].clone()
        tensors["in_head.bias"] = tensors["out_head.bias"].clone()
    return {"lilicorr." + k: v.contiguous() for k, v in tensors.items()}


def add_lilicorr(path: str, *, rank0: float = 2.0, seed: int = 5, **fields) -> str:
    """Make the draft at `path` a LiLiCorr draft: its class, `dflash_config.lilicorr_*`
    (`LILICORR_FIELDS`, updated with `fields`) and random head weights (`lilicorr_weights`)."""
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = ["LiLiCorrDraftModel"]
    head_fields = dict(LILICORR_FIELDS, **{f"lilicorr_{k}": v for k, v in fields.items()})
    config["dflash_config"].update(head_fields)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update(
        lilicorr_weights(config["hidden_size"], config["block_size"], head_fields, rank0=rank0, seed=seed)
    )
    save_file(tensors, file)
    return path


def add_laguna(path: str, *, gating="per-element", gate_scale: float = 0.1, seed: int = 4) -> str:
    """Make the draft at `path` a Laguna draft (`DFlashLagunaForCausalLM`, `model_type: laguna`):
    `gating`, one norm per captured feature slice (near 1) and a gate projection per layer (small,
    so each gate is near softplus(0))."""
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(architectures=["DFlashLagunaForCausalLM"], model_type="laguna", gating=gating)
    if config.get("sliding_window") is None:  # LagunaConfig takes an int (its default: 512)
        config.pop("sliding_window", None)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    gen = torch.Generator().manual_seed(seed)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    width = {"per-head": heads, "per-element": heads * config["head_dim"]}.get(gating, 0)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    features = tensors["fc.weight"].shape[1] // hidden
    for j in range(features):
        tensors[f"aux_hidden_norms.{j}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    for i in range(config["num_hidden_layers"]):
        if width:
            tensors[f"layers.{i}.self_attn.g_proj.weight"] = gate_scale * torch.randn(
                width, hidden, generator=gen
            )
    save_file(tensors, file)
    return path


# Beam's tiny shape: target "a"'s, three sliding layers of window 8 (RoPE) then a full one (no
# RoPE, SSMax), two dense MLP layers then two MoE ones (4 experts in 2 groups, top 2).
BEAM_SHAPE = dict(
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    mlp_layer_types=["dense"] * 2 + ["sparse"] * 2,
    sliding_window=8,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=2,
    routed_scaling_factor=2.5,
    final_logit_softcapping=30.0,
)


def make_beam_target(path: str, *, seed: int = 0, favour: float = 0.0) -> str:
    """A tiny Beam target (SGLang's `BeamForCausalLM`; transformers has no Beam class), written
    straight in the checkpoint names SGLang's loader reads: per layer q/k/v/gate/o projections, a
    per-head gate bias, q/k norms, four sandwich norms, and a dense MLP or experts with a
    sigmoid router and its correction bias. Random weights as `_save_peaked` draws them (normal
    0.15 for matrices, norms near 1), `favour` as in `make_hybrid_target`."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    a, b = TEXT_SHAPE_A, BEAM_SHAPE
    hidden, head_dim = a["hidden_size"], a["head_dim"]
    q, kv = a["num_attention_heads"] * head_dim, a["num_key_value_heads"] * head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * 0.15

    def norm(width: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(width, generator=gen)

    tensors = {
        "model.embed_tokens.weight": matrix(a["vocab_size"], hidden),
        "lm_head.weight": matrix(a["vocab_size"], hidden),
    }
    for i in range(a["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("gate_proj", q)):
            tensors[f"{layer}self_attn.{name}.weight"] = matrix(rows, hidden)
        tensors[f"{layer}self_attn.o_proj.weight"] = matrix(hidden, q)
        tensors[f"{layer}self_attn.gate_bias"] = 0.5 * torch.randn(a["num_attention_heads"], generator=gen)
        tensors[f"{layer}self_attn.q_norm.weight"] = norm(head_dim)
        tensors[f"{layer}self_attn.k_norm.weight"] = norm(head_dim)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            tensors[f"{layer}{name}_layernorm.weight"] = norm(hidden)
        if b["mlp_layer_types"][i] == "dense":
            experts = {"mlp.": b["intermediate_size"]}
        else:
            tensors[f"{layer}mlp.gate.weight"] = matrix(b["num_experts"], hidden)
            tensors[f"{layer}mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(
                b["num_experts"], generator=gen
            )
            experts = {f"mlp.experts.{e}.": b["moe_intermediate_size"] for e in range(b["num_experts"])}
        for prefix, width in experts.items():
            tensors[f"{layer}{prefix}gate_proj.weight"] = matrix(width, hidden)
            tensors[f"{layer}{prefix}up_proj.weight"] = matrix(width, hidden)
            tensors[f"{layer}{prefix}down_proj.weight"] = matrix(hidden, width)
    tensors["model.norm.weight"] = norm(hidden)
    _favour(tensors["model.embed_tokens.weight"], tensors["lm_head.weight"], favour)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = dict(a, **BEAM_SHAPE)
    config.update(
        architectures=["BeamForCausalLM"],
        model_type="beam",
        torch_dtype="float32",
        hidden_act="silu",
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
        attention_bias=False,
        pad_token_id=EOS_ID,
        # RoPE on the sliding layers only, as BeamConfig requires.
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": None,
        },
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    make_tokenizer(path)
    return path


class BeamReference:
    """Beam's forward in plain PyTorch over a `make_beam_target` checkpoint, the oracle for
    SGLang's `BeamForCausalLM` (transformers has none), from SGLang 0.5.23's `beam.py`:

    * attention: q/k RMS-normed per head; on sliding layers NeoX RoPE and a window of
      `sliding_window` keys (the query's own included); on full layers no RoPE, and SSMax, the
      queries scaled by exp(0.1 log1p((position + 1) / 2048)); the output gated per head by
      sigmoid(gate_proj(x) + gate_bias);
    * sandwich norms with depth-scaled residuals: after sublayer d (2(i+1) for layer i's
      attention, 2(i+1)+1 for its MLP), h = norm(branch) / sqrt(d) + h sqrt(d-1) / sqrt(d);
    * MoE: sigmoid router, top-k by score + correction bias within the best groups, weights
      renormalized, times `routed_scaling_factor`;
    * the LM head in bf16 (SGLang keeps Beam's head bf16 in any engine dtype), logits soft-capped.
    """

    def __init__(self, path: str):
        from safetensors.torch import load_file

        with open(os.path.join(path, "config.json")) as f:
            self.config = json.load(f)
        self.w = load_file(os.path.join(path, "model.safetensors"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config["rms_norm_eps"]) * self.w[name]

    def _attention(self, x: torch.Tensor, i: int) -> torch.Tensor:
        c, w, p = self.config, self.w, f"model.layers.{i}.self_attn."
        n, heads, kv_heads, d = x.shape[0], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q = self._norm((x @ w[p + "q_proj.weight"].T).view(n, heads, d), p + "q_norm.weight")
        k = self._norm((x @ w[p + "k_proj.weight"].T).view(n, kv_heads, d), p + "k_norm.weight")
        v = (x @ w[p + "v_proj.weight"].T).view(n, kv_heads, d)
        pos = torch.arange(n)
        allowed = pos[None, :] <= pos[:, None]  # [query, key]
        if c["layer_types"][i] == "sliding_attention":
            theta = c["rope_parameters"]["sliding_attention"]["rope_theta"]
            angle = pos[:, None].float() * theta ** (-torch.arange(0, d, 2).float() / d)  # [n, d/2]
            cos, sin = angle.cos()[:, None].repeat(1, 1, 2), angle.sin()[:, None].repeat(1, 1, 2)

            def rotate(t):  # NeoX: the two halves of each head
                return t * cos + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * sin

            q, k = rotate(q), rotate(k)
            allowed &= pos[:, None] - pos[None, :] < c["sliding_window"]
        else:
            q = q * torch.exp(0.1 * torch.log1p((pos.float() + 1) / 2048))[:, None, None]
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
        out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
        gate = (x @ w[p + "gate_proj.weight"].T).view(n, heads, d) + w[p + "gate_bias"][None, :, None]
        return (out * torch.sigmoid(gate)).reshape(n, heads * d) @ w[p + "o_proj.weight"].T

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        w = self.w
        return (F.silu(x @ w[prefix + "gate_proj.weight"].T) * (x @ w[prefix + "up_proj.weight"].T)) @ w[
            prefix + "down_proj.weight"
        ].T

    def _moe(self, x: torch.Tensor, i: int) -> torch.Tensor:
        c, p = self.config, f"model.layers.{i}.mlp."
        scores = torch.sigmoid(x @ self.w[p + "gate.weight"].T)  # [n, E]
        choice = (scores + self.w[p + "gate.e_score_correction_bias"]).view(x.shape[0], c["n_group"], -1)
        groups = (
            choice.topk(2, dim=-1).values.sum(-1).topk(c["topk_group"], dim=-1).indices
        )  # [n, topk_group]
        in_group = torch.zeros(choice.shape[:2], dtype=torch.bool).scatter(1, groups, True)
        choice = choice.masked_fill(~in_group[..., None], float("-inf")).flatten(1)
        ids = choice.topk(c["num_experts_per_tok"], dim=-1).indices  # [n, k]
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * c["routed_scaling_factor"]
        outputs = torch.stack(
            [self._mlp(x, f"{p}experts.{e}.") for e in range(c["num_experts"])], 1
        )  # [n, E, H]
        return (outputs.gather(1, ids[..., None].expand(-1, -1, x.shape[-1])) * weights[..., None]).sum(1)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> logits [n, V] float32."""
        c, w = self.config, self.w
        h = w["model.embed_tokens.weight"][ids]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            for depth, branch in ((2 * (i + 1), "attention"), (2 * (i + 1) + 1, "mlp")):
                if branch == "attention":
                    out = self._attention(self._norm(h, p + "input_layernorm.weight"), i)
                    post = p + "post_attention_layernorm.weight"
                else:
                    x = self._norm(h, p + "pre_feedforward_layernorm.weight")
                    out = self._mlp(x, p + "mlp.") if c["mlp_layer_types"][i] == "dense" else self._moe(x, i)
                    post = p + "post_feedforward_layernorm.weight"
                h = self._norm(out, post) / depth**0.5 + h * ((depth - 1) / depth) ** 0.5
        h = self._norm(h, "model.norm.weight")
        logits = F.linear(h.to(torch.bfloat16), w["lm_head.weight"].to(torch.bfloat16)).float()
        cap = c["final_logit_softcapping"]
        return torch.tanh(logits / cap) * cap

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **_greedy) -> torch.Tensor:
        """Greedy, as transformers' `generate(..., do_sample=False)` returns: [1, prompt + new]."""
        ids = input_ids[0]
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, self.logits(ids)[-1].argmax()[None]])
        return ids[None]


def _edit_json(file: str, **fields) -> None:
    with open(file) as f:
        data = json.load(f)
    data.update(fields)
    with open(file, "w") as f:
        json.dump(data, f, indent=2)


if __name__ == "__main__":
    out = sys.argv[1]
    make_target(os.path.join(out, "target"))
    make_draft(os.path.join(out, "draft"))
    print(out)


# Named shapes used across the tests. Targets differ in width, depth, GQA ratio and head_dim;
# drafts in depth, block size, KV heads and target_layer_ids.
TARGETS = {
    "a": dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, seed=0),
    "b": dict(hidden_size=96, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=32, seed=10),
    # Target "a" with a small LM head: flat, high-entropy next-token distributions, for
    # statistical tests of sampling (pairs with draft "a").
    "flat": dict(
        hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, seed=0, lm_head_std=0.01
    ),
}
DRAFTS = {
    "a": dict(target="a", hidden_size=64, num_layers=1, block_size=16, num_target_layers=4, seed=1),
    "b": dict(
        target="b",
        hidden_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        block_size=8,
        num_target_layers=6,
        target_layer_ids=[0, 2, 4],
        seed=11,
        prefix="model.",
    ),
}
# Draft "b" with 2 KV heads: it splits across two tensor-parallel ranks ("b" has 1, which does not).
DRAFTS["b-tp"] = dict(DRAFTS["b"], num_kv_heads=2, seed=12)


# Hybrid linear-attention targets (make_hybrid_target): family and favour, set so the favoured
# token is about half of the greedy choices. They pair with draft "a".
HYBRID_TARGETS = {
    "next": ("qwen3_next", 4.0),
    "q35": ("qwen3_5", 10.0),
    "q35moe": ("qwen3_5_moe", 4.0),
    "q35vl": ("qwen3_5_vl", 10.0),
    "q35moevl": ("qwen3_5_moe_vl", 4.0),
}


class TinyModels:
    """Builds each named checkpoint on first use under `root`."""

    def __init__(self, root):
        self.root = str(root)

    def target(self, name: str) -> str:
        path = os.path.join(self.root, f"target-{name}")
        if not os.path.isdir(path):
            make_target(path, **TARGETS[name])
        return path

    def draft(self, name: str) -> str:
        path = os.path.join(self.root, f"draft-{name}")
        if not os.path.isdir(path):
            spec = dict(DRAFTS[name])
            spec.pop("target")
            make_draft(path, **spec)
        return path

    def hybrid_target(self, name: str) -> str:
        path = os.path.join(self.root, f"hybrid-{name}")
        if not os.path.isdir(path):
            family, favour = HYBRID_TARGETS[name]
            make_hybrid_target(path, family=family, favour=favour)
        return path

    def pair(self, name: str) -> tuple[str, str]:
        return self.target(DRAFTS[name]["target"]), self.draft(name)

    def edited_draft(self, name: str, tag: str, edit) -> str:
        """A copy of draft `name` whose config.json dict is passed through `edit(dict)`."""
        import shutil

        path = os.path.join(self.root, f"draft-{name}-{tag}")
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(self.draft(name), path)
        file = os.path.join(path, "config.json")
        with open(file) as f:
            data = json.load(f)
        edit(data)
        with open(file, "w") as f:
            json.dump(data, f)
        return path

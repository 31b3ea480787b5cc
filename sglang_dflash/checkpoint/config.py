"""The DFlash draft checkpoint format (z-lab `DFlashDraftModel`), parsed and validated.

A checkpoint is a directory with `config.json` and safetensors weights. The config is a
Qwen3 decoder config plus the DFlash fields:

    {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 5, "hidden_size": 4096, ...,
     "block_size": 16, "num_target_layers": 36,
     "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669}}

Read as SGLang reads it: the model's fields (sizes, norms, RoPE, layer types, window,
causality) at the top level, through the config class `model_type` names (`config_class.py`);
the DFlash fields (`block_size`, `target_layer_ids`, the mask token, `num_target_layers`) from
`dflash_config` first, then the top level; each family's options where SGLang reads them. Every
problem raises `CheckpointError` naming the field and the value.

See docs/serving.md ("Draft checkpoints").
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from sglang_dflash.checkpoint import config_class, contract
from sglang_dflash.checkpoint.contract import CheckpointError
from sglang_dflash.checkpoint.fields import (
    LiLiCorrShape,
    bool_field,
    int_field,
    number_field,
    parse_conv,
    parse_domino,
    parse_lilicorr,
    parse_rope,
    parse_selector,
    read_laguna,
)
from sglang_dflash.checkpoint.quantization import QuantizedWeights, parse_quantization

ARCHITECTURE = "DFlashDraftModel"
SERVED_ARCHITECTURES = (
    ARCHITECTURE,
    *contract.SELECTOR_ARCHITECTURES,
    contract.MUSE_ASSISTANT,
    contract.LAGUNA,
    contract.LILICORR,
)
DEFAULT_MASK_TOKEN = "<|MASK|>"  # SGLang's default for `mask_token` (speculative/dflash_utils.py)
MASK_EMBEDDING = "mask_embedding.pt"  # a trained mask-token embedding beside the weights
LAYER_TYPES = ("full_attention", "sliding_attention")
# The knob that serves a draft whose config names another target (`check_made_for`).
ALLOW_OTHER_TARGET = "SGLANG_DFLASH_ALLOW_OTHER_TARGET"
# Configs pad the vocabulary's rows for their kernels and TP splits (Qwen2.5 writes 151936 or
# 152064 for one tokenizer; MiMo-V2-Flash 152576 where its published draft says 152064): two
# vocab_sizes closer than this may be one vocabulary, so they do not say "another target".
VOCAB_PADDING = 1024


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference default: round(linspace(1, L-3, n)), or L//2 for a single draft layer.

    E.g., L=36, n=5 -> [1, 9, 17, 25, 33].
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise CheckpointError(
            f"default target_layer_ids need a target with at least 4 layers, got {num_target_layers}"
        )
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def resolve_checkpoint_dir(path: str | None, revision: str | None = None) -> str:
    """A local checkpoint directory for `path`: the directory itself, or a Hugging Face hub id
    fetched (config, safetensors and a trained mask embedding) into the hub cache."""
    if path and os.path.isdir(path):
        return path
    if not path or path.startswith(("/", ".", "~")) or path.count("/") != 1:
        raise CheckpointError(f"draft checkpoint path {path!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", MASK_EMBEDDING]
        return snapshot_download(path, revision=revision, allow_patterns=patterns)
    except Exception as error:
        raise CheckpointError(
            f"draft checkpoint {path!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(error).__name__})"
        ) from error


def _check_layer_types(layer_types: Any, num_layers: int) -> None:
    if (
        not isinstance(layer_types, (list, tuple))
        or len(layer_types) != num_layers
        or any(t not in LAYER_TYPES for t in layer_types)
    ):
        raise CheckpointError(
            f"draft config field 'layer_types' must list one of {LAYER_TYPES} per layer "
            f"({num_layers} layers), got {layer_types!r}"
        )


def parse_swa(dflash: dict, layer_types) -> Optional[int]:
    """MiMo's `dflash_config.use_swa` with `swa_window_size` W: the checkpoint was trained with
    every layer a sliding one of window W, non-causal as its layers were: a query sees keys
    fewer than W positions before or after its own (`draft/attention.visibility`). vLLM serves it
    so (its MiMo draft: left and right windows of W - 1); SGLang's built-in ignores both keys and
    attends the whole context. Returns W, or None without `use_swa` (a lone `swa_window_size` is
    read by no implementation then)."""
    if not bool_field("dflash_config.use_swa", dflash.get("use_swa", False)):
        return None
    window = dflash.get("swa_window_size")
    if window is None:
        raise CheckpointError("draft config field 'dflash_config.use_swa' is true without 'swa_window_size'")
    if "sliding_attention" in layer_types:
        raise CheckpointError(
            "draft config declares both 'dflash_config.use_swa' (a window on every layer) and "
            f"sliding layers in 'layer_types' ({list(layer_types)}); sglang-dflash serves one or the other"
        )
    return int_field("dflash_config.swa_window_size", window, minimum=1)


@dataclass(frozen=True)
class DFlashDraftConfig:
    """Everything the draft network and the worker need from `config.json`."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool
    block_size: int
    # None: resolved from `mask_token` with the target's tokenizer (`resolve_mask_token_id`).
    mask_token_id: Optional[int]
    # None: not in the checkpoint; resolved against the target by `resolve_target_layer_ids`.
    target_layer_ids: Optional[tuple[int, ...]]
    num_target_layers: Optional[int]
    # Per draft layer: "full_attention" (non-causal) or "sliding_attention".
    layer_types: tuple[str, ...]
    sliding_window: Optional[int]
    # None: follow the reference (sliding layers causal, full layers not).
    is_causal: Optional[bool]
    rope: dict  # {"rope_type": str, "rope_theta": float, ...} in transformers' format
    max_position_embeddings: int
    input_embedding_scale: float = 1.0
    vocab_size: Optional[int] = None
    # False: `vocab_size` is the config class's default (Qwen3Config's 151936) or the target's,
    # not a statement about the draft's target.
    declares_vocab_size: bool = False
    declares_block_size: bool = True  # False: `block_size` is the caller's default
    mask_token: str = DEFAULT_MASK_TOKEN
    # The options SGLang's DFlash draft reads from the config (models/dflash.py):
    use_gemma_norm: bool = False  # every RMSNorm scales by (1 + w), in fp32
    rotary_dim: Optional[int] = None  # RoPE on the first rotary_dim dims of a head; None: all
    rope_is_neox_style: bool = True  # False: GPT-J style, rotating interleaved pairs
    hidden_act: str = "silu"  # or "swigluoai": gpt-oss's clamped SwiGLU
    swiglu_alpha: Optional[float] = None  # swigluoai only
    swiglu_limit: Optional[float] = None  # swigluoai only
    # MiMo's extras (dflash_config only, as SGLang reads them): a per-head sink logit in every
    # layer's attention softmax (tensors `layers.N.self_attn.attention_sink_bias`), and V scaled
    # by a constant for the block and the context alike.
    attention_sink_bias: bool = False
    attention_value_scale: Optional[float] = None
    # MiMo's `use_swa` window (`parse_swa`), already applied to `layer_types` and
    # `sliding_window`; kept to name it at start-up. None: not declared.
    swa_window: Optional[int] = None
    # Nemotron-3.5's drafts (`contract.is_nemotron_35`, SGLang's detection): the block is embedded
    # by the draft's own `embed_tokens` [vocab_size, H], not the target's.
    own_embedding: bool = False
    # fp8 or NVFP4 weights, dequantised at load (`quantization.py`). None: plain weights.
    quantization: Optional[QuantizedWeights] = None
    # Grouped dynamic convolution (DFlash2's backbone, on any class; dflash_config only): each
    # layer's two sublayers convolve their input and output over the block's previous
    # `conv_kernel_size` tokens, per group of `conv_group_size` channels. 0: off.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    # The class, and DFlash2's candidate selector (`propose/selector.py`; dflash_config only): the top
    # `selector_top_k` tokens of the target's head per slot, walked over a rank-`selector_rank`
    # lattice. 0: no selector (the plain argmax).
    architecture: str = ARCHITECTURE
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None  # None: off
    # Domino's projector (`propose/domino.py`; any class): the proposals roll out greedily, each slot's
    # base logits corrected by a GRU over the tokens proposed before it. None: no projector.
    projector_type: Optional[str] = None
    shift_label: bool = False  # True: slot i reads the draft's row i - 1 (else row i)
    gru_hidden_dim: int = 0
    emb_dim: int = 0
    # LiLiCorr's head (class `LiLiCorrDraftModel`; `propose/lilicorr.py`): the top candidates of the
    # target's head per slot, rescored jointly by a small transformer and walked over their pairs.
    lilicorr: Optional[LiLiCorrShape] = None
    # Laguna's drafts (class `DFlashLagunaForCausalLM`): each captured feature slice has its own
    # norm before `fc` (`aux_hidden_norms`), every layer's context K/V are projected from its
    # `input_layernorm` of the context feature, and with `gating` the attention output is scaled
    # by softplus(g_proj(x)) per head or per element before `o_proj`.
    gating: str = "disabled"  # "per-head", "per-element" or "disabled"
    # Keys accepted because they change no proposal of this draft, as 'name = value' (not
    # applied; named at start-up): a positive multiplier or a soft-cap of the target head's logits
    # on a draft proposing their argmax (`contract.inert_fields`), e.g. the Gemma-4 drafts' cap.
    inert_fields: tuple[str, ...] = ()

    @property
    def is_laguna(self) -> bool:
        return self.architecture == contract.LAGUNA

    @property
    def rope_width(self) -> int:
        """How many leading dims of each head RoPE rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def options_in_use(self, scope: str = "all") -> list[str]:
        """The options that depart from plain z-lab maths (Qwen3 norms, full-width neox RoPE,
        SiLU, plain softmax attention, unscaled V, no convolution), named for start-up lines.
        `scope`: "all"; "forward", what the draft network's own layer maths computes (not the
        attention's sinks); "context_kv", what the context K/V projection computes."""
        if scope not in ("all", "forward", "context_kv"):
            raise ValueError(f"unknown scope {scope!r}")
        options = []
        if scope == "all" and self.selector_rank:
            options.append(f"candidate selector (rank {self.selector_rank}, top {self.selector_top_k})")
        if scope == "all" and self.lilicorr is not None:
            head = self.lilicorr
            options.append(
                f"LiLiCorr head (top {head.candidate_topk}, {head.num_layers} layer(s) of width "
                f"{head.width(self.hidden_size)})"
            )
        if scope == "all" and self.projector_type:
            options.append(f"Domino rollout (GRU {self.gru_hidden_dim}, projection {self.emb_dim})")
        if scope != "forward" and self.is_laguna:
            options.append("Laguna feature-slice norms and context input norm")
        if scope != "context_kv" and self.gating != "disabled":
            options.append(f"Laguna attention gate ({self.gating})")
        if scope == "all" and self.attention_sink_bias:
            options.append("attention sinks")
        if scope == "all" and self.own_embedding:
            options.append("its own token embedding (Nemotron-3.5)")
        if scope == "all" and self.quantization is not None:
            options.append(f"{self.quantization.describe()} weights, dequantised at load")
        if scope == "all" and self.swa_window is not None:
            window = self.swa_window
            options.append(f"every layer windowed to {window} (use_swa; SGLang's built-in ignores it)")
        if scope != "context_kv" and self.conv_kernel_size:
            options.append(
                f"grouped convolution ({self.conv_kernel_size} taps, groups of {self.conv_group_size})"
            )
        if self.attention_value_scale is not None and self.attention_value_scale != 1.0:
            options.append(f"V scaled by {self.attention_value_scale}")
        if self.use_gemma_norm:
            options.append("Gemma norms")
        if self.rope_width != self.head_dim:
            options.append(f"RoPE on {self.rope_width} of {self.head_dim} head dims")
        if not self.rope_is_neox_style:
            options.append("GPT-J style RoPE")
        if scope != "context_kv" and self.hidden_act != "silu":
            options.append(f"hidden_act {self.hidden_act}")
        return options

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_is_causal(self, layer_id: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer_id] == "sliding_attention"

    def layer_window(self, layer_id: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[layer_id] == "sliding_attention" else None

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_pretrained(cls, path: str, default_block_size: Optional[int] = None) -> "DFlashDraftConfig":
        """Parse `config.json` of a checkpoint directory (see `resolve_checkpoint_dir`)."""
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(f"draft checkpoint {path!r} has no config.json")
        try:
            with open(config_path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"draft config {config_path!r} is not valid JSON: {e}") from e
        return cls.from_dict(raw, default_block_size)

    @classmethod
    def from_dict(cls, raw: dict, default_block_size: Optional[int] = None) -> "DFlashDraftConfig":
        """`default_block_size`: the draft block of a checkpoint without `block_size` (SGLang's
        built-in uses `--speculative-num-draft-tokens`, else 16: `integration/server_args.py`); without
        it, the field is required."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"draft config must be a JSON object, got {type(raw).__name__}")
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise CheckpointError(f"draft config field 'dflash_config' must be an object, got {dflash!r}")

        def get(name: str, default: Any = None) -> Any:  # a DFlash field: dflash_config first
            return dflash.get(name, raw.get(name, default))

        def model(name: str, default: Any = None) -> Any:  # a model field: the top level, as read
            value = top.get(name)
            return default if value is None else value

        def require(name: str, value: Any = None) -> Any:  # what the file itself must give
            value = raw.get(name) if value is None else value
            if value is None:
                raise CheckpointError(f"draft config is missing the field {name!r}")
            return value

        declares_vocab_size = raw.get("vocab_size") is not None  # before a class fills in its default
        archs = raw.get("architectures")
        contract.refuse_architecture(archs)
        architecture = (
            next((a for a in archs if a in SERVED_ARCHITECTURES), None) if isinstance(archs, list) else None
        )
        if architecture is None:
            raise CheckpointError(
                f"draft config field 'architectures' must contain one of {list(SERVED_ARCHITECTURES)}, "
                f"got {archs!r}"
            )
        gating = "disabled"
        if architecture == contract.LAGUNA:  # read as SGLang's LagunaConfig reads it
            raw, gating = read_laguna(raw)
        contract.check_config(raw, architecture, config_class.class_keys(raw.get("model_type")))
        # The sizes the file must give, checked before its config class (which would fill in its
        # own defaults, or fail with transformers' words) reads it.
        hidden_size = int_field("hidden_size", require("hidden_size"), minimum=1)
        num_layers = int_field("num_hidden_layers", require("num_hidden_layers"), minimum=1)
        num_heads = int_field("num_attention_heads", require("num_attention_heads"), minimum=1)
        intermediate = int_field("intermediate_size", require("intermediate_size"), minimum=1)
        if raw.get("layer_types") is not None:
            _check_layer_types(raw["layer_types"], num_layers)
        top = config_class.model_fields(raw)

        num_kv_heads = int_field("num_key_value_heads", model("num_key_value_heads", num_heads), minimum=1)
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"draft config field 'num_attention_heads' ({num_heads}) must be a multiple of "
                f"'num_key_value_heads' ({num_kv_heads})"
            )
        head_dim = model("head_dim") or hidden_size // num_heads
        head_dim = int_field("head_dim", head_dim, minimum=2)
        if head_dim % 2:
            raise CheckpointError(f"draft config field 'head_dim' must be even for RoPE, got {head_dim}")
        act = model("hidden_act", "silu")
        if act not in ("silu", "swigluoai"):
            raise CheckpointError(
                f"draft config field 'hidden_act' must be 'silu' or 'swigluoai', got {act!r}"
            )
        swiglu = {}
        if act == "swigluoai":  # SGLang reads both constants, with no default
            for name in ("swiglu_alpha", "swiglu_limit"):
                swiglu[name] = float(number_field(name, require(name, model(name)), positive=True))
        sinks = bool_field("attention_sink_bias", dflash.get("attention_sink_bias", False))
        own_embedding = contract.is_nemotron_35(raw)
        if own_embedding:  # SGLang reads a Nemotron-3.5 draft's sinks at the top level too
            sinks = sinks or bool_field("attention_sink_bias", raw.get("attention_sink_bias", False))
        value_scale = dflash.get("attention_value_scale")
        if value_scale is not None:
            value_scale = float(number_field("attention_value_scale", value_scale))
        conv = parse_conv(dflash, hidden_size)
        selector = parse_selector(dflash, architecture)
        domino = parse_domino(raw, dflash)
        lilicorr = parse_lilicorr(dflash, architecture, hidden_size)
        if (selector or lilicorr) and domino:  # SGLang's worker would roll out Domino, ignoring the head
            raise CheckpointError(
                f"draft config declares both the proposal head of class {architecture!r} and "
                "Domino's projector ('projector_type'), which sglang-dflash does not serve together"
            )
        gemma = bool_field("use_gemma_norm", model("use_gemma_norm", False))
        eps = number_field("rms_norm_eps", model("rms_norm_eps", 1e-6), positive=True)
        bias = bool_field("attention_bias", model("attention_bias", False))

        block_size = get("block_size")
        if block_size is None:
            block_size = default_block_size
        if block_size is None:
            raise CheckpointError("draft config is missing the field 'block_size'")
        block_size = int_field("block_size", block_size, minimum=2)
        mask_token_id = get("mask_token_id")
        if mask_token_id is not None:
            mask_token_id = int_field("mask_token_id", mask_token_id, minimum=0)
        mask_token = get("mask_token") or DEFAULT_MASK_TOKEN
        if not isinstance(mask_token, str):
            raise CheckpointError(f"draft config field 'mask_token' must be a string, got {mask_token!r}")

        num_target_layers = get("num_target_layers")
        if num_target_layers is not None:
            num_target_layers = int_field("num_target_layers", num_target_layers, minimum=1)
        layer_ids = get("target_layer_ids")
        if layer_ids is not None:
            if (
                not isinstance(layer_ids, list)
                or not layer_ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids)
            ):
                raise CheckpointError(
                    f"draft config field 'target_layer_ids' must be a non-empty list of integers, "
                    f"got {layer_ids!r}"
                )
            layer_ids = tuple(layer_ids)

        layer_types = model("layer_types") or ["full_attention"] * num_layers
        _check_layer_types(layer_types, num_layers)
        sliding_window = model("sliding_window")
        if "sliding_attention" in layer_types:
            if sliding_window is None and raw.get("sliding_window") is not None:
                raise CheckpointError(
                    f"draft config field 'sliding_window' is {raw['sliding_window']!r} but "
                    "'use_sliding_window' is not true, so transformers' Qwen3Config (which SGLang reads "
                    "the draft's config through) drops it and the sliding layers would have no window; "
                    "set 'use_sliding_window': true"
                )
            sliding_window = int_field("sliding_window", sliding_window, minimum=1)
        else:
            sliding_window = None
        is_causal = model("is_causal")
        if is_causal is None and raw.get("model_type") == "muse_glimmer_assistant":
            is_causal = False  # the class default of SGLang's MuseGlimmerAssistantConfig
        if is_causal is not None:
            bool_field("is_causal", is_causal)
        swa_window = parse_swa(dflash, layer_types)
        if swa_window is not None:  # every layer windowed; each keeps its causality
            if is_causal is None:
                is_causal = False  # the layers were all full (non-causal) before the window
            layer_types, sliding_window = ["sliding_attention"] * num_layers, swa_window

        scale = number_field("input_embedding_scale", get("input_embedding_scale", 1.0))
        vocab_size = model("vocab_size")
        if vocab_size is not None:
            vocab_size = int_field("vocab_size", vocab_size, minimum=1)
        rope, rotary_dim, neox = parse_rope(top, model, head_dim)

        config = cls(
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            rms_norm_eps=float(eps),
            attention_bias=bias,
            block_size=block_size,
            mask_token_id=mask_token_id,
            mask_token=mask_token,
            target_layer_ids=layer_ids,
            num_target_layers=num_target_layers,
            layer_types=tuple(layer_types),
            sliding_window=sliding_window,
            is_causal=is_causal,
            rope=rope,
            rotary_dim=rotary_dim,
            rope_is_neox_style=neox,
            use_gemma_norm=gemma,
            hidden_act=act,
            **swiglu,
            attention_sink_bias=sinks,
            own_embedding=own_embedding,
            **conv,
            architecture=architecture,
            **selector,
            **domino,
            **lilicorr,
            gating=gating,
            inert_fields=contract.inert_fields(raw, architecture),
            attention_value_scale=value_scale,
            swa_window=swa_window,
            quantization=parse_quantization(raw.get("quantization_config")),
            max_position_embeddings=int(model("max_position_embeddings", 32768)),
            input_embedding_scale=float(scale),
            vocab_size=vocab_size,
            declares_vocab_size=declares_vocab_size,
            declares_block_size=get("block_size") is not None,
        )
        contract.check_agreement(raw, top, config)
        return config

    # ------------------------------------------------------- pairing with a target

    def resolve_target_layer_ids(
        self, target_num_layers: int, after_last_layer: Optional[str] = None
    ) -> tuple[int, ...]:
        """The target layers whose outputs feed the draft, checked against the target.

        SGLang captures the residual stream *entering* layer `id + 1`, so the last usable id is
        L-2 for a target with L layers; L-1 too on a target whose class also captures after its
        last layer (`after_last_layer`: its name, `target_features.captures_after_last_layer`).
        """
        ids = self.target_layer_ids
        if ids is None:
            ids = tuple(build_target_layer_ids(target_num_layers, self.num_hidden_layers))
        last = target_num_layers - (1 if after_last_layer else 2)
        for i, layer_id in enumerate(ids):
            if not 0 <= layer_id <= last:
                why = ""
                if layer_id == target_num_layers - 1:
                    why = (
                        ": id L-1 (after the last layer) is served on the targets whose SGLang class "
                        "captures past its layer loop (MiMo-V2, gpt-oss, Laguna, LFM2, Gemma-4, Nemotron-H, "
                        "MiniMax-M3 VL), and this one's does not"
                    )
                raise CheckpointError(
                    f"draft config field 'target_layer_ids' has {layer_id} at index {i}, out of "
                    f"range [0, {last}] for a target with {target_num_layers} layers{why}"
                )
        return ids

    def check_num_draft_tokens(self, num_draft_tokens: int) -> None:
        """The verify width B may be smaller than the trained block, never larger."""
        if not 2 <= num_draft_tokens <= self.block_size:
            raise CheckpointError(
                f"--speculative-num-draft-tokens {num_draft_tokens} must be between 2 and the "
                f"draft checkpoint's block_size {self.block_size}"
            )

    def with_target_vocab(self, vocab_size: int) -> "DFlashDraftConfig":
        """A config without `vocab_size` takes the target's (SGLang's rule; the selector's
        codebooks have one row per token)."""
        return self if self.vocab_size is not None else dataclasses.replace(self, vocab_size=vocab_size)

    def check_target(
        self, *, hidden_size: int, vocab_size: int, num_layers: int, after_last_layer: Optional[str] = None
    ) -> tuple[int, ...]:
        """Validate the pairing with a target; return the resolved target layer ids
        (`after_last_layer`: see `resolve_target_layer_ids`)."""
        if hidden_size != self.hidden_size:
            raise CheckpointError(
                f"draft config field 'hidden_size' is {self.hidden_size} but the target's "
                f"hidden_size is {hidden_size}"
            )
        if self.selector_rank and self.vocab_size is not None and self.vocab_size < vocab_size:
            raise CheckpointError(
                f"draft config field 'vocab_size' is {self.vocab_size}, below the target's vocab_size "
                f"{vocab_size}: the candidate selector's codebooks index the target's vocabulary"
            )
        if self.own_embedding and self.vocab_size is not None and self.vocab_size < vocab_size:
            raise CheckpointError(
                f"draft config field 'vocab_size' is {self.vocab_size}, below the target's vocab_size "
                f"{vocab_size}: the draft's own embedding must embed every token the target emits"
            )
        if self.projector_type and self.vocab_size is not None and self.vocab_size != vocab_size:
            raise CheckpointError(
                f"draft config field 'vocab_size' is {self.vocab_size}, not the target's vocab_size "
                f"{vocab_size}: Domino's projector scores the target's vocabulary"
            )
        if self.mask_token_id is not None and self.mask_token_id >= vocab_size:
            raise CheckpointError(
                f"draft config field 'mask_token_id' is {self.mask_token_id}, at or beyond the "
                f"target's vocab_size {vocab_size}"
            )
        return self.resolve_target_layer_ids(num_layers, after_last_layer)

    def check_made_for(
        self, *, num_layers: int, vocab_size: int, loops: int = 1, allow_other_target: bool = False
    ) -> list[str]:
        """Refuse a draft whose config says it was made for another target: one line naming each
        field and both values, and the knob that serves it anyway. With `allow_other_target`
        (ALLOW_OTHER_TARGET set), the same findings are returned, for a warning."""
        found = self._other_target_fields(num_layers, vocab_size, loops)
        if found and not allow_other_target:
            raise CheckpointError(
                f"{'; '.join(found)}: the draft was made for another target "
                f"(set {ALLOW_OTHER_TARGET}=1 to serve it anyway)"
            )
        return found

    def _other_target_fields(self, num_layers: int, vocab_size: int, loops: int) -> list[str]:
        """`num_target_layers` against the target's depth (`num_layers`, a loop model's unrolled
        steps: `loops` runs of its layers), and a plain draft's `vocab_size` against the target's,
        where the file gives one and the two differ by more than padding (`VOCAB_PADDING`). A
        plain draft proposes through the target's embedding and LM head, so its vocab_size is
        only its training target's; the families whose own tensors index the vocabulary (selector
        codebooks, Nemotron-3.5's embedding, Domino's projector) have their rules in
        `check_target`."""
        found = []
        if self.num_target_layers is not None and self.num_target_layers != num_layers:
            steps = f" ({num_layers // loops} layers run {loops} times)" if loops > 1 else ""
            found.append(
                f"draft config field 'num_target_layers' is {self.num_target_layers} but the target "
                f"has {num_layers} layers{steps}"
            )
        plain = not (self.selector_rank or self.own_embedding or self.projector_type)
        if plain and self.declares_vocab_size and abs(self.vocab_size - vocab_size) >= VOCAB_PADDING:
            found.append(
                f"draft config field 'vocab_size' is {self.vocab_size} but the target's vocab_size "
                f"is {vocab_size}"
            )
        return found

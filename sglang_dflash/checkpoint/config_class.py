"""A draft's `config.json` as the config class of its `model_type` leaves it.

SGLang loads the draft's config with transformers' `AutoConfig` (or with one of its own config
classes, for the model types it registers), and its DFlash draft reads the model fields off that
object (models/dflash.py, speculative/dflash_utils.py). The class fills in what the file leaves
out and rewrites some of what it gives:

  * Qwen3Config drops `sliding_window` unless `use_sliding_window` is true, and without
    `layer_types` derives them from `max_window_layers` (layer i slides from that index on);
  * GptOssConfig gives every other layer a 128-token window, and YaRN RoPE, unless the file
    says otherwise;
  * every class has its own defaults (Qwen3Config: `head_dim` 128, ...).

`model_fields(raw)` reads the file through that class, so the draft built here is the one
SGLang builds from the same file. SGLang's own classes are read by emulation where we serve
their drafts (`fields.read_laguna`; `MuseGlimmerAssistantConfig`'s `is_causal` default in
`config.py`); a draft of another SGLang-registered type is refused by name.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from sglang_dflash.checkpoint.contract import WAY_OUT, CheckpointError

# What SGLang's DFlash draft reads off the config object (`getattr(config, ...)`), and which a
# class may default or rewrite. The DFlash fields proper (block size, target layer ids, the mask
# token, the families' options) are read from the file as it is: no class defines them.
MODEL_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "hidden_act", "rms_norm_eps", "attention_bias", "max_position_embeddings",
    "layer_types", "sliding_window", "is_causal", "rope_parameters", "partial_rotary_factor",
    "use_gemma_norm", "rope_is_neox_style", "is_neox_style", "swiglu_alpha", "swiglu_limit",
    "vocab_size",
)  # fmt: skip

# The model types SGLang 0.5.23 reads with its own config classes (`_CONFIG_REGISTRY` in
# srt/utils/hf_transformers/common.py, registered with transformers' AutoConfig when SGLang is
# imported; tests/unit/checkpoint/test_published_drafts.py checks this list against it). Of
# these, the drafts we serve are emulated (`EMULATED`); the others are refused.
SGLANG_CONFIG_TYPES = frozenset(
    {
        "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_VL_V2", "afmoe", "bailing_hybrid",
        "bailing_moe_v3_vl", "bailingmm_moe_v2_lite", "beam", "chatglm", "dbrx", "deepseek-ocr",
        "deepseek_v32", "deepseek_v4", "deepseek_v41", "deepseek_v41_text", "deepseek_v41_vision",
        "deepseek_vl_v2", "dots3_note", "dots_ocr", "dots_vlm", "exaone", "falcon_h1",
        "falcon_mamba", "gemma4_unified", "gigachat3_5", "glm5_next", "glm5_next_text",
        "granitemoehybrid", "hy_v4", "inkling_audio_model", "inkling_mm_model", "inkling_model",
        "inkling_vision_model", "intern_s2_preview", "interns2_mobius", "interns2_mobius_text",
        "internvl_chat", "iquest_q1", "iquest_q1_mtp", "jet_nemotron", "jet_vlm", "k2_horizon",
        "kimi_k2", "kimi_k25", "kimi_k3", "kimi_linear", "kimi_vl", "laguna", "locateanything",
        "longcat_flash", "mamba", "mamba2", "mellum", "minicpm_sala", "minicpmv4_6",
        "minicpmv4_6_vision", "minicpmv4_7", "minimax_m3_vl", "multi_modality", "muse_glimmer",
        "muse_glimmer_assistant", "nanbeige", "nemotron_h", "nemotron_h_omni", "nemotron_h_puzzle",
        "olmo3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next",
        "qwen4_exp", "qwen4_exp_text", "spark2_5", "step3_vl", "step3p5", "step3p7", "xllm",
    }
)  # fmt: skip
EMULATED = frozenset({"laguna", "muse_glimmer_assistant"})


@functools.lru_cache(maxsize=None)
def transformers_class(model_type: str):
    """transformers' config class for `model_type`, or None where it has none."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None


@functools.lru_cache(maxsize=None)
def class_keys(model_type: Optional[str]) -> frozenset:
    """The keys a default instance of `model_type`'s transformers class writes: its own fields
    (for gpt_oss: the target's experts, `initial_context_length`, ...). A DFlash draft reads
    none of them beyond `MODEL_FIELDS`, which the class resolves here."""
    cls = transformers_class(model_type) if isinstance(model_type, str) else None
    return frozenset(cls().to_dict()) if cls is not None else frozenset()


def model_fields(raw: dict) -> dict:
    """`raw` with `MODEL_FIELDS` as `raw["model_type"]`'s config class leaves them (a field the
    class does not set is left as the file gives it). Without a `model_type`, `raw` itself."""
    model_type = raw.get("model_type")
    if model_type is None or model_type in EMULATED:
        return raw  # None: read as it is (SGLang's built-in cannot load a config without one)
    if model_type in SGLANG_CONFIG_TYPES:
        raise CheckpointError(
            f"draft config field 'model_type' is {model_type!r}: SGLang reads it through its own "
            f"config class, which sglang-dflash does not emulate; {WAY_OUT}"
        )
    cls = transformers_class(model_type) if isinstance(model_type, str) else None
    if cls is None:  # SGLang's AutoConfig would refuse it too
        raise CheckpointError(
            f"draft config field 'model_type' is {model_type!r}, which names no transformers config "
            "class: SGLang reads the draft's config through that class (a z-lab draft says 'qwen3')"
        )
    try:
        with _quiet_transformers():
            config = cls.from_dict(raw)
    except Exception as error:  # transformers validates its fields (layer_types' length, ...)
        raise CheckpointError(
            f"draft config does not load as transformers' {cls.__name__} (its 'model_type' "
            f"{model_type!r}), as SGLang loads it: {error}"
        ) from error
    read = dict(raw)
    for name in MODEL_FIELDS:
        value: Any = getattr(config, name, _MISSING)
        if value is not _MISSING:
            read[name] = value
    if "rope_parameters" in read:  # v5: the class folds rope_theta and rope_scaling into it
        read.pop("rope_scaling", None)
        read.pop("rope_theta", None)
    return read


_MISSING = object()


class _quiet_transformers:
    """transformers' warnings about fields a draft never uses (an `eos_token_id` beyond the
    draft's `vocab_size`, ...) off while a config loads."""

    def __enter__(self):
        self.logger = logging.getLogger("transformers")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)

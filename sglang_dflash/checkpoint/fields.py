"""Reading `config.json`'s fields: typed readers whose errors name the field and the value, and
the parsers of the option groups (RoPE, grouped convolution, DFlash2's selector) as SGLang reads
them (speculative/dflash_utils.py, models/dflash.py). `config.py` assembles them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from sglang_dflash.checkpoint import contract
from sglang_dflash.checkpoint.contract import CheckpointError


def int_field(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"draft config field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def number_field(name: str, value: Any, *, positive: bool = False) -> Any:
    """`value` if it is a number: finite, or with `positive`, > 0."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not (value > 0 if positive else math.isfinite(value)):
        kind = "a positive number" if positive else "a number"
        raise CheckpointError(f"draft config field {name!r} must be {kind}, got {value!r}")
    return value


def bool_field(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise CheckpointError(f"draft config field {name!r} must be a boolean, got {value!r}")
    return value


# RoPE keys that SGLang's draft drops when `rope_dim` gives the rotary width (models/dflash.py):
# the draft sees 1-D positions only.
ROPE_DIM_SUPERSEDES = ("rope_dim", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def parse_conv(dflash: dict, hidden_size: int) -> dict:
    """Grouped dynamic convolution's two fields (dflash_config only, as SGLang reads them)."""
    conv = {
        name: int_field(name, dflash.get(name, 0), minimum=0)
        for name in ("conv_kernel_size", "conv_group_size")
    }
    if bool(conv["conv_kernel_size"]) != bool(conv["conv_group_size"]):
        raise CheckpointError(
            "draft config fields 'conv_kernel_size' and 'conv_group_size' go together, got "
            f"{conv['conv_kernel_size']} and {conv['conv_group_size']}"
        )
    if conv["conv_group_size"] and hidden_size % conv["conv_group_size"]:
        raise CheckpointError(
            f"draft config field 'conv_group_size' ({conv['conv_group_size']}) must divide "
            f"hidden_size ({hidden_size})"
        )
    return conv


def parse_selector(dflash: dict, architecture: str) -> dict:
    """DFlash2's selector fields (dflash_config only, as SGLang reads them); required on its
    classes, refused on the plain one by `contract.py`."""
    if architecture not in contract.SELECTOR_ARCHITECTURES:
        return {}
    fields = {}
    for name in ("selector_rank", "selector_top_k"):
        if not dflash.get(name):
            raise CheckpointError(
                f"draft config of class {architecture!r} is missing the field 'dflash_config.{name}'"
            )
        fields[name] = int_field(name, dflash[name], minimum=1)
    fields["output_multiplier"] = float(
        number_field("output_multiplier", dflash.get("output_multiplier", 1.0), positive=True)
    )
    softcap = float(number_field("final_logit_softcapping", dflash.get("final_logit_softcapping") or 0.0))
    fields["final_logit_softcapping"] = softcap if softcap > 0 else None
    return fields


@dataclass(frozen=True)
class LiLiCorrShape:
    """A LiLiCorr head's geometry and constants (`dflash_config.lilicorr_*`), as SGLang's
    `LiLiCorrConfig` holds them. `hidden_size` 0: as wide as the draft (no `token_proj`)."""

    candidate_topk: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_ratio: float
    factor_dim: int
    vector_eps: float
    logit_scale: float

    def width(self, draft_hidden_size: int) -> int:
        return self.hidden_size or draft_hidden_size


# The widest candidate list SGLang's fused LiLiCorr walk takes (`MAX_FUSED_CANDIDATE_TOPK`); it
# refuses wider heads, and so do we (the checkpoint would serve nowhere else).
LILICORR_MAX_TOPK = 16


def parse_lilicorr(dflash: dict, architecture: str, hidden_size: int) -> dict:
    """A LiLiCorr head's fields (dflash_config only; every one required, with no defaults, as
    SGLang's `_parse_lilicorr_config` requires them) on its class; `contract.py` refuses them on
    the others."""
    if architecture != contract.LILICORR:
        return {}
    if dflash.get("lilicorr_enabled") is not None and not dflash["lilicorr_enabled"]:
        raise CheckpointError(
            f"draft config of class {architecture!r} has 'dflash_config.lilicorr_enabled' = "
            f"{dflash['lilicorr_enabled']!r}: a LiLiCorr draft without its head is not served (SGLang "
            "refuses it too); declare architectures ['DFlashDraftModel'] for the plain draft"
        )
    values = {}
    for f in dataclasses.fields(LiLiCorrShape):
        key = f"lilicorr_{f.name}"
        if key not in dflash:
            raise CheckpointError(
                f"draft config of class {architecture!r} is missing the field 'dflash_config.{key}' "
                "(SGLang requires every lilicorr_* field, with no default)"
            )
        if f.name == "hidden_size":
            values[f.name] = int_field(key, dflash[key], minimum=0)
        elif f.type == "int":
            values[f.name] = int_field(key, dflash[key], minimum=1)
        else:
            values[f.name] = float(number_field(key, dflash[key], positive=True))
    shape = LiLiCorrShape(**values)
    k = shape.candidate_topk
    if k & (k - 1) or k > LILICORR_MAX_TOPK:
        raise CheckpointError(
            f"draft config field 'dflash_config.lilicorr_candidate_topk' must be a power of two up to "
            f"{LILICORR_MAX_TOPK} (as SGLang requires), got {k}"
        )
    if shape.width(hidden_size) % shape.num_heads:
        raise CheckpointError(
            f"draft config field 'dflash_config.lilicorr_num_heads' ({shape.num_heads}) must divide the "
            f"head's width ({shape.width(hidden_size)})"
        )
    return {"lilicorr": shape}


def parse_rope(raw: dict, get, head_dim: int) -> tuple[dict, Optional[int], bool]:
    """(RoPE parameters in transformers' `rope_parameters` form (v5), from either config style;
    the rotary width, None for the whole head; neox style), as SGLang's draft reads them:
    `rope_scaling.rope_dim` is the width; else `partial_rotary_factor` narrows the head."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", "default")
    number_field("rope_theta", params.get("rope_theta"), positive=True)
    if params["rope_type"] in ("dynamic",):
        raise CheckpointError(
            f"draft config rope type {params['rope_type']!r} is not supported (position-dependent)"
        )
    rope_dim = params.get("rope_dim")
    if rope_dim is not None:
        rotary_dim = int_field("rope_scaling.rope_dim", rope_dim, minimum=2)
    else:
        factor = params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise CheckpointError(
                f"draft config field 'partial_rotary_factor' must be in (0, 1], got {factor!r}"
            )
        rotary_dim = int(head_dim * factor) if factor < 1 else head_dim
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise CheckpointError(
            f"draft config gives a rotary width of {rotary_dim} for head_dim {head_dim}: it must be "
            "even and at most head_dim"
        )
    for key in ROPE_DIM_SUPERSEDES:
        params.pop(key, None)
    if rotary_dim != head_dim and params["rope_type"] != "default":
        raise CheckpointError(
            f"draft config rope type {params['rope_type']!r} with a rotary width of {rotary_dim} "
            f"(head_dim {head_dim}) is not served; {contract.WAY_OUT}"
        )
    # Read at the top level, as SGLang does.
    neox = bool_field("rope_is_neox_style", raw.get("rope_is_neox_style", raw.get("is_neox_style", True)))
    return params, (None if rotary_dim == head_dim else rotary_dim), neox


DOMINO_KEYS = ("shift_label", "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim")


def parse_domino(raw: dict, dflash: dict) -> dict:
    """Domino's projector fields (`projector_type: "domino"`), each read from dflash_config
    first, then the top level, as SGLang reads them; `emb_dim` must agree where both give it.
    Domino keys without the projector, and any other projector, are refused by name (SGLang
    would ignore them)."""

    def get(name: str) -> Any:
        return dflash.get(name, raw.get(name))

    projector = get("projector_type")
    if projector is None:
        stray = next((k for k in DOMINO_KEYS if get(k) is not None), None)
        if stray is not None:
            raise CheckpointError(
                f"draft config field {stray!r} declares Domino's GRU rollout projector, but "
                f"'projector_type' is not 'domino'; sglang-dflash would otherwise ignore it; "
                f"{contract.WAY_OUT}"
            )
        return {}
    if projector != "domino":
        raise CheckpointError(
            f"draft config field 'projector_type' is {projector!r}: only 'domino' is served; "
            f"{contract.WAY_OUT}"
        )
    shift_label = get("shift_label")
    if not isinstance(shift_label, bool):
        raise CheckpointError(
            f"Domino draft config field 'shift_label' must be a boolean, got {shift_label!r}"
        )
    prefix = get("pure_draft_prefix_len")
    if prefix != 1 or isinstance(prefix, bool):
        raise CheckpointError(
            "Domino draft config field 'pure_draft_prefix_len' must be 1 (as SGLang requires), "
            f"got {prefix!r}"
        )
    nested, top = dflash.get("emb_dim"), raw.get("emb_dim")
    if nested is not None and top is not None and nested != top:
        raise CheckpointError(
            f"Domino draft config field 'emb_dim' differs between dflash_config ({nested!r}) and the "
            f"top level ({top!r})"
        )
    return {
        "projector_type": "domino",
        "shift_label": shift_label,
        "gru_hidden_dim": int_field("gru_hidden_dim", get("gru_hidden_dim"), minimum=1),
        "emb_dim": int_field("emb_dim", nested if nested is not None else top, minimum=1),
    }


# SGLang's `LagunaConfig` (configs/laguna.py) defaults of the fields a draft reads, applied to a
# `model_type: laguna` config that omits them (SGLang builds such configs with that class).
LAGUNA_DEFAULTS = {
    "vocab_size": 100352, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 40,
    "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "attention_bias": False,
    "sliding_window": 512,
}  # fmt: skip
GATING = {True: "per-head", "per-head": "per-head", "per-element": "per-element", False: "disabled"}


def read_laguna(raw: dict) -> tuple[dict, str]:
    """A Laguna draft's config as SGLang reads it -> (the config with that reading applied, the
    gating mode: "per-head", "per-element" or "disabled").

    SGLang's `DFlashLagunaAttention` takes `gating` (default true: per head, `normalize_gating`)
    and one head count for every layer, which `LagunaConfig` takes from
    `num_attention_heads_per_layer` at the first full-attention layer; different counts per
    layer are refused here (SGLang would build every layer with that one count). RoPE
    parameters nested per layer type are refused: SGLang 0.5.23's draft hands the nested dict
    to `get_rope`, which cannot build it."""
    raw = dict(raw)
    if raw.get("model_type") == "laguna":
        raw.update({k: v for k, v in LAGUNA_DEFAULTS.items() if raw.get(k) is None})
    gating = raw.get("gating", True)
    if gating is None or gating == "disabled":
        gating = False
    if isinstance(gating, (int, float)) and not isinstance(gating, bool) or gating not in GATING:
        raise CheckpointError(
            "Laguna draft config field 'gating' must be true, false, null, 'per-head', 'per-element' "
            f"or 'disabled', got {gating!r}"
        )
    rope = raw.get("rope_parameters")
    nested = sorted(set(rope) & {"full_attention", "sliding_attention"}) if isinstance(rope, dict) else []
    if nested:
        raise CheckpointError(
            f"draft config field 'rope_parameters' is nested per layer type ({nested}): SGLang 0.5.23's "
            "Laguna draft cannot build that RoPE either (get_rope takes one flat dict); give one flat "
            "rope_parameters for every draft layer"
        )
    heads = raw.get("num_attention_heads_per_layer")
    if heads is not None:
        layers = raw.get("num_hidden_layers")
        if not isinstance(heads, list) or len(heads) != layers or not heads:
            raise CheckpointError(
                "draft config field 'num_attention_heads_per_layer' must list one head count per layer "
                f"({layers} layers), got {heads!r}"
            )
        for count in heads:
            int_field("num_attention_heads_per_layer", count, minimum=1)
        if len(set(heads)) > 1:
            raise CheckpointError(
                f"draft config field 'num_attention_heads_per_layer' is {heads}: SGLang's Laguna draft "
                "builds every layer with one head count, so counts that differ are not served; "
                f"{contract.WAY_OUT}"
            )
        raw["num_attention_heads"] = heads[0]
    return raw, GATING[gating]

"""What a draft checkpoint may hold: every config key and every tensor is served or refused.

SGLang's built-in DFLASH serves several draft families and options beyond plain z-lab DFlash
(grouped convolution, DFlash2's candidate selector, Domino, MiMo's attention sinks, ...), and
it declares most of them by a config key or by extra tensors on the same `DFlashDraftModel`
class. A checkpoint whose extras were ignored would still verify correctly, but its
acceptance would collapse without a word. So nothing is ignored:

  * a config key (in `dflash_config` or at the top level) is parsed by `config.py`, or listed
    here as metadata that carries no maths, or checked to agree with what is served (keys SGLang
    never reads: `check_agreement`), or refused by name with the family it declares;
  * a tensor is a weight of the draft network, or listed here as inert (a rotary cache), or
    refused by name with the family its name belongs to.

A refusal is one line: the field or tensor, its value, the family, and the way out
(`SGLANG_DFLASH_IMPL=builtin`, which hands DFLASH back to SGLang's built-in worker).

See docs/serving.md ("Draft checkpoints").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

WAY_OUT = "serve it with SGLang's built-in DFLASH (SGLANG_DFLASH_IMPL=builtin)"


class CheckpointError(ValueError):
    """A DFlash draft checkpoint (or its pairing with a target) is unusable."""


class RefusedCheckpoint(CheckpointError):
    """A draft checkpoint declares something sglang-dflash does not serve."""


# ------------------------------------------------------------------------------ classes

# The classes of DFlash2 drafts: the plain backbone plus a candidate selector (`propose/selector.py`).
SELECTOR_ARCHITECTURES = ("DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel")
# Muse Glimmer's assistant: the plain draft's maths under its own class (and `model_type`).
MUSE_ASSISTANT = "MuseGlimmerAssistantModel"
# Laguna's drafts: a softplus gate on the attention output, a norm per captured feature slice,
# and the context through each layer's input norm (`fields.read_laguna`).
LAGUNA = "DFlashLagunaForCausalLM"
# LiLiCorr's drafts: the plain backbone plus a lattice correction head (`propose/lilicorr.py`), its
# geometry in `dflash_config.lilicorr_*` (`fields.parse_lilicorr`).
LILICORR = "LiLiCorrDraftModel"
LILICORR_FAMILY = "LiLiCorr (lattice correction head)"
LILICORR_KEYS = frozenset(
    {
        "lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers", "lilicorr_num_heads",
        "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps", "lilicorr_logit_scale",
        "lilicorr_enabled",
    }
)  # fmt: skip

DSPARK = "DSpark (a separate algorithm, --speculative-algorithm DSPARK)"
# architectures[0] -> the family SGLang 0.5.23 serves under that class and this package does not.
# Served: `config.SERVED_ARCHITECTURES`.
REFUSED_ARCHITECTURES = {"Qwen3DSparkModel": DSPARK, "LingDSparkModel": DSPARK, "DSparkDraftModel": DSPARK}


def refused_family(arch: Any) -> Optional[str]:
    """The family of a draft class this package does not serve, or None. Any class named for
    DSpark is DSpark's: vendors subclass it per target (LiquidAI's `Lfm2DSparkDraftModel`)."""
    if not isinstance(arch, str):
        return None
    if arch in REFUSED_ARCHITECTURES:
        return REFUSED_ARCHITECTURES[arch]
    return DSPARK if "dspark" in arch.lower() else None


def refuse_architecture(architectures: Any) -> None:
    """A class of another draft family is refused by its family's name."""
    if isinstance(architectures, list):
        for arch in architectures:
            family = refused_family(arch)
            if family is not None:
                raise RefusedCheckpoint(
                    f"draft config field 'architectures' is {architectures!r}: "
                    f"{family} drafts are not served by sglang-dflash; {WAY_OUT}"
                )


# --------------------------------------------------------------------------- config keys


@dataclass(frozen=True)
class Declares:
    """A config key that declares maths this package does not implement, unless it holds the
    value that turns the feature off; `top_level_only`: served in `dflash_config`, refused at
    the top level (where SGLang's plain draft does not read it); `served_for`: architectures
    whose `dflash_config` declares it as served (refused at the top level, which SGLang does
    not read, and on every other class); `top_level_for`: architectures whose top level declares
    it as served (refused in `dflash_config`, which SGLang does not read for it);
    `inert_on_argmax`: the values that change no proposal of a draft proposing the argmax of the
    target's LM head (`proposes_target_argmax`): accepted there, in either scope, and named at
    start-up (`inert_fields`)."""

    family: str
    is_off: Callable[[Any], bool]
    top_level_only: bool = False
    served_for: tuple[str, ...] = ()
    top_level_for: tuple[str, ...] = ()
    inert_on_argmax: Optional[Callable[[Any], bool]] = None


def _absent(value: Any) -> bool:
    return value is None


def _falsy(value: Any) -> bool:
    return value is None or value is False or value == 0


def _one(value: Any) -> bool:
    return value is None or value == 1 or value == 1.0


def _true(value: Any) -> bool:
    return value is None or value is True


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _no_cap(value: Any) -> bool:  # SGLang's reading: a cap of 0 or below is none
    return value is None or (_real(value) and value <= 0)


def _positive(value: Any) -> bool:
    return _real(value) and value > 0


# In the order a refusal names them. (SGLang: speculative/dflash_utils.py,
# parse_dflash_draft_config and is_nemotron_35_draft_config; models/dflash.py for the options.)
REFUSED_KEYS: dict[str, Declares] = {
    # The draft's own token embedding: SGLang uses it only for a draft it detects as Nemotron-3.5
    # (`is_nemotron_35`, served), and skips its tensors otherwise.
    "has_embed_tokens": Declares("the draft's own token embedding (Nemotron-3.5 style)", _falsy),
    # MiMo's window switch is read from dflash_config (`config.py`, `use_swa`), as vLLM reads it.
    **{
        key: Declares(
            "MiMo's sliding window at the top level (read from dflash_config)", _absent, top_level_only=True
        )
        for key in ("use_swa", "swa_window_size")
    },
    "sample_from_anchor": Declares("Nemotron-3.5 / DSpark (non-anchor query layout)", _true),
    # The rest of what Nemotron-3.5's drafts record about DSpark and PARD heads: off, or refused.
    "dflash_query_causal": Declares("causal block queries (dflash_query_causal)", _falsy),
    **{
        key: Declares("DSpark (Markov or fix-up head)", _absent)
        for key in ("dspark_markov_rank", "dspark_fixup_head_type")
    },
    # DFlash2's candidate selector head (served on its classes).
    "selector_rank": Declares("DFlash2 (candidate selector)", _falsy, served_for=SELECTOR_ARCHITECTURES),
    "selector_top_k": Declares("DFlash2 (candidate selector)", _falsy, served_for=SELECTOR_ARCHITECTURES),
    # The selector's transform of the target head's logits. A positive scale and a soft-cap
    # (c tanh(x / c)) are strictly increasing, so on a draft proposing that head's argmax they
    # change no proposal and no ranking (the Gemma-4 drafts carry their target's cap, 30.0, at the
    # top level); on the other families they rescale the scores a walk or a GRU adds to.
    "output_multiplier": Declares(
        "DFlash2 (selector logit multiplier)",
        _one,
        served_for=SELECTOR_ARCHITECTURES,
        inert_on_argmax=_positive,
    ),
    "final_logit_softcapping": Declares(
        "DFlash2 (selector logit soft-capping)",
        _no_cap,
        served_for=SELECTOR_ARCHITECTURES,
        inert_on_argmax=_real,
    ),
    # Laguna's gate and head counts (served on its class, at the top level as LagunaConfig reads them).
    "gating": Declares(
        "Laguna (attention output gate)", lambda v: v in (None, False, "disabled"), top_level_for=(LAGUNA,)
    ),
    "num_attention_heads_per_layer": Declares(
        "Laguna (per-layer head counts)", _absent, top_level_for=(LAGUNA,)
    ),
    # Weight formats (`quantization_config` is parsed: fp8 dequantised at load, `quantization.py`).
    "text_config": Declares("a nested text_config (multimodal-style draft config)", _absent),
    # Options of the plain family.
    **{
        key: Declares(
            "grouped dynamic convolution at the top level (SGLang reads it from dflash_config)",
            _falsy,
            top_level_only=True,
        )
        for key in ("conv_kernel_size", "conv_group_size")
    },
    "attention_sink_bias": Declares(
        "Nemotron-3.5 style attention sinks (at the top level; MiMo's are read from dflash_config)",
        _falsy,
        top_level_only=True,
    ),
    "attention_value_scale": Declares(
        "a value scale at the top level (SGLang reads MiMo's from dflash_config)",
        _absent,
        top_level_only=True,
    ),
    "mlp_bias": Declares("MLP biases (mlp_bias)", _falsy),
}
# Key prefixes of families refused as a whole: LiLiCorr's head (but on its class, in dflash_config,
# where `fields.parse_lilicorr` reads its fields), DSpark's Markov head.
PREFIX_FAMILIES = {"lilicorr_": LILICORR_FAMILY, "markov_": "DSpark (Markov head)"}

# Keys `config.py` parses into `DFlashDraftConfig` (their values are checked there).
PARSED_KEYS = frozenset(
    {
        "architectures", "dflash_config", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps",
        "attention_bias", "block_size", "mask_token_id", "mask_token", "num_target_layers",
        "target_layer_ids", "layer_types", "sliding_window", "is_causal", "input_embedding_scale",
        "vocab_size", "rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
        "use_gemma_norm", "partial_rotary_factor", "rope_is_neox_style", "is_neox_style",
        "swiglu_alpha", "swiglu_limit",
        "projector_type", "shift_label", "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim",
        "use_swa", "swa_window_size", "quantization_config",
    }
)  # fmt: skip

# Keys that carry no maths for a draft network with no embedding and no LM head of its own:
# provenance, training-time settings and generation defaults. transformers' own generic keys
# (`PretrainedConfig().to_dict()`) are added to these in `metadata_keys()`.
METADATA_KEYS = frozenset(
    {
        "model_type", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "auto_map",
        "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "use_cache",
        "attention_dropout", "initializer_range", "pretraining_tp", "has_lm_head",
        # Qwen3's sliding-window switches, which its config class applies (`config_class.py`).
        "use_sliding_window", "max_window_layers",
        # Training settings (MiMo's drafts): the anchors per sequence, the loss's decay, and the
        # target's RoPE base, recorded beside the draft's own (`rope_theta`). No serving
        # implementation reads it (vLLM's and SGLang's MiMo drafts; llama.cpp copies it as metadata).
        "num_anchors", "loss_decay_gamma", "backbone_rotary_base",
        # Nemotron-3.5's: whether training updated the draft's own embedding.
        "train_embed_tokens",
    }
)  # fmt: skip

# RoPE parameters (rope_scaling / rope_parameters) that `config.py` and
# `draft/model.py`'s `_rope_inv_freq` serve, or that change nothing for a draft: it only ever sees 1-D
# positions, where M-RoPE equals RoPE (SGLang's draft does the same).
ROPE_KEYS = frozenset(
    {
        "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
        "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
        "mscale", "mscale_all_dim", "short_factor", "long_factor", "truncate",
        "rope_dim", "partial_rotary_factor", "mrope_section", "mrope_interleaved",
    }
)  # fmt: skip

# Keys SGLang's `LagunaConfig` takes for the Laguna target that a Laguna draft's config may carry
# and its draft layers never read (their MLP is dense; their attention reads the fields above).
LAGUNA_TARGET_KEYS = frozenset(
    {
        "mlp_layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "moe_routed_scaling_factor", "moe_router_logit_softcapping",
        "moe_apply_router_weight_on_input", "moe_router_score_func",
    }
)  # fmt: skip

_metadata_keys: Optional[frozenset] = None


def metadata_keys() -> frozenset:
    global _metadata_keys
    if _metadata_keys is None:
        from transformers import PretrainedConfig

        _metadata_keys = METADATA_KEYS | frozenset(PretrainedConfig().to_dict())
    return _metadata_keys


NEMOTRON_35_KEYS = ("has_embed_tokens", "sample_from_anchor", "attention_sink_bias")


def nemotron_35_unmet(raw: dict) -> list[str]:
    """What `raw` lacks to be a draft SGLang's built-in treats as Nemotron-3.5's (its own NVFP4
    embedding): the conditions of `is_nemotron_35_draft_config` in speculative/dflash_utils.py,
    condition for condition, each named as the field that would meet it. []: Nemotron-3.5's."""
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    unmet = []
    if not {"DFlashDraftModel", "Qwen3DSparkModel"} & set(raw.get("architectures") or []):
        unmet.append("architectures with 'DFlashDraftModel' or 'Qwen3DSparkModel'")
    if not raw.get("has_embed_tokens"):
        unmet.append("has_embed_tokens true")
    if raw.get("has_lm_head"):
        unmet.append("has_lm_head false")
    quant = raw.get("quantization_config") or {}
    if not isinstance(quant, dict) or quant.get("quant_algo") != "W4A16_NVFP4":
        unmet.append("the NVFP4 block quantization_config with quant_algo 'W4A16_NVFP4'")
    ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if not ids or not aux or len(ids) != len(aux) or any(int(t) + 1 != int(a) for t, a in zip(ids, aux)):
        unmet.append("eagle_aux_hidden_state_layer_ids equal to target_layer_ids + 1")
    if dflash.get("sample_from_anchor", raw.get("sample_from_anchor", True)) is not False:
        unmet.append("sample_from_anchor false")
    return unmet


def is_nemotron_35(raw: dict) -> bool:
    """Whether SGLang's built-in treats the draft as Nemotron-3.5's (`nemotron_35_unmet`)."""
    return not nemotron_35_unmet(raw)


def proposes_target_argmax(raw: dict, architecture: str) -> bool:
    """Whether the draft proposes the argmax of the target's LM head on its hidden states (plain
    DFlash, Muse Glimmer's assistant, Laguna, Nemotron-3.5): a map of those logits that keeps
    their order changes none of its proposals, nor a grammar's ranking of them. Not DFlash2's or
    LiLiCorr's walks, nor Domino's corrected logits, which add to the logits' values."""
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    projector = dflash.get("projector_type", raw.get("projector_type"))
    return architecture not in (*SELECTOR_ARCHITECTURES, LILICORR) and projector is None


def _scopes(raw: dict) -> tuple[tuple[str, dict], ...]:
    """Where a key may sit: (prefix of its name, the dict), dflash_config's then the top level's."""
    dflash = raw.get("dflash_config") or {}
    return (("dflash_config.", dflash), ("", raw)) if isinstance(dflash, dict) else (("", raw),)


def _inert(rule: Declares, value: Any, argmax: bool) -> bool:
    return argmax and rule.inert_on_argmax is not None and rule.inert_on_argmax(value)


def inert_fields(raw: dict, architecture: str) -> tuple[str, ...]:
    """The keys `check_config` accepts because they change no proposal of this draft, as
    'name = value', to name at start-up (they are not applied)."""
    argmax = proposes_target_argmax(raw, architecture)
    return tuple(
        f"{where}{key} = {_short(scope[key])}"
        for where, scope in _scopes(raw)
        for key, rule in REFUSED_KEYS.items()
        if key in scope and not rule.is_off(scope[key]) and _inert(rule, scope[key], argmax)
    )


def check_config(
    raw: dict, architecture: str = "DFlashDraftModel", class_keys: frozenset = frozenset()
) -> None:
    """Refuse the first key of `raw` (a parsed `config.json` of a draft of class `architecture`)
    that is neither parsed, nor metadata, nor switched off, nor one `check_agreement` checks.
    Keys of `dflash_config` and of the top level are both read. `class_keys`: the fields of the
    config class `model_type` names (`config_class.class_keys`), which the draft never reads
    beyond those `config.py` parses."""
    # A Nemotron-3.5 draft's own embedding is served, its top-level sinks are read (as SGLang's
    # draft reads them for it), and its `sample_from_anchor: false` is what SGLang's DFLASH serves
    # with the anchor row layout anyway (only DSpark reads it).
    unmet = nemotron_35_unmet(raw)
    nemotron = () if unmet else NEMOTRON_35_KEYS
    argmax = proposes_target_argmax(raw, architecture)
    scopes = _scopes(raw)
    for key, rule in REFUSED_KEYS.items():
        if key in nemotron:
            continue
        served = architecture in rule.served_for
        served_top = architecture in rule.top_level_for
        for where, scope in scopes:
            if ((rule.top_level_only or served) and where) or (served_top and not where):
                continue
            if key in scope and not rule.is_off(scope[key]) and not _inert(rule, scope[key], argmax):
                if key == "has_embed_tokens":  # served on Nemotron-3.5's drafts: say what is missing
                    _refuse_own_embedding(where + key, scope[key], unmet)
                family = rule.family
                if served:
                    family += " at the top level (SGLang reads it from dflash_config)"
                if served_top:
                    family += " in dflash_config (SGLang reads it at the top level)"
                _refuse_key(where + key, scope[key], family)
    known = PARSED_KEYS | REFUSED_KEYS.keys() | metadata_keys() | AGREEMENT_KEYS | class_keys | LILICORR_KEYS
    for where, scope in scopes:
        for key, value in scope.items():
            prefix = next((p for p in PREFIX_FAMILIES if key.startswith(p)), None)
            # On LiLiCorr's class its head's fields are read in dflash_config (others there: unknown).
            head_field = architecture == LILICORR and prefix == "lilicorr_" and bool(where)
            if prefix is not None and not head_field:
                family = PREFIX_FAMILIES[prefix]
                if architecture == LILICORR and prefix == "lilicorr_":
                    family += " at the top level (SGLang reads it from dflash_config)"
                _refuse_key(where + key, value, family)
            laguna_key = architecture == LAGUNA and key in LAGUNA_TARGET_KEYS and not where
            if key not in known and not laguna_key:
                raise RefusedCheckpoint(
                    f"draft config field {where + key!r} ({_short(value)}) is unknown to sglang-dflash, "
                    f"which would otherwise ignore it; {WAY_OUT}"
                )
    for name in ("rope_scaling", "rope_parameters"):
        rope = raw.get(name)
        if isinstance(rope, dict):
            for key, value in rope.items():
                if key not in ROPE_KEYS:
                    raise RefusedCheckpoint(
                        f"draft config field '{name}.{key}' ({_short(value)}) is unknown to "
                        f"sglang-dflash, which would otherwise ignore it; {WAY_OUT}"
                    )


# Keys SGLang never reads that published drafts carry: each is accepted when it agrees with what
# is served, and refused by name when it does not (it would describe a draft other than the one
# served). `check_agreement` checks them once the config is parsed.
AGREEMENT_KEYS = frozenset(
    {
        "draft_vocab_size", "sliding_windows", "causal", "eagle_aux_hidden_state_layer_ids", "v_head_dim",
        "initial_context_length", "num_aux_layers", "pard_token",
    }
)  # fmt: skip
# The model fields SGLang reads at the top level only (`config_class.MODEL_FIELDS`, less the ones
# no dflash_config would hold): a copy in dflash_config must agree with the top level's.
TOP_LEVEL_ONLY = (
    "layer_types", "sliding_window", "is_causal", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act",
    "rms_norm_eps", "attention_bias", "vocab_size",
)  # fmt: skip


def check_agreement(raw: dict, top: dict, config: Any) -> None:
    """Refuse a key SGLang never reads that disagrees with the parsed `config` (a
    `DFlashDraftConfig`; `top`: the model fields as SGLang reads them, `config_class.py`)."""
    dflash = raw.get("dflash_config") or {}
    for key in TOP_LEVEL_ONLY:
        if key in dflash and _as_list(dflash[key]) != _as_list(top.get(key)):
            _disagrees(
                f"dflash_config.{key}", dflash[key],
                f"SGLang reads '{key}' at the top level only, where it is {_short(top.get(key))}",
            )  # fmt: skip
    scopes = (("dflash_config.", dflash), ("", raw))
    for where, scope in scopes:
        if scope.get("draft_vocab_size") not in (None, config.vocab_size):
            _disagrees(
                where + "draft_vocab_size", scope["draft_vocab_size"],
                f"the draft proposes over the target's whole vocabulary (vocab_size {config.vocab_size}); "
                "a smaller draft vocabulary with a token map (EAGLE-3's d2t) is not DFlash's",
            )  # fmt: skip
        if "sliding_windows" in scope:
            want = [config.layer_window(i) for i in range(config.num_hidden_layers)]
            got = scope["sliding_windows"]
            if not isinstance(got, list) or [w or None for w in got] != want:
                _disagrees(
                    where + "sliding_windows",
                    got,
                    f"the layers' windows from 'layer_types' and 'sliding_window' are {want}",
                )
        if "causal" in scope:
            causal = [config.layer_is_causal(i) for i in range(config.num_hidden_layers)]
            if scope["causal"] not in (True, False) or any(c != scope["causal"] for c in causal):
                _disagrees(
                    where + "causal",
                    scope["causal"],
                    "SGLang ignores it; causality comes from 'layer_types' and 'is_causal', which make "
                    f"the layers' attention causal {causal}",
                )
        original = config.rope.get("original_max_position_embeddings")  # gpt-oss: before YaRN
        context = scope.get("initial_context_length")
        if context is not None and original is not None and context != original:
            why = f"the RoPE's original_max_position_embeddings is {original}"
            _disagrees(where + "initial_context_length", context, why)
        ids = config.target_layer_ids
        if "num_aux_layers" in scope and ids is not None and scope["num_aux_layers"] != len(ids):
            why = f"the draft reads {len(ids)} captured target layers ({list(ids)})"
            _disagrees(where + "num_aux_layers", scope["num_aux_layers"], why)
        if "pard_token" in scope and scope["pard_token"] != config.mask_token_id:
            why = f"the block's MASK token is {config.mask_token_id}"
            _disagrees(where + "pard_token", scope["pard_token"], why)
        if "v_head_dim" in scope and scope["v_head_dim"] not in (None, 0, config.head_dim):
            _disagrees(
                where + "v_head_dim",
                scope["v_head_dim"],
                f"the draft's V heads are head_dim ({config.head_dim}) wide",
            )
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None:
        ids = config.target_layer_ids
        if ids is None or _as_list(aux) != [i + 1 for i in ids]:
            _disagrees(
                "eagle_aux_hidden_state_layer_ids",
                aux,
                f"the layers captured for the draft are target_layer_ids + 1 ({[i + 1 for i in ids or ()]})",
            )
    if "eagle_aux_hidden_state_layer_ids" in dflash:
        _disagrees(
            "dflash_config.eagle_aux_hidden_state_layer_ids",
            dflash["eagle_aux_hidden_state_layer_ids"],
            "SGLang reads it at the top level only",
        )


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _disagrees(name: str, value: Any, why: str) -> None:
    raise RefusedCheckpoint(
        f"draft config field {name!r} = {_short(value)} disagrees with the draft served: {why}; "
        f"sglang-dflash would otherwise ignore it; {WAY_OUT}"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse_own_embedding(name: str, value: Any, unmet: list[str]) -> None:
    raise RefusedCheckpoint(
        f"draft config field {name!r} = {_short(value)} declares the draft's own token embedding, "
        "which SGLang and sglang-dflash serve on a draft SGLang detects as Nemotron-3.5 "
        f"(is_nemotron_35_draft_config), and this config lacks {'; '.join(unmet)}; {WAY_OUT}"
    )


def _refuse_key(name: str, value: Any, family: str) -> None:
    raise RefusedCheckpoint(
        f"draft config field {name!r} = {_short(value)} declares {family}, which sglang-dflash "
        f"does not serve; {WAY_OUT}"
    )


# ------------------------------------------------------------------------------ tensors

# Tensor-name patterns (after `model.` is stripped) -> the family whose weights they are. Served
# families whose config keys are missing say which keys (`SERVED_WHEN_DECLARED`).
TENSOR_FAMILIES = (
    (r"^layers\.\d+\.(attention_conv|mlp_conv)\.", "grouped dynamic convolution"),
    (r"^(prefix_gru|embed_proj)\.", "Domino (GRU rollout projector)"),
    (r"\.attention_sink_bias$", "attention sinks"),
    (r"^candidate_selector\.", "DFlash2 (candidate selector)"),
    (r"^lilicorr\.", LILICORR_FAMILY),
    (r"^aux_hidden_norms\.|\.self_attn\.g_proj\.", "Laguna (gated attention, per-slice feature norms)"),
    (r"^embed_tokens\.", "the draft's own token embedding (Nemotron-3.5 style)"),
    (r"^lm_head\.", "the draft's own LM head"),
    (
        r"\.(weight_scale|weight_scale_2|weight_scale_inv|input_scale|weight_packed|qweight|qzeros|"
        r"scales|g_idx)$",
        "quantized draft weights",
    ),
)
SERVED_WHEN_DECLARED = {
    "Domino (GRU rollout projector)": "projector_type: domino, with shift_label, gru_hidden_dim, emb_dim",
    "Laguna (gated attention, per-slice feature norms)": f"architectures: [{LAGUNA!r}], with its gating",
    "grouped dynamic convolution": "dflash_config.conv_kernel_size and conv_group_size",
    "attention sinks": "dflash_config.attention_sink_bias: true",
    "the draft's own token embedding (Nemotron-3.5 style)": (
        "a Nemotron-3.5 draft: has_embed_tokens, quantization_config.quant_algo W4A16_NVFP4, "
        "eagle_aux_hidden_state_layer_ids, sample_from_anchor false"
    ),
    LILICORR_FAMILY: f"architectures: [{LILICORR!r}], with dflash_config.lilicorr_*",
}
# Tensors that hold nothing the draft computes with: HF's cached RoPE frequencies.
INERT_TENSORS = r"(^|\.)rotary_emb\.inv_freq$"

# Vendor names SGLang's built-in loads as the plain draft's weights (models/dflash.py).
TENSOR_ALIASES = {
    "encoder.fc.weight": "fc.weight",
    "encoder.output_norm_enc.weight": "hidden_norm.weight",
}

# Safetensors header dtypes (and their torch names) that hold plain weights.
DENSE_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "float64", "float32", "float16", "bfloat16"})


def canonical_name(name: str) -> str:
    """The draft network's name for a checkpoint tensor: `model.` stripped, vendor aliases
    resolved."""
    name = name.removeprefix("model.")
    return TENSOR_ALIASES.get(name, name)


def check_tensors(names: Iterable[str], expected: Iterable[str], dtypes: dict[str, str]) -> None:
    """Refuse the first tensor that is not a weight of the draft network (`expected`), naming
    its family; refuse quantized dtypes. `names` and `dtypes` use canonical names."""
    expected = set(expected)
    for name in sorted(names):
        if name in expected:
            dtype = dtypes.get(name)
            if dtype is not None and dtype.removeprefix("torch.") not in DENSE_DTYPES:
                raise RefusedCheckpoint(
                    f"draft weight {name!r} is stored as {dtype}, and its config declares no "
                    "quantization_config that sglang-dflash dequantises (quant_method fp8); "
                    f"{WAY_OUT}"
                )
            continue
        if re.search(INERT_TENSORS, name):
            continue
        family = next((f for pattern, f in TENSOR_FAMILIES if re.search(pattern, name)), None)
        if family == LILICORR_FAMILY and any(e.startswith("lilicorr.") for e in expected):
            raise RefusedCheckpoint(
                f"draft checkpoint tensor {name!r} is not a weight of the LiLiCorr head its config "
                "describes (check lilicorr_hidden_size, lilicorr_num_layers and lilicorr_factor_dim); "
                f"sglang-dflash would otherwise ignore it; {WAY_OUT}"
            )
        if family in SERVED_WHEN_DECLARED:
            raise RefusedCheckpoint(
                f"draft checkpoint tensor {name!r} belongs to {family}, which its config does not "
                f"declare ({SERVED_WHEN_DECLARED[family]}); {WAY_OUT}"
            )
        if family is not None:
            raise RefusedCheckpoint(
                f"draft checkpoint tensor {name!r} belongs to {family}, which sglang-dflash does "
                f"not serve; {WAY_OUT}"
            )
        raise RefusedCheckpoint(
            f"draft checkpoint tensor {name!r} is not a weight of a DFlash draft, and sglang-dflash "
            f"would otherwise ignore it; {WAY_OUT}"
        )

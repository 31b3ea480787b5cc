"""The checkpoint contract (`checkpoint/contract.py`): every config key and tensor of a draft
checkpoint is served or refused by name, with its family and the way out.

The cases are the draft families and options SGLang's built-in DFLASH serves (see
docs/serving.md, "Draft checkpoints"). Before the contract, each case marked "was accepted"
below loaded as a plain DFlash draft with its extras ignored: those tests fail without it.
"""

import json
import os
import re

import pytest
import torch

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.checkpoint.mask_token import load_mask_embedding
from sglang_dflash.draft.model import DFlashDraftModel
from tests.support.tiny import LILICORR_FIELDS, draft_config_dict

WAY_OUT = "SGLANG_DFLASH_IMPL=builtin"


def _dc(**kwargs):
    return lambda d: d["dflash_config"].update(kwargs)


def _top(**kwargs):
    return lambda d: d.update(kwargs)


# (edit of a plain config, words the refusal must contain). "was accepted": served as plain
# DFlash, its extras ignored, before the contract.
CONFIG_CASES = [
    pytest.param(
        _top(conv_kernel_size=3, conv_group_size=16),
        "'conv_kernel_size' = 3 declares grouped dynamic convolution at the top level",
        id="top-level-conv",
    ),
    pytest.param(
        _dc(shift_label=True, gru_hidden_dim=32, emb_dim=24),
        "'shift_label' declares Domino's GRU rollout projector, but 'projector_type' is not 'domino'",
        id="domino-keys-without-the-projector",  # was accepted
    ),
    pytest.param(
        _top(projector_type="mlp"), "'projector_type' is 'mlp': only 'domino' is served", id="other-projector"
    ),
    pytest.param(
        _top(attention_sink_bias=True),
        "'attention_sink_bias' = True declares Nemotron-3.5 style",
        id="top-sinks",
    ),
    pytest.param(
        _top(attention_value_scale=0.5), "declares a value scale at the top level", id="top-value-scale"
    ),
    pytest.param(
        _top(quantization_config={"quant_method": "awq"}),
        "declares quant_method 'awq': sglang-dflash dequantises fp8 and NVFP4",
        id="awq-config",  # fp8 is served: test_quantization.py
    ),
    pytest.param(
        _dc(selector_rank=8, selector_top_k=4), "declares DFlash2 (candidate selector)", id="selector-keys"
    ),
    pytest.param(
        _top(has_embed_tokens=True),
        "'has_embed_tokens' = True declares the draft's own token embedding",
        id="own-embedding",  # was "sliding_window must be an integer" or an fc.weight shape error
    ),
    pytest.param(
        _top(
            has_embed_tokens=True,
            quantization_config={"quant_algo": "W4A16_NVFP4"},
            eagle_aux_hidden_state_layer_ids=[1],
            target_layer_ids=[0],
            sample_from_anchor=True,
        ),
        "'has_embed_tokens' = True declares the draft's own token embedding",
        id="not-quite-nemotron-3.5",  # one condition of SGLang's is_nemotron_35_draft_config unmet
    ),
    pytest.param(
        _dc(lilicorr_candidate_topk=4),
        "'dflash_config.lilicorr_candidate_topk' = 4 declares LiLiCorr",
        id="lilicorr-keys",
    ),
    pytest.param(_top(my_new_trick=1), "'my_new_trick' (1) is unknown to sglang-dflash", id="unknown-key"),
    pytest.param(
        _top(rope_scaling={"rope_type": "default", "twist": 2}),
        "'rope_scaling.twist' (2) is unknown",
        id="unknown-rope-key",
    ),
]


@pytest.mark.parametrize("edit, message", CONFIG_CASES)
def test_config_keys_that_declare_unserved_maths_are_refused_by_name(edit, message):
    raw = draft_config_dict()
    edit(raw)
    with pytest.raises(CheckpointError) as error:
        DFlashDraftConfig.from_dict(raw)
    assert message in str(error.value), str(error.value)
    assert WAY_OUT in str(error.value)


DSPARK = "DSpark (a separate algorithm, --speculative-algorithm DSPARK)"


@pytest.mark.parametrize(
    "architecture",
    # LiquidAI's class for its LFM2 drafts, and any other vendor's DSpark subclass (were refused as
    # "architectures must contain one of [...]", naming no family).
    ["Qwen3DSparkModel", "DSparkDraftModel", "Lfm2DSparkDraftModel", "AcmeDSparkForCausalLM"],
)
def test_other_families_are_refused_by_their_name(architecture):
    raw = draft_config_dict()
    raw["architectures"] = [architecture]
    with pytest.raises(CheckpointError, match=f"{re.escape(DSPARK)}.*{WAY_OUT}"):
        DFlashDraftConfig.from_dict(raw)


def _lilicorr(raw):
    raw.update(architectures=["LiLiCorrDraftModel"])
    raw["dflash_config"].update(LILICORR_FIELDS)


def _domino(raw):
    raw["dflash_config"].update(
        projector_type="domino", shift_label=False, pure_draft_prefix_len=1, gru_hidden_dim=16, emb_dim=24
    )


def _dflash2(raw):
    raw.update(architectures=["DFlash2DraftModel"])
    raw["dflash_config"].update(selector_rank=8, selector_top_k=4)


@pytest.mark.parametrize(
    "family, edit, named",
    [
        (None, _top(final_logit_softcapping=30.0), "final_logit_softcapping = 30.0"),  # the Gemma-4 drafts'
        (None, _dc(final_logit_softcapping=30), "dflash_config.final_logit_softcapping = 30"),
        (None, _top(output_multiplier=0.5), "output_multiplier = 0.5"),
        (lambda d: d.update(architectures=["MuseGlimmerAssistantModel"]), _top(final_logit_softcapping=30.0),
         "final_logit_softcapping = 30.0"),
    ],
    ids=["top-soft-cap", "dflash-soft-cap", "multiplier", "muse-assistant"],
)  # fmt: skip
def test_logit_maps_that_keep_the_argmax_are_accepted_and_named_on_argmax_drafts(family, edit, named):
    """A soft-cap (c tanh(x / c)) and a positive scale of the target head's logits are strictly
    increasing: a draft proposing their argmax proposes the same tokens, and a grammar ranks its
    candidates alike, with or without them. Accepted, not applied, named at start-up (was refused
    as DFlash2's selector soft-capping, which refused the published Gemma-4 drafts)."""
    raw = draft_config_dict()
    if family:
        family(raw)
    edit(raw)
    config = DFlashDraftConfig.from_dict(raw)
    assert config.inert_fields == (named,)
    assert config.final_logit_softcapping is None and config.output_multiplier == 1.0  # not applied
    assert named not in " ".join(config.options_in_use())  # no departure from the plain maths


@pytest.mark.parametrize(
    "family, edit, words",
    [
        (_dflash2, _top(final_logit_softcapping=30.0),
         "'final_logit_softcapping' = 30.0 declares DFlash2 (selector logit soft-capping) at the top level"),
        (_lilicorr, _top(final_logit_softcapping=30.0), "'final_logit_softcapping' = 30.0 declares DFlash2"),
        (_lilicorr, _dc(final_logit_softcapping=30.0), "'dflash_config.final_logit_softcapping' = 30.0"),
        (_domino, _top(final_logit_softcapping=30.0), "'final_logit_softcapping' = 30.0 declares DFlash2"),
        (_domino, _dc(output_multiplier=0.5), "'dflash_config.output_multiplier' = 0.5 declares DFlash2"),
        (None, _top(output_multiplier=-1.0), "'output_multiplier' = -1.0 declares DFlash2"),
        (None, _top(final_logit_softcapping="30"), "'final_logit_softcapping' = '30' declares DFlash2"),
    ],
    ids=["dflash2-top-level", "lilicorr", "lilicorr-dflash-config", "domino", "domino-multiplier",
         "reversing-multiplier", "not-a-number"],
)  # fmt: skip
def test_logit_maps_are_refused_where_they_would_change_a_proposal(family, edit, words):
    """DFlash2's and LiLiCorr's walks score the head's candidates by their logits' values, and
    Domino adds its GRU's corrections to them: there a cap or a scale changes the proposals (SGLang
    applies them on DFlash2's classes only, from dflash_config). A negative scale reverses the order."""
    raw = draft_config_dict()
    if family:
        family(raw)
    edit(raw)
    with pytest.raises(CheckpointError) as error:
        DFlashDraftConfig.from_dict(raw)
    assert words in str(error.value) and WAY_OUT in str(error.value), str(error.value)


@pytest.mark.parametrize(
    "architecture", ["DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel"]
)
def test_dflash2_classes_are_served_with_their_selector_fields(architecture):
    raw = draft_config_dict()
    raw["architectures"] = [architecture]
    with pytest.raises(CheckpointError, match="missing the field 'dflash_config.selector_rank'"):
        DFlashDraftConfig.from_dict(raw)
    raw["dflash_config"].update(
        selector_rank=8, selector_top_k=4, output_multiplier=0.5, final_logit_softcapping=0
    )
    config = DFlashDraftConfig.from_dict(raw)
    assert (config.architecture, config.selector_rank, config.selector_top_k) == (architecture, 8, 4)
    assert config.output_multiplier == 0.5 and config.final_logit_softcapping is None
    assert "candidate selector (rank 8, top 4)" in config.options_in_use()
    assert "candidate selector" not in " ".join(config.options_in_use("forward"))  # the fused forward applies
    raw["selector_rank"] = 8  # SGLang reads the selector's fields from dflash_config only
    with pytest.raises(CheckpointError, match="'selector_rank' = 8 declares DFlash2.*at the top level"):
        DFlashDraftConfig.from_dict(raw)


def test_muse_glimmer_assistants_are_served_with_their_class_defaults():
    """SGLang builds `model_type: muse_glimmer_assistant` configs with MuseGlimmerAssistantConfig,
    whose class default is_causal=False makes every layer non-causal, sliding ones too."""
    raw = draft_config_dict(num_layers=2)
    raw.update(architectures=["MuseGlimmerAssistantModel"], model_type="muse_glimmer_assistant")
    raw.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True)
    config = DFlashDraftConfig.from_dict(raw)
    assert config.architecture == "MuseGlimmerAssistantModel" and config.is_causal is False
    assert not config.layer_is_causal(0) and not config.layer_is_causal(1)
    raw["is_causal"] = True  # an explicit value wins, as over a class default
    assert DFlashDraftConfig.from_dict(raw).layer_is_causal(1)
    raw.pop("is_causal")
    raw["model_type"] = "qwen3"  # the reference's rule: sliding layers causal
    assert DFlashDraftConfig.from_dict(raw).layer_is_causal(0)


@pytest.mark.sglang
@pytest.mark.parametrize("target_type", ["muse_glimmer", "llama"])
@pytest.mark.parametrize(
    "architecture",
    ["MuseGlimmerAssistantModel", "DFlash2DraftModel", "MiniMaxDFlash2DraftModel", "DFlashDraftModel"],
)
def test_captured_layer_ids_follow_sglangs_muse_mapping(target_type, architecture):
    from types import SimpleNamespace

    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        _map_muse_target_layer_ids,
    )

    from sglang_dflash.draft.target_features import captured_layer_ids

    ids = [1, 5, 9]
    want = _map_muse_target_layer_ids(
        target_hf_config=SimpleNamespace(model_type=target_type),
        draft_hf_config=SimpleNamespace(architectures=[architecture]),
        layer_ids=ids,
    )
    assert captured_layer_ids(ids, target_type, architecture) == want


@pytest.mark.parametrize(
    "edit",
    [
        _dc(conv_kernel_size=0, conv_group_size=0),
        _dc(attention_sink_bias=False, attention_value_scale=None),
        _dc(attention_sink_bias=True, attention_value_scale=0.5),  # served (MiMo)
        _dc(conv_kernel_size=3, conv_group_size=16),  # served
        _top(use_gemma_norm=False, partial_rotary_factor=1.0, rope_is_neox_style=True),
        _top(use_gemma_norm=True, partial_rotary_factor=0.5, rope_is_neox_style=False),  # served
        _top(rope_scaling={"rope_type": "default", "rope_dim": 8}),  # served
        _top(hidden_act="swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0),  # served
        _top(rope_scaling={"rope_type": "default", "mrope_section": [8, 12, 12], "mrope_interleaved": True}),
        _dc(mask_token="<|MASK|>"),  # with mask_token_id: the id is used
        _top(quantization_config=None, projector_type=None, use_sliding_window=False, max_window_layers=28),
        _top(torch_dtype="bfloat16", transformers_version="4.57.1", bos_token_id=0, eos_token_id=2),
        _top(output_hidden_states=False, id2label={"0": "LABEL_0"}),  # transformers' generic keys
    ],
    ids=["conv-off", "mimo-off", "mimo", "grouped-conv", "rope-and-norm-defaults", "gemma-and-rope-options",
         "rope-dim", "swigluoai", "mrope-on-1d-positions", "mask-token-with-id",
         "nulls", "provenance", "hf-generic"],
)  # fmt: skip
def test_keys_that_change_nothing_are_accepted(edit):
    raw = draft_config_dict()
    edit(raw)
    DFlashDraftConfig.from_dict(raw)


def test_a_z_lab_config_as_published_is_accepted():
    """Qwen3-8B-DFlash's config.json keys (z-lab), as transformers writes them."""
    raw = {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
        "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960,
        "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32,
        "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "transformers_version": "4.57.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    assert DFlashDraftConfig.from_dict(raw).block_size == 16


# ------------------------------------------------------------------------------ tensors


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory):
    """A tiny plain draft on disk: (directory, its config, its tensors)."""
    from safetensors.torch import load_file

    path = str(tmp_path_factory.mktemp("plain-draft"))
    raw = draft_config_dict(target_layer_ids=[1])
    config = DFlashDraftConfig.from_dict(raw)
    torch.manual_seed(0)
    model = DFlashDraftModel(config, num_target_features=1)
    model.save_pretrained(path, raw)
    return path, config, load_file(os.path.join(path, "model.safetensors"))


def _write(tmp_path, plain_checkpoint, tensors) -> str:
    from safetensors.torch import save_file

    src, _, _ = plain_checkpoint
    os.makedirs(tmp_path, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(tmp_path, "config.json"), "w") as g:
        json.dump(json.load(f), g)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp_path, "model.safetensors"))
    return str(tmp_path)


H, TAPS, GROUP = 64, 3, 16
TENSOR_CASES = [
    pytest.param(
        {
            "layers.0.attention_conv.base_kernel": torch.zeros(2, TAPS, H),
            "layers.0.mlp_conv.kernel_projection.weight": torch.zeros(2 * TAPS * H // GROUP, H),
        },
        "'layers.0.attention_conv.base_kernel' belongs to grouped dynamic convolution, which its config",
        id="conv",  # was accepted
    ),
    pytest.param(
        {"prefix_gru.weight_ih_l0": torch.zeros(96, H), "embed_proj.0.weight": torch.zeros(24, H + 32)},
        "'embed_proj.0.weight' belongs to Domino",
        id="domino",  # was accepted
    ),
    pytest.param(
        {"layers.0.self_attn.attention_sink_bias": torch.zeros(4)},
        "'layers.0.self_attn.attention_sink_bias' belongs to attention sinks, which its config does not",
        id="sinks-without-the-config-key",  # was accepted
    ),
    pytest.param(
        {"layers.0.mlp.up_proj.weight_scale": torch.ones(1)},
        "'layers.0.mlp.up_proj.weight_scale' belongs to quantized draft weights",
        id="fp8-scales",  # was accepted
    ),
    pytest.param(
        {"embed_tokens.weight": torch.zeros(384, H)},
        "belongs to the draft's own token embedding",
        id="own-embedding",
    ),
    pytest.param(
        {"candidate_selector.hidden_projection.weight": torch.zeros(8, H)},
        "belongs to DFlash2",
        id="selector",
    ),
    pytest.param(
        {"layers.0.self_attn.g_proj.weight": torch.zeros(4, H)}, "belongs to Laguna", id="laguna-gate"
    ),
    pytest.param(
        {"layers.0.mystery.weight": torch.zeros(3)},
        "'layers.0.mystery.weight' is not a weight of a DFlash draft",
        id="unknown",
    ),
]


@pytest.mark.parametrize("extra, message", TENSOR_CASES)
def test_tensors_of_other_families_are_refused_by_name(tmp_path, plain_checkpoint, extra, message):
    _, config, tensors = plain_checkpoint
    path = _write(tmp_path, plain_checkpoint, {**tensors, **extra})
    for load in (  # the launching process's header check, and the scheduler's load
        lambda: DFlashDraftModel.check_checkpoint(path, config, 1),
        lambda: DFlashDraftModel.from_pretrained(path, config, 1),
    ):
        with pytest.raises(CheckpointError) as error:
            load()
        assert message in str(error.value) and WAY_OUT in str(error.value), str(error.value)


def test_quantized_weights_are_refused_by_their_dtype(tmp_path, plain_checkpoint):
    """fp8 weights in a checkpoint whose config declares no quantization (was accepted: their
    shapes matched, and the scales were dropped)."""
    _, config, tensors = plain_checkpoint
    fp8 = tensors["layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    path = _write(tmp_path, plain_checkpoint, {**tensors, "layers.0.mlp.up_proj.weight": fp8})
    with pytest.raises(CheckpointError, match="'layers.0.mlp.up_proj.weight' is stored as F8_E4M3"):
        DFlashDraftModel.check_checkpoint(path, config, 1)
    with pytest.raises(CheckpointError, match="is stored as torch.float8_e4m3fn"):
        DFlashDraftModel.from_pretrained(path, config, 1)


@pytest.mark.parametrize(
    "saved, message",
    [
        ({"embedding": torch.zeros(H), "mask_token_id": 1}, None),
        ({"embedding": torch.zeros(H), "mask_token_id": 2}, "trained with mask_token_id=2, but the draft's"),
        ({"embedding": torch.zeros(H + 1), "mask_token_id": 1}, "embedding has shape (65,), expected (64,)"),
        ({"embedding": torch.zeros(H), "mask_token_id": 1, "per_position": True}, "per_position=True"),
        ({"mask_token_id": 1}, "must hold 'embedding' and 'mask_token_id'"),
    ],
    ids=["served", "another-mask-id", "misshapen", "per-position", "no-embedding"],
)
def test_a_trained_mask_embedding_is_checked_at_launch(tmp_path, plain_checkpoint, saved, message):
    """mask_embedding.pt (was never read): checked as SGLang's built-in checks it, in the
    launching process; `test_target_head.py` checks what the draft then embeds."""
    _, config, tensors = plain_checkpoint
    path = _write(tmp_path, plain_checkpoint, tensors)
    torch.save(saved, os.path.join(path, "mask_embedding.pt"))
    if message is None:
        DFlashDraftModel.check_checkpoint(path, config, 1)
        assert torch.equal(load_mask_embedding(path, config), saved["embedding"])
    else:
        with pytest.raises(CheckpointError, match=re.escape(message)):
            DFlashDraftModel.check_checkpoint(path, config, 1)


def test_vendor_names_and_rotary_caches_load_as_the_plain_draft(tmp_path, plain_checkpoint):
    """`encoder.fc.weight` / `encoder.output_norm_enc.weight` are SGLang's aliases for `fc` and
    `hidden_norm`; a cached `rotary_emb.inv_freq` holds nothing the draft computes with."""
    _, config, tensors = plain_checkpoint
    renamed = dict(tensors)
    renamed["encoder.fc.weight"] = renamed.pop("fc.weight")
    renamed["model.encoder.output_norm_enc.weight"] = renamed.pop("hidden_norm.weight")
    renamed["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    path = _write(tmp_path, plain_checkpoint, renamed)
    DFlashDraftModel.check_checkpoint(path, config, 1)
    model = DFlashDraftModel.from_pretrained(path, config, 1)
    assert torch.equal(model.fc.weight, tensors["fc.weight"])
    assert torch.equal(model.hidden_norm.weight, tensors["hidden_norm.weight"])

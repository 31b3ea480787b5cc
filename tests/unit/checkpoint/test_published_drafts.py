"""Published draft configs, read by SGLang's built-in DFLASH and by us (docs/serving.md, "Draft
checkpoints").

`tests/data/published_drafts/` holds the `config.json` of published checkpoints (sources in its
SOURCES.md). The oracle is SGLang 0.5.23 itself, on the same file: `get_config` (transformers'
AutoConfig, or SGLang's own class for the types it registers), `parse_dflash_draft_config`, each
layer's `_get_dflash_layer_attention_params` (window and causality), the RoPE its
`DFlashAttention` builds with `get_rope` (compared on rotated vectors), and
`is_nemotron_35_draft_config`. A draft we serve must agree with SGLang on everything its draft
reads; one we refuse must be refused naming what it declares.

No engine starts: each case reads a config, builds one RoPE and rotates a few vectors.
"""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch

from sglang_dflash.checkpoint import config_class
from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.draft.model import RotaryEmbedding
from tests.support import paths
from tests.support.tiny import as_gemma4_published, draft_config_dict

pytestmark = pytest.mark.sglang  # imports SGLang's config loading and RoPE

DATA = paths.REPO / "tests" / "data" / "published_drafts"
DEFAULT_BLOCK = 16  # a checkpoint without block_size gets the server's (both sides alike)

SERVED = [
    "z-lab__Qwen3-8B-DFlash-b16",  # block_size at the top level
    "z-lab__Qwen3.5-4B-DFlash",  # block_size in dflash_config, rope_parameters; sliding layers
    "z-lab__Qwen3.5-27B-DFlash",
    "z-lab__Qwen3.8-27B-DFlash2",  # DFlash2: the selector, a window on every (non-causal) layer
    "z-lab__Muse-Glimmer-30B-DFlash2",
    "incoai__GLM-5.3-Flash-DFlash2",
    "z-lab__gpt-oss-20b-DFlash",  # GptOssConfig's alternating 128-token windows and YaRN
    "poolside__Laguna-S-2.1-DFlash",  # LagunaConfig; sliding_windows, draft_vocab_size, causal
    "poolside__Laguna-XS-2.1-DFlash",
    "XiaomiMiMo__MiMo-V2.5-Pro-FP4-DFlash__dflash",  # sinks, V scale, half RoPE; its window below
    # Qwen3 drafts of Gemma-4 targets: use_sliding_window with max_window_layers and layer_types, and
    # the target head's soft-cap at the top level (accepted: it keeps the argmax, test below).
    "z-lab__gemma-4-26B-A4B-it-DFlash",
    "z-lab__gemma-4-31B-it-DFlash",
]
# Where we serve what the checkpoint was trained with and SGLang's built-in does not: MiMo's
# `use_swa` window on every layer (SGLang ignores it; vLLM applies it), as (window, causal) per layer.
DEPARTURES = {"XiaomiMiMo__MiMo-V2.5-Pro-FP4-DFlash__dflash": {"layers": [(1024, False)] * 5}}
REFUSED = {
    # As copied, without its NVFP4 block: not SGLang's Nemotron-3.5, which would skip its own
    # embedding. With the block put back it is served (`test_a_nemotron_35_draft_is_served...`).
    "nvidia__NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4-DFlash": (
        "declares the draft's own token embedding, .* lacks the NVFP4 block quantization_config"
    ),
    "LiquidAI__LFM2.5-2.6B-DSpark": r"DSpark \(a separate algorithm, --speculative-algorithm DSPARK\)",
}


def test_every_published_copy_is_served_or_refused():
    assert {path.stem for path in DATA.glob("*.json")} == set(SERVED) | set(REFUSED)


def published(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def with_nvfp4(raw: dict) -> dict:
    """The Nemotron-3.5 draft with the quantization block its copy left out."""
    return {**raw, "quantization_config": {"quant_algo": "W4A16_NVFP4", "quant_method": "modelopt"}}


# ------------------------------------------------------------------------ the two readings


def _sglang_config(raw: dict, tmp_path: pathlib.Path):
    from sglang.srt.utils.hf_transformers.config import get_config

    path = tmp_path / f"config-{len(list(tmp_path.iterdir()))}"  # get_config caches by path
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    return get_config(str(path), trust_remote_code=False)


def _sglang_rope(config):
    """The RoPE SGLang's DFlashAttention builds from `config` (models/dflash.py, its __init__)."""
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.utils.hf_transformers.common import get_rope_config

    head_dim = int(getattr(config, "head_dim", config.hidden_size // config.num_attention_heads))
    rope_theta, rope_scaling = get_rope_config(config)
    rotary_dim, partial = head_dim, float(getattr(config, "partial_rotary_factor", 1.0))
    if rope_scaling is not None and "rope_dim" in rope_scaling:
        rotary_dim, partial = int(rope_scaling["rope_dim"]), 1.0
        superseded = {"rope_dim", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
        rope_scaling = {k: v for k, v in rope_scaling.items() if k not in superseded}
    return get_rope(
        head_dim,
        rotary_dim=rotary_dim,
        max_position=int(getattr(config, "max_position_embeddings", 32768)),
        base=rope_theta,
        rope_scaling=rope_scaling,
        is_neox_style=bool(getattr(config, "rope_is_neox_style", getattr(config, "is_neox_style", True))),
        partial_rotary_factor=partial,
        dtype=torch.float32,
    )


def sglang_reading(raw: dict, tmp_path: pathlib.Path) -> tuple[dict, object]:
    """What SGLang's built-in draft reads from `raw`, and its RoPE module."""
    from sglang.srt.models import dflash as sglang_draft
    from sglang.srt.speculative import dflash_utils

    config = _sglang_config(raw, tmp_path)
    parsed = dflash_utils.parse_dflash_draft_config(draft_hf_config=config)
    layers = []
    for i in range(parsed.require_num_layers()):
        window_left, kind = sglang_draft._get_dflash_layer_attention_params(config, i)
        layers.append((None if window_left < 0 else window_left + 1, kind.name == "DECODER"))
    text = config.get_text_config()
    reading = {
        "block_size": parsed.resolve_block_size(default=DEFAULT_BLOCK),
        "target_layer_ids": parsed.target_layer_ids,
        "mask_token_id": parsed.mask_token_id,
        "num_target_layers": parsed.num_target_layers,
        "layers": layers,  # (window including the current token, causal) per layer
        "hidden_size": text.hidden_size,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", text.num_attention_heads),
        "head_dim": int(getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)),
        "intermediate_size": text.intermediate_size,
        "rms_norm_eps": float(getattr(text, "rms_norm_eps", 1e-6)),
        "attention_bias": bool(getattr(text, "attention_bias", False)),
        "hidden_act": getattr(text, "hidden_act", "silu"),
        "use_gemma_norm": bool(getattr(text, "use_gemma_norm", False)),
        # A Nemotron-3.5 draft's sinks are also read at the top level (models/dflash.py, DFlashAttention).
        "attention_sink_bias": parsed.attention_sink_bias
        or (
            dflash_utils.is_nemotron_35_draft_config(config)
            and bool(getattr(config, "attention_sink_bias", False))
        ),
        "attention_value_scale": parsed.attention_value_scale,
        "conv": (parsed.conv_kernel_size, parsed.conv_group_size),
        "selector": (parsed.selector_rank, parsed.selector_top_k),
        "projector_type": parsed.projector_type,
        "nemotron": dflash_utils.is_nemotron_35_draft_config(config),
    }
    return reading, _sglang_rope(text)


def our_reading(raw: dict) -> tuple[dict, DFlashDraftConfig]:
    c = DFlashDraftConfig.from_dict(raw, default_block_size=DEFAULT_BLOCK)
    reading = {
        "block_size": c.block_size,
        "target_layer_ids": list(c.target_layer_ids) if c.target_layer_ids else None,
        "mask_token_id": c.mask_token_id,
        "num_target_layers": c.num_target_layers,
        "layers": [(c.layer_window(i), c.layer_is_causal(i)) for i in range(c.num_hidden_layers)],
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps,
        "attention_bias": c.attention_bias,
        "hidden_act": c.hidden_act,
        "use_gemma_norm": c.use_gemma_norm,
        "attention_sink_bias": c.attention_sink_bias,
        "attention_value_scale": c.attention_value_scale,
        "conv": (c.conv_kernel_size, c.conv_group_size),
        "selector": (c.selector_rank, c.selector_top_k),
        "projector_type": c.projector_type,
        "nemotron": c.own_embedding,
    }
    return reading, c


def rope_gap(sglang_rope, config: DFlashDraftConfig) -> float:
    """Largest difference between SGLang's RoPE and ours on random query heads at positions up
    to the config's limit (YaRN and partial rotation included)."""
    ours = RotaryEmbedding(config)
    top = config.max_position_embeddings - 1
    positions = torch.tensor(sorted({0, 1, 7, 100, 4095, 4096, 5000, top // 2, top}))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 2, config.head_dim, generator=gen)
    theirs, _ = sglang_rope.forward_native(positions, q.reshape(len(positions), -1).clone(), q[:, :1].clone())
    cos, sin = ours.cos_sin(positions, torch.float32)
    return (theirs.reshape_as(q) - ours.apply(q, cos, sin)).abs().max().item()


# --------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", SERVED)
def test_published_drafts_are_served_as_sglang_reads_them(name, tmp_path):
    raw = published(name)
    theirs, sglang_rope = sglang_reading(copy.deepcopy(raw), tmp_path)
    ours, config = our_reading(raw)
    for key, ours_only in DEPARTURES.get(name, {}).items():
        assert ours[key] == ours_only and theirs[key] != ours_only
        theirs[key] = ours_only
    assert ours == theirs
    assert rope_gap(sglang_rope, config) < 1e-5


def test_mimos_window_is_applied_named_and_checked():
    """`dflash_config.use_swa`: every layer windowed to `swa_window_size`, non-causal as before
    (vLLM's reading, `draft/attention.visibility` gives both sides), named at start-up; `use_swa`
    false or absent leaves the layers alone; a window without its size, or beside sliding
    `layer_types`, is refused by name."""
    raw = published("XiaomiMiMo__MiMo-V2.5-Pro-FP4-DFlash__dflash")
    config = DFlashDraftConfig.from_dict(copy.deepcopy(raw))
    assert any("windowed to 1024 (use_swa" in option for option in config.options_in_use())
    raw["dflash_config"]["use_swa"] = False
    plain = DFlashDraftConfig.from_dict(copy.deepcopy(raw))
    assert [plain.layer_window(i) for i in range(5)] == [None] * 5 and plain.swa_window is None
    raw["dflash_config"].update(use_swa=True, swa_window_size=None)
    with pytest.raises(CheckpointError, match="'dflash_config.use_swa' is true without 'swa_window_size'"):
        DFlashDraftConfig.from_dict(copy.deepcopy(raw))
    raw["dflash_config"]["swa_window_size"] = 1024
    raw.update(use_sliding_window=True, layer_types=["sliding_attention"] * 5)
    with pytest.raises(CheckpointError, match="both 'dflash_config.use_swa'"):
        DFlashDraftConfig.from_dict(copy.deepcopy(raw))
    qwen3 = _qwen3(use_swa=True)  # at the top level, where no implementation reads it
    words = "'use_swa' = True declares MiMo's sliding window at the top level"
    with pytest.raises(CheckpointError, match=words):
        DFlashDraftConfig.from_dict(qwen3)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_published_drafts_we_do_not_serve_are_refused_by_name(name):
    with pytest.raises(CheckpointError, match=REFUSED[name]) as error:
        DFlashDraftConfig.from_dict(published(name))
    assert "SGLANG_DFLASH_IMPL=builtin" in str(error.value)


def test_a_nemotron_35_draft_is_served_as_sglang_detects_and_reads_it(tmp_path):
    """As published with its NVFP4 block: SGLang's Nemotron-3.5 (its own embedding, NVFP4
    weights), read alike; its PARD token, aux-layer count and DSpark fields agree or are off."""
    raw = with_nvfp4(published("nvidia__NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4-DFlash"))
    from sglang.srt.speculative.dflash_utils import is_nemotron_35_draft_config

    theirs, sglang_rope = sglang_reading(copy.deepcopy(raw), tmp_path)
    ours, config = our_reading(copy.deepcopy(raw))
    assert ours == theirs and ours["nemotron"]
    assert rope_gap(sglang_rope, config) < 1e-5
    assert "its own token embedding (Nemotron-3.5)" in config.options_in_use()
    assert config.quantization.algo == "W4A16_NVFP4"
    sinks = dict(raw, attention_sink_bias=True)  # read at the top level for this family
    assert DFlashDraftConfig.from_dict(copy.deepcopy(sinks), DEFAULT_BLOCK).attention_sink_bias
    for key, value, words in [
        ("pard_token", 7, "the block's MASK token is 990"),
        ("num_aux_layers", 5, "reads 6 captured target layers"),
        ("dspark_markov_rank", 4, "declares DSpark"),
        ("dflash_query_causal", True, "causal block queries"),
    ]:
        with pytest.raises(CheckpointError, match=words):
            DFlashDraftConfig.from_dict(dict(copy.deepcopy(raw), **{key: value}), DEFAULT_BLOCK)
    raw["dflash_config"]["sample_from_anchor"] = True  # no longer SGLang's Nemotron-3.5
    assert not is_nemotron_35_draft_config(_sglang_config(raw, tmp_path))
    with pytest.raises(CheckpointError, match="own token embedding, .* lacks sample_from_anchor false;"):
        DFlashDraftConfig.from_dict(raw)


def test_a_nemotron_35_draft_without_its_nvfp4_block_is_refused_naming_the_block():
    """Served with the block (above), so the refusal says what is missing, and only that (was
    "declares the draft's own token embedding ..., which sglang-dflash does not serve")."""
    with pytest.raises(CheckpointError) as error:
        DFlashDraftConfig.from_dict(published("nvidia__NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4-DFlash"))
    message = str(error.value)
    assert (
        "detects as Nemotron-3.5 (is_nemotron_35_draft_config), and this config lacks the NVFP4 block "
        in message
    )
    assert "lacks the NVFP4 block quantization_config with quant_algo 'W4A16_NVFP4'; serve it" in message
    assert "does not serve" not in message


@pytest.mark.parametrize("name", ["z-lab__gemma-4-26B-A4B-it-DFlash", "z-lab__gemma-4-31B-it-DFlash"])
def test_the_gemma_4_drafts_soft_cap_is_accepted_and_named(name):
    """Their top-level `final_logit_softcapping` (30.0, their target head's cap) is a strictly
    increasing map of the logits whose argmax a plain draft proposes: accepted, named at start-up,
    not applied (SGLang's built-in reads it from dflash_config, for DFlash2's selector only). Their
    layers: four sliding ones of 2048 tokens, causal, then a full non-causal one."""
    config = DFlashDraftConfig.from_dict(published(name))
    assert config.inert_fields == ("final_logit_softcapping = 30.0",)
    assert config.final_logit_softcapping is None
    layers = [(config.layer_window(i), config.layer_is_causal(i)) for i in range(config.num_hidden_layers)]
    assert layers == [(2048, True)] * 4 + [(None, False)]


@pytest.mark.parametrize("layers", [1, 2])
def test_the_tiny_gemma_4_stand_in_carries_the_published_fields_and_reads_alike(layers, tmp_path):
    """`as_gemma4_published` (the engine tests' Gemma-4 draft): the published drafts' fields in their
    places, the soft-cap named as theirs is, the windows as SGLang reads them."""
    gemma = published("z-lab__gemma-4-26B-A4B-it-DFlash")
    raw = draft_config_dict(num_layers=layers)
    as_gemma4_published(raw)
    for key in ("final_logit_softcapping", "use_sliding_window", "tie_word_embeddings", "model_type"):
        assert raw[key] == gemma[key]
    assert raw["max_window_layers"] == layers and raw["layer_types"][-1] == "full_attention"
    theirs, _ = sglang_reading(copy.deepcopy(raw), tmp_path)
    ours, config = our_reading(raw)
    assert ours["layers"] == theirs["layers"] == [(8, True)] * (layers - 1) + [(None, False)]
    assert config.inert_fields == ("final_logit_softcapping = 30.0",)


def test_without_the_config_class_gpt_oss_would_be_served_otherwise(monkeypatch, tmp_path):
    """The control: read as the file is, with no class to fill it in, gpt-oss's draft would get
    full non-causal layers and plain RoPE where SGLang's has windows and YaRN."""
    raw = published("z-lab__gpt-oss-20b-DFlash")
    theirs, sglang_rope = sglang_reading(copy.deepcopy(raw), tmp_path)
    monkeypatch.setattr(config_class, "model_fields", lambda raw: raw)
    ours, config = our_reading(raw)
    assert ours["layers"] != theirs["layers"]
    assert rope_gap(sglang_rope, config) > 1e-3


# Edge cases beyond the published files, on a plain z-lab config (Qwen3-8B-DFlash-b16's).
def _qwen3(**top) -> dict:
    raw = published("z-lab__Qwen3-8B-DFlash-b16")
    raw.update(top)
    return raw


@pytest.mark.parametrize(
    "raw",
    [
        _qwen3(num_hidden_layers=3, use_sliding_window=True, sliding_window=64, max_window_layers=1),
        _qwen3(layer_types=["sliding_attention"] * 5, use_sliding_window=True, sliding_window=64),
        _qwen3(
            layer_types=["sliding_attention"] * 5, use_sliding_window=True, sliding_window=8, is_causal=False
        ),
        _qwen3(layer_types=["full_attention"] * 5, is_causal=True),
        _qwen3(  # the Gemma-4 drafts' fields: max_window_layers beside layer_types
            use_sliding_window=True,
            max_window_layers=5,
            layer_types=["sliding_attention"] * 4 + ["full_attention"],
            sliding_window=2048,
        ),
    ],
    ids=[
        "layer-types-from-max-window-layers",
        "sliding",
        "sliding-non-causal",
        "full-causal",
        "gemma-4-windows",
    ],
)
def test_qwen3_window_and_causality_rules_are_sglangs(raw, tmp_path):
    theirs, _ = sglang_reading(copy.deepcopy(raw), tmp_path)
    ours, _ = our_reading(raw)
    assert ours["layers"] == theirs["layers"]


def test_a_window_qwen3config_drops_is_refused_where_sglang_fails(tmp_path):
    raw = _qwen3(layer_types=["sliding_attention"] * 5, sliding_window=64)  # no use_sliding_window
    with pytest.raises(ValueError, match="sliding_attention layers require config.sliding_window"):
        sglang_reading(copy.deepcopy(raw), tmp_path)
    with pytest.raises(CheckpointError, match="'use_sliding_window' is not true"):
        DFlashDraftConfig.from_dict(raw)


@pytest.mark.parametrize(
    "edit, words",
    [
        ({"dflash_config": {"is_causal": True}}, "'dflash_config.is_causal' = True disagrees"),
        ({"dflash_config": {"layer_types": ["sliding_attention"] * 5}}, "'dflash_config.layer_types'"),
        ({"draft_vocab_size": 32000}, "'draft_vocab_size' = 32000 disagrees"),
        ({"sliding_windows": [512] * 5}, "'sliding_windows' = [512, 512, 512, 512, 512] disagrees"),
        ({"dflash_config": {"causal": True}}, "'dflash_config.causal' = True disagrees"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 9, 17, 25, 33]}, "'eagle_aux_hidden_state_layer_ids'"),
        ({"v_head_dim": 64}, "'v_head_dim' = 64 disagrees"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
          "initial_context_length": 4096}, "'initial_context_length' = 4096 disagrees"),
    ],
    ids=["dflash-is-causal", "dflash-layer-types", "draft-vocab", "sliding-windows", "causal",
         "eagle-aux-ids", "v-head-dim", "initial-context"],
)  # fmt: skip
def test_keys_sglang_never_reads_are_refused_when_they_disagree(edit, words):
    """SGLang ignores each of these keys; a value that disagrees with the draft served would
    describe another draft, so it is refused by name (the agreeing values are in the published
    Laguna and MiMo configs, and in the accepted cases below)."""
    raw = _qwen3()
    raw["dflash_config"].update(edit.pop("dflash_config", {}))
    raw.update(edit)
    with pytest.raises(CheckpointError, match=words.replace("[", r"\[").replace("]", r"\]")):
        DFlashDraftConfig.from_dict(raw)


def test_keys_sglang_never_reads_are_accepted_when_they_agree():
    raw = _qwen3(draft_vocab_size=151936, v_head_dim=128, sliding_windows=[None] * 5)
    raw["eagle_aux_hidden_state_layer_ids"] = [2, 10, 18, 26, 34]  # target_layer_ids + 1
    raw["dflash_config"].update(causal=False, is_causal=None, num_anchors=512, loss_decay_gamma=7.0)
    raw["dflash_config"]["layer_types"] = ["full_attention"] * 5
    DFlashDraftConfig.from_dict(raw)


def test_the_sglang_config_types_are_sglangs():
    from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY

    assert config_class.SGLANG_CONFIG_TYPES == frozenset(_CONFIG_REGISTRY)
    assert config_class.EMULATED <= config_class.SGLANG_CONFIG_TYPES

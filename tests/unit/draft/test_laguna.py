"""Laguna's drafts (`DFlashLagunaForCausalLM`), against SGLang 0.5.23's own code.

* The attention gate: our attention's output equals SGLang's
  `DFlashLagunaAttention.apply_attention_output` on the same attention output, hidden states and
  `g_proj` weights, per head and per element.
* The context: our fused feature and every layer's context K/V equal SGLang's
  `DFlashLagunaForCausalLM.project_target_hidden` (its per-slice `RMSNorm`s, `fc`,
  `hidden_norm`) followed by each layer's `input_layernorm` and K/V projection.
* The config: read as SGLang builds it (`LagunaConfig`, `normalize_gating`, `get_rope_config`):
  head counts, class defaults, gating modes and RoPE; what SGLang cannot build is refused.
Each comparison is shown failing with the Laguna part dropped from our side. Greedy
losslessness end to end is the "laguna" shape of test_target_shapes.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.draft.model import DFlashDraftModel
from tests.support.tiny import draft_config_dict

pytestmark = pytest.mark.sglang  # imports SGLang's modules

FEATURES, N = 2, 5


def _raw(**fields) -> dict:
    raw = draft_config_dict(num_layers=2, target_layer_ids=[0, 2], num_target_layers=4)
    raw.update(architectures=["DFlashLagunaForCausalLM"], model_type="laguna", **fields)
    return raw


def _model(config: DFlashDraftConfig, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(config, num_target_features=FEATURES).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    return model


def _attend(q, k, v):  # a stand-in attention: the values of the first KV head, per query head
    return v[:, :1].expand(-1, q.shape[1], -1) + q


@pytest.mark.parametrize("gating", ["per-head", "per-element"])
def test_the_gate_equals_sglangs(gating):
    from sglang.srt.models.dflash import DFlashLagunaAttention

    model = _model(DFlashDraftConfig.from_dict(_raw(gating=gating)))
    attn = model.layers[0].self_attn
    x = torch.randn(N, model.config.hidden_size)
    cos, sin = model.rotary_emb.cos_sin(torch.arange(N), x.dtype)
    seen = {}

    def attend(layer_id, q, k, v):
        seen["out"] = _attend(q, k, v)
        return seen["out"]

    with torch.no_grad():
        ours = attn(x, cos, sin, attend)
        theirs_self = SimpleNamespace(
            g_proj=lambda h: (attn.g_proj(h), None),
            gate_per_head=gating == "per-head",
            num_heads=attn.num_heads,
            head_dim=attn.head_dim,
        )
        gated = DFlashLagunaAttention.apply_attention_output(theirs_self, seen["out"].reshape(N, -1), x)
        theirs = attn.o_proj(gated)
        attn.gate_width = 0  # the control: our attention without its gate
        ungated = attn(x, cos, sin, attend)
    torch.testing.assert_close(ours, theirs)
    assert not torch.allclose(ungated, theirs, atol=1e-3)


def test_the_context_equals_sglangs():
    from sglang.srt.layers.layernorm import RMSNorm as SGLangRMSNorm
    from sglang.srt.models.dflash import DFlashLagunaForCausalLM

    config = DFlashDraftConfig.from_dict(_raw(gating=False))
    model = _model(config)
    hidden = config.hidden_size
    norms = []
    for ours in model.aux_hidden_norms:
        theirs = SGLangRMSNorm(hidden, eps=config.rms_norm_eps)
        theirs.weight.data.copy_(ours.weight)
        norms.append(theirs.forward_native)
    theirs_self = SimpleNamespace(
        fc=model.fc,
        is_nemotron_35_draft=False,
        num_context_features=FEATURES,
        config=SimpleNamespace(hidden_size=hidden),
        aux_hidden_norms=norms,
        hidden_norm=model.hidden_norm,
    )
    features = torch.randn(N, FEATURES * hidden) * 3
    positions = torch.arange(N) + 7
    with torch.no_grad():
        context = DFlashLagunaForCausalLM.project_target_hidden(theirs_self, features)
        cos, sin = model.rotary_emb.cos_sin(positions, context.dtype)
        want = [
            layer.self_attn.project_kv(layer.input_layernorm(context), cos, sin) for layer in model.layers
        ]
        ours = model.fuse_target_features(features)
        k, v = model.context_kv(ours, positions)
        plain = dataclasses.replace(config, architecture="DFlashDraftModel")  # the control
        model.config = plain
        plain_k, _ = model.context_kv(model.fuse_target_features(features), positions)
    torch.testing.assert_close(ours, context)
    torch.testing.assert_close(k, torch.stack([w[0] for w in want]))
    torch.testing.assert_close(v, torch.stack([w[1] for w in want]))
    assert not torch.allclose(plain_k, k, atol=1e-3)


def _sglang_config(raw: dict):
    from sglang.srt.configs.laguna import LagunaConfig

    return LagunaConfig(**{k: v for k, v in raw.items() if k != "architectures"})


@pytest.mark.parametrize(
    "edit",
    [
        {},
        {"gating": True},
        {"gating": "per-element"},
        {"gating": None},
        {"gating": "disabled"},
        {"num_attention_heads_per_layer": [2, 2], "num_attention_heads": 4},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        {"head_dim": None, "num_key_value_heads": None, "num_attention_heads": 16},  # LagunaConfig's defaults
    ],
    ids=["no-gating", "true", "per-element", "null", "disabled", "per-layer-heads", "flat-rope", "defaults"],
)
def test_the_config_reads_as_sglangs_laguna_config(edit):
    from sglang.srt.configs.laguna import normalize_gating
    from sglang.srt.utils.hf_transformers.common import get_rope_config

    raw = _raw()
    raw.pop("gating", None)
    for key, value in edit.items():
        if value is None and key != "gating":
            raw.pop(key)
        else:
            raw[key] = value
    ours, theirs = DFlashDraftConfig.from_dict(raw), _sglang_config(raw)
    assert ours.gating == normalize_gating(getattr(theirs, "gating", True))
    assert ours.num_attention_heads == theirs.num_attention_heads
    assert (ours.head_dim, ours.num_key_value_heads) == (theirs.head_dim, theirs.num_key_value_heads)
    assert ours.rope["rope_theta"] == get_rope_config(theirs)[0]
    assert ours.is_laguna and "Laguna feature-slice norms" in " ".join(ours.options_in_use("context_kv"))
    gated = ours.gating != "disabled"
    assert gated == any("attention gate" in o for o in ours.options_in_use("forward"))


def test_what_sglang_cannot_build_is_refused():
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.utils.hf_transformers.common import get_rope_config

    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": {}}
    raw = _raw(rope_parameters=nested)
    theta, scaling = get_rope_config(_sglang_config(raw))
    with pytest.raises(TypeError):  # SGLang's draft attention builds its RoPE with this
        get_rope(16, rotary_dim=16, max_position=4096, base=theta, rope_scaling=scaling)
    with pytest.raises(CheckpointError, match="nested per layer type"):
        DFlashDraftConfig.from_dict(raw)
    with pytest.raises(CheckpointError, match="counts that differ"):
        DFlashDraftConfig.from_dict(_raw(num_attention_heads_per_layer=[4, 2]))
    with pytest.raises(CheckpointError, match="'gating' must be"):
        DFlashDraftConfig.from_dict(_raw(gating="per-row"))
    raw = _raw()
    raw["dflash_config"]["gating"] = "per-head"  # SGLang reads it at the top level only
    with pytest.raises(CheckpointError, match="in dflash_config"):
        DFlashDraftConfig.from_dict(raw)
    plain = draft_config_dict()
    plain["gating"] = "per-head"  # on another class: refused as before
    with pytest.raises(CheckpointError, match="declares Laguna"):
        DFlashDraftConfig.from_dict(plain)


def test_a_laguna_checkpoint_loads_its_norms_and_gates(tmp_path):
    from safetensors.torch import load_file

    from tests.support.tiny import add_laguna, make_draft

    path = add_laguna(make_draft(str(tmp_path / "draft")), gating="per-head")
    config = DFlashDraftConfig.from_pretrained(path)
    features = len(config.resolve_target_layer_ids(config.num_target_layers))
    DFlashDraftModel.check_checkpoint(path, config, features)
    model = DFlashDraftModel.from_pretrained(path, config, features)
    saved = load_file(f"{path}/model.safetensors")
    assert torch.equal(model.layers[0].self_attn.g_proj.weight, saved["layers.0.self_attn.g_proj.weight"])
    assert torch.equal(model.aux_hidden_norms[0].weight, saved["aux_hidden_norms.0.weight"])
    off = dataclasses.replace(config, gating="disabled")  # gates in the file, none in the config
    with pytest.raises(CheckpointError, match="g_proj.weight' belongs to Laguna.*does not declare"):
        DFlashDraftModel.check_checkpoint(path, off, features)


@pytest.mark.parametrize("gating", ["per-head", False])
def test_cuda_takes_the_module_path_for_what_the_fused_kernels_do_not_compute(gating):
    """The fused draft forward computes no gate and the fused context-K/V op no slice norms: on
    CUDA each is refused by name at start-up (the module path runs instead); an ungated Laguna
    draft keeps the fused forward, whose block maths are then the plain ones."""
    from sglang_dflash.draft import fused_forward
    from sglang_dflash.ops import reference

    model = _model(DFlashDraftConfig.from_dict(_raw(gating=gating)))
    forward = fused_forward.unavailable_reason(model, torch.device("cuda"))
    if gating:
        assert "Laguna attention gate (per-head)" in forward
    else:
        assert forward is None or "Laguna" not in forward  # e.g. the draft's fp32 dtype
    assert "Laguna feature-slice norms" in reference.fusion_unsupported_reason(model)

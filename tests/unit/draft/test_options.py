"""The plain draft options SGLang's built-in DFLASH serves, against SGLang's own modules.

Options (read from config.json as SGLang's `models/dflash.py` reads them): Gemma norms
(`use_gemma_norm`), a narrowed rotary width (`rope_scaling.rope_dim`, `partial_rotary_factor`),
GPT-J style RoPE (`rope_is_neox_style: false`) and gpt-oss's clamped SwiGLU
(`hidden_act: swigluoai`).

The oracle is our draft network with its norms, RoPE and activation replaced by SGLang's
(`GemmaRMSNorm.forward_native`, `get_rope(...).forward_native`,
`swiglu_no_interleaved_with_alpha_and_limit`) on the same weights: the serving path's hidden
states and the greedy proposals of one decode step through a random head must agree. The
negative control drops each option from our side and shows the comparison fails. Greedy
losslessness with such a draft, end to end, is in test_target_shapes.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.draft.attention import SdpaDraftAttention
from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.model import DFlashDraftModel, RMSNorm
from tests.support.tiny import draft_config_dict

pytestmark = pytest.mark.sglang  # imports SGLang's layers

HEAD_DIM, NUM_TARGET_LAYERS, BLOCK, VOCAB = 32, 4, 8, 384
SWIGLU = {"hidden_act": "swigluoai", "swiglu_alpha": 1.702, "swiglu_limit": 0.3}  # a limit that bites

OPTIONS = {
    "gemma-norm": {"use_gemma_norm": True},
    "partial-rotary": {"partial_rotary_factor": 0.5},
    "rope-dim": {"rope_scaling": {"rope_type": "default", "rope_dim": 8, "partial_rotary_factor": 0.25}},
    "gptj-rope": {"rope_is_neox_style": False},
    "gptj-partial-rope": {"rope_is_neox_style": False, "partial_rotary_factor": 0.5},
    "swigluoai": SWIGLU,
    "grouped-conv": {"dflash_config": {"conv_kernel_size": 3, "conv_group_size": 16}},
    "all": {
        "use_gemma_norm": True,
        "partial_rotary_factor": 0.5,
        "rope_is_neox_style": False,
        **SWIGLU,
        "dflash_config": {"conv_kernel_size": 2, "conv_group_size": 32},
    },
}


def _raw(edits: dict) -> dict:
    raw = draft_config_dict(num_layers=2, head_dim=HEAD_DIM, target_layer_ids=[0, 2], num_target_layers=4)
    edits = copy.deepcopy(edits)
    raw["dflash_config"].update(edits.pop("dflash_config", {}))
    raw.update(edits)
    return raw


def _model(raw: dict, seed: int = 0) -> DFlashDraftModel:
    config = DFlashDraftConfig.from_dict(raw)
    torch.manual_seed(seed)
    model = DFlashDraftModel(config, num_target_features=2).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights near 1 (or near 0 for Gemma's 1 + w), the rest small.
            p.copy_(
                torch.randn_like(p) * 0.3 + (1.0 if "norm" in name and not config.use_gemma_norm else 0.0)
            )
    return model


# ------------------------------------------------------------ SGLang's modules in place of ours


def _sglang_rope(raw: dict):
    """`get_rope` with the arguments SGLang's DFlashAttention derives from the config
    (models/dflash.py: DFlashAttention.__init__)."""
    from sglang.srt.layers.rotary_embedding import get_rope

    rope_scaling = raw.get("rope_scaling")
    rotary_dim, partial = HEAD_DIM, float(raw.get("partial_rotary_factor", 1.0))
    if rope_scaling is not None and "rope_dim" in rope_scaling:
        rotary_dim, partial = int(rope_scaling["rope_dim"]), 1.0
        superseded = {"rope_dim", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
        rope_scaling = {k: v for k, v in rope_scaling.items() if k not in superseded}
    if rope_scaling == {"rope_type": "default"}:
        rope_scaling = None  # get_rope_config gives None for plain RoPE
    return get_rope(
        HEAD_DIM,
        rotary_dim=rotary_dim,
        max_position=4096,
        base=raw["rope_theta"],
        rope_scaling=rope_scaling,
        is_neox_style=bool(raw.get("rope_is_neox_style", raw.get("is_neox_style", True))),
        partial_rotary_factor=partial,
        dtype=torch.float32,
    )


def _with_sglang_modules(model: DFlashDraftModel, raw: dict) -> DFlashDraftModel:
    """A copy of `model` whose norms, RoPE and MLP activation are SGLang's."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm
    from sglang.srt.layers.layernorm import RMSNorm as SglangRMSNorm
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import (
        swiglu_no_interleaved_with_alpha_and_limit,
    )
    from sglang.srt.models.dflash import DFlashGroupedConv

    model = copy.deepcopy(model)
    config = model.config
    for module in model.modules():
        if isinstance(module, RMSNorm):
            norm_cls = GemmaRMSNorm if raw.get("use_gemma_norm") else SglangRMSNorm
            theirs = norm_cls(module.weight.shape[0], eps=module.eps)
            theirs.weight = module.weight
            module.forward = theirs.forward_native

    rope = _sglang_rope(raw)
    # Our layers call rope(x, cos, sin) with cos/sin from rotary_emb.cos_sin(positions): hand
    # the positions through instead, and rotate with SGLang's module.
    model.rotary_emb.cos_sin = lambda positions, dtype: (positions, None)

    def sglang_rope(x: torch.Tensor, positions: torch.Tensor, _) -> torch.Tensor:
        n, heads, d = x.shape
        flat = x.reshape(n, heads * d)
        q, _ = rope.forward_native(positions, flat.clone(), flat.clone())
        return q.view(n, heads, d)

    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            if conv is not None:
                theirs = DFlashGroupedConv(config.hidden_size, config.block_size, conv.taps, conv.group_size)
                theirs.load_state_dict(conv.state_dict())
                conv.prepare, conv.finish = theirs.prepare, theirs.finish
        layer.self_attn.rope = sglang_rope
        mlp = layer.mlp
        if config.hidden_act == "swigluoai":

            def forward(x, mlp=mlp):
                gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
                act = swiglu_no_interleaved_with_alpha_and_limit(
                    gate_up, raw["swiglu_alpha"], raw["swiglu_limit"]
                )
                return mlp.down_proj(act)

            mlp.forward = forward
    return model


# ------------------------------------------------------------------------ the serving path


@torch.no_grad()
def _serving_block(model: DFlashDraftModel, seed: int = 0) -> torch.Tensor:
    """Two requests' context K/V injected into a store, then one block each -> hidden [2*B, H]."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    store = DraftKVStore(
        num_slots=64,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=torch.float32,
        device="cpu",
    )
    lens = torch.tensor([13, 21])
    features = torch.randn(int(lens.sum()), 2 * config.hidden_size, generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens.tolist()])
    slots = 1 + torch.arange(int(lens.sum()))
    ops.inject_context_kv(model, store, features, positions, slots)
    context_slots = torch.zeros(2, int(lens.max()), dtype=torch.int64)
    context_slots[0, :13], context_slots[1, :21] = slots[:13], slots[13:]
    attend = SdpaDraftAttention(config, store, None).bind(context_slots, torch.arange(2), lens, lens, BLOCK)
    noise = torch.randn(2 * BLOCK, config.hidden_size, generator=gen)
    block_positions = (lens[:, None] + torch.arange(BLOCK)).reshape(-1)
    return model(noise, block_positions, attend)


def _sglang_block(model: DFlashDraftModel) -> torch.Tensor:
    """`_serving_block` with SGLang's modules in place: its grouped convolution is a
    `torch.compile`d function, run eagerly here as on any CPU."""
    with torch.compiler.set_stance("force_eager"):
        return _serving_block(model)


def _proposals(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head = torch.randn(VOCAB, hidden.shape[-1], generator=torch.Generator().manual_seed(7))
    logits = hidden @ head.T
    return logits, logits.argmax(-1)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_matches_sglang_modules(option):
    raw = _raw(OPTIONS[option])
    ours = _model(raw)
    theirs = _with_sglang_modules(ours, raw)
    got, want = _serving_block(ours), _sglang_block(theirs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (_, got_ids), (want_logits, want_ids) = _proposals(got), _proposals(want)
    top2 = want_logits.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert decided.float().mean() > 0.9
    assert torch.equal(got_ids[decided], want_ids[decided])


@pytest.mark.parametrize("option", [o for o in OPTIONS if o != "all"])
def test_the_comparison_fails_when_our_side_drops_the_option(option):
    """The negative control: ours built without the option, SGLang's modules with it."""
    raw = _raw(OPTIONS[option])
    with_option = _model(raw)
    ours = _model(_raw({}))
    ours.load_state_dict(with_option.state_dict(), strict=False)  # the same weights (but the conv's)
    theirs = _with_sglang_modules(with_option, raw)
    got, want = _serving_block(ours), _sglang_block(theirs)
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_the_options_take_the_module_path_for_context_kv():
    """The fused context-KV op computes plain norms and full-width neox RoPE only."""
    from sglang_dflash.ops import reference

    assert reference.fusion_unsupported_reason(_model(_raw({}))) is None
    for option in ("gemma-norm", "partial-rotary", "gptj-rope"):
        assert "the fused op computes plain norms" in reference.fusion_unsupported_reason(
            _model(_raw(OPTIONS[option]))
        )
    assert reference.fusion_unsupported_reason(_model(_raw(SWIGLU))) is None  # no MLP in the op


def test_rope_dim_supersedes_partial_rotary_factor_and_other_rope_types_are_refused():
    config = DFlashDraftConfig.from_dict(_raw(OPTIONS["rope-dim"]))
    assert config.rope_width == 8 and "rope_dim" not in config.rope
    assert DFlashDraftConfig.from_dict(_raw(OPTIONS["partial-rotary"])).rope_width == 16
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}}
    assert DFlashDraftConfig.from_dict(_raw(yarn)).rope_width == HEAD_DIM
    with pytest.raises(CheckpointError, match="rope type 'yarn' with a rotary width of 16"):
        DFlashDraftConfig.from_dict(_raw({**yarn, "partial_rotary_factor": 0.5}))
    with pytest.raises(CheckpointError, match="'swiglu_limit'"):
        DFlashDraftConfig.from_dict(_raw({"hidden_act": "swigluoai", "swiglu_alpha": 1.0}))


# ------------------------------------------------------------------------- MiMo's extras


def test_attention_sinks_add_a_valueless_term_to_each_heads_softmax():
    """`attend_with_context` with sinks against the softmax written out by hand:
    out_h = sum_j e^{s_hj} v_j / (sum_j e^{s_hj} + e^{sink_h}), over the visible keys only."""
    from sglang_dflash.draft.attention import attend_with_context

    gen = torch.Generator().manual_seed(3)
    b, q_len, c, heads, kv_heads, d = 2, 3, 5, 4, 2, 8
    q = torch.randn(b, q_len, heads, d, generator=gen)
    k_ctx, v_ctx = torch.randn(2, b, c, kv_heads, d, generator=gen)
    k, v = torch.randn(2, b, q_len, kv_heads, d, generator=gen)
    mask = torch.rand(b, 1, q_len, c + q_len, generator=gen) < 0.7
    mask[..., -1] = True  # every query sees at least one key
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    got = attend_with_context(q, k_ctx, v_ctx, k, v, mask, d**-0.5, sinks)

    keys = torch.cat([k_ctx, k], 1).repeat_interleave(heads // kv_heads, dim=2)  # [b, C+Q, heads, d]
    values = torch.cat([v_ctx, v], 1).repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) * d**-0.5
    weights = torch.exp(scores).masked_fill(~mask, 0.0)  # [b, heads, Q, C+Q]
    denominator = weights.sum(-1, keepdim=True) + torch.exp(sinks)[None, :, None, None]
    want = torch.einsum("bhqk,bkhd->bqhd", weights / denominator, values)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    without = attend_with_context(q, k_ctx, v_ctx, k, v, mask, d**-0.5)
    assert not torch.allclose(without, want, rtol=1e-3, atol=1e-3)  # the sinks matter


def test_the_value_scale_applies_to_the_context_and_the_block():
    """SGLang scales V in the block's forward and in the context K/V it writes alike."""
    raw = _raw({})
    scaled = _raw({"dflash_config": {**raw["dflash_config"], "attention_value_scale": 0.5}})
    plain, halved = _model(raw), _model(scaled)
    context, positions = torch.randn(5, plain.config.hidden_size), torch.arange(5)
    (k0, v0), (k1, v1) = plain.context_kv(context, positions), halved.context_kv(context, positions)
    torch.testing.assert_close(k1, k0)
    torch.testing.assert_close(v1, 0.5 * v0)
    assert "V scaled by 0.5" in halved.config.options_in_use()


def test_sinks_take_sdpa_and_are_loaded_per_head(tmp_path):
    """The sink tensors load into each layer (sharded by head under TP), and FlashInfer's draft
    attention, which has no sink term here, is refused for them by name."""
    from sglang_dflash.draft import flashinfer_attention
    from sglang_dflash.draft.model import shard_checkpoint_tensor
    from sglang_dflash.draft.tensor_parallel import TensorParallel

    raw = _raw({"dflash_config": {**_raw({})["dflash_config"], "attention_sink_bias": True}})
    model = _model(raw)
    model.save_pretrained(str(tmp_path), raw)
    loaded = DFlashDraftModel.from_pretrained(str(tmp_path), model.config, 2)
    for want, got in zip(model.attention_sinks(), loaded.attention_sinks()):
        assert torch.equal(want, got)
    sinks = model.layers[0].self_attn.attention_sink_bias.detach()
    rank1 = shard_checkpoint_tensor(
        "layers.0.self_attn.attention_sink_bias", sinks, TensorParallel(size=2, rank=1)
    )
    assert torch.equal(rank1, sinks[2:])
    reason = flashinfer_attention.unavailable_reason(model.config, torch.device("cuda"))
    assert "attention sinks" in reason

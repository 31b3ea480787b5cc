"""Greedy losslessness on the other target and pool shapes users serve, each against the same
engine without speculation: tiny Llama and Qwen3-MoE targets, a paged KV cache (page size 16),
and a draft context window shorter than the prompts (--speculative-draft-window-size). The Llama
case also serves a draft whose config has neither block_size nor mask_token_id,
"draft-options" a draft with Gemma norms, partial GPT-J RoPE, clamped SwiGLU, a trained mask
embedding, MiMo's attention sinks, value scale and window on every layer, grouped
convolution, and fp8 weights with block scales (dequantised at load), "dflash2" a DFlash2
draft whose proposals walk its candidate selector, "domino" a draft whose proposals roll out
through Domino's projector over a candidate pool, and "laguna" a Laguna draft (gated attention,
per-slice feature norms; the llama target's plain outputs are shared). The page16 shape's draft
is a Nemotron-3.5 draft (its own token embedding and NVFP4 weights), and the window16 shape's a
LiLiCorr draft whose proposals walk its head's lattice, with every request's last-token feature known at
every step.
On the MoE target, --enable-return-routed-experts returns the same experts for every token.

16 prompts x batch sizes {1, 8}. The targets favour one token (`make_family_target`), so the
untrained draft "a" gets multi-token acceptances and the commit paths all run. The window test
is the one that shows the window is applied: test_model.py checks its semantics against
the reference draft, and that proposals change once the context is longer than the window.

Sliding-window targets (Gemma-4, gpt-oss), MLA targets (DeepSeek-V3, GLM-4-MoE-Lite) and Qwen3-VL
are in test_target_classes.py. (Mistral's SGLang class is Llama's with no code of its own.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import engines
from tests.support.favoured_targets import favoured_target
from tests.support.tiny import (
    add_domino,
    add_laguna,
    add_lilicorr,
    add_selector,
    make_nemotron_35,
    quantize_fp8,
)

pytestmark = pytest.mark.sglang

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PROMPTS = engines.prompts(16, seed=40, min_len=20, max_len=40)
WINDOW = 16  # the draft's block size; shorter than every prompt

# name -> (target family, engine flags for both engines, DFLASH-only flags)
SHAPES = {
    "llama": ("llama", {}, {}),  # with a draft config that has no block_size (see below)
    "qwen3_moe": ("qwen3_moe", {"enable_return_routed_experts": True}, {}),
    # Paging and the draft's window are orthogonal to the draft's family: these two shapes also
    # serve a Nemotron-3.5 draft (own embedding, NVFP4 weights) and a LiLiCorr draft.
    "page16-nemotron": ("llama", {"page_size": 16}, {}),
    "window16-lilicorr": ("llama", {}, {"speculative_draft_window_size": WINDOW}),
    "draft-options": ("llama", {}, {}),  # with DRAFT_OPTIONS (see below)
    "dflash2": ("llama", {}, {}),  # draft "a" with a candidate selector (MiniMax's DFlash2 alias)
    # draft "a" with Domino's projector, its rollout over a candidate pool of 16
    "domino": ("llama", {}, {"speculative_domino_candidate_pool_size": 16}),
    "laguna": ("llama", {}, {}),  # draft "a" as a Laguna draft: per-element gates, per-slice norms
}
# How each shape's draft proposes (`propose/proposers.py`; the server info's "dflash_proposals").
PROPOSALS = {
    "dflash2": "candidate selector",
    "domino": "Domino rollout (greedy over a candidate pool of 16",
    "window16-lilicorr": "LiLiCorr lattice (top 4; greedy and sampled walks)",
}
# The plain options SGLang's built-in serves, all at once (test_options.py checks each
# against SGLang's own modules): served end to end, lossless, and still accepting.
DRAFT_OPTIONS = {
    "use_gemma_norm": True,
    "partial_rotary_factor": 0.5,
    "rope_is_neox_style": False,
    "hidden_act": "swigluoai",
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}
# (family, engine flags) -> {batch size: outputs of the engine without speculation}
_PLAIN_OUTPUTS: dict = {}


def _with_draft_options(config: dict) -> None:
    config.update(DRAFT_OPTIONS)
    config["dflash_config"].update(attention_sink_bias=True, attention_value_scale=0.75)  # MiMo's
    config["dflash_config"].update(use_swa=True, swa_window_size=SWA_WINDOW)  # and its window
    config["dflash_config"].update(conv_kernel_size=CONV_TAPS, conv_group_size=CONV_GROUP)


CONV_TAPS, CONV_GROUP = 3, 16
SWA_WINDOW = 20  # longer than the block (16), shorter than the contexts: the layers see 20 positions


def _add_option_tensors(draft: str) -> None:
    """MiMo's per-head sink logits, and the grouped convolution's kernels (near the identity),
    for every draft layer."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    file = os.path.join(draft, "model.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(1)
    for i in range(config["num_hidden_layers"]):
        hidden = config["hidden_size"]
        for side in ("attention_conv", "mlp_conv"):
            base = 0.1 * torch.randn(2, CONV_TAPS, hidden, generator=gen)
            base[:, 0] += 1.0
            tensors[f"layers.{i}.{side}.base_kernel"] = base
            projection = 0.01 * torch.randn(2 * CONV_TAPS * hidden // CONV_GROUP, hidden, generator=gen)
            tensors[f"layers.{i}.{side}.kernel_projection.weight"] = projection
        tensors[f"layers.{i}.self_attn.attention_sink_bias"] = torch.randn(
            config["num_attention_heads"], generator=gen
        )
    save_file(tensors, file)


def _save_mask_embedding(target: str, draft: str) -> None:
    """A trained mask row beside the draft: the target's row for the mask token, perturbed."""
    import glob

    import torch
    from safetensors.torch import load_file

    from tests.support.tiny import MASK_ID

    (weights,) = glob.glob(os.path.join(target, "*.safetensors"))
    row = load_file(weights)["model.embed_tokens.weight"][MASK_ID].float()
    trained = row + 0.1 * row.std() * torch.randn(row.shape, generator=torch.Generator().manual_seed(0))
    torch.save({"embedding": trained, "mask_token_id": MASK_ID}, os.path.join(draft, "mask_embedding.pt"))


def _run(engine, batch_size, routed_experts):
    out = []
    for i in range(0, len(PROMPTS), batch_size):
        out += engine.generate(
            input_ids=PROMPTS[i : i + batch_size],
            sampling_params=GREEDY,
            return_routed_experts=routed_experts,
        )
    return out


@pytest.fixture(scope="module", params=list(SHAPES))
def served(request, tiny):
    """(shape, {batch size: plain outputs}, DFLASH engine), one engine at a time."""
    family, flags, spec_flags = SHAPES[request.param]
    target = favoured_target(tiny, family)
    routed = bool(flags.get("enable_return_routed_experts"))
    # The plain engine's tokens do not depend on the page size: page16 is checked against page 1.
    key = (family, tuple(sorted((k, v) for k, v in flags.items() if k != "page_size")))
    if key not in _PLAIN_OUTPUTS:
        engine = engines.start(target, **flags)
        try:
            _PLAIN_OUTPUTS[key] = {bs: _run(engine, bs, routed) for bs in (1, 8)}
        finally:
            engines.shutdown(engine)
    want = _PLAIN_OUTPUTS[key]
    draft = tiny.draft("a")
    if request.param == "llama":
        # A checkpoint without block_size drafts blocks of 16 (SGLang's default), and one without
        # mask_token_id uses the tokenizer's id for "<|MASK|>" (SGLang's default mask_token):
        # draft "a"'s own block and mask id, served instead of refused.
        def no_defaults(d):
            d.pop("block_size")
            d["dflash_config"].pop("mask_token_id")

        draft = tiny.edited_draft("a", "no-block-size-no-mask-id", no_defaults)
    if request.param == "draft-options":
        draft = tiny.edited_draft("a", "options", _with_draft_options)
        _save_mask_embedding(target, draft)
        _add_option_tensors(draft)
        quantize_fp8(draft)  # and its projections stored in fp8 with block scales
    if request.param == "dflash2":
        draft = add_selector(
            tiny.edited_draft("a", "dflash2", lambda d: None), architecture="MiniMaxDFlash2DraftModel"
        )
    if request.param == "domino":
        draft = add_domino(tiny.edited_draft("a", "domino", lambda d: None), scale=1.0)
    if request.param == "laguna":
        draft = add_laguna(tiny.edited_draft("a", "laguna", lambda d: None), gate_scale=1.0)
    if request.param == "window16-lilicorr":  # a LiLiCorr head leaning to the top candidates
        draft = add_lilicorr(tiny.edited_draft("a", "lilicorr", lambda d: None))
    if request.param == "page16-nemotron":  # draft "a" as a Nemotron-3.5 draft
        draft = make_nemotron_35(tiny.edited_draft("a", "nemotron", lambda d: None), target)
    engine = engines.start(target, draft, fixed_width=True, **flags, **spec_flags)
    yield request.param, want, engine
    engines.shutdown(engine)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_matches_target(served, batch_size):
    shape, want, engine = served
    routed = shape == "qwen3_moe"
    got = _run(engine, batch_size, routed)
    state = engines.server_state(engine)
    assert state["dflash_implementation"].startswith("sglang-dflash")
    assert state["dflash_proposals"].startswith(PROPOSALS.get(shape, "argmax"))
    weights = state["dflash_draft_weights"]  # the draft-options draft is stored in fp8, nemotron's in NVFP4
    assert weights.startswith("fp8 e4m3 (16x24 block scales") == (shape == "draft-options"), weights
    assert weights.startswith("NVFP4 e2m1 (W4A16_NVFP4") == (shape == "page16-nemotron"), weights
    assert ("its own token embedding [384, 64]" in weights) == (shape == "page16-nemotron"), weights
    # Each draft layer's reach: MiMo's window on every layer, or --speculative-draft-window-size.
    window = {"draft-options": SWA_WINDOW, "window16-lilicorr": WINDOW}.get(shape)
    kv = state["dflash_draft_kv"]
    assert kv["sliding_windows"] == [window] * len(kv["sliding_layers"]), kv
    assert (kv["full_layers"] == []) == (window is not None), kv
    if window is not None:  # --max-total-tokens caps the pool: a window ring would gain it nothing
        assert not kv["sliding_layers_windowed"] and "tokens with the ring" in kv["window_ring_why_not"], kv
    mismatches = [
        i for i, (g, w) in enumerate(zip(got, want[batch_size])) if g["output_ids"] != w["output_ids"]
    ]
    assert not mismatches, f"{shape}: prompts {mismatches} differ"
    accepted = sum(o["meta_info"]["completion_tokens"] for o in got) / sum(
        o["meta_info"]["spec_verify_ct"] for o in got
    )
    print(f"{shape} bs {batch_size}: mean acceptance {accepted:.2f}")
    if shape == "window16-lilicorr":  # each step scored every request with its last committed token's feature
        known, _, total, *_ = state["dflash_lilicorr_last_tokens"].split()
        assert known == total and int(total) > 0, state["dflash_lilicorr_last_tokens"]
        # Sampled requests walk the lattice by sampling, verified with its q (test_lilicorr.py).
        sampled = engine.generate(input_ids=PROMPTS[:8], sampling_params=dict(GREEDY, temperature=1.0))
        steps = sum(o["meta_info"]["spec_verify_ct"] for o in sampled)
        assert sum(o["meta_info"]["completion_tokens"] for o in sampled) > 1.1 * steps
    assert accepted > 1.1, f"{shape}: mean acceptance {accepted:.2f}; multi-token commits barely ran"
    if routed:
        for g, w in zip(got, want[batch_size]):
            # One row per token but the last, [layers x top-k] each, as SGLang returns them.
            experts = _experts(g)
            assert experts.size > 0
            np.testing.assert_array_equal(experts, _experts(w))


def _experts(output) -> np.ndarray:
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    return extract_routed_experts_from_meta_info(output)

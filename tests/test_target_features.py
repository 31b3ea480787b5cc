"""Drafts whose `target_layer_ids` repeat a layer or are not increasing (draft/target_features.py).

SGLang captures each listed layer once, in layer order. The oracle for the engine test is an
equivalent draft: fc([h2, h1, h2]) with fc.weight [A | B | C] equals fc([h1, h2]) with
[B | A + C], so a draft listing [2, 1, 2] must propose exactly what the folded draft listing
[1, 2] proposes. Without the gather, the [2, 1, 2] draft dies at its first prefill (fc reads
3 chunks from 2), and a reordered one proposes from the wrong layers.
"""

import json
import os

import pytest
import torch

from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.target_features import FeatureLayout, captured_chunk_of
from tests import engines, tiny_models

H = 4


def _captured(layer_ids, hidden):
    """What SGLang hands over: each distinct layer once, in layer order. hidden: {id: [T, H]}."""
    return torch.cat([hidden[i] for i in sorted(set(layer_ids))], dim=-1)


@pytest.mark.parametrize(
    "layer_ids",
    [[1, 9, 17], [1, 1], [9, 1, 9], [3, 2, 1], [5]],
    ids=["increasing", "z-lab-2-on-4", "mixed", "reversed", "one"],
)
def test_the_gather_gives_fc_its_layers_in_listed_order(layer_ids):
    hidden = {i: torch.randn(3, H) for i in set(layer_ids)}
    expected = torch.cat([hidden[i] for i in layer_ids], dim=-1)  # [T, K*H], what fc reads
    layout = FeatureLayout(layer_ids, H, "cpu")
    torch.testing.assert_close(layout.arrange(_captured(layer_ids, hidden)), expected, rtol=0, atol=0)
    assert layout.is_identity == (layer_ids == sorted(set(layer_ids)))


def test_the_gather_reads_a_packed_buffer_with_unwritten_chunks():
    """SGLang's packed capture buffer may hold one chunk per listed id, only the distinct ones
    written (the rest is whatever the buffer held)."""
    layer_ids = [9, 1, 9]
    hidden = {1: torch.randn(2, H), 9: torch.randn(2, H)}
    packed = torch.cat([_captured(layer_ids, hidden), torch.full((2, H), float("nan"))], dim=-1)
    out = FeatureLayout(layer_ids, H, "cpu").arrange(packed)
    torch.testing.assert_close(out, torch.cat([hidden[9], hidden[1], hidden[9]], dim=-1))


def test_the_default_ids_of_a_two_layer_draft_on_a_four_layer_target_repeat_a_layer():
    config = DFlashDraftConfig.from_dict(tiny_models.draft_config_dict(num_layers=2, num_target_layers=4))
    assert config.resolve_target_layer_ids(4) == (1, 1)
    assert captured_chunk_of([1, 1]) == (0, 0)


def _fold(draft: str, out: str, layer_ids: list[int]) -> str:
    """The equivalent draft listing each layer of `layer_ids` once, in layer order: fc's column
    blocks of a repeated layer are summed."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    tensors = load_file(os.path.join(draft, "model.safetensors"))
    order = sorted(set(layer_ids))
    blocks = tensors["fc.weight"].chunk(len(layer_ids), dim=1)  # K x [H, H]
    tensors["fc.weight"] = torch.cat(
        [sum(b for b, i in zip(blocks, layer_ids) if i == layer) for layer in order], dim=1
    ).contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    config["dflash_config"]["target_layer_ids"] = order
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def _serve(target, draft, trace):
    os.environ["SGLANG_DFLASH_TRACE_PROPOSALS"] = str(trace)
    try:
        engine = engines.start(target, draft, 8, fixed_width=True)
    finally:
        os.environ.pop("SGLANG_DFLASH_TRACE_PROPOSALS")
    try:
        out = engines.generate(
            engine, engines.prompts(4, seed=5), {"max_new_tokens": 24, "temperature": 0}, 4
        )
    finally:
        engines.shutdown(engine)
    with open(trace) as f:
        proposals = sorted((r["prefix_len"], r["proposals"]) for r in map(json.loads, f))
    return [o["output_ids"] for o in out], proposals


@pytest.mark.sglang
def test_a_draft_listing_a_layer_twice_out_of_order_proposes_as_its_folded_equivalent(tiny, tmp_path):
    layer_ids = [2, 1, 2]
    spec = dict(tiny_models.DRAFTS["a"], num_layers=2, target_layer_ids=layer_ids, seed=31)
    spec.pop("target")
    draft = tiny_models.make_draft(str(tmp_path / "draft"), **spec)
    folded = _fold(draft, str(tmp_path / "folded"), layer_ids)
    target = tiny.target("a")
    outputs, proposals = _serve(target, draft, tmp_path / "draft.jsonl")
    folded_outputs, folded_proposals = _serve(target, folded, tmp_path / "folded.jsonl")
    assert outputs == folded_outputs
    assert len(proposals) >= 8 and proposals == folded_proposals

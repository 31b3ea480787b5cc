"""A draft's target features as served: a draft listing a layer twice, out of order, proposes as its
folded equivalent."""

import json
import os

import pytest
import torch

from tests.support import engines
from tests.support.tiny import DRAFTS, make_draft


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
    spec = dict(DRAFTS["a"], num_layers=2, target_layer_ids=layer_ids, seed=31)
    spec.pop("target")
    draft = make_draft(str(tmp_path / "draft"), **spec)
    folded = _fold(draft, str(tmp_path / "folded"), layer_ids)
    target = tiny.target("a")
    outputs, proposals = _serve(target, draft, tmp_path / "draft.jsonl")
    folded_outputs, folded_proposals = _serve(target, folded, tmp_path / "folded.jsonl")
    assert outputs == folded_outputs
    assert len(proposals) >= 8 and proposals == folded_proposals

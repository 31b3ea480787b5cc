"""fp8 draft checkpoints, dequantised at load (`checkpoint/quantization.py`).

Oracle: the element rule W[n, k] = w[n, k] * s[n // bn, k // bk] (or one scale per tensor),
applied by hand in `tiny_models.quantize_fp8` to a draft it quantizes: the loaded draft's weights
equal it exactly, and stay near the original weights (fp8's rounding). The header check (for
the launching process) names a missing or misshapen scale; every other quantization method, and
a key SGLang's Fp8Config does not read, is refused by name. The engine test (greedy lossless,
acceptance above 1) is the "fp8" shape of test_target_shapes.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.checkpoint.quantization import Fp8Weights, dequantize_weight, parse_quantization
from sglang_dflash.draft.model import DFlashDraftModel
from tests.tiny_models import quantize_fp8

NUM_FEATURES = 1  # draft "a" reads one layer of its target


def test_the_docstrings_worked_example():
    weight = torch.ones(3, 3).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = dequantize_weight(weight, scale, Fp8Weights((2, 2), "dynamic"))
    assert torch.equal(got, torch.tensor([[1.0, 1, 2], [1, 1, 2], [3, 3, 4]]))


def _copy(tiny, tmp_path, name: str) -> str:
    path = str(tmp_path / name)
    shutil.copytree(tiny.draft("a"), path)
    return path


def _load(path: str) -> DFlashDraftModel:
    config = DFlashDraftConfig.from_pretrained(path)
    DFlashDraftModel.check_checkpoint(path, config, NUM_FEATURES)
    return DFlashDraftModel.from_pretrained(path, config, NUM_FEATURES)


@pytest.mark.parametrize("block", [(16, 24), None], ids=["block-scales", "per-tensor"])
def test_an_fp8_draft_loads_as_its_dequantised_weights(tiny, tmp_path, block):
    original = load_file(os.path.join(tiny.draft("a"), "model.safetensors"))
    path = _copy(tiny, tmp_path, "fp8")
    reference = quantize_fp8(path, block)
    model = _load(path)
    params = dict(model.named_parameters())
    assert reference and model.dequantized_numel == sum(w.numel() for w in reference.values())
    for name, want in reference.items():
        assert torch.equal(params[name], want), name  # exactly the element rule
        torch.testing.assert_close(want, original[name], rtol=0.07, atol=1e-3 * original[name].abs().max())
    for name in set(original) - set(reference):  # norms and the rest as stored
        assert torch.equal(params[name], original[name]), name
    described = " ".join(model.config.options_in_use())
    assert ("16x24 block scales" if block else "per-tensor scales") in described


def test_a_missing_or_misshapen_scale_is_named(tiny, tmp_path):
    path = _copy(tiny, tmp_path, "fp8")
    quantize_fp8(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    scale = "layers.0.self_attn.q_proj.weight_scale_inv"
    tensors[scale] = tensors[scale][:1]
    save_file(tensors, file)
    config = DFlashDraftConfig.from_pretrained(path)
    with pytest.raises(CheckpointError, match=f"needs '{scale}' of shape"):
        DFlashDraftModel.check_checkpoint(path, config, NUM_FEATURES)
    del tensors[scale]
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match="'layers.0.self_attn.q_proj.weight' has no"):
        DFlashDraftModel.check_checkpoint(path, config, NUM_FEATURES)


@pytest.mark.parametrize(
    "quant, words",
    [
        ({"quant_algo": "W4A16_NVFP4", "quant_method": "modelopt"}, "quant_method 'modelopt' .quant_algo"),
        ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
        ({"quant_method": "fp8", "kv_cache_quant_algo": "FP8"}, "'quantization_config.kv_cache_quant_algo'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ],
    ids=["nvfp4", "compressed-tensors", "unknown-key", "static-blocks"],
)
def test_other_quantizations_are_refused_by_name(quant, words):
    with pytest.raises(CheckpointError, match=words):
        parse_quantization(quant)


def test_the_config_reads_the_quantization(tiny):
    with open(os.path.join(tiny.draft("a"), "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert DFlashDraftConfig.from_dict(raw).quantization == Fp8Weights((128, 128), "dynamic")

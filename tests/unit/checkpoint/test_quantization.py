"""fp8 and NVFP4 draft checkpoints, dequantised at load (`checkpoint/quantization.py`).

Oracles: for fp8, the element rule W[n, k] = w[n, k] * s[n // bn, k // bk] (or one scale per
tensor), applied by hand in `tiny.quantize_fp8` to a draft it quantizes; for NVFP4, SGLang's
own `dequantize_nvfp4` (layers/quantization/dequantization.py) of each stored weight, which
`tiny.quantize_nvfp4` writes as ModelOpt does. The loaded draft's weights equal the oracle
exactly, and stay near the original weights (the format's rounding). The header check (for the
launching process) names a missing or misshapen scale; every other quantization method, and a
key the format's SGLang config does not read, is refused by name. The engine tests (greedy
lossless, acceptance above 1) are the "draft-options" (fp8) and "page16-nemotron" (NVFP4) shapes of
test_target_shapes.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.checkpoint.quantization import Fp8Weights, Nvfp4Weights, parse_quantization
from sglang_dflash.draft.model import DFlashDraftModel
from tests.support.tiny import quantize_fp8, quantize_nvfp4

NUM_FEATURES = 1  # draft "a" reads one layer of its target


def test_the_docstrings_worked_example():
    weight = torch.ones(3, 3).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = Fp8Weights((2, 2), "dynamic").dequantize(weight, {"weight_scale_inv": scale})
    assert torch.equal(got, torch.tensor([[1.0, 1, 2], [1, 1, 2], [3, 3, 4]]))
    # NVFP4: the byte 0x2F holds code 15 (-6), then code 2 (1); scales 0.5 and 2 cancel.
    packed = torch.tensor([[0x2F] + [0] * 7], dtype=torch.uint8)  # [1, 8]: 16 values
    scales = {
        "weight_scale": torch.tensor([[0.5]]).to(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(2.0),
    }
    got = Nvfp4Weights("W4A16_NVFP4").dequantize(packed, scales)
    assert torch.equal(got, torch.tensor([[-6.0, 1.0] + [0.0] * 14]))


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
        ({"quant_algo": "NVFP4_AWQ", "quant_method": "modelopt"}, "quant_method 'modelopt' .quant_algo"),
        ({"quant_algo": "NVFP4", "quant_method": "modelopt", "group_size": 32}, "NVFP4 scales groups of 16"),
        ({"quant_algo": "NVFP4", "quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}, "draft KV cache"),
        ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
        ({"quant_method": "fp8", "kv_cache_quant_algo": "FP8"}, "'quantization_config.kv_cache_quant_algo'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ],
    ids=["nvfp4-awq", "nvfp4-groups", "nvfp4-kv", "compressed-tensors", "unknown-key", "static-blocks"],
)
def test_other_quantizations_are_refused_by_name(quant, words):
    with pytest.raises(CheckpointError, match=words):
        parse_quantization(quant)


def test_the_config_reads_the_quantization(tiny):
    with open(os.path.join(tiny.draft("a"), "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert DFlashDraftConfig.from_dict(raw).quantization == Fp8Weights((128, 128), "dynamic")

    raw["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert DFlashDraftConfig.from_dict(raw).quantization == Nvfp4Weights("W4A16_NVFP4")


@pytest.mark.sglang  # SGLang's dequantize_nvfp4 is the oracle
def test_an_nvfp4_draft_loads_as_sglangs_dequantisation(tiny, tmp_path):
    from sglang.srt.layers.quantization.dequantization import dequantize_nvfp4

    original = load_file(os.path.join(tiny.draft("a"), "model.safetensors"))
    path = _copy(tiny, tmp_path, "nvfp4")
    quantize_nvfp4(path)
    stored = load_file(os.path.join(path, "model.safetensors"))
    model = _load(path)
    params = dict(model.named_parameters())
    packed = [name for name, t in stored.items() if t.dtype == torch.uint8]
    assert packed and model.dequantized_numel == sum(original[name].numel() for name in packed)
    for name in packed:
        base = name[: -len("weight")]
        want = dequantize_nvfp4(
            stored[name], stored[base + "weight_scale"], stored[base + "weight_scale_2"], torch.float32
        )
        assert torch.equal(params[name], want), name
        cosine = torch.nn.functional.cosine_similarity(want.flatten(), original[name].flatten(), dim=0)
        assert cosine > 0.97, (name, cosine)  # e2m1 keeps the weights' direction
    for name in set(original) - set(packed):
        assert torch.equal(params[name], original[name]), name
    assert "NVFP4 e2m1 (W4A16_NVFP4" in " ".join(model.config.options_in_use())
    # The header check names a missing global scale.
    del stored["layers.0.mlp.down_proj.weight_scale_2"]
    save_file(stored, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="'layers.0.mlp.down_proj.weight' has no"):
        DFlashDraftModel.check_checkpoint(path, model.config, NUM_FEATURES)

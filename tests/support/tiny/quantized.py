"""Quantized drafts: fp8 (`quantize_fp8`), ModelOpt NVFP4 (`quantize_nvfp4`) and a Nemotron-3.5
draft (`make_nemotron_35`: its own embedding, NVFP4 projections)."""

from __future__ import annotations

import json
import os

import torch


def quantize_fp8(path: str, block: tuple[int, int] | None = (16, 24)) -> dict:
    """Rewrite draft `path` as an fp8 checkpoint, as SGLang's Fp8Config loads one: every 2-D
    projection weight (`*proj.weight`, `fc.weight`) in float8_e4m3fn with its scales (per block
    `weight_scale_inv`, or one `weight_scale`), and `quantization_config` in config.json. Returns
    the weights as dequantised from the fp8 ones, by the element rule (the reference)."""
    import math

    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors, reference = load_file(file), {}
    for name in [n for n in tensors if n.endswith(("proj.weight", "fc.weight"))]:
        w = tensors.pop(name).float()  # [N, K]
        n, k = w.shape
        bn, bk = block or (n, k)
        grid = torch.zeros(math.ceil(n / bn), math.ceil(k / bk))
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                amax = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max()
                grid[i, j] = amax.clamp_min(1e-8) / 448.0  # e4m3's largest value
        full = torch.stack([torch.stack([grid[r // bn, c // bk] for c in range(k)]) for r in range(n)])
        fp8 = (w / full).to(torch.float8_e4m3fn)
        tensors[name] = fp8
        scale_name = name[: -len("weight")] + ("weight_scale_inv" if block else "weight_scale")
        tensors[scale_name] = grid if block else grid.reshape(())
        reference[name] = fp8.float() * full
    save_file(tensors, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if block:
        quant["weight_block_size"] = list(block)
    config["quantization_config"] = quant
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return reference


def quantize_nvfp4(path: str, algo: str = "W4A16_NVFP4") -> None:
    """Rewrite draft `path` as a ModelOpt NVFP4 checkpoint: every 2-D projection weight
    (`*proj.weight`, `fc.weight`) [N, K] as e2m1 codes packed two a byte, the low nibble first
    [N, K/2], with fp8 scales per 16 elements (`weight_scale`) and a global one
    (`weight_scale_2`), as ModelOpt scales them (each group's largest value at 6, the largest
    group scale at 448); and `quantization_config` in config.json."""
    from safetensors.torch import load_file, save_file

    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("proj.weight", "fc.weight"))]:
        w = tensors.pop(name).float()  # [N, K]
        global_scale = w.abs().max() / (6.0 * 448.0)
        groups = w.view(w.shape[0], -1, 16)  # [N, K/16, 16]
        scale = (groups.abs().amax(-1) / 6.0 / global_scale).to(torch.float8_e4m3fn)  # [N, K/16]
        x = groups / (scale.float() * global_scale).clamp_min(1e-12)[..., None]
        code = (x.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (x < 0)  # nearest, sign bit 3
        code = code.view(w.shape).to(torch.uint8)
        tensors[name] = code[:, 0::2] | (code[:, 1::2] << 4)
        tensors[name[: -len("weight")] + "weight_scale"] = scale
        tensors[name[: -len("weight")] + "weight_scale_2"] = global_scale.reshape(1)
    save_file(tensors, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def make_nemotron_35(path: str, target: str) -> str:
    """Make the draft at `path` a Nemotron-3.5 draft as SGLang detects one
    (`is_nemotron_35_draft_config`): `has_embed_tokens` with its own `embed_tokens` (a copy of the
    target's table, as a draft trained with `train_embed_tokens: false` holds), no LM head, the
    captured layers' `eagle_aux_hidden_state_layer_ids` (= target_layer_ids + 1),
    `sample_from_anchor: false`, and W4A16_NVFP4 projections (`quantize_nvfp4`)."""
    import glob

    from safetensors.torch import load_file, save_file

    from sglang_dflash.checkpoint.config import DFlashDraftConfig

    config = DFlashDraftConfig.from_pretrained(path)
    ids = list(config.resolve_target_layer_ids(config.num_target_layers))
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["dflash_config"].update(target_layer_ids=ids, sample_from_anchor=False)
    raw.update(
        has_embed_tokens=True,
        has_lm_head=False,
        train_embed_tokens=False,
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids],
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    (weights,) = glob.glob(os.path.join(target, "*.safetensors"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["embed_tokens.weight"] = load_file(weights)["model.embed_tokens.weight"].clone()
    save_file(tensors, file)
    quantize_nvfp4(path, "W4A16_NVFP4")
    return path

"""Quantized draft weights: fp8 checkpoints, dequantised once at load to the draft's dtype.

SGLang's built-in runs a quantized draft through its quantized kernels (`Fp8Config`,
layers/quantization/fp8.py). A draft is a few layers, so here every fp8 weight becomes a plain
one once, at load, on any device (CPU included), and the draft then runs as any other; the cost
is the memory of the wider weights, which the start-up line states. Verification is exact
whatever the draft computes, so serving is lossless; activations stay in the draft's dtype
where SGLang's kernels quantize them too, so acceptance may differ a little from the built-in's.

Served: `quantization_config.quant_method: "fp8"` with e4m3 weights (`float8_e4m3fn`), as
SGLang's `Fp8Config.from_config` reads it:

* block scales, `weight_block_size: [bn, bk]` (activation_scheme "dynamic", as SGLang requires):
  each `X.weight` [N, K] has `X.weight_scale_inv` [ceil(N / bn), ceil(K / bk)] (float32), and
  W[n, k] = w[n, k] * s[n // bn, k // bk]. E.g. N = K = 3, blocks [2, 2], s = [[1, 2], [3, 4]]:
  row 0 and 1 scale by [1, 1, 2], row 2 by [3, 3, 4];
* per-tensor scales (no `weight_block_size`): `X.weight_scale` of one value, W = w * s; with
  activation_scheme "static" also `X.input_scale`, which scales activations SGLang quantizes and
  is not used here (activations are not quantized).

Weights without a scale (`ignored_layers`, norms) load as they are. Every other method (NVFP4,
modelopt, compressed-tensors, MXFP8, GPTQ, AWQ, ...) is refused by name (`parse_quantization`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang_dflash.checkpoint.contract import WAY_OUT, CheckpointError, RefusedCheckpoint

FP8_DTYPES = ("F8_E4M3", "float8_e4m3fn", "torch.float8_e4m3fn")  # header and torch names
# The keys of `quantization_config` SGLang's Fp8Config reads, and what each may hold here.
FP8_KEYS = frozenset(
    {"quant_method", "activation_scheme", "weight_block_size", "ignored_layers", "modules_to_not_convert"}
)


@dataclass(frozen=True)
class Fp8Weights:
    """How a checkpoint's fp8 weights are scaled."""

    block: Optional[tuple[int, int]]  # (bn, bk) block scales; None: one scale per tensor
    activation_scheme: str  # "dynamic" or "static" (then tensors carry `input_scale`)

    def describe(self) -> str:
        scales = f"{self.block[0]}x{self.block[1]} block scales" if self.block else "per-tensor scales"
        return f"fp8 e4m3 ({scales}, {self.activation_scheme} activations)"


def parse_quantization(quant: Any) -> Optional[Fp8Weights]:
    """`quantization_config` -> how to dequantise; None without one. Refuses every method but
    fp8, and any key SGLang's Fp8Config does not read, by name."""
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise CheckpointError(f"draft config field 'quantization_config' must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method != "fp8":
        algo = quant.get("quant_algo")
        what = f"quant_method {method!r}" + (f" (quant_algo {algo!r})" if algo else "")
        raise RefusedCheckpoint(
            f"draft config field 'quantization_config' declares {what}: sglang-dflash dequantises "
            f"fp8 draft weights only; {WAY_OUT}"
        )
    for key in quant:
        if key not in FP8_KEYS:
            raise RefusedCheckpoint(
                f"draft config field 'quantization_config.{key}' ({quant[key]!r}) is unknown to "
                f"sglang-dflash's fp8 loader, which would otherwise ignore it; {WAY_OUT}"
            )
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise CheckpointError(
            f"draft config field 'quantization_config.activation_scheme' must be 'dynamic' or 'static', "
            f"got {scheme!r}"
        )
    block = quant.get("weight_block_size")
    if block is not None:
        sizes = isinstance(block, list) and len(block) == 2
        if not (sizes and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(
                f"draft config field 'quantization_config.weight_block_size' must be two positive "
                f"integers [bn, bk], got {block!r}"
            )
        if scheme != "dynamic":  # SGLang's Fp8LinearMethod asserts the same
            raise CheckpointError(
                "draft config declares fp8 block scales ('weight_block_size') with static activation "
                "scales, which SGLang does not load either"
            )
        block = (block[0], block[1])
    return Fp8Weights(block, scheme)


def scale_shape(quant: Fp8Weights, weight_shape: tuple) -> tuple:
    """The scale tensor an fp8 weight [N, K] carries: [ceil(N/bn), ceil(K/bk)], or one value."""
    if quant.block is None:
        return ()
    (n, k), (bn, bk) = weight_shape, quant.block
    return (math.ceil(n / bn), math.ceil(k / bk))


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, quant: Fp8Weights) -> torch.Tensor:
    """weight [N, K] fp8, scale (see `scale_shape`) -> W [N, K] float32."""
    w = weight.float()
    if quant.block is None:
        return w * scale.float().reshape(())
    (n, k), (bn, bk) = w.shape, quant.block
    # [N/bn, K/bk] -> [N, K]: each scale repeated over its block, cut at the ragged edge.
    s = scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w * s


def _scale_name(quant: Fp8Weights) -> str:
    return "weight_scale" if quant.block is None else "weight_scale_inv"


def _checked_pairs(
    shapes: dict[str, tuple], fp8: set[str], quant: Fp8Weights
) -> tuple[dict[str, str], set[str]]:
    """shapes: every tensor's; fp8: the names of the fp8 ones. -> fp8 weight name -> its scale's
    name, and the names to drop (scales, input scales). Refuses an fp8 weight without its scale
    or with a misshapen one, and a scale without an fp8 weight."""
    scale_suffix = "." + _scale_name(quant)
    static = quant.activation_scheme == "static"
    pairs, drop = {}, set()
    for name in sorted(shapes):
        if name.endswith(".weight") and name in fp8:
            scale = name[: -len(".weight")] + scale_suffix
            if scale not in shapes:
                raise CheckpointError(f"fp8 draft weight {name!r} has no {scale!r}")
            want, got = scale_shape(quant, shapes[name]), shapes[scale]
            if math.prod(got) != math.prod(want) or (want and got != want):
                raise CheckpointError(
                    f"fp8 draft weight {name!r} of shape {shapes[name]} needs {scale!r} of shape "
                    f"{want or '(one value)'}, found {got}"
                )
            pairs[name] = scale
        elif name.endswith(scale_suffix) or (static and name.endswith(".input_scale")):
            weight = name.rsplit(".", 1)[0] + ".weight"
            if weight not in fp8:
                raise CheckpointError(f"draft checkpoint tensor {name!r} scales no fp8 weight ({weight!r})")
            drop.add(name)
    return pairs, drop


Header = dict[str, tuple[tuple, str]]  # tensor name -> (shape, dtype name)


def dequantize_header(header: Header, quant: Fp8Weights) -> Header:
    """A safetensors header (name -> (shape, dtype)) as the dequantised checkpoint's: scales
    checked against their weights' shapes and removed, fp8 weights made float32."""
    fp8 = {name for name, (_, dtype) in header.items() if dtype in FP8_DTYPES}
    pairs, drop = _checked_pairs({name: shape for name, (shape, _) in header.items()}, fp8, quant)
    out = {name: value for name, value in header.items() if name not in drop}
    out.update({weight: (header[weight][0], "F32") for weight in pairs})
    return out


def dequantize_state(state: dict[str, torch.Tensor], quant: Fp8Weights) -> tuple[dict, int]:
    """The checkpoint's tensors with every fp8 weight dequantised to float32 and the scales
    removed; and how many weight elements were dequantised."""
    fp8 = {name for name, t in state.items() if t.dtype == torch.float8_e4m3fn}
    pairs, drop = _checked_pairs({name: tuple(t.shape) for name, t in state.items()}, fp8, quant)
    out = {name: t for name, t in state.items() if name not in drop}
    for weight, scale in pairs.items():
        out[weight] = dequantize_weight(state[weight], state[scale], quant)
    return out, sum(state[weight].numel() for weight in pairs)

"""Quantized draft weights: fp8 and NVFP4 checkpoints, dequantised once at load to the draft's
dtype.

SGLang's built-in runs a quantized draft through its quantized kernels (`Fp8Config`,
layers/quantization/fp8.py; `ModelOptFp4Config`, modelopt_quant.py). A draft is a few layers, so
here every quantized weight becomes a plain one once, at load, on any device (CPU included), and
the draft then runs as any other; the cost is the memory of the wider weights, which the
start-up line states. Verification is exact whatever the draft computes, so serving is lossless;
activations stay in the draft's dtype where SGLang's kernels quantize them (fp8, and NVFP4's
W4A4 form), so acceptance may differ a little from the built-in's.

Served formats (`parse_quantization`), each weight `X.weight` with its scales beside it:

* fp8: `quant_method: "fp8"` with e4m3 weights (`float8_e4m3fn`), as SGLang's
  `Fp8Config.from_config` reads it.
  - Block scales, `weight_block_size: [bn, bk]` (activation_scheme "dynamic", as SGLang
    requires): `X.weight` [N, K] has `X.weight_scale_inv` [ceil(N / bn), ceil(K / bk)]
    (float32), and W[n, k] = w[n, k] * s[n // bn, k // bk]. E.g. N = K = 3, blocks [2, 2],
    s = [[1, 2], [3, 4]]: rows 0 and 1 scale by [1, 1, 2], row 2 by [3, 3, 4].
  - Per-tensor scales (no `weight_block_size`): `X.weight_scale` of one value, W = w * s; with
    activation_scheme "static" also `X.input_scale`, which scales activations SGLang quantizes
    and is not used here.
* NVFP4: `quant_method: "modelopt"` (or none, which SGLang reads as modelopt), `quant_algo`
  "NVFP4" or "W4A16_NVFP4" (group size 16), as `ModelOptFp4Config.from_config` reads the flat
  form. `X.weight` [N, K/2] uint8 holds two e2m1 values a byte, the low nibble first (element 2j
  in the low four bits of byte j); `X.weight_scale` [N, K/16] float8_e4m3fn scales each 16
  elements of a row, and `X.weight_scale_2` (one float32) the whole tensor:
  W[n, k] = e2m1(w, n, k) * s[n, k // 16] * s2. e2m1 codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6,
  and 8..15 their negatives; e.g. the byte 0x2F holds code 15 (-6) then code 2 (1), so with
  s = 0.5 and s2 = 2 the pair is [-6, 1]. `X.input_scale` (the W4A4 form's activation scale) is
  not used.

Weights without a scale (`ignored_layers`, `exclude_modules`, norms) load as they are. Every
other method (compressed-tensors, MXFP8, GPTQ, AWQ, NVFP4_AWQ, ...) is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from sglang_dflash.checkpoint.contract import WAY_OUT, CheckpointError, RefusedCheckpoint

FP8_DTYPES = ("F8_E4M3", "float8_e4m3fn", "torch.float8_e4m3fn")  # header and torch names
PACKED_DTYPES = ("U8", "uint8", "torch.uint8")
# The keys of `quantization_config` each format's SGLang config reads, and what they may hold here.
FP8_KEYS = frozenset(
    {"quant_method", "activation_scheme", "weight_block_size", "ignored_layers", "modules_to_not_convert"}
)
NVFP4_KEYS = frozenset(
    {
        "quant_method", "quant_algo", "group_size", "exclude_modules", "ignore", "modules_to_not_convert",
        "kv_cache_quant_algo", "kv_cache_scheme", "producer",
    }
)  # fmt: skip
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
NVFP4_GROUP = 16
# e2m1 code -> value: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6 (SGLang's LUT).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Fp8Weights:
    """How a checkpoint's fp8 weights are scaled."""

    block: Optional[tuple[int, int]]  # (bn, bk) block scales; None: one scale per tensor
    activation_scheme: str  # "dynamic" or "static" (then tensors carry `input_scale`)

    stored = FP8_DTYPES
    bytes_per_weight = 1.0

    def describe(self) -> str:
        scales = f"{self.block[0]}x{self.block[1]} block scales" if self.block else "per-tensor scales"
        return f"fp8 e4m3 ({scales}, {self.activation_scheme} activations)"

    def scale_names(self) -> tuple[str, ...]:
        """The suffixes of the scale tensors beside each quantized `X.weight`."""
        return ("weight_scale",) if self.block is None else ("weight_scale_inv",)

    def scales(self, shape: tuple) -> dict[str, tuple]:
        """The scale tensors a weight of stored `shape` [N, K] carries: suffix -> shape."""
        if self.block is None:
            return {"weight_scale": ()}
        (n, k), (bn, bk) = shape, self.block
        return {"weight_scale_inv": (math.ceil(n / bn), math.ceil(k / bk))}

    def unused(self) -> tuple[str, ...]:
        return ("input_scale",) if self.activation_scheme == "static" else ()

    def weight_shape(self, shape: tuple) -> tuple:
        return shape

    def dequantize(self, weight: torch.Tensor, scales: dict[str, torch.Tensor]) -> torch.Tensor:
        """weight [N, K] fp8, its scales -> W [N, K] float32."""
        w = weight.float()
        if self.block is None:
            return w * scales["weight_scale"].float().reshape(())
        (n, k), (bn, bk) = w.shape, self.block
        # [N/bn, K/bk] -> [N, K]: each scale repeated over its block, cut at the ragged edge.
        s = scales["weight_scale_inv"].float()
        return w * s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


@dataclass(frozen=True)
class Nvfp4Weights:
    """A ModelOpt NVFP4 checkpoint's weights: e2m1 pairs, fp8 scales per 16, a global scale."""

    algo: str  # "NVFP4" (SGLang quantizes activations too) or "W4A16_NVFP4" (weights only)

    stored = PACKED_DTYPES
    bytes_per_weight = 0.5 + 1 / NVFP4_GROUP  # half a byte, and a one-byte scale per 16

    def describe(self) -> str:
        activations = "fp4 activations" if self.algo == "NVFP4" else "16-bit activations"
        return f"NVFP4 e2m1 ({self.algo}: fp8 scales per {NVFP4_GROUP} and a global scale, {activations})"

    def scale_names(self) -> tuple[str, ...]:
        return ("weight_scale", "weight_scale_2")

    def scales(self, shape: tuple) -> dict[str, tuple]:
        n, half = shape
        return {"weight_scale": (n, 2 * half // NVFP4_GROUP), "weight_scale_2": ()}

    def unused(self) -> tuple[str, ...]:
        return ("input_scale",)

    def weight_shape(self, shape: tuple) -> tuple:
        n, half = shape
        return (n, 2 * half)

    def dequantize(self, weight: torch.Tensor, scales: dict[str, torch.Tensor]) -> torch.Tensor:
        """weight [N, K/2] uint8, its scales -> W [N, K] float32."""
        codes = torch.stack([weight & 0xF, weight >> 4], dim=-1).flatten(-2).long()  # [N, K], low first
        values = torch.tensor(E2M1_VALUES, device=weight.device)[codes]
        s = scales["weight_scale"].float() * scales["weight_scale_2"].float().reshape(())
        return values * s.repeat_interleave(NVFP4_GROUP, dim=-1)


QuantizedWeights = Union[Fp8Weights, Nvfp4Weights]


def parse_quantization(quant: Any) -> Optional[QuantizedWeights]:
    """`quantization_config` -> how to dequantise; None without one. Refuses every other method,
    and any key the format's SGLang config does not read, by name."""
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise CheckpointError(f"draft config field 'quantization_config' must be an object, got {quant!r}")
    method, algo = quant.get("quant_method"), quant.get("quant_algo")
    if method == "fp8":
        _check_keys(quant, FP8_KEYS, "fp8")
        return _parse_fp8(quant)
    if method in (None, "modelopt") and algo in NVFP4_ALGOS:  # SGLang takes no method as modelopt
        _check_keys(quant, NVFP4_KEYS, "NVFP4")
        return _parse_nvfp4(quant)
    what = f"quant_method {method!r}" + (f" (quant_algo {algo!r})" if algo else "")
    raise RefusedCheckpoint(
        f"draft config field 'quantization_config' declares {what}: sglang-dflash dequantises fp8 and "
        f"NVFP4 (modelopt {' / '.join(NVFP4_ALGOS)}) draft weights only; {WAY_OUT}"
    )


def _check_keys(quant: dict, known: frozenset, loader: str) -> None:
    for key in quant:
        if key not in known:
            raise RefusedCheckpoint(
                f"draft config field 'quantization_config.{key}' ({quant[key]!r}) is unknown to "
                f"sglang-dflash's {loader} loader, which would otherwise ignore it; {WAY_OUT}"
            )


def _parse_fp8(quant: dict) -> Fp8Weights:
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


def _parse_nvfp4(quant: dict) -> Nvfp4Weights:
    group = quant.get("group_size", NVFP4_GROUP)
    if group != NVFP4_GROUP:
        raise CheckpointError(
            f"draft config field 'quantization_config.group_size' is {group!r}: NVFP4 scales groups of "
            f"{NVFP4_GROUP}"
        )
    # The draft's KV cache dtype is the server's (--speculative-draft-kv-cache-dtype), never the
    # checkpoint's: a KV quantization it declares would otherwise be ignored.
    for key in ("kv_cache_quant_algo", "kv_cache_scheme"):
        if quant.get(key) not in (None, "auto"):
            raise RefusedCheckpoint(
                f"draft config field 'quantization_config.{key}' ({quant[key]!r}) declares a quantized "
                f"draft KV cache; sglang-dflash takes the draft's KV dtype from the server's "
                f"arguments (--speculative-draft-kv-cache-dtype); {WAY_OUT}"
            )
    return Nvfp4Weights(quant["quant_algo"])


def _checked_pairs(
    shapes: dict[str, tuple], quantized: set[str], quant: QuantizedWeights
) -> tuple[dict[str, dict[str, str]], set[str]]:
    """shapes: every tensor's; quantized: the names of the weights stored quantized. -> each
    quantized weight's scales (suffix -> tensor name), and the names to drop (scales, unused
    activation scales). Refuses a quantized weight without a scale or with a misshapen one, and a
    scale without a quantized weight."""
    pairs, drop = {}, set()
    for name in sorted(shapes):
        base, _, suffix = name.rpartition(".")
        if suffix == "weight" and name in quantized:
            if len(shapes[name]) != 2:
                raise CheckpointError(f"quantized draft weight {name!r} has shape {shapes[name]}, not 2-D")
            pairs[name] = {}
            for scale_suffix, want in quant.scales(shapes[name]).items():
                scale = f"{base}.{scale_suffix}"
                if scale not in shapes:
                    raise CheckpointError(f"quantized draft weight {name!r} has no {scale!r}")
                got = shapes[scale]
                if math.prod(got) != math.prod(want) or (want and got != want):
                    raise CheckpointError(
                        f"quantized draft weight {name!r} of shape {shapes[name]} needs {scale!r} of "
                        f"shape {want or '(one value)'}, found {got}"
                    )
                pairs[name][scale_suffix] = scale
        elif suffix in quant.scale_names() or suffix in quant.unused():
            if f"{base}.weight" not in quantized:
                raise CheckpointError(f"draft checkpoint tensor {name!r} scales no quantized weight")
            drop.add(name)
    return pairs, drop


Header = dict[str, tuple[tuple, str]]  # tensor name -> (shape, dtype name)


def dequantize_header(header: Header, quant: QuantizedWeights) -> Header:
    """A safetensors header (name -> (shape, dtype)) as the dequantised checkpoint's: scales
    checked against their weights' shapes and removed, quantized weights made float32."""
    quantized = {name for name, (_, dtype) in header.items() if dtype in quant.stored}
    pairs, drop = _checked_pairs({name: shape for name, (shape, _) in header.items()}, quantized, quant)
    out = {name: value for name, value in header.items() if name not in drop}
    out.update({weight: (quant.weight_shape(header[weight][0]), "F32") for weight in pairs})
    return out


def dequantize_state(state: dict[str, torch.Tensor], quant: QuantizedWeights) -> tuple[dict, int]:
    """The checkpoint's tensors with every quantized weight dequantised to float32 and the scales
    removed; and how many weight elements were dequantised."""
    quantized = {name for name, t in state.items() if str(t.dtype) in quant.stored}
    pairs, drop = _checked_pairs({name: tuple(t.shape) for name, t in state.items()}, quantized, quant)
    out = {name: t for name, t in state.items() if name not in drop}
    for weight, scales in pairs.items():
        out[weight] = quant.dequantize(state[weight], {s: state[n] for s, n in scales.items()})
    return out, sum(out[weight].numel() for weight in pairs)

"""The stand-in's norms and gated activations for float32 inputs, in PyTorch: FlashInfer's
kernels take fp16 and bf16 only, and sgl-kernel's take float32 too (a target served with
`--dtype float32`, e.g. on the Triton backend). Same signatures and in-place contracts as
sgl-kernel's; the maths in float32, as sgl-kernel's kernels accumulate."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    # x [..., H], weight [H]; Gemma's norm scales by (1 + weight).
    scale = weight.float() + 1.0 if gemma else weight.float()
    return x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * scale


def rmsnorm(input, weight, eps=1e-6, out=None, gemma=False):
    """out = norm(input), into `out` when given."""
    result = _norm(input, weight, eps, gemma).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, gemma=False):
    """In place, as sgl-kernel's: residual += input, then input = norm(residual)."""
    residual.add_(input)
    input.copy_(_norm(residual, weight, eps, gemma).to(input.dtype))


def gated(input, out=None, act="silu"):
    """input [..., 2d] = [gate, up] -> act(gate) * up [..., d], into `out` when given."""
    gate, up = input.chunk(2, dim=-1)
    if act == "silu":
        result = F.silu(gate) * up
    else:
        result = F.gelu(gate, approximate="tanh" if act == "gelu_tanh" else "none") * up
    if out is None:
        return result
    out.copy_(result)
    return out

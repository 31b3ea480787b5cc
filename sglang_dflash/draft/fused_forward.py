"""The draft network's forward on CUDA in fused kernels: `DFlashDraftModel.forward`'s maths (the
reference) over the same weights, in about 14 launches a layer instead of 58.

One layer, N block tokens:

    [residual-add +] RMSNorm                  1 kernel   (the reference: ~8 elementwise ops)
    q/k/v projection                          1 GEMM     over the layer's stacked [q+2kv, H] weight
    q_norm, k_norm                            2 kernels  (per head, on strided views of the GEMM)
    RoPE of q and k                           1 kernel   from a cos/sin cache, in place
    attention                                 the caller's `attend` (FlashInfer on CUDA)
    o_proj                                    1 GEMM
    residual-add + RMSNorm                    1 kernel
    gate/up projection                        1 GEMM     over the stacked [2I, H] weight
    SiLU(gate) * up                           1 kernel
    down_proj                                 1 GEMM

The residual stream is carried as in SGLang's decoder layers: each RMSNorm after the first adds
the sublayer's output into the residual first, and the final norm adds the last MLP's.

The kernels are FlashInfer's (`flashinfer.norm`, `flashinfer.activation`, `flashinfer.rope`),
behind `Kernels`; `TorchKernels` states each one's contract in PyTorch, so the CPU tests run the
fused forward's data flow against the reference, and the GPU tests run FlashInfer's against it.
They differ from the reference only in rounding: FlashInfer normalises in fp32 and rounds once,
the reference rounds the normalised row before scaling it, and rounds the residual before the
next norm reads it.

Stacking: each layer's q/k/v_proj weights (and biases) become row slices of one tensor, gate/up
of another, and the modules' parameters are re-pointed at those slices, so nothing is stored
twice and the module forward still works on the same weights.

See docs/gpu.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.draft.model import AttendFn, DFlashDraftModel

FUSED_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's norm and RoPE kernels


class Kernels(Protocol):
    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [N, D] or [N, heads, D] (rows may be strided) -> x / rms(x) * weight, new tensor."""

    def fused_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: residual += x; x = residual / rms(residual) * weight ([N, D] each)."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, 2I] -> silu(x[:, :I]) * x[:, I:], [N, I]."""

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """In place, neox style: q [N, heads, d], k [N, kv_heads, d] rotated at `positions` [N]
        by cos_sin [P, d] fp32 (cos in the first half of each row, sin in the second)."""

    def describe(self, device: torch.device) -> str:
        """Which kernels these are, for the start-up line."""


class TorchKernels:
    """Each kernel's contract in PyTorch, with FlashInfer's rounding: fp32 inside, one rounding
    to the input dtype at the end (and the residual rounded when stored)."""

    def describe(self, device: torch.device) -> str:
        return "PyTorch reference kernels"

    @staticmethod
    def _normalise(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()

    def rmsnorm(self, x, weight, eps):
        return self._normalise(x, weight, eps).to(x.dtype)

    def fused_add_rmsnorm(self, x, residual, weight, eps):
        total = x.float() + residual.float()
        residual.copy_(total)
        x.copy_(self._normalise(total, weight, eps))

    def silu_and_mul(self, x):
        gate, up = x.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)

    def rope(self, positions, q, k, cos_sin):
        cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [N, d/2] each
        for x in (q, k):
            first, second = x.float().chunk(2, dim=-1)  # [N, heads, d/2]
            c, s = cos[:, None, :], sin[:, None, :]
            x.copy_(torch.cat([first * c - second * s, second * c + first * s], dim=-1))


def norm_path(device: torch.device) -> str:
    """Which of FlashInfer's two RMSNorm implementations serves `device`: its CuTe-DSL kernels
    (where nvidia-cutlass-dsl is installed and targets the GPU, as on every full SGLang install)
    or its CUDA JIT ones (`flashinfer.norm._use_cuda_norm`). Both take the strided q/k views of
    the stacked projection; only one of them runs in a given process, so the start-up line names
    it."""
    import flashinfer.norm as fi_norm

    return "CUDA JIT" if fi_norm._use_cuda_norm(device) else "CuTe DSL"


class FlashInferKernels:
    """The kernels from FlashInfer (imported here, on first construction)."""

    def __init__(self):
        from flashinfer.activation import silu_and_mul
        from flashinfer.norm import fused_add_rmsnorm, rmsnorm
        from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

        self._rmsnorm, self._fused_add_rmsnorm = rmsnorm, fused_add_rmsnorm
        self._silu_and_mul, self._rope = silu_and_mul, apply_rope_with_cos_sin_cache_inplace

    def describe(self, device: torch.device) -> str:
        return f"FlashInfer norm ({norm_path(device)}), RoPE and SiLU kernels"

    def rmsnorm(self, x, weight, eps):
        return self._rmsnorm(x, weight, eps)

    def fused_add_rmsnorm(self, x, residual, weight, eps):
        self._fused_add_rmsnorm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        return self._silu_and_mul(x)

    def rope(self, positions, q, k, cos_sin):
        self._rope(positions, q, k, q.shape[-1], cos_sin, is_neox=True)


def unavailable_reason(model: DFlashDraftModel, device: torch.device) -> Optional[str]:
    """Why the fused forward cannot run `model` on `device` (None if it can)."""
    if device.type != "cuda":
        return f"the draft runs on {device.type}"
    options = model.config.options_in_use("forward")  # sinks are the attention's business
    if options:
        return (
            "its kernels compute plain norms, full-width neox RoPE, unscaled V, SiLU and no "
            f"convolution, not {', '.join(options)}"
        )
    dtype = model.fc.weight.dtype
    if dtype not in FUSED_DTYPES:
        return f"FlashInfer's norm and RoPE kernels take fp16 or bf16, the draft is {dtype}"
    try:
        FlashInferKernels()
    except ImportError as error:
        return f"flashinfer is not importable ({error})"
    return None


def rope_cache(model: DFlashDraftModel, max_positions: int, device: torch.device | str) -> torch.Tensor:
    """[max_positions, head_dim] fp32: row p is `[cos(p * inv_freq), sin(p * inv_freq)]` times
    the RoPE attention scaling, in the products the reference computes (`RotaryEmbedding`)."""
    rotary = model.rotary_emb
    inv_freq = rotary.inv_freq.to(device)
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
    scaling = rotary.attention_scaling
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1).contiguous()


@dataclass
class StackedLayer:
    qkv_weight: torch.Tensor  # [q + 2kv, H]: q_proj, k_proj, v_proj rows
    qkv_bias: Optional[torch.Tensor]  # [q + 2kv]
    gate_up_weight: torch.Tensor  # [2I, H]: gate_proj, up_proj rows


def _stack(modules: list[nn.Linear], name: str) -> Optional[torch.Tensor]:
    """Concatenate the modules' `name` parameters along rows and re-point each module at its
    slice (the originals are then free). E.g., q [4, H], k [2, H] -> one [6, H]; q = rows 0..3."""
    parts = [getattr(m, name) for m in modules]
    if parts[0] is None:
        return None
    stacked = torch.cat([p.detach() for p in parts])
    start = 0
    for module, part in zip(modules, parts):
        rows = part.shape[0]
        setattr(module, name, nn.Parameter(stacked[start : start + rows], requires_grad=False))
        start += rows
    return stacked


def stack_layer(layer) -> StackedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    return StackedLayer(
        qkv_weight=_stack(projections, "weight"),
        qkv_bias=_stack(projections, "bias"),
        gate_up_weight=_stack([mlp.gate_proj, mlp.up_proj], "weight"),
    )


class FusedDraftForward:
    """`forward(block_embeds [N, H], positions [N], attend) -> [N, H]`, the same contract as
    `DFlashDraftModel.forward`, except that `block_embeds` is used as the residual stream's
    storage (overwritten). Inference only: the stacked weights carry no gradients."""

    def __init__(self, model: DFlashDraftModel, max_positions: int, kernels: Optional[Kernels] = None):
        self.model = model
        self.kernels = kernels if kernels is not None else FlashInferKernels()
        config = model.config
        self.eps = config.rms_norm_eps
        self.embed_scale = config.input_embedding_scale
        self.max_positions = max_positions
        with torch.no_grad():
            self.stacked = [stack_layer(layer) for layer in model.layers]
        device = model.fc.weight.device
        self.cos_sin = rope_cache(model, max_positions, device)  # [P, head_dim] fp32

    def __call__(self, block_embeds: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        kernels, eps = self.kernels, self.eps
        residual = block_embeds  # [N, H]
        if self.embed_scale != 1.0:
            residual = residual * self.embed_scale
        x = None  # the last sublayer's output, not yet added into the residual
        for layer, stacked in zip(self.model.layers, self.stacked):
            if x is None:
                h = kernels.rmsnorm(residual, layer.input_layernorm.weight, eps)
            else:
                kernels.fused_add_rmsnorm(x, residual, layer.input_layernorm.weight, eps)
                h = x
            x = self._attention(layer.self_attn, stacked, h, positions, attend)
            kernels.fused_add_rmsnorm(x, residual, layer.post_attention_layernorm.weight, eps)
            x = self._mlp(layer.mlp, stacked, x)
        kernels.fused_add_rmsnorm(x, residual, self.model.norm.weight, eps)
        return x

    def _attention(self, attn, stacked: StackedLayer, h: torch.Tensor, positions, attend) -> torch.Tensor:
        n, d = h.shape[0], attn.head_dim
        q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d
        qkv = F.linear(h, stacked.qkv_weight, stacked.qkv_bias)  # [N, q + 2kv]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views
        q = self.kernels.rmsnorm(q.view(n, attn.num_heads, d), attn.q_norm.weight, attn.q_norm.eps)
        k = self.kernels.rmsnorm(k.view(n, attn.num_kv_heads, d), attn.k_norm.weight, attn.k_norm.eps)
        self.kernels.rope(positions, q, k, self.cos_sin)
        out = attend(attn.layer_id, q, k, v.view(n, attn.num_kv_heads, d))  # [N, heads, d]
        return attn.tp.all_reduce(attn.o_proj(out.reshape(n, q_size)))

    def _mlp(self, mlp, stacked: StackedLayer, h: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(h, stacked.gate_up_weight)  # [N, 2I]
        return mlp.tp.all_reduce(mlp.down_proj(self.kernels.silu_and_mul(gate_up)))

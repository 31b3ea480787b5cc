"""Pure-PyTorch implementations of the package's kernels.

`inject_context_kv` is the model-level reference: it runs the draft's own layer maths
(`DFlashDraftModel.fuse_target_features` and `context_kv`) and is the path used on CPU.

`fused_inject_reference` is the same computation in the fused op's form
(`torch.ops.sglang_dflash.inject_context_kv`): it takes the weights prepared by `fuse_weights`
and spells out the CUDA kernel's maths step by step. It is the op's CPU kernel (so the op can be
`opcheck`ed without a GPU) and the tight oracle for the CUDA kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.model import DFlashDraftModel


def inject_context_kv(
    model: DFlashDraftModel,
    store: DraftKVStore,
    target_features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
) -> None:
    """Feature fusion and KV injection for committed tokens.

    target_features [N, K*H] -> fc -> hidden_norm -> every layer's k_proj/v_proj, k_norm,
    RoPE at `positions` [N] -> stored at `slots` [N] for every draft layer (a windowed layer
    at ring `rows` [N], with a window ring: `DraftKVStore.write`).
    """
    context = model.fuse_target_features(target_features.to(model.fc.weight.dtype))
    k, v = model.context_kv(context, positions)
    store.write(slots, k, v, rows)


@dataclass(frozen=True)
class FusedKVWeights:
    """The fused op's weights, built once per model by `fuse_weights`.

    `hidden_norm` is a per-row scale times its weight, so its weight folds into the stacked K/V
    projection and only the row scale is left to the kernel:
        k_proj(hidden_norm(y)) = rsqrt(mean(y^2) + eps) * (y @ (W_k * w_hidden)^T) + b_k.
    """

    fc_weight: torch.Tensor  # [H, K*H], the model's own parameter (not a copy)
    kv_weight: torch.Tensor  # [L*2*KVH*D, H]: per layer [k_proj; v_proj] rows, times hidden_norm.weight
    kv_bias: Optional[torch.Tensor]  # [L*2*KVH*D] or None
    k_norm_weight: torch.Tensor  # [L, D]
    inv_freq: torch.Tensor  # [D/2] float32
    hidden_norm_eps: float
    k_norm_eps: float
    attention_scaling: float

    def op_args(self) -> tuple:
        """The op's weight arguments, in schema order after (target_features, positions, slots)."""
        return (
            self.fc_weight,
            self.kv_weight,
            self.kv_bias,
            self.k_norm_weight,
            self.inv_freq,
            self.hidden_norm_eps,
            self.k_norm_eps,
            self.attention_scaling,
        )


def fusion_unsupported_reason(model: DFlashDraftModel) -> Optional[str]:
    """Why `fuse_weights` cannot express this model, or None."""
    options = model.config.options_in_use("context_kv")
    if options:
        plain = "plain norms, full-width neox RoPE and unscaled V"
        return f"the fused op computes {plain}, not {', '.join(options)}"
    eps = {layer.self_attn.k_norm.eps for layer in model.layers}
    if len(eps) != 1:
        return f"the draft layers' k_norm eps differ ({sorted(eps)})"
    if model.config.head_dim % 2:
        return f"head_dim {model.config.head_dim} is odd"
    return None


@torch.no_grad()
def fuse_weights(model: DFlashDraftModel) -> FusedKVWeights:
    """Stack and fold the model's weights for the fused op (one copy of the K/V projection)."""
    reason = fusion_unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"the fused context-KV op cannot express this draft: {reason}")
    dtype, device = model.fc.weight.dtype, model.fc.weight.device
    attns = [layer.self_attn for layer in model.layers]
    stacked = torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)])  # [L*2*KVH*D, H]
    kv_weight = (stacked.float() * model.hidden_norm.weight.float()[None, :]).to(dtype).contiguous()
    kv_bias = None
    if model.config.attention_bias:
        kv_bias = torch.cat([b for a in attns for b in (a.k_proj.bias, a.v_proj.bias)]).contiguous()
    rope = model.rotary_emb
    return FusedKVWeights(
        fc_weight=model.fc.weight.contiguous(),
        kv_weight=kv_weight,
        kv_bias=kv_bias,
        k_norm_weight=torch.stack([a.k_norm.weight for a in attns]).contiguous(),
        inv_freq=rope.inv_freq.to(device=device, dtype=torch.float32).contiguous(),
        hidden_norm_eps=float(model.hidden_norm.eps),
        k_norm_eps=float(attns[0].k_norm.eps),
        attention_scaling=float(rope.attention_scaling),
    )


@torch.no_grad()
def fused_context_kv(
    target_features: torch.Tensor,
    positions: torch.Tensor,
    fc_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: Optional[torch.Tensor],
    k_norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    hidden_norm_eps: float,
    k_norm_eps: float,
    attention_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op's maths in PyTorch: target_features [N, K*H] at `positions` [N] -> every
    layer's k, v [L, N, KVH, D] in fp32, to be rounded once, by the store.

    Roundings, as in the CUDA kernel: the two GEMM outputs (in the weights' dtype, fp32
    accumulation) and the final store. Everything in between is fp32.
    """
    num_tokens = target_features.shape[0]
    num_layers, head_dim = k_norm_weight.shape
    num_kv_heads = kv_weight.shape[0] // (num_layers * 2 * head_dim)
    fused = target_features @ fc_weight.T  # [N, H]                         (GEMM 1)
    row_scale = torch.rsqrt(fused.float().pow(2).mean(-1, keepdim=True) + hidden_norm_eps)  # [N, 1]
    kv = (fused @ kv_weight.T).float() * row_scale  # [N, L*2*KVH*D]         (GEMM 2)
    if kv_bias is not None:
        kv = kv + kv_bias.float()
    kv = kv.view(num_tokens, num_layers, 2, num_kv_heads, head_dim)
    k, v = kv[:, :, 0], kv[:, :, 1]  # [N, L, KVH, D]
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + k_norm_eps)
    k = k * k_norm_weight.float()[None, :, None, :]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2]
    cos = (freqs.cos() * attention_scaling)[:, None, None, :]
    sin = (freqs.sin() * attention_scaling)[:, None, None, :]
    k1, k2 = k[..., : head_dim // 2], k[..., head_dim // 2 :]
    k = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return k.transpose(0, 1), v.transpose(0, 1)


@torch.no_grad()
def fused_inject_reference(
    target_features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    fc_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: Optional[torch.Tensor],
    k_norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    hidden_norm_eps: float,
    k_norm_eps: float,
    attention_scaling: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """The CUDA op's contract in PyTorch (`fused_context_kv`): writes k_cache/v_cache
    [L, num_slots, KVH, D] at `slots`."""
    if target_features.shape[0] == 0:
        return
    k, v = fused_context_kv(
        target_features, positions, fc_weight, kv_weight, kv_bias, k_norm_weight, inv_freq,
        hidden_norm_eps, k_norm_eps, attention_scaling,
    )  # fmt: skip
    k_cache[:, slots] = k.to(k_cache.dtype)
    v_cache[:, slots] = v.to(v_cache.dtype)

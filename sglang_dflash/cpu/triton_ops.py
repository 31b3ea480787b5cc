"""Pure-PyTorch versions of the SGLang Triton kernels that its CPU path reaches with hybrid
targets, put in place by `bootstrap.PATCHES`:

* `scatter_mamba_states_after_mtp_verify`: the post-verify mamba state commit (speculative
  decoding on linear-attention layers);
* `fused_gate_sigmoid_mul_add`: the shared-expert gate of Qwen2-MoE-style blocks (Qwen3-Next);
* `rms_sumsq_serial`, `rms_apply_serial`: MiniMax-M2's q/k RMSNorm over all heads at once.
"""

from __future__ import annotations

from typing import Optional

import torch


def fused_gate_sigmoid_mul_add(
    hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared_output: torch.Tensor, out: torch.Tensor
) -> None:
    """out += sigmoid(hidden_states @ gate_weight) * shared_output; hidden [T, D], gate [D]."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())[:, None]
    out += (gate * shared_output.float()).to(out.dtype)


def rms_sumsq_serial(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares, in float32: x1 [B, D1], x2 [B, D2] -> [2B], x1's rows then x2's
    (SGLang's kernel pads its buffer for an all-reduce; the padding is never read)."""
    return torch.cat([x1.float().square().sum(-1), x2.float().square().sum(-1)])


def rms_apply_serial(x1, x2, w1, w2, sum_sq: torch.Tensor, tp_world: int = 1, eps: float = 1e-5):
    """RMSNorm of each row of x1 [B, D1] and x2 [B, D2] by the sums of squares `sum_sq` [2B] over
    the full width (tp_world ranks of D each), times the weights w1 [D1], w2 [D2]."""
    rows = x1.shape[0]
    out = []
    for x, w, total in ((x1, w1, sum_sq[:rows]), (x2, w2, sum_sq[rows : 2 * rows])):
        inv_rms = torch.rsqrt(total / x.shape[1] / tp_world + eps)[:, None]  # [B, 1]
        out.append((x.float() * inv_rms * w.float()).to(x.dtype))
    return out[0], out[1]


def _scatter(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor, src_rows) -> None:
    """dst[:, rows[i]] = src[:, src_rows[i], steps[i]] for every layer, where all are valid."""
    rows, steps = rows.to(torch.int64), steps.to(torch.int64)
    src_rows = torch.arange(len(steps), device=steps.device) if src_rows is None else src_rows.to(torch.int64)
    ok = (
        (steps >= 0)
        & (steps < src.shape[2])
        & (rows >= 0)
        & (rows < dst.shape[1])
        & (src_rows < src.shape[1])
    )
    dst[:, rows[ok]] = src[:, src_rows[ok], steps[ok]].to(dst.dtype)


def scatter_mamba_states_after_mtp_verify(
    mamba_caches,
    state_indices_tensor: torch.Tensor,
    last_correct_step_indices: torch.Tensor,
    mamba_track_indices: Optional[torch.Tensor],
    mamba_steps_to_track: Optional[torch.Tensor],
    src_indices_raw: Optional[torch.Tensor] = None,
) -> None:
    """Make each request's recurrent and conv state the one after its last accepted verify step
    (and copy the step a track slot wants, where tracking is on). Layers are stacked on dim 0."""
    pairs = [(mamba_caches.temporal, mamba_caches.intermediate_ssm)]
    pairs += list(zip(mamba_caches.conv, mamba_caches.intermediate_conv_window))
    for dst, src in pairs:
        _scatter(dst, src, state_indices_tensor, last_correct_step_indices, src_indices_raw)
        if mamba_track_indices is not None and mamba_steps_to_track is not None:
            _scatter(dst, src, mamba_track_indices, mamba_steps_to_track, src_indices_raw)

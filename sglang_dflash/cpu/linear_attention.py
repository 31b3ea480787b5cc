"""CPU stand-ins for the linear-attention ops that SGLang 0.5.23's hybrid models (Qwen3-Next,
Qwen3.5) call on a CPU host, with the signatures SGLang calls them with; the maths is in
`gated_delta.py`.

* `sgl_kernel.mamba` functions: `causal_conv1d_fn_cpu` (prefill), `causal_conv1d_update_cpu`
  (decode, and the target-verify form that keeps each step's conv window),
  `chunk_gated_delta_rule_cpu` (prefill).
* `torch.ops.sgl_kernel` ops, which SGLang looks up when its modules are imported:
  `fused_gdn_gating_cpu`, `fused_sigmoid_gating_delta_rule_update_cpu` (decode, and the
  target-verify form that keeps each step's state), `fused_rmsnorm_gated_cpu`, and Qwen3.5's
  `fused_qk_gemma_rmsnorm[_with_gate]_cpu`, `fused_sigmoid_mul_cpu`,
  `fused_qkvzba_split_reshape_cat_contiguous_cpu`.

Pool rows with a negative index are padding: they are neither read nor written.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from sglang_dflash.cpu import gated_delta

# ---- sgl_kernel.mamba ------------------------------------------------------------------------


def causal_conv1d_fn_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
    conv_states: torch.Tensor,
    has_initial_state: torch.Tensor,
    cache_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens_cpu=None,
    **unused,
) -> torch.Tensor:
    """Prefill conv over packed sequences. x [dim, T] -> out [dim, T] (a transposed [T, dim]
    buffer, as SGLang transposes it back); conv_states[cache_indices[i]] becomes sequence i's
    last W - 1 inputs, starting from its old state where has_initial_state[i], else zeros."""
    width = weight.shape[1] - 1
    index, valid = gated_delta.padded_index(query_start_loc)
    seqs = gated_delta.pad(x.t(), index, valid).transpose(1, 2)  # [N, dim, L]
    rows = cache_indices[: query_start_loc.shape[0] - 1].to(torch.int64)
    history = conv_states[rows.clamp(min=0)].to(seqs.dtype)
    history = history * (has_initial_state & (rows >= 0)).view(-1, 1, 1).to(seqs.dtype)
    window = torch.cat([history, seqs], dim=-1)  # [N, dim, W - 1 + L]
    out = torch.empty(x.shape[1], x.shape[0], dtype=x.dtype)
    out[index[valid]] = (
        gated_delta.conv(window, weight, bias, activation == "silu").transpose(1, 2)[valid].to(x.dtype)
    )
    # The new state of sequence i: window columns len_i .. len_i + W - 2.
    lens = valid.sum(1)
    cols = lens[:, None] + torch.arange(width)[None, :]  # [N, W - 1]
    new = window.gather(2, cols[:, None, :].expand(-1, window.shape[1], -1))
    keep = rows >= 0
    conv_states[rows[keep]] = new[keep].to(conv_states.dtype)
    return out.t()


def causal_conv1d_update_cpu(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
    conv_state_indices: torch.Tensor,
    intermediate_conv_window: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
    retrieve_next_token: Optional[torch.Tensor] = None,
    retrieve_next_sibling: Optional[torch.Tensor] = None,
    retrieve_parent_token: Optional[torch.Tensor] = None,
    **unused,
) -> torch.Tensor:
    """Conv over D new inputs per sequence: decode x [bs, dim] (D = 1), or target-verify x
    [bs, dim, D] (a chain; trees are not supported). conv_states[idx] becomes the window after
    all D inputs; in verify, intermediate_conv_window[int_idx, t] is the window after input t,
    which the post-verify commit copies back for the accepted step."""
    if retrieve_next_token is not None:
        raise NotImplementedError("tree-shaped verify is not supported by the CPU conv stand-in")
    decode = x.dim() == 2
    inputs = x[:, :, None] if decode else x  # [bs, dim, D]
    width = weight.shape[1] - 1
    rows = conv_state_indices.to(torch.int64)
    keep = rows >= 0
    history = conv_states[rows.clamp(min=0)].to(inputs.dtype) * keep.view(-1, 1, 1).to(inputs.dtype)
    # The state keeps inputs in its own dtype (bf16 by default). Output t sees inputs before t
    # as kept and input t exactly, in decode and verify alike, so a verify window computes what
    # D decode steps would: conv(kept window) + w_last * (x_t - kept x_t).
    kept = inputs.to(conv_states.dtype).to(inputs.dtype)
    window = torch.cat([history, kept], dim=-1)  # [bs, dim, W - 1 + D]
    pre = (
        gated_delta.conv(window, weight, bias, silu=False)
        + weight[:, -1, None].float() * (inputs - kept).float()
    )
    out = (torch.nn.functional.silu(pre) if activation == "silu" else pre).to(x.dtype)  # [bs, dim, D]
    conv_states[rows[keep]] = window[keep, :, -width:].to(conv_states.dtype)
    if intermediate_conv_window is not None:
        # The window after input t is columns t + 1 .. t + W - 1: [bs, dim, D, W - 1] -> [bs, D, dim, W - 1].
        steps = window.unfold(2, width, 1)[:, :, 1:].transpose(1, 2)
        slots = intermediate_state_indices.to(torch.int64)
        ok = slots >= 0
        intermediate_conv_window[slots[ok], : steps.shape[1]] = steps[ok].to(intermediate_conv_window.dtype)
    if decode:
        return out[:, :, 0]
    return out.transpose(1, 2).contiguous().transpose(1, 2)  # SGLang views it as [bs, D, dim]


def chunk_gated_delta_rule_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    initial_state_indices: Optional[torch.Tensor] = None,
    **unused,
):
    """Prefill over packed sequences. q, k [1, T, H, K], v [1, T, HV, V], g, beta [1, T, HV];
    initial_state[idx[i]] [HV, V, K] is read and overwritten with the final state. Returns
    (o [1, T, HV, V], final states [N, HV, V, K], None)."""
    assert not head_first and use_qk_l2norm_in_kernel
    rows = initial_state_indices[: cu_seqlens.shape[0] - 1].to(torch.int64)
    o, final, _ = _run(q, k, v, g[0], beta[0], initial_state, rows, cu_seqlens, gated_delta.chunked)
    keep = rows >= 0
    initial_state[rows[keep]] = final[keep].to(initial_state.dtype)
    return o, final, None


def _run(q, k, v, g, beta, states, rows, cu_seqlens, form):
    """Pad the packed sequences, run `form` (`gated_delta.chunked` or `.recurrent`) from each
    sequence's pool state (zeros for padding rows), and unpad o. q, k [1, T, H, K], v
    [1, T, HV, V], g, beta [T, HV] -> (o [1, T, HV, V], what `form` returns second, valid)."""
    index, valid = gated_delta.padded_index(cu_seqlens)
    qh, kh = gated_delta.heads(q[0], k[0], v.shape[-2])
    qh, kh, vh, gh, bh = (
        gated_delta.pad(t, index, valid) for t in (qh, kh, v[0].float(), g.float(), beta.float())
    )
    start = states[rows.clamp(min=0)].float() * (rows >= 0).view(-1, 1, 1, 1)
    o, second = form(qh, kh, vh, gh, bh, start)
    out = torch.empty(1, q.shape[1], v.shape[-2], v.shape[-1], dtype=v.dtype)
    out[0, index[valid]] = o[valid].to(v.dtype)
    return out, second, valid


# ---- torch.ops.sgl_kernel --------------------------------------------------------------------


@torch.library.custom_op("sgl_kernel::fused_gdn_gating_cpu", mutates_args=())
def fused_gdn_gating_cpu(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, HV] -> (g fp32 [1, T, HV], beta [1, T, HV])."""
    g, beta = gated_delta.gates(A_log, a, b, dt_bias)
    return g[None].contiguous(), beta[None].contiguous()


# Defined from a schema rather than with `torch.library.custom_op`: in torch 2.11, custom_op's
# mutation bookkeeping indexes `args[i]` for every mutated argument, and fails with IndexError
# when a defaulted one is omitted, as SGLang's decode omits `intermediate_states_buffer`
# (later torch checks the index). A plain CPU kernel has no such bookkeeping.
_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
_LIB.define(
    "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, "
    "Tensor v, Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, "
    "Tensor cu_seqlens, bool use_qk_l2norm_in_kernel=True, float softplus_beta=1.0, "
    "float softplus_threshold=20.0, bool is_kda=False, bool disable_state_update=False, "
    "Tensor(b!)? intermediate_states_buffer=None, Tensor? intermediate_state_indices=None, "
    "int? cache_steps=None, Tensor? retrieve_parent_token=None) -> Tensor"
)


def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    is_kda: bool = False,
    disable_state_update: bool = False,
    intermediate_states_buffer: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
    cache_steps: Optional[int] = None,
    retrieve_parent_token: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Step-by-step gated delta rule over packed sequences, gates computed from a, b [T, HV].

    Decode: one token per sequence; initial_state_source[idx] advances. Target-verify
    (disable_state_update, a chain of cache_steps tokens per sequence): the pool state is only
    read, and the state after step t goes to intermediate_states_buffer[int_idx, t].
    Returns o [1, T, HV, V].
    """
    assert use_qk_l2norm_in_kernel and not is_kda and softplus_beta == 1.0 and softplus_threshold == 20.0
    if retrieve_parent_token is not None:
        raise NotImplementedError("tree-shaped verify is not supported by the CPU recurrence stand-in")
    g, beta = gated_delta.gates(A_log, a, b, dt_bias)
    rows = initial_state_indices[: cu_seqlens.shape[0] - 1].to(torch.int64)
    steps = functools.partial(gated_delta.recurrent, kept_dtype=initial_state_source.dtype)
    out, states, valid = _run(q, k, v, g, beta, initial_state_source, rows, cu_seqlens, steps)
    if intermediate_states_buffer is not None:
        slots = intermediate_state_indices[: states.shape[0]].to(torch.int64)
        ok = slots >= 0
        intermediate_states_buffer[slots[ok], : states.shape[1]] = states[ok].to(
            intermediate_states_buffer.dtype
        )
    if not disable_state_update:
        keep = rows >= 0
        last = states[torch.arange(len(rows)), valid.sum(1).clamp(min=1) - 1]
        initial_state_source[rows[keep]] = last[keep].to(initial_state_source.dtype)
    return out


_LIB.impl("fused_sigmoid_gating_delta_rule_update_cpu", fused_sigmoid_gating_delta_rule_update_cpu, "CPU")


@torch.library.custom_op("sgl_kernel::fused_rmsnorm_gated_cpu", mutates_args=())
def fused_rmsnorm_gated_cpu(
    x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, eps: float
) -> torch.Tensor:
    """rmsnorm(x) * weight * silu(z), rows of [.., D]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.nn.functional.silu(z.float())).to(x.dtype)


def _gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, x * (1 + weight) after normalising, per row of [.., D]."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


@torch.library.custom_op("sgl_kernel::fused_qk_gemma_rmsnorm_cpu", mutates_args=())
def fused_qk_gemma_rmsnorm_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head Gemma RMSNorm of q [T, H * Dh] and k [T, Hk * Dh] -> [T * H, Dh], [T * Hk, Dh]."""
    return (
        _gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps),
        _gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps),
    )


@torch.library.custom_op("sgl_kernel::fused_qk_gemma_rmsnorm_with_gate_cpu", mutates_args=())
def fused_qk_gemma_rmsnorm_with_gate_cpu(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_gate [T, H * 2 * Dh] holds, per head, Dh query then Dh gate values. Returns the normed
    query [T, H * Dh], the normed key [T, Hk * Dh] and the gate [T, H * Dh]."""
    t = q_gate.shape[0]
    q, gate = q_gate.reshape(t, num_heads, 2 * head_dim).chunk(2, dim=-1)
    q = _gemma_rmsnorm(q, q_weight, eps).reshape(t, -1)
    k = _gemma_rmsnorm(k.reshape(t, -1, head_dim), k_weight, eps).reshape(t, -1)
    return q, k, gate.reshape(t, -1).clone()


@torch.library.custom_op("sgl_kernel::fused_sigmoid_mul_cpu", mutates_args=("x",))
def fused_sigmoid_mul_cpu(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x *= sigmoid(gate), in place; gate may be a [T, H, Dh] view of x's [T, H * Dh] shape."""
    x.copy_((x.float() * torch.sigmoid(gate.float()).reshape(x.shape)).to(x.dtype))


@torch.library.custom_op("sgl_kernel::fused_qkvzba_split_reshape_cat_contiguous_cpu", mutates_args=())
def fused_qkvzba_split_reshape_cat_contiguous_cpu(
    qkvz: torch.Tensor, ba: torch.Tensor, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3.5's projections [T, q|k|v|z] and [T, b|a] -> (q|k|v contiguous, z [T, HV, Dv], b, a)."""
    qkv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    z = qkvz[:, qkv_dim:].reshape(qkvz.shape[0], num_v_heads, head_v_dim)
    parts = (qkvz[:, :qkv_dim], z, ba[:, :num_v_heads], ba[:, num_v_heads:])
    return tuple(p.clone(memory_format=torch.contiguous_format) for p in parts)  # never an alias of an input

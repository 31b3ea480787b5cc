"""The maths of Gated DeltaNet layers (Qwen3-Next, Qwen3.5) in pure PyTorch: the gates, the
causal depthwise conv that precedes the recurrence, and the gated delta rule itself in its
chunked (prefill) and step-by-step (decode, verify) forms.

Layouts follow SGLang's mamba pool: a recurrent state is [..., HV, V, K] (value rows, key
columns), a conv state is [..., dim, W - 1] (the last W - 1 inputs, oldest first). Ragged
batches of N sequences packed along T are described by `cu_seqlens` [N + 1].

The recurrence, per value head, with q and k L2-normalised and q scaled by K ** -0.5:

    S_t = exp(g_t) * S_{t-1}                       decay
    u_t = beta_t * (v_t - S_t k_t)                 delta-rule correction   [V]
    S_t = S_t + u_t k_t^T                          rank-1 write            [V, K]
    o_t = S_t q_t                                                          [V]

with g_t = -exp(A_log) * softplus(a_t + dt_bias) and beta_t = sigmoid(b_t) (Yang, Kautz and
Hatamizadeh, "Gated Delta Networks", 2024).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

CHUNK = 64
L2_EPS = 1e-6


def gates(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor):
    """[..., HV] projections -> (g fp32 log-decay, beta in b's dtype)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return g, torch.sigmoid(b.float()).to(b.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


# ---- ragged <-> padded ---------------------------------------------------------------------


def padded_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences packed along T: (index [N, L] into T, valid [N, L]), L the longest length.

    E.g. cu_seqlens [0, 2, 5] -> index [[0, 1, 1], [2, 3, 4]], valid [[1, 1, 0], [1, 1, 1]]
    (padding repeats a valid index; callers zero it or ignore it).
    """
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    width = int(lens.max()) if lens.numel() else 0  # host value: CPU tensors, no device sync
    steps = torch.arange(width, dtype=torch.int64)
    valid = steps[None, :] < lens[:, None]
    index = cu[:-1, None] + torch.minimum(steps[None, :], (lens - 1).clamp(min=0)[:, None])
    return index, valid


def pad(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[T, ...] -> [N, L, ...] with zeros past each sequence's end."""
    out = x[index]
    return out * valid.view(*valid.shape, *([1] * (out.dim() - 2))).to(out.dtype)


def heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int):
    """L2-normalise q and k, scale q, and repeat key heads to the value heads (GQA):
    value head hv reads key head hv // (HV / H)."""
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    repeat = num_v_heads // q.shape[-2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q, k


# ---- the recurrence --------------------------------------------------------------------------


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    kept_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step form over L positions (decode: L = 1; verify: L = the window).

    q, k [N, L, HV, K] (normalised, scaled), v [N, L, HV, V], g, beta [N, L, HV], state
    [N, HV, V, K] fp32 -> (o [N, L, HV, V], states [N, L, HV, V, K], the state after each step).
    One iteration per position, each batched over every sequence and head. Each step's state
    is rounded to `kept_dtype` (the pool's) before the next, as decode keeps it there between
    steps, so a verify window follows what decoding its tokens one at a time would.
    """
    # Position-major copies: each step reads contiguous [N, ...] slices, laid out as in decode.
    q, k, v, g, beta = (x.transpose(0, 1).contiguous() for x in (q, k, v, g, beta))
    outs, states = [], []
    for t in range(q.shape[0]):
        state = state * g[t, :, :, None, None].exp()
        u = beta[t, :, :, None] * (v[t] - torch.einsum("nhvk,nhk->nhv", state, k[t]))
        state = state + u[..., None] * k[t, :, :, None, :]
        outs.append(torch.einsum("nhvk,nhk->nhv", state, q[t]))
        state = state.to(kept_dtype).float()
        states.append(state)
    return torch.stack(outs, 1), torch.stack(states, 1)


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, CHUNK positions at a time (prefill). Shapes as `recurrent`; returns
    (o [N, L, HV, V], the final state [N, HV, V, K]). Positions past a sequence's end must have
    k = v = beta = g = 0, which leaves the state unchanged.

    Within a chunk starting from S0, with G_t the cumulative log-decay and u_t the corrections:
        S_t = e^{G_t} S0 + sum_{i<=t} e^{G_t - G_i} u_i k_i^T
    Substituting S_{t-1} into u_t gives a unit lower-triangular system for all u at once:
        u_t + beta_t sum_{i<t} e^{G_t - G_i} (k_t . k_i) u_i = beta_t (v_t - e^{G_t} S0 k_t)
    and then o_t = e^{G_t} S0 q_t + sum_{i<=t} e^{G_t - G_i} (q_t . k_i) u_i.
    """
    n, length, heads, dk = k.shape
    pad = (-length) % CHUNK
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    # [N, HV, chunks, C, ...]
    q, k, v = (x.transpose(1, 2).reshape(n, heads, -1, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(n, heads, -1, CHUNK).float() for x in (g, beta))
    G = g.cumsum(-1)
    decay = (G[..., :, None] - G[..., None, :]).tril().exp().tril()  # e^{G_t - G_i}, i <= t
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril(-1)
    A = torch.where(strict, beta[..., :, None] * decay * (k @ k.transpose(-1, -2)), 0.0)
    system = A + torch.eye(CHUNK)  # unit lower-triangular: (I + A) u = rhs
    rhs_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    rhs_k = torch.linalg.solve_triangular(
        system, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay  # e^{G_t - G_i} (q_t . k_i), i <= t
    outs = []
    for c in range(q.shape[2]):
        u = rhs_v[:, :, c] - rhs_k[:, :, c] @ state.transpose(-1, -2)  # [N, HV, C, V]
        outs.append((G[:, :, c, :, None].exp() * q[:, :, c]) @ state.transpose(-1, -2) + attn[:, :, c] @ u)
        tail = (G[:, :, c, -1:] - G[:, :, c]).exp()  # e^{G_C - G_i}
        state = (
            G[:, :, c, -1, None, None].exp() * state + (u * tail[..., None]).transpose(-1, -2) @ k[:, :, c]
        )
    o = torch.stack(outs, 2).reshape(n, heads, -1, v.shape[-1])[:, :, :length].transpose(1, 2)
    return o, state


# ---- the causal depthwise conv ---------------------------------------------------------------


def conv(
    window: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], silu: bool
) -> torch.Tensor:
    """[N, dim, W - 1 + L] history-then-inputs -> [N, dim, L]: output t sees inputs t-W+1..t.

    Summed tap by tap in a fixed order, so an output takes the same arithmetic whatever L is:
    a verify window computes what the same inputs give one decode step at a time.
    """
    taps = weight.shape[1]
    length = window.shape[-1] - (taps - 1)
    window, weight = window.float(), weight.float()
    out = (
        torch.zeros(window.shape[0], window.shape[1], length)
        if bias is None
        else bias.float()[:, None].expand(window.shape[0], -1, length)
    )
    for j in range(taps):
        out = out + weight[:, j, None] * window[..., j : j + length]
    return F.silu(out) if silu else out

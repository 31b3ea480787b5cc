"""Training's block attention split in two: the context by a fused kernel, each block's own
keys by hand, merged by log-sum-exp. The masked cross-block region is never computed.

The dense path (`mask.block_attention_mask` + SDPA) scores every block query against
`[context (S) ; every block (A*B)]` keys and masks the other blocks away: at S = 3072,
A = 512, B = 16, 73% of the score matrix. Here a query (block j, offset k) is scored against

  * the context: S keys, by SDPA's fused kernel with a mask (tokens before the anchor, and
    `attention.visibility` by position), which also returns each row's log-sum-exp lse_c;
  * its own block: B keys, [A, B, B] scores per sequence and head, lse_b by hand;

and the two softmaxes merge exactly:

    lse = logaddexp(lse_c, lse_b)
    out = exp(lse_c - lse) * out_c + exp(lse_b - lse) * out_b

Backward. For attention over a union of key sets, each set's share of the gradient is that
set's attention backward taken with the union's `out` and `lse` (P = exp(s - lse),
dS = P * (dP - rowsum(dO * out))). SDPA's kernel backward ops take `out` and `lse` as inputs,
so the context share is one kernel call; the block share is the same formula by hand.

Rows with no context (an anchor at 0, or a window that ends before it) would give the kernel
a row with every key masked. Each row therefore also sees a null key (k = v = 0, bias
`NULL_BIAS`): beside any real key its weight exp(NULL_BIAS - max) is 0 in fp32 and bf16, and
a row that sees only it gets out_c = 0 and lse_c = NULL_BIAS, whose merge weight
exp(NULL_BIAS - lse) is 0 again. So every kernel row is finite and the null key adds nothing.

Kernels: CPU `_scaled_dot_product_flash_attention_for_cpu` and CUDA
`_scaled_dot_product_efficient_attention` (the kernels `F.scaled_dot_product_attention` runs
with a mask), each with its backward op.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_dflash.draft.attention import visibility
from sglang_dflash.train.mask import context_mask

NULL_BIAS = -30000.0
_ALIGN = 16  # the CUDA kernel reads the bias rows in aligned chunks: pad its last dim (as SDPA does)


def supported(device: torch.device) -> Optional[str]:
    """None if the split runs on `device`, else why not."""
    if device.type in ("cpu", "cuda"):
        return None
    return f"no fused attention kernel with a log-sum-exp output for device type {device.type!r}"


def context_bias(
    anchors: torch.Tensor, seq_len: int, block_size: int, *, causal: bool, window: Optional[int], dtype
) -> torch.Tensor:
    """anchors [b, A] -> additive bias [b, 1, Q, S + 1] (0: may attend, -inf: may not) over
    `[context ; null key]`, Q = A*B. The context rule is `mask.block_attention_mask`'s.

    E.g., S=3, anchors=[[0, 2]], B=2, full attention (columns t=0, 1, 2, null):
        q (a=0, k=0, 1)   -inf -inf -inf N
        q (a=2, k=0, 1)      0    0 -inf N      (N = NULL_BIAS)
    """
    visible = context_mask(anchors, seq_len, block_size, causal=causal, window=window)  # [b, Q, S]
    b, q_len, _ = visible.shape
    width = -(-(seq_len + 1) // _ALIGN) * _ALIGN
    bias = torch.full((b, 1, q_len, width), float("-inf"), dtype=dtype, device=anchors.device)
    bias[:, 0, :, :seq_len].masked_fill_(visible, 0.0)
    bias[:, 0, :, seq_len] = NULL_BIAS
    return bias[..., : seq_len + 1]


def own_block_mask(block_size: int, *, causal: bool, window: Optional[int], device=None) -> torch.Tensor:
    """[B, B] bool: which keys of its own block a block query sees (the same for every block:
    `visibility` depends on relative position only). Full attention: all True."""
    offsets = torch.arange(block_size, device=device)
    return visibility(
        offsets, offsets, torch.ones_like(offsets, dtype=torch.bool), causal=causal, window=window
    )


def _kernel_forward(q, k, v, bias, scale):
    """q [b, h, Q, d], k/v [b, h, K, d], bias [b, 1|h, Q, K] -> out [b, h, Q, d], lse [b, h, >=Q]
    (CUDA pads lse's last dim to a multiple of 32), and what the backward needs."""
    if q.device.type == "cuda":
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias.expand(-1, q.shape[1], -1, -1), True, 0.0, False, scale=scale
        )
        return out, lse, (seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse, ()


def _kernel_backward(dout, q, k, v, bias, out, lse, extra, scale):
    """The context's share of dq, dk, dv, taken with the merged out and lse."""
    if q.device.type == "cuda":
        seed, offset = extra
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            k,
            v,
            bias.expand(-1, q.shape[1], -1, -1),
            out,
            lse,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            False,
            scale=scale,
        )
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale
    )


class _SplitBlockAttention(torch.autograd.Function):
    """q, k, v [b, h, Q, d] (Q = A*B, blocks contiguous), k_ctx, v_ctx [b, h, S + 1, d]
    (null key last), bias [b, 1, Q, S + 1], own [B, B] -> [b, h, Q, d]."""

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k, v, bias, own, scale, block_size):
        with torch.autocast(q.device.type, enabled=False):  # the block part and the merge in fp32
            return _SplitBlockAttention._forward(ctx, q, k_ctx, v_ctx, k, v, bias, own, scale, block_size)

    @staticmethod
    def _forward(ctx, q, k_ctx, v_ctx, k, v, bias, own, scale, block_size):
        b, h, nq, d = q.shape
        a = nq // block_size
        out_c, lse_c, extra = _kernel_forward(q, k_ctx, v_ctx, bias, scale)
        lse_b, out_b = _own_block_forward(q, k, v, own, scale, block_size)  # [b,h,A,B], [b,h,A,B,d]
        lse = torch.logaddexp(lse_c[..., :nq].view(b, h, a, block_size), lse_b)  # [b, h, A, B]
        w_c = torch.exp(lse_c[..., :nq].view(b, h, a, block_size) - lse)[..., None]
        w_b = torch.exp(lse_b - lse)[..., None]
        out = (
            (w_c * out_c.float().reshape(b, h, a, block_size, d) + w_b * out_b)
            .reshape(b, h, nq, d)
            .to(q.dtype)
        )
        lse_full = lse_c.clone()  # the kernel's layout (padded on CUDA), now the merged lse
        lse_full[..., :nq] = lse.view(b, h, nq)
        ctx.save_for_backward(q, k_ctx, v_ctx, k, v, bias, own, out, lse_full)
        ctx.extra, ctx.scale, ctx.block_size = extra, scale, block_size
        return out

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _SplitBlockAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k_ctx, v_ctx, k, v, bias, own, out, lse_full = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk_ctx, dv_ctx = _kernel_backward(
            dout, q, k_ctx, v_ctx, bias, out, lse_full, ctx.extra, ctx.scale
        )
        dq_b, dk, dv = _own_block_backward(dout, q, k, v, own, out, lse_full, ctx.scale, ctx.block_size)
        return dq + dq_b.to(dq.dtype), dk_ctx, dv_ctx, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, h, A*B, d] -> [b, h, A, B, d] in fp32."""
    return x.float().unflatten(2, (-1, block_size))


def _own_scores(q, k, own, scale, block_size) -> torch.Tensor:
    """[b, h, A, B, B] fp32 scores of each block's queries against its own keys, masked by `own`."""
    s = _blocks(q, block_size) @ _blocks(k, block_size).transpose(-1, -2) * scale
    return s.masked_fill(~own, float("-inf"))


def _own_block_forward(q, k, v, own, scale, block_size):
    s = _own_scores(q, k, own, scale, block_size)
    lse = torch.logsumexp(s, dim=-1)  # [b, h, A, B]: finite, a query always sees itself
    return lse, torch.exp(s - lse[..., None]) @ _blocks(v, block_size)


def _own_block_backward(dout, q, k, v, own, out, lse_full, scale, block_size):
    nq = q.shape[2]
    lse = lse_full[..., :nq].unflatten(2, (-1, block_size))  # [b, h, A, B] merged
    p = torch.exp(_own_scores(q, k, own, scale, block_size) - lse[..., None])  # [b, h, A, B, B]
    do = _blocks(dout, block_size)
    rows = (do * _blocks(out, block_size)).sum(-1, keepdim=True)  # rowsum(dO * out) [b, h, A, B, 1]
    ds = p * (do @ _blocks(v, block_size).transpose(-1, -2) - rows)
    dq = (ds @ _blocks(k, block_size)) * scale
    dk = (ds.transpose(-1, -2) @ _blocks(q, block_size)) * scale
    dv = p.transpose(-1, -2) @ do
    return dq.flatten(2, 3), dk.flatten(2, 3), dv.flatten(2, 3)


def split_block_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    own: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """`attention.attend_with_context` with the block-wise mask, split (see the module doc).

    q [b, Q, heads, d]; k_ctx, v_ctx [b, S, kv_heads, d]; k, v [b, Q, kv_heads, d];
    bias [b, 1, Q, S + 1] from `context_bias`; own [B, B] from `own_block_mask` -> [b, Q, heads, d].
    """
    heads, kv_heads = q.shape[2], k.shape[2]

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [b, L, kv_heads, d] -> [b, heads, L, d]
        return x.to(q.dtype).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)

    null = k_ctx.new_zeros(k_ctx.shape[0], 1, *k_ctx.shape[2:])
    k_ctx = heads_first(torch.cat([k_ctx, null], dim=1))
    v_ctx = heads_first(torch.cat([v_ctx, null], dim=1))
    out = _SplitBlockAttention.apply(
        q.transpose(1, 2).contiguous(),
        k_ctx.contiguous(),
        v_ctx.contiguous(),
        heads_first(k).contiguous(),
        heads_first(v).contiguous(),
        bias.to(q.dtype),
        own,
        scale,
        block_size,
    )
    return out.transpose(1, 2)

"""The two MoE kernels SGLang's Triton MoE runner calls from sgl_kernel, in PyTorch: fixed output
shapes and no host sync, so they run inside SGLang's CUDA graphs.

`moe_align_block_size` is reached through SGLang's kernel registry
(`sglang.kernels.ops.moe`: target "sgl_kernel:moe_align_block_size"); `moe_sum_reduce` sums
the top-k expert outputs beyond 32 tokens (`fused_moe.py`). Both run on CPU tensors too, where
the tests check them against a loop over their definition.
"""

from __future__ import annotations

import torch


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    cumsum_buffer: torch.Tensor,
    pad_sorted_token_ids: bool = False,
    ignore_invalid_expert: bool = False,
) -> None:
    """sgl-kernel's contract, with its +1 offset: `num_experts` buckets, id e in bucket e + 1
    (-1, an expert filtered out by expert parallelism, in bucket 0). Written in place:

      * sorted_token_ids: bucket by bucket, the flat indices of `topk_ids` in it (ascending
        here; the CUDA kernel's order within a bucket is unspecified), each bucket padded to a
        multiple of `block_size` with `topk_ids.numel()` where `pad_sorted_token_ids`;
      * experts_ids [blocks]: each block's bucket - 1 (blocks past the total left as they are);
      * num_tokens_post_pad [1]: the padded total; cumsum_buffer[:num_experts + 1]: the buckets'
        padded starts and the total.

    E.g., topk_ids [[1, 0], [1, -1]], 3 buckets, block 2, numel 4: buckets [0, 1, 2] hold flat
    indices [3], [1], [0, 2] -> sorted [3, 4, 1, 4, 0, 2], experts [-1, 0, 1], total 6.
    """
    if ignore_invalid_expert:
        raise NotImplementedError(
            "sgl_kernel.moe_align_block_size(ignore_invalid_expert=True) is not provided by "
            "sglang-dflash's stand-in (GPU serving kit)"
        )
    device = topk_ids.device
    bucket = topk_ids.flatten().to(torch.int64) + 1  # [n]
    n = bucket.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # [E]
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    starts[1:] = padded.cumsum(0)  # [E + 1]: bucket b's padded run is [starts[b], starts[b+1])
    order = torch.argsort(bucket, stable=True)  # [n] flat indices, bucket by bucket
    sorted_bucket = bucket[order]
    first = counts.cumsum(0) - counts  # [E] each bucket's first place among the n
    dest = starts[sorted_bucket] + torch.arange(n, device=device) - first[sorted_bucket]
    if pad_sorted_token_ids:
        sorted_token_ids.fill_(n)
    sorted_token_ids.scatter_(0, dest, order.to(sorted_token_ids.dtype))
    block_start = torch.arange(experts_ids.numel(), device=device) * block_size
    block_bucket = torch.searchsorted(starts[1:], block_start, right=True)  # [blocks]
    inside = block_start < starts[-1]
    experts_ids.copy_(torch.where(inside, block_bucket - 1, experts_ids.to(torch.int64)))
    num_tokens_post_pad[:1].copy_(starts[-1:])
    cumsum_buffer[: num_experts + 1].copy_(starts)


def moe_sum_reduce(x: torch.Tensor, out: torch.Tensor, routed_scaling_factor: float) -> None:
    """x [tokens, top_k, hidden] -> out [tokens, hidden] = sum over top_k * factor, summed in
    fp32 (as the kernel accumulates)."""
    out.copy_((x.float().sum(1) * routed_scaling_factor).to(out.dtype))

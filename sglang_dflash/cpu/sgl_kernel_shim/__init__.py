"""Pure-PyTorch stand-ins for the sgl_kernel CPU ops that SGLang 0.5.23 reaches on a plain CPU
host (torch_native attention, page size 1), served as the package `sgl_kernel`. Any other op
raises, naming itself. The linear-attention ops of hybrid models (`sgl_kernel.mamba` and their
`torch.ops.sgl_kernel` ops) live in sglang_dflash/cpu/linear_attention.py."""

from __future__ import annotations

import ctypes

import torch

from sglang_dflash.cpu import linear_attention  # noqa: F401  (registers its torch.ops.sgl_kernel ops)

IS_STAND_IN = True
STAND_INS = (
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "torch.ops.sgl_kernel.murmur_hash32_cpu",
    "the linear-attention ops in sglang_dflash/cpu/linear_attention.py",
)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[r_i, start_i:end_i] = out_cache_loc[off_i : off_i + end_i - start_i], where
    off_i is the sum of the earlier requests' lengths.

    E.g., rows [2, 5], start [0, 3], end [2, 4], loc [10, 11, 12] ->
    req_to_token[2, 0:2] = [10, 11], req_to_token[5, 3:4] = [12].
    """
    lens = (end_offset - start_offset).to(torch.int64)
    total = int(lens.sum())
    if total == 0:
        return
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lens)
    req_start = torch.cumsum(lens, 0) - lens  # offset of each request in out_cache_loc
    within = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(req_start, lens)
    cols = torch.repeat_interleave(start_offset.to(torch.int64), lens) + within
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every KV buffer i (base address data_ptrs[i], row size strides[i] bytes), copy row
    src_loc[j] to row tgt_loc[j]."""
    if tgt_loc.numel() == 0:
        return
    num_rows = int(torch.maximum(tgt_loc.max(), src_loc.max())) + 1
    tgt, src = tgt_loc.to(torch.int64), src_loc.to(torch.int64)
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (num_rows * stride)).from_address(ptr)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, stride)
        rows[tgt] = rows[src]


@torch.library.custom_op("sgl_kernel::murmur_hash32_cpu", mutates_args=())
def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """SGLang's seeded-sampling hash (`--enable-deterministic-inference`): [n] seeds and positions,
    [m] columns -> [n, m] uint32."""
    from sglang_dflash.verify.sampling import murmur_hash32

    return murmur_hash32(seed, positions, col_indices).to(torch.uint32)


@murmur_hash32_cpu.register_fake
def _(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    # SGLang calls it from a torch.compile'd function (multinomial_with_seed).
    return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this host has no sgl-kernel CPU build, and "
            f"sglang_dflash only provides stand-ins for {', '.join(STAND_INS)}"
        )

    missing.__name__ = name
    return missing

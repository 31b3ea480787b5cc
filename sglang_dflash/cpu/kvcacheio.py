"""CPU stand-ins for the HiCache copy ops of sgl_kernel's `kvcacheio` that SGLang's host KV pool
calls with its default layout (`--hicache-mem-layout page_first`, `--hicache-io-backend kernel`).

SGLang imports them only on CUDA and ROCm (`mem_cache/pool_host/mha.py`); `bootstrap.PATCHES`
puts these into that module on the CPU engine. Layouts, with `item` the bytes of one token's
K (or V) in one layer (kv_heads x head_dim x itemsize):

* device, layer-first: one buffer per layer, [slots, item] bytes, given by its base address (a
  uint64 pointer table) or as a tensor;
* host, page-first: one buffer, [tokens, layers, item] bytes (`layout_dim` = layers x item).

Indices are token slots on both sides. See docs/serving.md ("CPU").
"""

from __future__ import annotations

import ctypes

import torch


def _rows(address: int, num_rows: int, row_bytes: int) -> torch.Tensor:
    """The [num_rows, row_bytes] uint8 view of the memory at `address` (a CPU tensor's)."""
    raw = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, row_bytes)


def _bytes(buffer: torch.Tensor, row_bytes: int) -> torch.Tensor:
    return buffer.view(torch.uint8).view(-1, row_bytes)


def transfer_kv_all_layer_lf_pf(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
) -> None:
    """Backup, device -> host: host[dst_indices[j], l] = device layer l[src_indices[j]], for every
    layer l (its base address is src_*_layers[l])."""
    if src_indices.numel() == 0:
        return
    src, dst = src_indices.to(torch.int64), dst_indices.to(torch.int64)
    num_rows = int(src.max()) + 1
    for host, table in ((dst_k, src_k_layers), (dst_v, src_v_layers)):
        host_rows = _bytes(host, dst_layout_dim)  # [tokens, layers * item]
        for layer, address in enumerate(table.tolist()[:num_layers]):
            columns = slice(layer * item_size, (layer + 1) * item_size)
            host_rows[dst, columns] = _rows(address, num_rows, item_size)[src]


def transfer_kv_per_layer_pf_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
) -> None:
    """Load, host -> device, one layer: device[dst_indices[j]] = host[src_indices[j], layer_id]."""
    if src_indices.numel() == 0:
        return
    src, dst = src_indices.to(torch.int64), dst_indices.to(torch.int64)
    columns = slice(layer_id * item_size, (layer_id + 1) * item_size)
    for host, device in ((src_k, dst_k), (src_v, dst_v)):
        _bytes(device, item_size)[dst] = _bytes(host, src_layout_dim)[src, columns]

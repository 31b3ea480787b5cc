"""Random paged K/V caches and queries for the CPU attention tests."""

import torch

D = 16  # head dim


def paged_case(prefix_lens, extend_lens, heads, kv_heads, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    bs, slots = len(prefix_lens), 400
    k_cache = torch.randn(slots, kv_heads, D, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, D, generator=g).to(dtype)
    req_to_token = torch.zeros(bs + 2, 96, dtype=torch.int32)
    rows = torch.randperm(bs + 2, generator=g)[:bs]
    for row, p, e in zip(rows.tolist(), prefix_lens, extend_lens):
        req_to_token[row, : p + e] = (torch.randperm(slots - 1, generator=g)[: p + e] + 1).to(torch.int32)
    query = torch.randn(sum(extend_lens), heads, D, generator=g)
    sinks = 2.0 * torch.randn(heads, generator=g)  # about as large as the scores
    return (
        query,
        k_cache,
        v_cache,
        req_to_token,
        rows,
        torch.tensor(prefix_lens),
        torch.tensor(extend_lens),
        sinks,
    )

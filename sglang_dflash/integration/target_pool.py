"""The target's KV pool, as the draft store sees it: how many slot ids it must cover.

The store is indexed by the target's full-attention slot ids (`req_to_token`, `out_cache_loc`),
so it needs as many rows as the target's full-attention pool, whatever else the target keeps:
a hybrid linear-attention pool (Qwen3-Next, Qwen3.5) holds its full-attention layers in
`full_kv_pool` next to the mamba state; a sliding-window pool (gpt-oss, Gemma) holds a full
pool and a smaller SWA pool whose slot ids are translated from the full ones. One function
decides, at start-up, and refuses a pool it does not know.

See README.md ("Supported targets").
"""

from __future__ import annotations


def num_target_slots(pool) -> int:
    """Rows of the target's full-attention pool: `size` token slots plus the padding page."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    full = pool.full_kv_pool if isinstance(pool, (HybridLinearKVPool, SWAKVPool)) else pool
    if not isinstance(full, (MHATokenToKVPool, MLATokenToKVPool)):
        raise ValueError(
            f"sglang-dflash does not know the target's KV pool {type(pool).__name__} "
            f"(full-attention part: {type(full).__name__}); it supports MHA and MLA pools, alone, "
            "in a hybrid linear-attention pool, or in a sliding-window pool"
        )
    if getattr(full, "post_capture_active", False):
        # Its `size` is then a virtual-address upper bound, backed only after CUDA-graph capture;
        # a store sized from it would allocate more than SGLang budgeted for the draft.
        raise ValueError(
            "sglang-dflash does not support post-capture KV sizing (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1) "
            "with DFLASH; unset it"
        )
    return int(full.size + full.page_size)

"""The draft KV store as an SGLang KV pool: what SGLang's distributed machinery reads.

`DraftKVPool` is an `MHATokenToKVPool` whose per-layer buffers are views of the store's rows,
so no byte is copied and the draft's own fast paths (injection, SDPA and FlashInfer attention)
keep writing and reading the store's tensors. The worker hands it to SGLang as
`primary_draft_kv_pool`: prefill/decode disaggregation registers its buffers for transfer
after the target's (`get_contiguous_buf_infos`), and moves a request's draft K/V at the same
slot ids as its target K/V. See docs/serving-past-one-engine.md.
"""

from __future__ import annotations

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_dflash.draft.kv_store import DraftKVStore


class DraftKVPool(MHATokenToKVPool):
    """Layer l's K buffer is `store.k[l, :rows]`, one contiguous [rows, kv_heads, head_dim] view,
    where `rows` is the target pool's (its `size` slots plus the padding page). Store rows past
    that are FlashInfer scratch, private to the draft step, and not part of the pool."""

    def __init__(self, store: DraftKVStore, target_pool, *, enable_memory_saver: bool):
        full = getattr(target_pool, "full_kv_pool", target_pool)  # hybrid and SWA pools
        rows = int(full.size + full.page_size)
        if store.num_slots < rows:
            raise ValueError(f"the draft KV store has {store.num_slots} slots; the target pool has {rows}")
        self.store = store
        super().__init__(
            size=int(full.size),
            page_size=int(full.page_size),
            dtype=store.k.dtype,
            head_num=store.k.shape[2],
            head_dim=store.k.shape[3],
            layer_num=store.k.shape[0],
            device=str(store.k.device),
            enable_memory_saver=enable_memory_saver,
            enable_alt_stream=False,
            kv_cache_layout="nhd",
            allocation_label="DFLASH draft",
        )
        if self.enable_custom_mem_pool:
            # Mooncake's NVLink transport registers memory from its own allocator's pool; the
            # store was allocated outside it.
            raise ValueError(
                "sglang-dflash does not support SGLANG_MOONCAKE_CUSTOM_MEM_POOL with DFLASH; "
                "unset it, or serve with SGLANG_DFLASH_IMPL=builtin"
            )

    def _create_buffers_normal(self):
        rows = self.size + self.page_size
        # SGLang's pools hold fp8 K/V as uint8 (same bytes; index_put works on it).
        self.k_buffer = [layer[:rows].view(self.store_dtype) for layer in self.store.k]
        self.v_buffer = [layer[:rows].view(self.store_dtype) for layer in self.store.v]

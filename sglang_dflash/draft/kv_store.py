"""The draft KV store: context K/V of every draft layer, indexed by the target's KV slot ids.

Sharing the target's slot ids is what makes the radix cache work for the draft too: a prefix
whose target KV is cached has its draft K/V at the same slots, and freeing or evicting a slot
releases both.

Invariant: every slot that holds a *committed* token in the target's KV pool holds that token's
context K/V here (written in the same step as its target KV). Other slots hold garbage that is
never read, because every read is bounded by the committed `seq_lens`. Slot 0 is SGLang's
padding sink: writes that must be dropped are redirected there.

Its dtype is the draft KV dtype SGLang resolves and budgets for (`resolve_draft_kv_dtype`), so
`--kv-cache-dtype fp8_e4m3` (or `--speculative-draft-kv-cache-dtype`) stores fp8: writes cast
with scale 1, as SGLang's own pools do for a layer without checkpoint KV scales (DFlash drafts
ship none), and readers upcast to the query dtype.

With a window ring (`window_ring.py`, SGLANG_DFLASH_DRAFT_WINDOW_POOL) the windowed layers
keep only each request's last positions, at ring rows instead of slot ids.

SGLang's own machinery reads the store through `draft_pool.DraftKVPool`, an SGLang KV pool
over the same memory.

See docs/architecture.md ("How it works").
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang_dflash.draft.window_ring import WindowRing

STORE_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2,
)


def resolve_draft_kv_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The draft KV dtype: `--speculative-draft-kv-cache-dtype`, else `--kv-cache-dtype`, else the
    model dtype, resolved by SGLang's own function with the arguments its pool budget passes
    (`mem_cache/draft_kv_budget.py`), so the store costs the bytes per token SGLang set aside."""
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.runtime_context import get_model, get_spec

    model, spec = get_model(), get_spec()
    _, dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=model.kv_cache_dtype,
        speculative_draft_kv_cache_dtype=spec.speculative_draft_kv_cache_dtype,
        model=None,
        model_dtype=model_dtype,
        is_draft_worker=True,
        is_dflash=True,
        speculative_draft_attention_backend=spec.speculative_draft_attention_backend,
    )
    if dtype not in STORE_DTYPES:
        # E.g. nvfp4 packs two values per element, with block scales the store does not keep.
        raise ValueError(
            f"sglang-dflash keeps the draft's K/V in {', '.join(str(d) for d in STORE_DTYPES)}; "
            f"--kv-cache-dtype {model.kv_cache_dtype} (--speculative-draft-kv-cache-dtype "
            f"{spec.speculative_draft_kv_cache_dtype}) gives {dtype}: pass "
            "--speculative-draft-kv-cache-dtype bf16 or fp8_e4m3"
        )
    return dtype


def kv_cache_region():
    """SGLang's memory-saver region for KV caches (`--enable-memory-saver`): what is allocated
    inside is released and re-mapped with the target's KV pools by `release_memory_occupation`
    / `resume_memory_occupation` (tag "kv_cache"), so an RL trainer gets the draft's memory back
    too. Without the flag it is a no-op context."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    adapter = TorchMemorySaverAdapter.create(enable=get_exec().features.enable_memory_saver)
    return adapter.region(GPU_MEMORY_TYPE_KV_CACHE)


class DraftKVStore:
    """`k`, `v` [L, num_slots, kv_heads, head_dim]: every layer's K/V at the target's slot ids;
    with a window ring (`window_ring.py`), `k`, `v` hold the full layers only, and the layers
    `windowed_layers` are in `ring_k`, `ring_v` [L_w, ring rows + ring_scratch_rows, kv_heads,
    head_dim] (the scratch rows, past the sink, are FlashInfer's for each step's block)."""

    def __init__(
        self,
        *,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        ring: Optional[WindowRing] = None,
        windowed_layers: Sequence[int] = (),
        ring_scratch_rows: int = 0,
    ):
        windowed = tuple(windowed_layers) if ring is not None else ()
        full = [layer for layer in range(num_layers) if layer not in windowed]
        shape = (len(full), num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L_full, num_slots, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L_full, num_slots, kv_heads, head_dim]
        self.ring = ring if windowed else None
        self.ring_k = self.ring_v = None
        if self.ring is not None:
            ring_shape = (len(windowed), self.ring.num_rows + ring_scratch_rows, num_kv_heads, head_dim)
            self.ring_k = torch.zeros(ring_shape, dtype=dtype, device=device)  # [L_w, ring rows, ...]
            self.ring_v = torch.zeros(ring_shape, dtype=dtype, device=device)
        # layer id -> (in the ring, index in its tensor)
        self._index = {layer: (False, i) for i, layer in enumerate(full)}
        self._index.update({layer: (True, i) for i, layer in enumerate(windowed)})
        self._full = torch.tensor(full, dtype=torch.int64)
        self._windowed = torch.tensor(windowed, dtype=torch.int64)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        ring = 0 if self.ring_k is None else 2 * self.ring_k.numel() * self.ring_k.element_size()
        return 2 * self.k.numel() * self.k.element_size() + ring

    def in_ring(self, layer_id: int) -> bool:
        return self._index[layer_id][0]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_id`'s K and V buffers: [num_slots, ...] at slot ids, or [ring rows, ...]
        at ring rows (`in_ring`)."""
        in_ring, i = self._index[layer_id]
        if in_ring:
            return self.ring_k[i], self.ring_v[i]
        return self.k[i], self.v[i]

    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Optional[torch.Tensor] = None
    ) -> None:
        """Store k, v [L, N, kv_heads, head_dim] of every layer: the full layers at `slots` [N],
        the windowed ones at ring `rows` [N] (`WindowRing.write_rows`; needed with a ring)."""
        if self.ring is None:
            self.k[:, slots] = k.to(self.k.dtype)
            self.v[:, slots] = v.to(self.v.dtype)
            return
        if rows is None:
            raise ValueError("a draft KV store with a window ring needs the ring rows of a write")
        full, windowed = self._full.to(k.device), self._windowed.to(k.device)
        if len(full):
            self.k[:, slots] = k[full].to(self.k.dtype)
            self.v[:, slots] = v[full].to(self.v.dtype)
        self.ring_k[:, rows] = k[windowed].to(self.ring_k.dtype)
        self.ring_v[:, rows] = v[windowed].to(self.ring_v.dtype)

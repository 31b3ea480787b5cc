"""What the draft's K/V costs, layer by layer: which draft layers are full attention and which
are windowed, their bytes per target token, and what the store holds of each.

A layer's reach is its `sliding_window` (sliding layers) capped by `--speculative-draft-window-size`
(every layer), or None: the whole context. A layer with a reach reads at most that many context
rows in a step (the window counted back from the block's first position); a full layer reads all.

Without a window ring the store (`kv_store.py`) keeps every layer's K/V at every target slot,
windowed or not, so a windowed layer costs what a full one costs. With one
(SGLANG_DFLASH_DRAFT_WINDOW_POOL's choice, `window_ring.py`) the windowed layers keep R rows per request
slot instead, and the target's pool gets `sliding_bytes_per_token` per slot back, less the ring.
The plan says which, on the start-up line and in server info, the bytes of each kind apart.

Worked example: draft "a" re-declared all-sliding (2 layers, window 32, 2 KV heads x 64, fp32):
each layer costs 2 (K and V) x 2 x 64 x 4 = 1024 B per token, so full 0 B, sliding 2048 B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_dflash.draft.window_ring import WindowRing


@dataclass(frozen=True)
class DraftKVPlan:
    # layer id -> its reach in context rows (None: the whole context), in layer order
    reach: tuple[Optional[int], ...]
    bytes_per_layer_token: int  # K and V of one layer for one token, on this rank
    store_slots: int  # target slots the store keeps K/V for (scratch rows excluded)
    ring: Optional[WindowRing] = None  # the windowed layers' window ring, if they keep one

    @property
    def windowed(self) -> bool:
        """Whether the sliding layers hold only their window (a window ring)."""
        return self.ring is not None

    @classmethod
    def for_draft(
        cls,
        config,
        *,
        context_window: Optional[int],
        num_kv_heads: int,
        itemsize: int,
        store_slots: int,
        ring: Optional[WindowRing] = None,
    ) -> "DraftKVPlan":
        """`config`: the draft's `DFlashDraftConfig`; `context_window`:
        `--speculative-draft-window-size` (None: unset); `num_kv_heads`: this rank's."""
        reach = []
        for layer_id in range(config.num_hidden_layers):
            bounds = [w for w in (config.layer_window(layer_id), context_window) if w is not None]
            reach.append(min(bounds) if bounds else None)
        return cls(tuple(reach), 2 * num_kv_heads * config.head_dim * itemsize, store_slots, ring)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.reach) if r is None)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.reach) if r is not None)

    @property
    def full_bytes_per_token(self) -> int:
        return len(self.full_layers) * self.bytes_per_layer_token

    @property
    def sliding_bytes_per_token(self) -> int:
        return len(self.sliding_layers) * self.bytes_per_layer_token

    @property
    def ring_bytes(self) -> int:
        """The window ring's K/V (0 without one)."""
        if self.ring is None:
            return 0
        return self.ring.nbytes(self.bytes_per_layer_token, len(self.sliding_layers))

    @property
    def store_bytes(self) -> int:
        if self.ring is not None:
            return self.store_slots * self.full_bytes_per_token + self.ring_bytes
        return self.store_slots * (self.full_bytes_per_token + self.sliding_bytes_per_token)

    def _windows(self) -> str:
        windows = sorted({r for r in self.reach if r is not None})
        return "/".join(str(w) for w in windows)

    def describe(self) -> str:
        """The start-up line's `draft_kv` field."""
        full, sliding = self.full_layers, self.sliding_layers
        parts = [f"{self.bytes_per_layer_token} B/token per layer"]
        if full:
            parts.append(f"full: layers {list(full)}, {self.full_bytes_per_token} B/token")
        if sliding:
            held = "held for every token (SGLANG_DFLASH_DRAFT_WINDOW_POOL=0)"
            if self.ring is not None:
                held = (
                    f"window ring of {self.ring.rows_per_request} rows x {self.ring.num_requests} "
                    f"request slots, {self.ring_bytes / 2**20:.1f} MiB"
                )
            parts.append(
                f"sliding: layers {list(sliding)} (window {self._windows()}), "
                f"{self.sliding_bytes_per_token} B/token, {held}"
            )
        parts.append(f"{self.store_slots} slots, {self.store_bytes / 2**20:.1f} MiB")
        return "; ".join(parts)

    def server_info(self) -> dict:
        """Server info's `dflash_draft_kv`."""
        return {
            "full_layers": list(self.full_layers),
            "sliding_layers": list(self.sliding_layers),
            "sliding_windows": [self.reach[i] for i in self.sliding_layers],
            "bytes_per_token_full": self.full_bytes_per_token,
            "bytes_per_token_sliding": self.sliding_bytes_per_token,
            "sliding_layers_windowed": self.windowed,
            "window_ring_rows_per_request": None if self.ring is None else self.ring.rows_per_request,
            "window_ring_request_slots": None if self.ring is None else self.ring.num_requests,
            "window_ring_bytes": self.ring_bytes,
            "store_slots": self.store_slots,
            "store_bytes": self.store_bytes,
        }

"""The draft KV store: context K/V of every draft layer, indexed by the target's KV slot ids.

Sharing the target's slot ids is what makes the radix cache work for the draft too: a prefix
whose target KV is cached has its draft K/V at the same slots, and freeing or evicting a slot
releases both.

Invariant: every slot that holds a *committed* token in the target's KV pool holds that token's
context K/V here (written in the same step as its target KV). Other slots hold garbage that is
never read, because every read is bounded by the committed `seq_lens`. Slot 0 is SGLang's
padding sink: writes that must be dropped are redirected there.
"""

from __future__ import annotations

import torch


class DraftKVStore:
    def __init__(
        self,
        *,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, num_slots, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, num_slots, kv_heads, head_dim]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [L, N, kv_heads, head_dim] at `slots` [N], all layers in one scatter."""
        self.k[:, slots] = k.to(self.k.dtype)
        self.v[:, slots] = v.to(self.v.dtype)

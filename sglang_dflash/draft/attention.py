"""Draft attention: the block's queries over [committed context K/V ; the block's own K/V].

`visibility` is the one statement of which keys a query sees (used by serving and training).
`SdpaDraftAttention` is the PyTorch path used on CPU: it gathers each request's context K/V from
the draft KV store into a padded batch and runs `scaled_dot_product_attention`; a windowed
layer's from its window ring, when the store has one (`window_ring.py`). With a context
window W (`--speculative-draft-window-size`) a block sees only its request's last W committed
tokens (`block.context_window`), on top of what `visibility` allows per layer.

See docs/architecture.md ("How it works").
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.block import context_window, gather_rows, gather_slots
from sglang_dflash.draft.kv_store import DraftKVStore


def visibility(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor,
    *,
    causal: bool,
    window: Optional[int],
) -> torch.Tensor:
    """Which keys each query may attend to, by absolute position.

    q_pos [..., Q], k_pos [..., K], k_valid [..., K] -> bool [..., Q, K].
    Full-attention DFlash layers are non-causal: a block query sees every valid key. Sliding
    layers follow the reference: causal unless the config says otherwise, within `window`.
    """
    visible = k_valid.unsqueeze(-2).expand(*q_pos.shape, k_pos.shape[-1])
    return within_reach(visible, q_pos.unsqueeze(-1), k_pos.unsqueeze(-2), causal=causal, window=window)


def within_reach(
    visible: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, causal: bool, window: Optional[int]
) -> torch.Tensor:
    """`visibility`'s rule by position, elementwise: `visible` narrowed to the keys at positions
    `k` that queries at positions `q` may see (all three broadcast together; training's
    FlexAttention mask applies it per element)."""
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


def planning_lens(
    seq_lens_cpu: Optional[torch.Tensor], reserved_lens_cpu: Optional[torch.Tensor]
) -> tuple[torch.Tensor, bool]:
    """Host lengths to plan a step's draft attention with, and whether they are exact.

    seq_lens_cpu [bs]: SGLang's `batch.seq_lens_cpu`, the committed lengths (exact when present:
    `prepare_for_decode` seeds it from the requests, and under overlap scheduling
    `FutureMap.resolve_seq_lens_cpu` replaces it with the published lengths before the forward;
    None only when every attention backend opted out of host lengths).
    reserved_lens_cpu [bs]: `DFlashDraftInputV2.nxt_kv_lens_cpu`, the slots `prepare_for_decode`
    reserved, committed + 2B page-aligned: an upper bound.
    Planning with an upper bound is safe only where the plan does not split the KV by its host
    length (`FlashInferDraftAttention.bind`); reading either costs no device sync.
    """
    if seq_lens_cpu is not None:
        return seq_lens_cpu, True
    if reserved_lens_cpu is None:
        raise ValueError("the batch has neither seq_lens_cpu nor reserved lengths to plan with")
    return reserved_lens_cpu, False


def attend_with_context(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Block queries over `[context K/V ; block K/V]` by SDPA, in the queries' dtype.

    q [b, Q, heads, d]; k_ctx, v_ctx [b, C, kv_heads, d]; k, v [b, Q, kv_heads, d];
    mask [b, 1, Q, C + Q] (True: may attend) -> [b, Q, heads, d].

    sinks [heads]: gpt-oss style sink logits (MiMo drafts). Each head's softmax gets one more
    term, exp(sink), that carries no value: out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}).
    SDPA computes that with one extra key of zeros (score 0) and value zeros, its additive mask
    entry set to the sink.
    """
    keys = torch.cat([k_ctx.to(q.dtype), k.to(q.dtype)], dim=1).transpose(1, 2)
    values = torch.cat([v_ctx.to(q.dtype), v.to(q.dtype)], dim=1).transpose(1, 2)
    if sinks is not None:
        b, kv_heads, _, d = keys.shape
        zeros = keys.new_zeros(b, kv_heads, 1, d)
        keys, values = torch.cat([keys, zeros], dim=2), torch.cat([values, zeros], dim=2)
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        sink_column = sinks.to(q.dtype)[None, :, None, None].expand(b, -1, mask.shape[2], 1)
        mask = torch.cat([additive.expand(b, sinks.shape[0], -1, -1), sink_column], dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != q.shape[2]
    )  # [b, heads, Q, d]
    return out.transpose(1, 2)


class SdpaDraftAttention:
    """One step's draft attention over the store, batched with padding.

    Shapes: bs requests, Bd block tokens each, C = longest committed context in the batch.
    """

    def __init__(
        self,
        config: DFlashDraftConfig,
        store: DraftKVStore,
        context_window: Optional[int] = None,
        sinks: Optional[list[torch.Tensor]] = None,
    ):
        self.config = config
        self.store = store
        self.context_window = context_window
        self.scale = config.head_dim**-0.5
        self.sinks = sinks  # per layer [heads on this rank] (`DFlashDraftModel.attention_sinks`)

    def bind(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        context_lens: torch.Tensor,
        context_lens_cpu: torch.Tensor,
        block_size: int,
        host_lens_exact: bool = True,
    ) -> "SdpaDraftAttention":
        """Plan this step (same contract as `FlashInferDraftAttention.bind`).

        context_lens [bs] exact committed lengths (device); context_lens_cpu [bs] on the host,
        exact or an upper bound (`host_lens_exact`): it only sizes the padded gather, so reading
        it costs no sync, and an upper bound only pads more.
        """
        bs = context_lens.shape[0]
        longest = min(int(context_lens_cpu.max()), req_to_token.shape[1])
        self.bs, self.block_size = bs, block_size
        device = context_lens.device
        q_pos = context_lens[:, None] + torch.arange(block_size, device=device)  # [bs, Bd]
        layers = range(self.config.num_hidden_layers)
        ring = self.store.ring
        in_ring = [ring is not None and self.store.in_ring(i) for i in layers]
        masks = [None] * len(in_ring)
        if not all(in_ring):
            # The full layers (all layers without a ring) see the context window, by slot id.
            c = longest if self.context_window is None else min(longest, self.context_window)
            start, visible = context_window(context_lens, self.context_window)  # [bs], [bs]
            # [bs, C] slot ids of every request's visible context, from `start`; entries past its
            # visible length are masked (start + C stays in the row: start > 0 only when C <= W).
            self.context_slots = gather_slots(req_to_token, req_pool_indices, start, c)
            full = self._masks(q_pos, start, visible, c, block_size)
            masks = [m if not r else None for m, r in zip(full, in_ring)]
        if any(in_ring):
            # A windowed layer in the ring sees no further back than its R rows (the positions
            # still there, `window_ring.py`): its gather is R wide whatever the context.
            reach = ring.rows_per_request
            if self.context_window is not None:
                reach = min(reach, self.context_window)
            start, visible = context_window(context_lens, reach)
            c = min(longest, reach)
            self.ring_rows = ring.read_rows(req_pool_indices, start, c)  # [bs, C_ring]
            windowed = self._masks(q_pos, start, visible, c, block_size)
            masks = [w if r else m for m, w, r in zip(masks, windowed, in_ring)]
        self.masks = masks
        return self

    def _masks(self, q_pos, start, visible, c: int, block_size: int) -> list[torch.Tensor]:
        """Each layer's [bs, 1, Bd, C + Bd] mask over a gather of C context positions from
        `start` [bs] (the first `visible` [bs] of them valid) and the block at `q_pos` [bs, Bd]."""
        cols = torch.arange(c, device=q_pos.device)
        k_pos = torch.cat([start[:, None] + cols, q_pos], dim=1)  # [bs, C + Bd], absolute
        k_valid = torch.cat(
            [cols[None, :] < visible[:, None], torch.ones_like(q_pos, dtype=torch.bool)], dim=1
        )  # [bs, C + Bd]
        by_kind: dict[tuple, torch.Tensor] = {}
        masks = []
        for layer_id in range(self.config.num_hidden_layers):
            kind = (self.config.layer_is_causal(layer_id), self.config.layer_window(layer_id))
            if kind not in by_kind:
                by_kind[kind] = visibility(q_pos, k_pos, k_valid, causal=kind[0], window=kind[1])[:, None]
            masks.append(by_kind[kind])  # [bs, 1, Bd, C + Bd]
        return masks

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [bs*Bd, heads, d], k/v [bs*Bd, kv_heads, d] -> [bs*Bd, heads, d]
        bs = self.bs
        k_cache, v_cache = self.store.layer(layer_id)
        rows = self.ring_rows if self.store.in_ring(layer_id) else self.context_slots
        k_ctx = gather_rows(k_cache, rows)  # [bs, C, kv_heads, d]
        v_ctx = gather_rows(v_cache, rows)
        out = attend_with_context(
            q.unflatten(0, (bs, -1)),
            k_ctx,
            v_ctx,
            k.unflatten(0, (bs, -1)),
            v.unflatten(0, (bs, -1)),
            self.masks[layer_id],
            self.scale,
            None if self.sinks is None else self.sinks[layer_id],
        )
        return out.flatten(0, 1)

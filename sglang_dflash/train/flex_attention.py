"""Training's block attention by FlexAttention: the kernel visits only the tiles the block mask
keeps, forward and backward, and one compiled kernel serves the whole run.

The rule is `mask.py`'s: per sequence, keys `[context (S) ; every block (A*B)]`, queries
`[every block]`; a block query sees the context before its anchor and its own block, within
`attention.visibility`.

**One compile.** `torch.compile` specialises on shapes, so every dimension is padded to a size
fixed for the run (`FlexShapes`), and a batch of any length, any number of anchors and any
batch size (up to `--batch-size`) reuses the kernel compiled for the first:

    rows     b      -> --batch-size             (padding rows: queries that see only their block)
    context  S      -> --max-length, to a tile  (padding keys: past every anchor, never seen)
    blocks   Q = AB -> --num-anchors * B, to a tile (padding queries: blocks of their own)

E.g., --max-length 200, 20 anchors of B = 16, tile 128: context 256, queries 384 (320 real),
keys 640. Padding costs little: its tiles are skipped, except the padding blocks' own.
Training compiles one graph per layer kind (full, sliding) and grad mode (training, evaluation);
`compiled_graphs` counts them, and the training log records the count.

**The tiles.** Which tiles to visit comes from the anchors (`tile_mask`), not from evaluating
the mask at every (query, key) pair as `create_block_mask` does ([b, Q, S + Q] intermediates,
gigabytes at S = 2048 and 512 anchors). Inside a tile that is only partly visible the kernel
applies `mask_mod`, the same rule per element.

FlexAttention has no backward on CPU (torch 2.14), so training with it needs CUDA; its forward
runs on CPU, where the tests check it against the dense path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from sglang_dflash.draft.attention import within_reach

TILE = 128  # FlexAttention's default sparse block, queries and keys


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class FlexShapes:
    """The padded sizes every batch of a run is attended at."""

    rows: int  # sequences per batch
    context: int  # S, a multiple of TILE
    queries: int  # Q = A*B, a multiple of TILE
    block_size: int

    @classmethod
    def for_run(cls, batch_size: int, max_length: int, num_anchors: int, block_size: int) -> "FlexShapes":
        return cls(
            batch_size, _round_up(max_length, TILE), _round_up(num_anchors * block_size, TILE), block_size
        )

    @property
    def keys(self) -> int:
        return self.context + self.queries


def supported(device: torch.device) -> Optional[str]:
    """None if FlexAttention trains on `device`, else why not."""
    if device.type == "cpu":
        return f"FlexAttention has no backward on CPU (torch {torch.__version__})"
    if device.type != "cuda":
        return f"FlexAttention is not built for device type {device.type!r}"
    try:
        import triton  # noqa: F401  (FlexAttention's CUDA kernels are Triton templates)
    except ImportError:
        return "FlexAttention's CUDA kernels need Triton, which is not installed"
    return None


def query_anchors(anchors: torch.Tensor, shapes: FlexShapes) -> torch.Tensor:
    """anchors [b, A] -> the anchor of each query's block, [rows, queries]; 0 on padding
    (b may exceed `shapes.rows`, at the price of a compile for the new shape).

    E.g., anchors [[3, 9]], B = 2, padded to 2 rows of 6 queries:
        [[3, 3, 9, 9, 0, 0],
         [0, 0, 0, 0, 0, 0]]
    """
    b, a = anchors.shape
    out = anchors.new_zeros(max(b, shapes.rows), shapes.queries)
    out[:b, : a * shapes.block_size] = anchors.repeat_interleave(shapes.block_size, dim=1)
    return out


def mask_mod_for(q_anchor: torch.Tensor, shapes: FlexShapes, *, causal: bool, window: Optional[int]):
    """The mask per (row, head, query, key) over the padded layout; `q_anchor` from
    `query_anchors`. Context key t: t < the query's anchor; block key j: the query's own block.
    Then `attention.visibility`'s rule by position (query q at anchor + q % B, block key j at
    anchor + j % B), per element; `tests/unit/train/test_flex_attention.py` checks the whole equals
    `mask.block_attention_mask`."""
    s, bsz = shapes.context, shapes.block_size

    def mask_mod(b, h, q, kv):
        anchor = q_anchor[b, q]
        q_pos = anchor + q % bsz
        in_context = kv < s
        block_key = kv - s  # negative on context keys
        k_pos = torch.where(in_context, kv, anchor + block_key % bsz)
        seen = torch.where(in_context, kv < anchor, block_key // bsz == q // bsz)
        return within_reach(seen, q_pos, k_pos, causal=causal, window=window)

    return mask_mod


def tile_mask(
    q_anchor: torch.Tensor, shapes: FlexShapes, *, causal: bool, window: Optional[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_anchor [rows, Q] -> (any, full), bool [rows, Q / TILE, keys / TILE]: the tiles with at
    least one visible (query, key) pair, and those with every pair visible (the kernel skips
    `mask_mod` there). `any` may over-cover (`mask_mod` is exact); `full` may not.

    Context: query q sees the interval [lo_q, hi_q) of context keys, hi_q = its anchor,
    lo_q = max(0, position - window + 1) with a window, else 0 (keys before the anchor are before
    the position, so causality adds nothing). A tile [t0, t1) has some key of it iff
    lo_q < t1, t0 < hi_q and lo_q < hi_q, and all iff lo_q <= t0 and t1 <= hi_q.
    Blocks: the query tile [q0, q1) holds blocks q0 // B .. (q1 - 1) // B, whose keys are the
    interval [(q0 // B) * B, ((q1 - 1) // B + 1) * B); those tiles are partial (never full:
    the other blocks in a tile are masked).

    E.g., TILE 128, B = 16, S = 256: a query tile whose 8 blocks are anchored in 40..200 has
    context tile 0 partial (keys 0..127: the query anchored at 40 sees only 0..39), context
    tile 1 partial, and the block-key tile of its own index partial.
    """
    rows, nq = q_anchor.shape
    bsz, device = shapes.block_size, q_anchor.device
    q_pos = q_anchor + torch.arange(nq, device=device) % bsz  # [rows, Q]
    hi = q_anchor[..., None]  # [rows, Q, 1]
    lo = (q_pos - window + 1).clamp(min=0)[..., None] if window is not None else torch.zeros_like(hi)
    t0 = torch.arange(0, shapes.context, TILE, device=device)  # [S / TILE]
    t1 = t0 + TILE
    some = (lo < t1) & (t0 < hi) & (lo < hi)  # [rows, Q, S / TILE]
    every = (lo <= t0) & (t1 <= hi)
    some = some.unflatten(1, (-1, TILE)).any(2)  # [rows, QT, S / TILE]
    every = every.unflatten(1, (-1, TILE)).all(2)

    q0 = torch.arange(0, nq, TILE, device=device)  # [QT]: query tiles, and block-key tiles alike
    first, last = (q0 // bsz) * bsz, ((q0 + TILE - 1) // bsz + 1) * bsz  # own blocks' keys
    own = (first[:, None] < q0 + TILE) & (q0 < last[:, None])  # [QT (queries), QT (block keys)]
    own = own.expand(rows, -1, -1)
    return torch.cat([some, own], 2), torch.cat([every, torch.zeros_like(own)], 2)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [rows, QT, KT] -> (count [rows, 1, QT], indices [rows, 1, QT, KT]), int32: per query
    tile, how many key tiles and which (the chosen first, ascending), BlockMask's layout."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def block_mask(anchors: torch.Tensor, shapes: FlexShapes, *, causal: bool, window: Optional[int]):
    """anchors [b, A] -> FlexAttention's BlockMask over the padded layout, for one layer kind."""
    from torch.nn.attention.flex_attention import BlockMask

    q_anchor = query_anchors(anchors, shapes)
    some, every = tile_mask(q_anchor, shapes, causal=causal, window=window)
    return BlockMask.from_kv_blocks(
        *_ordered(some & ~every),
        *_ordered(every),
        BLOCK_SIZE=TILE,
        mask_mod=mask_mod_for(q_anchor, shapes, causal=causal, window=window),
        seq_lengths=(shapes.queries, shapes.keys),
    )


@functools.cache
def compiled_flex():
    """`flex_attention` compiled once per process (uncompiled it materialises every score)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def compiled_graphs() -> int:
    """Graphs `torch.compile` has compiled in this process (the recipe compiles only this)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def flex_block_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask,
    shapes: FlexShapes,
    scale: float,
) -> torch.Tensor:
    """`attention.attend_with_context` with the block-wise mask, by FlexAttention.

    q [b, Q, heads, d]; k_ctx, v_ctx [b, S, kv_heads, d]; k, v [b, Q, kv_heads, d]; `mask`
    from `block_mask` -> [b, Q, heads, d]. Padded to `shapes` on the way in, cut on the way out.
    """
    b, nq, heads, _ = q.shape
    rows = mask.kv_num_blocks.shape[0]

    def padded(x: torch.Tensor, length: int) -> torch.Tensor:  # [b, L, h, d] -> [rows, h, length, d]
        pad = (0, 0, 0, 0, 0, length - x.shape[1], 0, rows - b)
        return F.pad(x.to(q.dtype), pad).transpose(1, 2)

    keys = torch.cat([padded(k_ctx, shapes.context), padded(k, shapes.queries)], 2)
    values = torch.cat([padded(v_ctx, shapes.context), padded(v, shapes.queries)], 2)
    out = compiled_flex()(
        padded(q, shapes.queries), keys, values, block_mask=mask, scale=scale,
        enable_gqa=heads != k.shape[2],
    )  # fmt: skip
    return out.transpose(1, 2)[:b, :nq]

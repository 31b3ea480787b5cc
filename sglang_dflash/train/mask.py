"""The block-wise attention mask that trains every anchored block of a batch in one forward.

Per sequence the draft sees keys `[context (S tokens) ; all blocks (A*B tokens)]` and queries
`[all blocks (A*B tokens)]`. Query (block j, offset k) sits at position `anchors[j] + k` and may
see:
  * context token t iff t < anchors[j]: the committed tokens strictly before the anchor, as in
    serving, where the block `[bonus, MASK...]` starts right after the committed context;
  * block token (j', k') iff j' == j: its own block only;
and, on top of both, what `sglang_dflash.draft.attention.visibility` allows by position (non-causal for
full layers; causal within `sliding_window` for sliding layers), the same rule serving uses.

E.g., S=6, anchors=[1, 3], B=2 (queries at positions 1, 2 | 3, 4), full attention:

                 context t=0..5     block a=1   block a=3
    q (a=1, k=0)   1 0 0 0 0 0        1 1         0 0
    q (a=1, k=1)   1 0 0 0 0 0        1 1         0 0
    q (a=3, k=0)   1 1 1 0 0 0        0 0         1 1
    q (a=3, k=1)   1 1 1 0 0 0        0 0         1 1

Every row sees at least its own block, so no softmax row is empty.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_dflash.draft.attention import visibility


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors [b, A] -> positions of every block token [b, A*B].

    E.g., anchors [[1, 3]], B=2 -> [[1, 2, 3, 4]].
    """
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).flatten(1)


def context_mask(
    anchors: torch.Tensor, seq_len: int, block_size: int, *, causal: bool, window: Optional[int]
) -> torch.Tensor:
    """anchors [b, A] -> bool [b, A*B, S]: the context columns of the mask (tokens before the
    anchor, and `visibility` by position)."""
    b = anchors.shape[0]
    q_pos = block_positions(anchors, block_size)  # [b, Q]
    ctx_pos = torch.arange(seq_len, device=anchors.device)  # [S]
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]; E.g., [1, 3] -> [1, 1, 3, 3]
    before_anchor = ctx_pos[None, None, :] < q_anchor[:, :, None]  # [b, Q, S]
    everywhere = torch.ones(b, seq_len, dtype=torch.bool, device=anchors.device)
    return before_anchor & visibility(
        q_pos, ctx_pos.expand(b, seq_len), everywhere, causal=causal, window=window
    )


def block_attention_mask(
    anchors: torch.Tensor,
    seq_len: int,
    block_size: int,
    *,
    causal: bool,
    window: Optional[int],
) -> torch.Tensor:
    """anchors [b, A] -> bool mask [b, A*B, S + A*B] (True: may attend), see the module doc."""
    b, num_anchors = anchors.shape
    q_pos = block_positions(anchors, block_size)  # [b, Q]
    by_position = visibility(
        q_pos, q_pos, torch.ones_like(q_pos, dtype=torch.bool), causal=causal, window=window
    )  # [b, Q, Q]
    q_block = torch.arange(num_anchors, device=anchors.device).repeat_interleave(block_size)  # [Q]
    same_block = q_block[:, None] == q_block[None, :]  # [Q, Q]
    context = context_mask(anchors, seq_len, block_size, causal=causal, window=window)  # [b, Q, S]
    return torch.cat([context, same_block & by_position], dim=2)

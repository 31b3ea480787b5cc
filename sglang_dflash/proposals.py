"""Proposals: the draft block's final hidden states -> the tokens the target verifies.

One `Proposer` per checkpoint family, chosen once at start-up (`proposer_for`). Each returns
`Proposals`: the proposed ids, the draft's logits when a grammar ranks the candidates
(`grammar.py` walks them in order), and the draft distribution q over what was proposed when a
sampled walk drew it (the verify then accepts with min(1, p/q)).

Today's families propose greedily from the target's LM head: `ArgmaxProposer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch


@dataclass
class Proposals:
    tokens: torch.Tensor  # [bs, W-1] int64: d1 .. d_{W-1}
    logits: Optional[torch.Tensor] = None  # [bs, W-1, V]: when a grammar ranks the candidates
    q: Optional[torch.Tensor] = None  # [bs, W-1]: q(d_i), when the proposals were sampled


class Proposer(Protocol):
    name: str

    def __call__(self, hidden: torch.Tensor, with_logits: bool) -> Proposals:
        """hidden [bs, W-1, H]: the draft's final hidden states at window positions 1..W-1."""
        ...


class ArgmaxProposer:
    """The target's LM head over the draft's hidden states, and its argmax (vocab-parallel under
    tensor parallelism). With `with_logits`, the full logits too, for the grammar window."""

    name = "argmax"

    def __init__(self, head):
        self.head = head  # TargetHead

    def __call__(self, hidden: torch.Tensor, with_logits: bool) -> Proposals:
        if not with_logits:
            return Proposals(self.head.argmax(hidden))  # [bs, W-1]
        logits = self.head.logits(hidden)  # [bs, W-1, V]
        return Proposals(torch.argmax(logits, dim=-1), logits)


def proposer_for(config, head) -> Proposer:
    """The proposer of the checkpoint's family (`config`: DFlashDraftConfig). Every family
    served today proposes the argmax; the checkpoint contract refuses the others by name."""
    return ArgmaxProposer(head)

"""DFlash2's selector loss: the candidate selector trained on the lattice row the walk reads.

Serving (`propose/selector.py`) walks, for slot e = 1..B-1 of a block, the row of the lattice
given the token picked at slot e-1 (the bonus token for slot 1), over the top-K candidates of the
target's head on the draft's hidden state h_e:

    score[c] = unary[c] + < A[pred] * (P h_e), B[cand_c] >

Training teacher-forces the walk: slot e's predecessor is the gold token of slot e-1 (for slot 1
the block's first token, the one at its anchor), which is the walk's own pick wherever the walk
is still accepted. Its loss is the cross-entropy of that row against the gold token's candidate,
weighted by the block position's w_k as the head's loss is. Where the gold token is not among
the top K it is inserted in place of the K-th candidate, so every labelled slot trains the
codebooks (`insert_gold`).

Metrics, per labelled slot: `candidate_recall`, the share whose gold token is among the strict
top K (none of the walk's picks can be right where it is not), and the walk's hits: gold among
the top K and the row's argmax. A greedy walk's accepted run is the run of these hits from
slot 1, because its predecessors are the gold tokens for as long as it is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang_dflash.propose.selector import CandidateSelector, unary_logits


def insert_gold(
    candidates: torch.Tensor, gold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """candidates [M, K] (best first), gold [M] -> (candidates with the gold token in place of the
    K-th where it is missing [M, K], the gold token's index [M], in the strict top K [M] bool).

    E.g., candidates [[5, 9, 2], [4, 7, 1]], gold [9, 3] -> [[5, 9, 2], [4, 7, 3]], [1, 2], [T, F].
    """
    in_top_k = (candidates == gold[:, None]).any(-1)
    inserted = candidates.clone()
    inserted[:, -1] = torch.where(in_top_k, candidates[:, -1], gold)
    return inserted, (inserted == gold[:, None]).int().argmax(-1), in_top_k


@dataclass
class SelectorTerms:
    loss_sum: torch.Tensor  # [] sum of w * CE over the labelled slots (with its graph)
    in_top_k: torch.Tensor  # [M] bool: the gold token among the strict top K
    walk_hit: torch.Tensor  # [M] bool: ... and the argmax of its teacher-forced row


@dataclass(frozen=True)
class SelectorLoss:
    """A DFlash2 draft's selector loss: its selector, top K, the loss's weight beside the head's,
    the unary transform (`output_multiplier`, `softcap`) and the stop-gradient setting."""

    selector: CandidateSelector
    top_k: int
    weight: float
    output_multiplier: float = 1.0
    softcap: float | None = None
    stop_gradient: bool = False

    @classmethod
    def of(cls, draft, weight: float, stop_gradient: bool) -> "SelectorLoss":
        config = draft.config
        return cls(
            draft.candidate_selector, config.selector_top_k, weight, config.output_multiplier,
            config.final_logit_softcapping, stop_gradient,
        )  # fmt: skip

    def __call__(
        self,
        rows: torch.Tensor,
        gold: torch.Tensor,
        predecessors: torch.Tensor,
        candidates: torch.Tensor,
        w: torch.Tensor,
        lm_head_weight: torch.Tensor,
    ) -> SelectorTerms:
        """rows [M, H]: the draft's hidden states at the labelled slots; gold [M] their labels;
        predecessors [M] the gold token of each slot's previous slot (for slot 1 the token at the
        block's anchor); candidates [M, K] the top K of the target's head on `rows`
        (`objective.head_loss`); w [M].

        With `stop_gradient` the loss reaches the selector only, not the draft's layers (the
        rows, and so the unary logits, are detached)."""
        if self.stop_gradient:
            rows = rows.detach()
        inserted, index, in_top_k = insert_gold(candidates, gold)
        # The candidates' logits, from their rows of the head only: [M, K], differentiable in `rows`.
        values = torch.einsum("mh,mkh->mk", rows, lm_head_weight[inserted].to(rows.dtype))
        unary = unary_logits(values, self.output_multiplier, self.softcap)
        scores = unary + self.selector.pair(predecessors[:, None], inserted, rows)[:, 0]  # [M, K]
        loss_sum = (w * F.cross_entropy(scores, index, reduction="none")).sum()
        with torch.no_grad():
            walk_hit = in_top_k & (scores.argmax(-1) == index)
        return SelectorTerms(loss_sum, in_top_k, walk_hit)

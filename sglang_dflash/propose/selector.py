"""DFlash2's candidate selector: the draft's proposals as a walk over a low-rank lattice.

A DFlash2 draft (`DFlash2DraftModel`, and its `DFlash2BeamDraftModel` / `MiniMaxDFlash2DraftModel`
aliases) runs the plain backbone (usually with grouped convolution), then, for each proposal slot
e = 1..W-1 of the window:

  candidates[e]  the top-K tokens of the target's LM head on the draft's hidden state h_e,
                 unary[e] = their logits x `output_multiplier`, soft-capped by
                 `final_logit_softcapping` (c * tanh(x / c)) when it is > 0;
  score[e, p, c] = unary[e, c] + < A[pred_p] * (P h_e), B[candidates[e, c]] >
                 where pred_p is candidate p of slot e-1, or the bonus token for slot 1;
                 A = `predecessor_codebook` [V, r], B = `successor_codebook` [V, r],
                 P = `hidden_projection` [r, H].

The walk picks slot 1's candidate from score[1, bonus], then each next slot's from the row of
the candidate picked before it: the argmax for greedy requests, else a draw from
softmax(score / T) at the request's temperature T (no top-k or top-p on the draft's side). q, the
draft distribution over slot e's candidates given the walk so far, goes to the verify, which
accepts d with min(1, p(d)/q(d)) and resamples rejections from (p - q)+ (`verify/q_sampling.py`); a
greedy walk's q is the point mass on its pick.

This is SGLang 0.5.23's maths (models/dflash.py: `CandidateSelector`, `candidate_topk`,
`DFlash2DraftModel`), as `tests/unit/propose/test_selector.py` checks against its own modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CandidateSelector(nn.Module):
    """The selector's weights; replicated on every tensor-parallel rank (candidate ids are global)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank), requires_grad=False)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank), requires_grad=False)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def lattice(
        self, candidate_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor, bonus: torch.Tensor
    ) -> torch.Tensor:
        """candidate_ids [bs, E, K], unary [bs, E, K] float32, hidden [bs, E, H], bonus [bs]
        -> score [bs, E, K (predecessor), K (candidate)] float32."""
        bs, _, k = candidate_ids.shape
        # Slot 1's predecessors are the bonus token, repeated K times; slot e's the candidates of e-1.
        predecessor_ids = torch.cat([bonus.reshape(bs, 1, 1).expand(bs, 1, k), candidate_ids[:, :-1]], dim=1)
        return unary[:, :, None, :] + self.pair(predecessor_ids, candidate_ids, hidden)

    def pair(
        self, predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The lattice's pair term for any leading shape: predecessor_ids [..., P], candidate_ids
        [..., K], hidden [..., H] -> [..., P, K] float32, < A[pred_p] * (P h), B[cand_c] >. The
        serving walk scores K predecessors per slot; training scores the gold one (P = 1)."""
        projected = self.hidden_projection(hidden).float()  # [..., r]
        # [..., P, r]: each predecessor's codebook row gated by the projected hidden state
        predecessors = self.predecessor_codebook[predecessor_ids].float() * projected[..., None, :]
        successors = self.successor_codebook[candidate_ids].float()  # [..., K, r]
        return predecessors @ successors.transpose(-1, -2)


def unary_logits(values: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """The candidates' target logits [.., K] -> the lattice's unary scores, float32."""
    unary = values.float()
    if multiplier != 1.0:
        unary = unary * multiplier
    if softcap is not None:
        unary = torch.tanh(unary / softcap) * softcap
    return unary


def walk(
    candidate_ids: torch.Tensor,
    scores: torch.Tensor,
    uniforms: torch.Tensor,
    temperatures: torch.Tensor,
    greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One path through the lattice per request.

    candidate_ids [bs, E, K]; scores [bs, E, K, K]; uniforms [bs, E] in [0, 1); temperatures
    [bs] (> 0); greedy [bs] bool -> tokens [bs, E] int64, q [bs, E, K] float32: row e is the
    distribution slot e's pick was drawn from (one-hot for greedy rows). A draw takes the first
    candidate whose cumulative probability exceeds the uniform (inverse CDF), as SGLang's walk.
    E.g., probabilities [.2, .5, .3], u = .6 -> cumulative [.2, .7, 1.] -> candidate 1.
    The loop runs over the E slots (a handful), each a batched step.
    """
    bs, slots, k = candidate_ids.shape
    temps = temperatures.float().reshape(bs, 1)
    rows = torch.arange(bs, device=scores.device)
    picks, qs = [], []
    row_scores = scores[:, 0, 0]  # [bs, K]: slot 1 given the bonus token
    for e in range(slots):
        if e > 0:
            row_scores = scores[rows, e, picks[-1]]  # [bs, K]: given the candidate picked before
        probs = torch.softmax(row_scores / temps, dim=-1)
        drawn = (uniforms[:, e : e + 1] >= probs.cumsum(dim=-1)).sum(dim=-1).clamp_max(k - 1)
        pick = torch.where(greedy, row_scores.argmax(dim=-1), drawn)
        q = torch.where(greedy[:, None], F.one_hot(pick, k).float(), probs)
        picks.append(pick)
        qs.append(q)
    index = torch.stack(picks, dim=1)  # [bs, E]
    return candidate_ids.gather(-1, index[..., None])[..., 0], torch.stack(qs, dim=1)

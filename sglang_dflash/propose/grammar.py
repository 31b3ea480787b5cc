"""Grammar-constrained decoding over the verify window, through SGLang's own grammar objects.

Terms are those of `verify/acceptance.py`: a request's verify window is `[bonus, d1 .. d_{B-1}]` and the
target's row t predicts the token after window[0..t]. `req.grammar` is SGLang's matcher for the
request (xgrammar, llguidance or outlines, possibly inside the reasoning-parser wrapper); when a
step starts it has accepted every committed token, the bonus included (the scheduler advances it
from each step's result; under overlap scheduling the worker first calls the scheduler's
`grammar_barrier`, which finishes the previous step's advance).

Mask rows. Row t of a request's window mask is the grammar's mask after window tokens 1..t, i.e.
the mask a non-speculative decode step applies when its input token is window[t]. The walk
accepts d_t, fills row t, and so on, then rolls the matcher back to where it started, so no
proposal leaves a trace in it: after the step the scheduler advances it by exactly the committed
tokens. The walk stops early in two cases, and leaves the rows after it unconstrained:
  * d_t is not allowed by row t-1: the target's masked row t-1 gives d_t probability zero, so
    verification never accepts d_t and no row after t-1 ever emits a token;
  * d_t terminated the grammar (it was the grammar's stop token): the scheduler keeps a step's
    tokens only up to the one that terminated the grammar, and the request finishes there.

Grammar-aware proposals (`propose=True`). The same walk also chooses the proposals: d_t is the
draft's highest-scoring token among those row t-1 allows. Every proposal is then legal, so the
window never stops at an illegal proposal, which is what makes acceptance collapse in JSON mode
without it. The draft stays a deterministic function of the history (a point mass), so exact
verification is unaffected (`verify/sampling.py`).

See docs/requests.md.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

# How many of the draft's best tokens per position are copied to the host for the proposal walk
# (fewer where the draft ranks fewer: a DFlash2 slot's K candidates, a Domino slot's pool). When
# none of them is legal the worker takes the masked argmax over the whole vocabulary.
DRAFT_TOP_K = 32


def allows(mask: np.ndarray, row: int, token: int) -> bool:
    """Does row `row` of a host vocab mask allow `token`?

    Two layouts exist among SGLang's backends: packed int32 bitmasks, bit set = allowed
    (xgrammar, llguidance), and bool masks, True = banned (outlines).
    E.g., packed row [0b100, 0], token 2 -> True; bool row [F, T], token 1 -> False.
    """
    if mask.dtype == np.bool_:
        return not mask[row, token]
    return bool((int(mask[row, token >> 5]) >> (token & 31)) & 1)


class _Undo:
    """Undoes the walk's `accept_token` calls: SGLang's `rollback(k)` where the grammar object
    has one; outlines has none, and keeps its whole matcher state in one integer, `state`."""

    def __init__(self, grammar):
        self.grammar = grammar
        self.accepted = 0
        self.saved_state = None
        if type(grammar).rollback is _base_rollback():
            if not hasattr(grammar, "state"):
                raise NotImplementedError(
                    f"{type(grammar).__name__} can neither roll back nor save its state; "
                    "DFLASH needs one of the two to mask a verify window"
                )
            self.saved_state = grammar.state

    def accept(self, token: int) -> None:
        self.grammar.accept_token(token)
        self.accepted += 1

    def undo(self) -> None:
        if self.saved_state is not None:
            self.grammar.state = self.saved_state
        elif self.accepted:
            self.grammar.rollback(self.accepted)


def _base_rollback():
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject

    return BaseGrammarObject.rollback


def walk_window(
    grammar, mask: torch.Tensor, first_row: int, width: int, choose: Callable[[int, int], int]
) -> list[int]:
    """Fill one request's window rows `first_row .. first_row + width - 1` of `mask` (host) and
    choose its window tokens 1..width-1 on the way; the grammar ends as it started.

    `choose(t, row)` returns window token t, given that mask row `row` (= first_row + t - 1) is
    filled: the draft's own proposal, or with grammar-aware proposals the best legal one. Returns
    the tokens the walk accepted, in order (shorter than width-1 when it stopped early, see above).
    E.g., width 4, grammar "ab" then stop, choose -> a, b, EOS: rows 0-2 filled, returns [a, b, EOS].
    """
    view = mask.numpy()
    undo = _Undo(grammar)
    tokens: list[int] = []
    try:
        for t in range(width):
            if grammar.is_terminated():
                break
            grammar.fill_vocab_mask(mask, first_row + t)
            if t == width - 1:
                break
            token = choose(t + 1, first_row + t)
            if not allows(view, first_row + t, token):
                break
            undo.accept(token)
            tokens.append(token)
    finally:
        undo.undo()
    return tokens


class GrammarWindow:
    """Builds one decode step's verify mask for a batch, and with `propose` its legal proposals.

    Host work, per grammar request: up to B `fill_vocab_mask` and B-1 `accept_token` calls, then
    one rollback, as in SGLang's own speculative tree walk (`spec_utils.traverse_tree`).
    """

    def __init__(self, propose: bool, vocab_size: int):
        self.propose = propose
        self.vocab_size = vocab_size
        # Grammar-aware proposals chosen, and those none of the draft's ranked candidates allowed
        # (taken from the whole vocabulary): a proposal the draft did not rank costs acceptance,
        # so the server info reports both (`describe`).
        self.choices = 0
        self.full_vocab_choices = 0

    def __call__(
        self,
        reqs: Sequence,
        proposals: torch.Tensor,
        draft_logits: Optional[torch.Tensor],
        fallback_logits: Optional[torch.Tensor] = None,
    ):
        """reqs: the batch's SGLang `Req`s; proposals [bs, W-1] the draft's argmax tokens;
        draft_logits [bs, W-1, V] (needed with `propose` when W > 1): the scores that rank each
        slot's candidates, -inf where a token is no candidate; fallback_logits [bs, W-1, V]: the
        full vocabulary's, for a slot none of whose candidates is legal (None: draft_logits are
        finite everywhere). Returns (proposals [bs, W-1], with the grammar requests' rows
        replaced by legal ones when `propose`; SGLang `GrammarMask` over the [bs * W] verify
        rows, or None when no request in the batch is constrained)."""
        from sglang.srt.constrained.base_grammar_backend import GrammarMask

        rows = [i for i, req in enumerate(reqs) if _constrained(req)]
        if not rows:
            return proposals, None
        bs, width = proposals.shape[0], proposals.shape[1] + 1
        grammar = reqs[rows[0]].grammar
        mask = grammar.allocate_vocab_mask(vocab_size=self.vocab_size, batch_size=bs * width, device="cpu")

        # One device->host copy per step (the walk is host work; SGLang's tree walk copies too).
        index = torch.tensor(rows, device=proposals.device)
        propose = self.propose and width > 1  # a window of one row (W = 1) has no proposal
        if propose:
            top = draft_logits[index].topk(min(DRAFT_TOP_K, draft_logits.shape[-1]), dim=-1)
            # [n, B-1, K]; -1 marks a place past the slot's candidates (a -inf score)
            candidates = top.indices.masked_fill(top.values == float("-inf"), -1).cpu().tolist()
        else:
            candidates = proposals[index].cpu().tolist()  # [n, B-1]
        full = draft_logits if fallback_logits is None else fallback_logits
        chosen = []
        for n, i in enumerate(rows):
            choose = self._chooser(candidates[n], full, i, mask, grammar, propose)
            chosen.append(walk_window(reqs[i].grammar, mask, i * width, width, choose))

        if propose:
            # The legal proposals; past an early stop (termination) the draft's own stay.
            fixed = proposals[index].cpu()
            for n, tokens in enumerate(chosen):
                fixed[n, : len(tokens)] = torch.tensor(tokens, dtype=fixed.dtype)
            proposals = proposals.clone()
            proposals[index] = fixed.to(proposals.device, non_blocking=True)
        return proposals, GrammarMask(grammar, _to_device(grammar, mask, proposals.device))

    def _chooser(self, candidates, full_logits, i, mask, grammar, propose) -> Callable[[int, int], int]:
        if not propose:
            return lambda t, row: candidates[t - 1]
        view = mask.numpy()

        def best_legal(t: int, row: int) -> int:
            self.choices += 1
            for token in candidates[t - 1]:
                if token >= 0 and allows(view, row, token):
                    return token
            # None of the candidates is legal: the masked argmax over the whole vocabulary.
            self.full_vocab_choices += 1
            logits = full_logits[i, t - 1 : t].float().clone()  # [1, V]
            grammar.apply_vocab_mask(
                logits=logits, vocab_mask=_to_device(grammar, mask[row : row + 1], logits.device)
            )
            return int(torch.argmax(logits, dim=-1))  # host sync, rare

        return best_legal


def describe_choices(window: "GrammarWindow") -> str:
    """For the server info: how many grammar-aware proposals came from beyond the draft's ranked
    candidates."""
    return (
        f"{window.full_vocab_choices} of {window.choices} grammar-aware proposals came from beyond the "
        f"draft's top {DRAFT_TOP_K} candidates"
    )


def _to_device(grammar, mask: torch.Tensor, device) -> torch.Tensor:
    """The backend's own host-to-device move (xgrammar's pinned non-blocking copy); outlines'
    leaves a mask where it was allocated, which here is the host."""
    return grammar.move_vocab_mask(mask, device).to(device, non_blocking=True)


def _constrained(req) -> bool:
    grammar = req.grammar
    return grammar is not None and not grammar.finished and not grammar.is_terminated()

"""Proposals: the draft block's final hidden states -> the tokens the target verifies.

One `Proposer` per checkpoint family, chosen once at start-up (`proposer_for`). Each returns
`Proposals`: the proposed ids, the draft's logits when a grammar ranks the candidates
(`grammar.py` walks them in order), and the draft distribution q of each proposal when a sampled
walk drew it (the verify then accepts with min(1, p/q): `verify/q_sampling.py`).

* `ArgmaxProposer` (plain DFlash): the target's LM head argmax; q is a point mass.
* `SelectorProposer` (DFlash2): the top-K candidates of the target's head, walked over the
  selector's lattice (`selector.py`), greedily for greedy requests and requests under a grammar,
  by sampling at the request's temperature for the others.
* `LiLiCorrProposer` (LiLiCorr): the top-K candidates of the target's head with their
  log-probabilities, rescored jointly by the LiLiCorr head (`lilicorr.py`) and walked like DFlash2's.
* `DominoProposer` (Domino's projector): the target's head corrected slot by slot by a GRU over
  the tokens proposed before (`domino.py`); a greedy rollout for every request, as in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from sglang_dflash.propose import domino
from sglang_dflash.propose.lilicorr import LastTokenStore
from sglang_dflash.propose.selector import unary_logits, walk
from sglang_dflash.verify.q_sampling import DraftQ
from sglang_dflash.verify.sampling import SamplingRows, seeded_uniforms

WALK_COLUMN = 0xFFFFFFFE  # the walk's hash column for seeded requests (q_sampling.ACCEPT_COLUMN - 1)


@dataclass
class Proposals:
    tokens: torch.Tensor  # [bs, W-1] int64: d1 .. d_{W-1}
    logits: Optional[torch.Tensor] = None  # [bs, W-1, V]: when a grammar ranks the candidates
    q: Optional[DraftQ] = None  # when some proposals were sampled; None: all point masses
    # [bs, W-1, V]: the full vocabulary's logits, for a grammar slot where none of the ranked
    # candidates (the finite `logits`) is legal. None: `logits` is finite over the whole vocabulary.
    fallback: Optional[torch.Tensor] = None


@dataclass
class ProposalInputs:
    """What a step knows besides the hidden states."""

    bonus: torch.Tensor  # [bs] the bonus tokens: the block's first ids
    positions: torch.Tensor  # [bs, W] the window's absolute positions
    sampling_info: Any = None  # SGLang's SamplingBatchInfo; None: every request greedy
    grammar_rows: Optional[list[bool]] = None  # per request; None: no grammar in the batch
    # [bs, Bd, H]: the whole trained block's final hidden states when the window is narrower
    # (W < Bd); Domino's candidate pool spans the block, as SGLang's. None: the window is the block.
    block_hidden: Optional[torch.Tensor] = None
    # SGLang's request-to-slot table and the batch's rows in it: where LiLiCorr finds each
    # request's last committed token (`lilicorr.LastTokenStore`). None: unknown (the warm-up step).
    req_to_token: Optional[torch.Tensor] = None
    req_pool_indices: Optional[torch.Tensor] = None

    @property
    def with_logits(self) -> bool:
        return self.grammar_rows is not None


class Proposer(Protocol):
    name: str

    def __call__(self, hidden: torch.Tensor, inputs: ProposalInputs) -> Proposals:
        """hidden [bs, W, H]: the draft's final hidden states at window positions 0..W-1 (the
        proposals d_1 .. d_{W-1} are read from rows 1..W-1, or from 0..W-2 by a shifted Domino)."""
        ...


class ArgmaxProposer:
    """The target's LM head over the draft's hidden states, and its argmax (vocab-parallel under
    tensor parallelism). With a grammar, the full logits too, for the grammar window."""

    name = "argmax"

    def __init__(self, head):
        self.head = head  # TargetHead

    def __call__(self, hidden: torch.Tensor, inputs: ProposalInputs) -> Proposals:
        hidden = hidden[:, 1:]  # [bs, W-1, H]
        if not inputs.with_logits:
            return Proposals(self.head.argmax(hidden))  # [bs, W-1]
        logits = self.head.logits(hidden)  # [bs, W-1, V]
        return Proposals(torch.argmax(logits, dim=-1), logits)


class SelectorProposer:
    """DFlash2: top-K candidates from the target's head, walked over the selector's lattice."""

    def __init__(self, selector, head, config):
        self.selector = selector  # selector.CandidateSelector
        self.head = head
        self.top_k = config.selector_top_k
        self.multiplier = config.output_multiplier
        self.softcap = config.final_logit_softcapping
        self.name = f"candidate selector (top {self.top_k}; greedy and sampled walks)"

    def __call__(self, hidden: torch.Tensor, inputs: ProposalInputs) -> Proposals:
        hidden = hidden[:, 1:]  # [bs, W-1, H]
        values, candidate_ids = self.head.topk(hidden, self.top_k)  # [bs, W-1, K] x2
        unary = unary_logits(values, self.multiplier, self.softcap)
        scores = self.selector.lattice(candidate_ids, unary, hidden, inputs.bonus)  # [bs, W-1, K, K]
        return _walked(candidate_ids, scores, hidden, inputs, self.head)


def _walked(
    candidate_ids, scores, hidden, inputs: ProposalInputs, head, sampled_walks: bool = True
) -> Proposals:
    """The proposals of a walk over `scores` [bs, E, K, K] among `candidate_ids` [bs, E, K] (the
    draft's `hidden` [bs, E, H] for the grammar's fallback logits)."""
    bs, slots = candidate_ids.shape[:2]
    temperatures, greedy, uniforms = _walk_params(inputs, bs, slots, hidden.device, sampled_walks)
    sampled = uniforms is not None
    if not sampled:  # every request walks the argmax
        uniforms = torch.zeros(bs, slots, device=hidden.device)
    tokens, q = walk(candidate_ids, scores, uniforms, temperatures, greedy)
    logits = fallback = None
    if inputs.with_logits:  # the grammar ranks slot e's candidates by the walk's row there,
        logits = _candidate_logits(candidate_ids, scores, tokens, head.vocab_size)
        fallback = head.logits(hidden)  # [bs, W-1, V]; and the head's, past them
    return Proposals(tokens, logits, DraftQ(candidate_ids, q) if sampled else None, fallback)


def _walk_params(inputs: ProposalInputs, bs: int, slots: int, device, sampled_walks: bool = True):
    """Per request: the walk's temperature [bs], greedy [bs] bool, uniforms [bs, W-1] (None
    when every request walks greedily). Requests under a grammar walk greedily: the grammar
    window may re-pick their proposals, which a point mass allows. `sampled_walks=False`: every
    request walks greedily."""
    info = inputs.sampling_info
    if info is None or info.is_all_greedy or not sampled_walks:
        return torch.ones(bs, device=device), torch.ones(bs, dtype=torch.bool, device=device), None
    rows = SamplingRows.from_sampling_info(info)
    greedy = rows.is_greedy
    if inputs.grammar_rows is not None:
        constrained = torch.tensor(inputs.grammar_rows, dtype=torch.bool).to(device, non_blocking=True)
        greedy = greedy | constrained
    # SGLang stores temperature 0 as 1 with top_k 1; sampled rows are > 0 (clamped as SGLang).
    temperatures = rows.temperatures.float().clamp_min(1e-5)
    if rows.seeds is None:
        uniforms = torch.rand(bs, slots, device=device)
    else:  # row t's proposal comes from the input at window position t
        uniforms = seeded_uniforms(rows.seeds, inputs.positions[:, :slots], WALK_COLUMN)
    return temperatures, greedy, uniforms


def _candidate_logits(candidate_ids, scores, tokens, vocab_size: int) -> torch.Tensor:
    """[bs, E, V] with slot e's candidates scored by the row the walk took there, -inf elsewhere:
    what the grammar window ranks candidates by."""
    bs, slots, k = candidate_ids.shape
    previous = torch.cat([torch.zeros_like(tokens[:, :1]), tokens[:, :-1]], dim=1)  # unused at e=0
    # The walk's predecessor index at each slot: where the previous pick sits among e-1's candidates.
    index = (candidate_ids[:, :-1] == previous[:, 1:, None]).float().argmax(dim=-1)  # [bs, E-1]
    bonus_row = torch.zeros(bs, 1, dtype=index.dtype, device=index.device)
    index = torch.cat([bonus_row, index], dim=1)  # [bs, E]; slot 0: the row given the bonus token
    rows = scores.gather(2, index[:, :, None, None].expand(bs, slots, 1, k))[:, :, 0]  # [bs, E, K]
    logits = torch.full((bs, slots, vocab_size), float("-inf"), device=scores.device)
    return logits.scatter_(2, candidate_ids, rows)


class LiLiCorrProposer:
    """LiLiCorr: the target head's top-K candidates per slot with their log-probabilities over the
    whole vocabulary, rescored by the head's lattice given the context feature of each request's
    last committed token (`LastTokenStore`), and walked as DFlash2's: greedily for greedy requests,
    sampled with q for the others (`sampled_walks`; SGLang's built-in walks greedily unless
    SGLANG_ENABLE_LILICORR_SAMPLING=1, which our exact verify does not need to ask for)."""

    def __init__(self, lilicorr, head, sampled_walks: bool = True):
        self.lilicorr = lilicorr  # lilicorr.LiLiCorrHead
        self.head = head
        self.sampled_walks = sampled_walks
        self.last_tokens: Optional[LastTokenStore] = None  # the runtime's, once SGLang's pools exist
        walks = (
            "greedy and sampled walks" if sampled_walks else "greedy walks: SGLANG_ENABLE_LILICORR_SAMPLING=0"
        )
        self.name = f"LiLiCorr lattice (top {lilicorr.top_k}; {walks})"

    def __call__(self, hidden: torch.Tensor, inputs: ProposalInputs) -> Proposals:
        hidden = hidden[:, 1:]  # [bs, W-1, H]
        bs, slots, k = hidden.shape[0], hidden.shape[1], self.lilicorr.top_k
        log_probs, candidate_ids = self.head.topk_log_probs(hidden, k)  # [bs, W-1, K] x2
        # The target's embedding of every candidate (whole on every rank under TP).
        embeddings = self.head.embedding(candidate_ids.reshape(-1)).view(bs, slots, k, -1)
        if self.last_tokens is not None and inputs.req_to_token is not None:
            rows = inputs.req_pool_indices.to(torch.int64)  # the token before the block: seq_len - 1
            last_slots = inputs.req_to_token[rows, inputs.positions[:, 0] - 1]
            last_feature, known = self.last_tokens.read(rows, last_slots)
        else:  # unknown (the warm-up step): scored as SGLang scores a request without one
            last_feature = hidden.new_zeros(bs, hidden.shape[-1])
            known = torch.zeros(bs, dtype=torch.bool, device=hidden.device)
        scores = self.lilicorr.lattice(embeddings, log_probs, hidden, last_feature, known)  # [bs, W-1, K, K]
        return _walked(candidate_ids, scores, hidden, inputs, self.head, self.sampled_walks)


class DominoProposer:
    """Domino: the target's head over the proposal slots' hidden states, corrected slot by slot
    by the projector's GRU over the tokens proposed before (`domino.rollout`). Every request
    rolls out greedily (SGLang's rule): the proposals are point masses."""

    def __init__(self, draft_model, head, pool_size: int):
        if pool_size < 0:
            raise ValueError(f"--speculative-domino-candidate-pool-size must be >= 0, got {pool_size}")
        self.gru, self.embed_proj = draft_model.prefix_gru, draft_model.embed_proj
        self.head = head
        self.shift = draft_model.config.shift_label
        self.pool_size = pool_size
        self.pooled = 0 < pool_size < head.vocab_size
        pool = f"a candidate pool of {pool_size}" if self.pooled else "the full vocabulary"
        rows = "rows 0..W-2 (shift_label)" if self.shift else "rows 1..W-1"
        self.name = f"Domino rollout (greedy over {pool}; draft {rows})"

    def __call__(self, hidden: torch.Tensor, inputs: ProposalInputs) -> Proposals:
        slots = hidden.shape[1] - 1  # W-1 proposals
        block = hidden
        if self.pooled and inputs.block_hidden is not None:
            block = inputs.block_hidden  # [bs, Bd, H]: the pool spans the block, not the window
        z = block[:, :-1] if self.shift else block[:, 1:]  # [bs, Bd-1, H]
        base = self.head.logits(z)  # [bs, Bd-1, V], the full vocabulary on every rank
        tokens, scores = domino.rollout(
            base[:, :slots],
            z[:, :slots],
            inputs.bonus,
            self.head.embed,
            self.gru,
            self.embed_proj,
            self.pool_size,
            with_scores=inputs.with_logits,
            pool_logits=base,
        )
        # Under a grammar: slots ranked by their pool's corrected logits, then by the head's.
        fallback = base[:, :slots] if self.pooled and inputs.with_logits else None
        return Proposals(tokens, scores, fallback=fallback)


def proposer_for(
    draft_model, head, domino_pool_size: int = domino.DEFAULT_POOL_SIZE, lilicorr_sampled_walks: bool = True
) -> Proposer:
    """The proposer of the checkpoint's family: the selector's walk for DFlash2, LiLiCorr's
    lattice, the rollout for Domino, else the argmax."""
    selector = getattr(draft_model, "candidate_selector", None)
    if selector is not None:
        return SelectorProposer(selector, head, draft_model.config)
    lilicorr = getattr(draft_model, "lilicorr", None)
    if lilicorr is not None:
        return LiLiCorrProposer(lilicorr, head, lilicorr_sampled_walks)
    if getattr(draft_model, "prefix_gru", None) is not None:
        return DominoProposer(draft_model, head, domino_pool_size)
    return ArgmaxProposer(head)

"""`DecodeStep`: what one decode step's stages hand each other, and the result SGLang gets.

The worker runs a decode step as stages over one record (`DFlashWorker._forward_decode`):
propose (the width and the draft's proposals), constrain (the window, under a grammar), verify
(the target's forward over the window), accept and commit (the committed tokens and lengths),
inject (their draft K/V). Each stage sets its own fields of the record. Here too: the pure index
work on them (which verify slots to inject, which row is each request's new last token), the
draft's proposal inputs read off SGLang's batch, and what the scheduler gets back from a decode
step and from an idle one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import IO, Any, Optional

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

from sglang_dflash.propose.proposers import ProposalInputs
from sglang_dflash.verify.q_sampling import DraftQ


def make_draft_input(bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor) -> DFlashDraftInputV2:
    """SGLang's cross-step DFLASH state: the bonus token and committed length per request."""
    bs, device = new_seq_lens.numel(), bonus_tokens.device
    return DFlashDraftInputV2(
        # Eagle-shaped fields SGLang's overlap relay reads; DFLASH leaves them empty.
        topk_p=torch.empty((bs, 0), device=device, dtype=torch.float32),
        topk_index=torch.empty((bs, 0), device=device, dtype=torch.int64),
        hidden_states=torch.empty((bs, 0), device=device, dtype=torch.float16),
        bonus_tokens=bonus_tokens.to(torch.int64),
        new_seq_lens=new_seq_lens.to(torch.int64),
    )


@dataclass
class DecodeStep:
    """One decode step of bs requests at verify width W (1 <= W <= B)."""

    seq_lens: torch.Tensor  # [bs] committed lengths at the step's start (the batch's)
    host_lens: torch.Tensor  # [bs] host committed lengths the draft plans with (exact or upper bounds)
    width: int  # W, this step's verify width
    decoded: bool  # W = 1 through the target's decode forward (else a verify over the window)
    # propose; constrain
    # [bs, W] int64: the window [bonus, d1 .. d_{W-1}] (after propose, the bonus column [bs, 1])
    candidates: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None  # [bs, W] int64: the window's absolute positions
    proposals: Optional[torch.Tensor] = None  # [bs, W-1] int64: d1 .. d_{W-1}, as constrained
    draft_q: Optional[DraftQ] = None  # the draft's q of sampled proposals; None: point masses
    grammar_mask: Any = None  # SGLang's grammar mask over the [bs*W] rows; None: no grammar
    # verify
    verify_slots: Optional[torch.Tensor] = None  # [bs, W] int64: the window's KV slots
    verified: Optional[GenerationBatchResult] = None  # the target's forward over the window
    # accept and commit
    logits: Optional[torch.Tensor] = None  # [bs*W, V]: the verify logits, adjusted as decode steps
    out_tokens: Optional[torch.Tensor] = None  # [bs, W] int64: accepted proposals, then the bonus
    new_bonus: Optional[torch.Tensor] = None  # [bs] int64: each request's next bonus token
    commit_lens: Optional[torch.Tensor] = None  # [bs] int32: accept_len + 1
    new_seq_lens: Optional[torch.Tensor] = None  # [bs]: seq_lens + commit_lens

    @property
    def bs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def logits_output(self):
        """The target's `LogitsProcessorOutput` of the verify forward."""
        return self.verified.logits_output

    def injection_slots(self, device) -> torch.Tensor:
        """[bs*W] int64: the committed tokens' (bonus, d1..d_accept) verify slots; the rest go to
        the sink slot 0. E.g., W = 3, commit_lens [1, 3], verify_slots [[5, 6, 7], [9, 10, 11]]
        -> [5, 0, 0, 9, 10, 11]."""
        committed = torch.arange(self.width, device=device)[None, :] < self.commit_lens[:, None]
        return torch.where(committed, self.verify_slots, 0).view(-1)

    def last_rows(self, device) -> torch.Tensor:
        """[bs]: row b*W + commit_len - 1 of the window's [bs*W] rows, each request's new last
        token. E.g., W = 3, commit_lens [1, 3] -> [0, 5]."""
        return torch.arange(self.bs, device=device) * self.width + self.commit_lens - 1

    def compute_logprobs(self, batch) -> None:
        """SGLang's own: one entry per window row, from the adjusted logits; its result
        processor keeps the committed rows (accepted proposals and the bonus)."""
        self.logits_output.next_token_logits = self.logits
        compute_spec_logprobs(batch, self.logits_output, self.out_tokens.reshape(-1), chain_stride=self.width)

    def trace(self, reqs, file: IO[str]) -> None:
        """Test aid: one JSON line per request, its verified proposals with its committed length
        on the device and the host length the draft's attention plans with (host sync)."""
        rows = zip(reqs, self.seq_lens.tolist(), self.host_lens.tolist(), self.proposals.tolist())
        for req, prefix, host_prefix, row in rows:
            record = {"rid": req.rid, "prefix_len": prefix, "host_prefix_len": host_prefix, "proposals": row}
            file.write(json.dumps(record) + "\n")
        file.flush()

    def result(self) -> GenerationBatchResult:
        """What the scheduler gets back from the step."""
        return GenerationBatchResult(
            logits_output=self.logits_output,
            next_token_ids=self.out_tokens.reshape(-1),
            accept_lens=self.commit_lens,
            can_run_cuda_graph=self.verified.can_run_cuda_graph,
            next_draft_input=make_draft_input(self.new_bonus, self.new_seq_lens),
            speculative_num_draft_tokens=self.width,
            new_seq_lens=self.new_seq_lens,
            # Captured per verify slot; a rejected slot is rewritten by the next verify of its
            # position, so each committed slot ends up with its committed token's values.
            routed_experts_output=self.verified.routed_experts_output,
            indexer_topk_output=self.verified.indexer_topk_output,
        )


def proposal_inputs(
    batch, block_ids: torch.Tensor, positions: torch.Tensor, block_hidden: torch.Tensor, req_to_token
) -> ProposalInputs:
    """What the proposer reads besides the window's hidden states, for the draft's `block_ids`
    and `positions` [bs, W] and its hidden states over the whole block `block_hidden` [bs, Bd, H];
    `req_to_token`: SGLang's request-to-slot table."""
    # With a grammar, its window ranks the draft's candidates by their logits.
    grammar_rows = [req.grammar is not None for req in batch.reqs] if batch.has_grammar else None
    inputs = ProposalInputs(block_ids[:, 0], positions, batch.sampling_info, grammar_rows)
    inputs.req_to_token = req_to_token
    inputs.req_pool_indices = batch.req_pool_indices
    if positions.shape[1] < block_hidden.shape[1]:
        inputs.block_hidden = block_hidden
    return inputs


def idle_result(device, num_draft_tokens: int, on_publish=None) -> GenerationBatchResult:
    """An idle step's result (forward mode IDLE: no request on this rank this step): empty
    tokens and lengths, published."""
    empty = torch.empty((0,), dtype=torch.int64, device=device)
    if on_publish is not None:
        on_publish(empty)
    return GenerationBatchResult(
        next_token_ids=empty,
        accept_lens=torch.empty((0,), dtype=torch.int32, device=device),
        next_draft_input=make_draft_input(empty, empty),
        speculative_num_draft_tokens=num_draft_tokens,
        new_seq_lens=empty,
    )

"""Penalties and logit_bias inside a verify block, exactly as successive normal decode steps
apply them, and the per-request output-token state they need.

SGLang's normal decode adjusts logits, in this order, before sampling: additive penalties
(frequency, presence, the min_new_tokens stop-token ban), then the repetition scaling
(`sampling/sampling_batch_info.py:426-437`), then `logit_bias` (`:439-449`). Within one verify
block the penalties at position k depend on the tokens before k, so row k is adjusted as the
decode step whose input is `candidates[k]`. SGLang's own penalizer orchestrator never sees the
tokens DFLASH commits, so the worker keeps the output-token counts itself (`PenaltyState`).

See docs/requests.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


def needs_penalties(sampling_params: Any) -> bool:
    """Does this request use a penalty whose value depends on earlier output tokens?"""
    p = sampling_params
    return (
        p.frequency_penalty != 0
        or p.presence_penalty != 0
        or p.repetition_penalty != 1
        or p.min_new_tokens > 0
    )


@dataclass(frozen=True)
class PenaltyParams:
    """Per-request logit adjustments of normal decode that depend on earlier output tokens."""

    # [bs] float32, subtracted once per earlier occurrence of a token
    frequency_penalties: torch.Tensor
    # [bs] float32, subtracted once if a token occurred
    presence_penalties: torch.Tensor
    # [bs] float32, logit / r if positive, logit * r if negative, for tokens that occurred
    repetition_penalties: torch.Tensor
    # [bs] int64: stop tokens are banned while fewer output tokens exist
    min_new_tokens: torch.Tensor
    # [bs, S] int64 stop-token ids for min_new_tokens, padded with -1
    stop_token_ids: torch.Tensor
    # [bs, V] float32 or None: `SamplingBatchInfo.logit_bias`
    logit_bias: Optional[torch.Tensor] = None

    @classmethod
    def from_reqs(
        cls, reqs: Sequence[Any], device: torch.device | str, logit_bias: Optional[torch.Tensor] = None
    ) -> "PenaltyParams":
        """From SGLang `Req`s (host fields only), as SGLang's penalizers build them.

        The stop set is min_new_tokens.py:32-55: sampling_params.stop_token_ids | req.eos_token_ids
        | tokenizer.additional_stop_token_ids | {tokenizer.eos_token_id}.
        """
        stop_sets = []
        for req in reqs:
            tokenizer = getattr(req, "tokenizer", None)
            ids = set(req.sampling_params.stop_token_ids or ()) | set(req.eos_token_ids or ())
            ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
            ids.add(getattr(tokenizer, "eos_token_id", None))
            stop_sets.append(sorted(i for i in ids if i is not None))
        width = max((len(s) for s in stop_sets), default=0)
        stops = [s + [-1] * (width - len(s)) for s in stop_sets]

        def host(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        params = [r.sampling_params for r in reqs]
        return cls(
            frequency_penalties=host([p.frequency_penalty for p in params], torch.float32),
            presence_penalties=host([p.presence_penalty for p in params], torch.float32),
            repetition_penalties=host([p.repetition_penalty for p in params], torch.float32),
            min_new_tokens=host([p.min_new_tokens for p in params], torch.int64),
            stop_token_ids=host(stops, torch.int64).reshape(len(reqs), width),
            logit_bias=logit_bias,
        )


def _stop_mask(stop_token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[bs, S] padded ids -> [bs, V] bool. E.g., [[2, -1]], V 4 -> [[F, F, T, F]]."""
    valid = (stop_token_ids >= 0) & (stop_token_ids < vocab)
    mask = torch.zeros(stop_token_ids.shape[0], vocab + 1, dtype=torch.bool, device=stop_token_ids.device)
    mask.scatter_(1, torch.where(valid, stop_token_ids, vocab), True)
    return mask[:, :vocab]


def _penalize(
    logits: torch.Tensor,
    counts: torch.Tensor,
    banned_stop: torch.Tensor,
    params: PenaltyParams,
    per_request: tuple[int, ...],
) -> torch.Tensor:
    """One formula for the dense pass and the candidate-column fix-up (so both round alike).

    logits, counts, banned_stop broadcast together; `per_request` reshapes [bs] params to match.
    SGLang: logits += (-freq * count - presence * seen + min_new ban); then repetition scaling.
    """
    freq = params.frequency_penalties.reshape(per_request)
    presence = params.presence_penalties.reshape(per_request)
    repetition = params.repetition_penalties.reshape(per_request)
    seen = counts > 0
    additive = -(freq * counts) - torch.where(seen, presence, 0.0)
    out = (logits + additive).masked_fill(banned_stop, -torch.inf)
    scale = torch.where(seen, repetition, 1.0)
    return torch.where(out < 0, out * scale, out / scale)  # apply_scaling_penalties


def penalize_block_logits(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    output_counts: torch.Tensor,
    num_output_tokens: torch.Tensor,
    params: PenaltyParams,
) -> torch.Tensor:
    """Adjust verify logits exactly as B successive normal decode steps would.

    logits [bs, B, V] raw target logits of the window; candidates [bs, B];
    output_counts [bs, V]: occurrences of each token among the request's output tokens *before*
    `candidates[:, 0]` (the committed output tokens); num_output_tokens [bs]: their number.
    Row k is adjusted as the decode step whose input is candidates[k]: it counts the earlier
    outputs plus candidates[0..k]. Returns a new [bs, B, V] float32 tensor. No host sync.
    Frequency uses count * penalty, where SGLang adds the penalty once per occurrence: equal up
    to float32 rounding (a few ulp of the penalty).
    """
    bs, width, vocab = logits.shape
    logits = logits.float()
    counts0 = output_counts.float()
    stop = _stop_mask(params.stop_token_ids, vocab)  # [bs, V]
    # [bs, B]: row k has seen num_output_tokens + k + 1 outputs (the bonus included).
    seen_outputs = num_output_tokens.reshape(bs, 1) + torch.arange(1, width + 1, device=logits.device)
    banned_rows = seen_outputs < params.min_new_tokens.reshape(bs, 1)

    # Dense pass with the counts before the block; only candidate columns can differ from it.
    out = _penalize(
        logits, counts0[:, None, :], banned_rows[:, :, None] & stop[:, None, :], params, (bs, 1, 1)
    )

    # Fix-up of the candidate columns: column j of row k counts candidates[0..k] equal to it.
    # E.g., candidates [4, 7, 4]: column 4 is counted +1 in rows 0-1 and +2 in row 2.
    cols = candidates.to(torch.int64)[:, None, :].expand(bs, width, width)  # [bs, k, j]
    same = candidates[:, :, None] == candidates[:, None, :]  # [bs, i, j]
    counts = counts0.gather(1, candidates.to(torch.int64))[:, None, :] + same.cumsum(dim=1)
    banned = banned_rows[:, :, None] & stop.gather(1, candidates.to(torch.int64))[:, None, :]
    fixed = _penalize(logits.gather(2, cols), counts.float(), banned, params, (bs, 1, 1))
    out.scatter_(2, cols, fixed)

    if params.logit_bias is not None:
        out += params.logit_bias[:, None, :].float()
    return out


def commit_output_counts(
    output_counts: torch.Tensor,
    num_output_tokens: torch.Tensor,
    candidates: torch.Tensor,
    commit_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the committed tokens `candidates[:, :commit_len]` into the penalty state.

    output_counts [bs, V], num_output_tokens [bs], candidates [bs, B], commit_lens [bs]
    -> new (output_counts, num_output_tokens). E.g., candidates [5, 8, 2], commit 2 -> +1 at 5, 8.
    """
    width = candidates.shape[1]
    committed = torch.arange(width, device=candidates.device)[None, :] < commit_lens.reshape(-1, 1)
    counts = output_counts.scatter_add(1, candidates.to(torch.int64), committed.to(output_counts.dtype))
    return counts, num_output_tokens + commit_lens.to(num_output_tokens.dtype)


class PenaltyState:
    """Committed output-token counts per request slot (`req_pool_idx`); owned by the worker.

    Invariant, for every running request that uses penalties: `counts[slot]` and
    `num_outputs[slot]` cover its committed output tokens before its current bonus token. Rows
    of other requests hold anything: with zero penalties their counts have no effect.
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str):
        self.counts = torch.zeros((num_slots, vocab_size), dtype=torch.int32, device=device)
        self.num_outputs = torch.zeros((num_slots,), dtype=torch.int64, device=device)

    def reset(self, slots: torch.Tensor, outputs: Sequence[Sequence[int]]) -> None:
        """Requests (re)start at a prefill: their state becomes `outputs` (their output tokens
        so far: none for a new request, all of them for a retracted one). slots [n]."""
        counts = torch.zeros((len(outputs), self.counts.shape[1]), dtype=self.counts.dtype)
        for row, ids in enumerate(outputs):  # host lists, once per request per prefill
            counts[row] = torch.bincount(
                torch.tensor(list(ids), dtype=torch.int64), minlength=counts.shape[1]
            )
        self.counts[slots] = counts.to(self.counts.device, non_blocking=True)
        self.num_outputs[slots] = torch.tensor([len(ids) for ids in outputs], device=self.num_outputs.device)

    def adjust(
        self, logits: torch.Tensor, candidates: torch.Tensor, slots: torch.Tensor, params: PenaltyParams
    ) -> torch.Tensor:
        """logits [bs, B, V] of the verify window -> adjusted float32 logits."""
        return penalize_block_logits(logits, candidates, self.counts[slots], self.num_outputs[slots], params)

    def commit(self, slots: torch.Tensor, candidates: torch.Tensor, commit_lens: torch.Tensor) -> None:
        counts, num = commit_output_counts(
            self.counts[slots], self.num_outputs[slots], candidates, commit_lens
        )
        self.counts[slots] = counts
        self.num_outputs[slots] = num

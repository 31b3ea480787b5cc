"""`StepAids`: the benchmark, test and debugging aids a decode step calls, each resolved once at
start-up from the knobs into a function; an aid that is off is a call that does nothing, so the
step tests no switch."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Callable

from sglang_dflash.draft.tensor_parallel import check_ranks_agree
from sglang_dflash.verify.acceptance import acceptance_for


def skipped(*args, **kwargs) -> None:
    """An aid that is off: the step's call to it does nothing."""


@dataclass(frozen=True)
class StepAids:
    # (candidates [bs, W], logits [bs*W, V], verified (accept_len, out_tokens, new_bonus)) -> the
    # run the step commits: as verified, or drawn under SGLANG_SIMULATE_ACC_LEN.
    accepted: Callable
    # (candidates=, commit_lens=, tokens=) -> None; SGLANG_DFLASH_CHECK_RANKS: gathers, host sync.
    check_ranks: Callable
    # (step, reqs) -> None; SGLANG_DFLASH_TRACE_PROPOSALS: a JSON line per request, host sync.
    trace: Callable
    # (positions [T], features [T, K*H]) -> None; SGLANG_DFLASH_TRACE_FEATURES: a JSON line per
    # injection, host sync.
    trace_features: Callable = skipped

    @classmethod
    def from_knobs(cls, knobs, tp, num_draft_tokens: int) -> "StepAids":
        check = skipped
        if tp.size > 1 and knobs.check_ranks:
            check = functools.partial(check_ranks_agree, tp)
        trace = skipped
        if knobs.trace_proposals:
            file = open(knobs.trace_proposals, "a", buffering=1)  # line-buffered: each line lands
            trace = lambda step, reqs: step.trace(reqs, file)  # noqa: E731
        features = skipped
        if knobs.trace_features:
            features = functools.partial(_write_features, open(knobs.trace_features, "a", buffering=1))
        return cls(acceptance_for(knobs.simulated_acceptance, num_draft_tokens), check, trace, features)


def _write_features(file, positions, features) -> None:
    """Test aid: the features the draft's fc reads for T tokens, [T, K*H], with their positions."""
    record = {"positions": positions.tolist(), "features": features.float().tolist()}
    file.write(json.dumps(record) + "\n")

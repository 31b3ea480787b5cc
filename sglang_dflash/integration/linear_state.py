"""The target's linear-attention (mamba) state across a verify, for hybrid targets (Qwen3-Next,
Qwen3.5): the recurrent and conv state of every linear-attention layer must end each step as
the state after exactly the committed tokens.

A TARGET_VERIFY forward leaves each request's state as it was and records the state after each
window position in the pool's intermediate buffers; `commit` then copies the one after the
last committed position (`commit_lens - 1`) into the request's state slot, with SGLang's own
`update_mamba_state_after_mtp_verify`. It reads the slots from the verify forward's metadata,
so it must run before the target's next forward; the draft's own forwards do not touch it.

See docs/serving.md ("Hybrid linear-attention targets").
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

SKIP_ENV = "SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT"

logger = logging.getLogger(__name__)


def steps_to_track(pre: torch.Tensor, commit_lens: torch.Tensor, interval: int) -> torch.Tensor:
    """For the radix cache's periodic state snapshots (`extra_buffer` strategies): the window
    step whose state lands on a multiple of `interval`, or -1 where the commit crosses none.

    E.g. interval 4, pre 6, commit 3 (lengths 7, 8, 9): the state at length 8 is step 1.
    pre 8, commit 3: no multiple of 4 in (8, 11], so -1.
    """
    post = pre + commit_lens.to(pre.dtype)
    point = post // interval * interval
    step = (point - pre - 1).clamp(min=0)
    crosses = (pre // interval != post // interval) & (step < commit_lens.to(step.dtype))
    return torch.where(crosses, step, torch.full_like(step, -1)).to(torch.int64)


class LinearStateCommit:
    def __init__(self, runner):
        self.runner = runner  # its attention backend is built after the speculative worker

    @classmethod
    def for_target(cls, runner, skip: bool = False) -> Optional["LinearStateCommit"]:
        """None for targets without linear-attention layers. `skip`: the test aid
        SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT, chosen here once (`SkippedStateCommit`)."""
        from sglang.srt.configs.hybrid_arch import mambaish_config

        if mambaish_config(runner.model_config) is None:
            return None
        if skip:
            logger.warning("DFLASH linear-attention state commit is OFF (%s=1): outputs are wrong", SKIP_ENV)
            return SkippedStateCommit(runner)
        return cls(runner)

    def __call__(self, batch, seq_lens: torch.Tensor, commit_lens: torch.Tensor) -> None:
        """seq_lens [bs]: the committed lengths before this verify; commit_lens [bs] >= 1."""
        from sglang.srt.runtime_context import mamba_track_grid

        steps = None
        if batch.mamba_track_indices is not None:
            steps = steps_to_track(seq_lens, commit_lens, mamba_track_grid(batch.tree_cache.page_size))
        # HybridLinearAttnBackend's, the one SGLang builds for every mamba-style target.
        self.runner.attn_backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=commit_lens.to(torch.int64) - 1,
            mamba_track_indices=batch.mamba_track_indices,
            mamba_steps_to_track=steps,
            model=self.runner.model,
            req_pool_indices=batch.req_pool_indices[: commit_lens.shape[0]],
        )


class SkippedStateCommit(LinearStateCommit):
    """Test aid: the commit switched off (tests show they notice: outputs are wrong)."""

    def __call__(self, batch, seq_lens: torch.Tensor, commit_lens: torch.Tensor) -> None:
        pass

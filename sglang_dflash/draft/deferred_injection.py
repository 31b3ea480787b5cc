"""`DeferredInjection`: the draft K/V of tokens committed without a draft, written late and in bulk.

A decode step at verify width 1 runs no draft, so nothing reads the draft KV store until the
next step that drafts. Such a step therefore queues its committed tokens' captured target
features (one row per request) instead of injecting them, and the queue is injected in one call
(one feature fusion and one K/V projection per draft layer for all its rows, instead of one set
per step) before the store is read or written again:

  * before a draft forward (a decode step at W > 1);
  * before an extend's own injection: a slot freed by a finished request may be reused, and
    the writes must land in the order they were committed, so the latest owner's wins;
  * when the queue is full (`capacity` rows).

E.g., 16 requests at W = 1 for 40 steps, capacity 512: steps 1-32 queue 16 rows each, step 33
injects those 512 rows at once and queues its own, ..., and the first step with a draft
injects the last 128 rows before drafting.

Only where nothing else reads the store between steps; the worker decides once at start-up
(`why_not_deferred`) and says why in its start-up line.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

DEFAULT_CAPACITY = 512  # rows: 32 steps at batch 16


class DeferredInjection:
    def __init__(self, inject: Callable[..., None], capacity: int = DEFAULT_CAPACITY):
        # inject(captured [T, C*H], positions [T], slots [T], token_reqs=[T]): `DraftRuntime.inject`
        self._inject = inject
        self.capacity = capacity
        self.rows = 0  # queued rows
        self._flush_seconds = 0.0  # host time spent injecting, since the owner last took it
        self._captured: Optional[torch.Tensor] = None  # [capacity, C*H], at the first push
        self._positions: Optional[torch.Tensor] = None  # [capacity] int64
        self._slots: Optional[torch.Tensor] = None  # [capacity] int64
        self._reqs: Optional[torch.Tensor] = None  # [capacity] int64: each row's request slot

    def push(
        self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, reqs: torch.Tensor
    ) -> None:
        """Queue T committed tokens: captured [T, C*H], positions [T], slots [T], their request
        slots reqs [T]. Copied: the captured rows may be a graph's output buffer, rewritten by
        the next replay."""
        n = captured.shape[0]
        if self.rows + n > self.capacity:
            self.flush()
        if n > self.capacity:
            self._timed(captured, positions, slots, reqs)
            return
        if self._captured is None:
            self._captured = captured.new_empty(self.capacity, captured.shape[1])
            self._positions, self._slots, self._reqs = (
                torch.empty(self.capacity, dtype=torch.int64, device=captured.device) for _ in range(3)
            )
        end = self.rows + n
        self._captured[self.rows : end].copy_(captured)
        self._positions[self.rows : end].copy_(positions)
        self._slots[self.rows : end].copy_(slots)
        self._reqs[self.rows : end].copy_(reqs)
        self.rows = end

    def flush(self) -> None:
        """Inject every queued row, in the order queued."""
        if self.rows:
            n, self.rows = self.rows, 0
            self._timed(self._captured[:n], self._positions[:n], self._slots[:n], self._reqs[:n])

    def take_flush_seconds(self) -> float:
        """The host time spent injecting since the last call (for the width policy, which leaves
        it out of the step that happened to flush: `StepWidth.exclude`)."""
        seconds, self._flush_seconds = self._flush_seconds, 0.0
        return seconds

    def _timed(self, captured, positions, slots, reqs) -> None:
        start = time.perf_counter()
        self._inject(captured, positions, slots, token_reqs=reqs)
        self._flush_seconds += time.perf_counter() - start


def why_not_deferred(
    *, switched_off: bool, offloads: bool, disaggregation: str, last_tokens: bool
) -> Optional[str]:
    """None if steps at W = 1 may defer their injection, else why not (for the start-up line).
    `offloads`: HiCache (or a host pool) backs cached slots up between steps; `disaggregation`:
    SGLang's mode ("null" when not PD); `last_tokens`: the draft keeps the context feature of
    each request's last committed token (LiLiCorr's `LastTokenStore`), which a step reads."""
    if switched_off:
        return "SGLANG_DFLASH_DEFERRED_INJECTION=0"
    if offloads:
        return "the hierarchical cache backs slots up between steps"
    if disaggregation != "null":
        return f"a PD {disaggregation} engine"
    if last_tokens:
        return "the draft reads each request's last committed token (LiLiCorr's last-token store)"
    return None

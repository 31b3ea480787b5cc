"""Whether a decode engine under prefill/decode disaggregation received each request's draft K/V.

The prompt's draft K/V reaches a decode engine only if its prefill engine sends it, that is, if
the prefill engine runs this package's DFLASH with the same draft. If it does not (it runs
without speculation, say), the decode engine drafts without the prompt's context: the target
still verifies, so the tokens stay right, but acceptance collapses without a word. This makes
it loud.

When SGLang allocates a request's slots for the transfer (`DecodePreallocQueue._pre_alloc`), a
sentinel (NaN) goes into the first K element of the first slot's row in draft layer 0; a
transfer that carries the draft K/V overwrites the row with the prompt's. When the request
leaves the transfer queue (`DecodeTransferQueue.pop_transferred`), a sentinel still there means
its drafts have no context: the request is counted (`sglang:dflash_requests_without_draft_context_total`
with --enable-metrics, and `dflash_requests_without_draft_context` in /server_info), and the
first one is warned about. See docs/serving-past-one-engine.md.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang_dflash.draft.kv_store import DraftKVStore

logger = logging.getLogger(__name__)


class DraftContextCheck:
    def __init__(self, store: DraftKVStore, metrics=None):
        self.store = store
        self.metrics = metrics  # DFlashMetrics or None
        self.requests_without_context = 0

    def stamp(self, slots: torch.Tensor) -> None:
        """Mark the row of `slots[0]` [N] (the first slot allocated for a transfer) as not
        received."""
        self.store.k[0, slots[:1], 0, 0] = float("nan")

    def check(self, first_slots: torch.Tensor, rids: list) -> int:
        """Count the requests whose first transferred slot `first_slots` [R] still holds the
        sentinel; warn on the first one. Returns how many."""
        if first_slots.numel() == 0:
            return 0
        # One host sync per transfer poll that completed requests, in the scheduler's transfer
        # queue (not the forward step): the count and the warning need it on the host.
        column = self.store.k[0, first_slots, 0, 0]
        missing = torch.isnan(column.float()).tolist()
        self.store.k[0, first_slots, 0, 0] = torch.nan_to_num(column, nan=0.0)  # never read a NaN
        count = sum(missing)
        if count:
            if self.requests_without_context == 0:
                rid = next(r for r, m in zip(rids, missing) if m)
                logger.warning(
                    "DFLASH: request %s arrived from its prefill engine without the draft's K/V, so "
                    "its drafts see no prompt context and acceptance collapses (outputs stay "
                    "correct). Serve the prefill engine with sglang-dflash's DFLASH and the same "
                    "draft. Further such requests are counted, not logged "
                    "(dflash_requests_without_draft_context).",
                    rid,
                )
            self.requests_without_context += count
            if self.metrics is not None:
                self.metrics.observe_without_context(count)
        return count


def for_decode_engine(
    store: DraftKVStore, pool_registered: bool, metrics=None
) -> Optional[DraftContextCheck]:
    """The check on a PD decode engine whose draft pool is registered for transfer; else None."""
    from sglang.srt.runtime_context import get_disagg

    if get_disagg().disaggregation_mode != "decode" or not pool_registered:
        return None
    return DraftContextCheck(store, metrics)

"""`WindowMisses`: requests whose drafts start without part of their window, with a window ring.

A window ring (`window_ring.py`) holds a request slot's last R positions as that slot's own
writes left them. A request that starts from a prefix it did not write there (a radix-cache
hit, or a request retracted and admitted again, maybe in another slot) has the K/V of
positions [max(0, end - reach), prefix) missing: its first drafts read other rows there. The
outputs stay the target's (every proposal is verified); acceptance drops until the request has
committed `reach` tokens of its own. Each such request is counted, with its missing positions,
for server info (`dflash_window_misses`), with a warning the first time.

Host bookkeeping on the extend's request list, per request (never per token): slot -> the
request that last extended in it. The same request again in its slot (its next chunk, a
decode mixed into an extend batch) misses nothing: its decode steps wrote the slot too.

E.g., reach 32: a request admitted with a cached prefix of 100 tokens and 20 new ones -> 12
positions missing (88..99); its next chunk -> none.
"""

from __future__ import annotations

import logging
from typing import Sequence

logger = logging.getLogger(__name__)


class WindowMisses:
    def __init__(self, reach: int):
        self.reach = reach  # the longest windowed layer's reach
        self.requests = 0  # requests that drafted without part of their window
        self.positions = 0  # positions missing, over those requests
        self._written: dict[int, str] = {}  # request slot -> the rid that last extended in it

    def extend(self, reqs: Sequence, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        """An extend of `reqs` (SGLang's `Req`s, in the batch's order; `req.kv.req_pool_idx`:
        its slot) from `prefix_lens`, for `extend_lens` tokens each."""
        for req, prefix, length in zip(reqs, prefix_lens, extend_lens):
            slot = req.kv.req_pool_idx
            if prefix > 0 and self._written.get(slot) != req.rid:
                missing = prefix - max(0, prefix + length - self.reach)
                if missing > 0:
                    if self.requests == 0:
                        logger.warning(
                            "DFLASH window ring: a request starts from a prefix whose draft K/V its slot "
                            "does not hold (a radix-cache hit); its drafts read %d positions without "
                            "their K/V until it commits %d tokens (counted: dflash_window_misses)",
                            missing,
                            self.reach,
                        )
                    self.requests += 1
                    self.positions += missing
            self._written[slot] = req.rid

    def describe(self) -> dict:
        """Server info's `dflash_window_misses`."""
        return {"requests": self.requests, "positions": self.positions}

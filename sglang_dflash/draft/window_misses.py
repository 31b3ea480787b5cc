"""`WindowMisses`: requests whose drafts start without part of their window, with a window ring.

A window ring (`window_ring.py`) holds a request slot's last R positions as that slot's own
writes left them. A request that starts from a prefix it did not write there (a radix-cache
hit, or a request retracted and admitted again, maybe in another slot) has the K/V of
positions [max(0, end - reach), prefix) missing: its first drafts read other rows there. The
outputs stay the target's (every proposal is verified); acceptance drops until the request has
committed `reach` tokens of its own. Each such request is counted, with its missing positions,
for server info (`dflash_window_misses`), with a warning the first time.

Host bookkeeping on the extend's request list, per request (never per token): slot -> the
admission of the request that extends in it (a retracted request admitted again is another,
whose rows are still there if it comes back to the same slot before another request), the first
position it wrote there, and whether its window was judged. A request is judged at the extend
that completes its prefill (its last chunk: the first draft follows), once: the positions of
its window [max(0, end - reach), end) that lie before the first one it wrote are missing.

E.g., reach 32: a request admitted with a cached prefix of 100 tokens and 20 new ones (in
chunks of 8 and 12) -> at the second chunk, 12 positions missing (88..99); a request with a
cached prefix of 2 tokens and 40 new ones -> none (its window starts at 10).
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
        # request slot -> [(rid, retractions) of the admission extending there, the first
        # position it wrote, judged]: a retracted request admitted again is a new admission.
        self._slots: dict[int, list] = {}

    def extend(self, reqs: Sequence, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        """An extend of `reqs` (SGLang's `Req`s, in the batch's order; `req.kv.req_pool_idx`:
        its slot) from `prefix_lens`, for `extend_lens` tokens each."""
        for req, prefix, length in zip(reqs, prefix_lens, extend_lens):
            admission = (req.rid, req.retraction_count)
            record = self._slots.get(req.kv.req_pool_idx)
            if record is None or record[0][0] != req.rid:  # another request wrote the slot last
                record = self._slots[req.kv.req_pool_idx] = [admission, prefix, False]
            elif record[0] != admission:  # retracted, and back in its slot: its rows are still there
                record[0], record[2] = admission, False
            end = prefix + length
            if record[2] or end < len(req.origin_input_ids) + len(req.output_ids):
                continue  # judged already (a decode mixed in), or more prefill chunks to come
            record[2] = True
            missing = record[1] - max(0, end - self.reach)
            if missing > 0:
                if self.requests == 0:
                    logger.warning(
                        "DFLASH window ring: a request drafts over %d positions of its window whose "
                        "draft K/V its slot does not hold (a prefix served from the radix cache); "
                        "counted in dflash_window_misses",
                        missing,
                    )
                self.requests += 1
                self.positions += missing

    def describe(self) -> dict:
        """Server info's `dflash_window_misses`."""
        return {"requests": self.requests, "positions": self.positions}

"""`WindowRing`: where a windowed draft layer keeps its context K/V, R rows per request slot.

A windowed layer (a sliding layer, or any layer under `--speculative-draft-window-size`: a
`DraftKVPlan` reach) never reads a context row more than its reach behind the block, so it
needs a request's last R >= reach positions only, not a row per target token slot. The ring
gives each request slot of SGLang's `req_to_token` table (its `req_pool_idx`) R rows:

    row(req, pos) = req * R + pos % R            one row past the last ring: the sink

Worked example, R = 4: request slot 2 at positions 9, 10, 11 -> rows 9, 10, 11; position 12
-> row 8, overwriting position 8, which a layer reaching 4 back from 13 no longer reads.

Invariant: after a write that ends at position e - 1 of a request, its rows hold positions
[e - R, e) (those it has written). A step reads positions [start, L) of a request with
L - start <= reach <= R, so no position it reads has been overwritten. Rows of positions the
request never wrote (a prefix served from the radix cache, a slot last used by another
request) hold other data: `window_misses.py` counts the requests that draft over them.

Writes must not name one row twice (a scatter with duplicate indices keeps an arbitrary
one): a write of more than R positions of one request (an extend chunk) keeps its last R and
sends the rest to the sink, as it does tokens that are not committed. The choice of what to
keep is made on the device, without a host sync.

Memory: (request slots x R + 1) rows per windowed layer, instead of one per target token
slot; it pays where request slots x R < token slots (`pays`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class WindowRing:
    rows_per_request: int  # R: the longest reach of the windowed layers, plus the block
    num_requests: int  # request slots: rows of SGLang's req_to_token table

    @classmethod
    def for_reach(cls, reach: int, block_size: int, num_requests: int) -> "WindowRing":
        """A ring for layers reaching at most `reach` context rows behind a block of
        `block_size` (the block's margin keeps a step's read clear of its own commits)."""
        return cls(reach + block_size, num_requests)

    @property
    def sink(self) -> int:
        """The row writes that must be dropped go to (never read)."""
        return self.num_requests * self.rows_per_request

    @property
    def num_rows(self) -> int:
        return self.sink + 1

    def rows(self, reqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Ring rows of (request slot, position) pairs, broadcast together."""
        return (
            reqs.to(torch.int64) * self.rows_per_request + positions.to(torch.int64) % self.rows_per_request
        )

    def write_rows(self, reqs: torch.Tensor, positions: torch.Tensor, keep: Optional[torch.Tensor] = None):
        """Rows for a write of T tokens: reqs [T] request slots, positions [T], keep [T] bool (the
        tokens that are committed; None: all) -> [T] int64, the sink for tokens not kept and for
        those R or more positions behind their request's last kept one in this write.

        E.g., R 4, one request at positions 0..5, all kept -> [sink, sink, 2, 3, 0, 1].
        """
        positions = positions.to(torch.int64)
        reqs = reqs.to(torch.int64)
        if keep is None:
            keep = torch.ones_like(positions, dtype=torch.bool)
        # [num_requests] one past each request's last kept position in this write (0: none).
        ends = torch.zeros(self.num_requests, dtype=torch.int64, device=positions.device)
        ends.scatter_reduce_(0, reqs, torch.where(keep, positions + 1, 0), reduce="amax")
        keep = keep & (positions >= ends[reqs] - self.rows_per_request)
        return torch.where(keep, self.rows(reqs, positions), self.sink)

    def read_rows(self, req_pool_indices: torch.Tensor, start: torch.Tensor, count: int) -> torch.Tensor:
        """[bs, count] rows of positions start .. start + count - 1 of each request (the same
        positions `block.gather_slots` gives target slots for); req_pool_indices, start [bs]."""
        cols = torch.arange(count, device=start.device)
        return self.rows(req_pool_indices[:, None], start[:, None] + cols)

    def nbytes(self, bytes_per_layer_token: int, num_layers: int) -> int:
        return self.num_rows * bytes_per_layer_token * num_layers

    def pays(self, token_slots: int) -> bool:
        """Whether the ring has fewer rows than a row per target token slot."""
        return self.num_rows < token_slots

"""`Verifier`: turns one step's target verify logits into accepted tokens, per batch.

* All greedy, no penalties, no logit_bias: `greedy_verify` on the raw argmax.
* Otherwise: penalties and logit_bias applied per window position as successive decode steps
  would (`penalties.py`), then `sampled_verify`, which is exactly lossless for sampled rows and
  is argmax of the adjusted logits for greedy rows (`sampling.py`).

It owns the only cross-step state verification needs: the committed output-token counts of
requests that use penalties (`PenaltyState`), created on first need.

Seeds. SGLang's sampler honours `sampling_seed` only when `SamplingBatchInfo.sampling_seed` is
set, which it does only under `--enable-deterministic-inference` (not available with the CPU
engine's attention backend). While a batch holds a request with a `sampling_seed`, `seeded`
sets it for the step, giving unseeded requests a fresh random seed, so seeded requests are
reproducible in the prefill token (SGLang's sampler) and in every verified token (ours), and
unseeded ones still sample independently.
"""

from __future__ import annotations

import contextlib
import logging
import random
from typing import Iterator, Optional

import torch

from sglang_dflash.penalties import PenaltyParams, PenaltyState, needs_penalties
from sglang_dflash.sampling import SamplingRows, sampled_verify
from sglang_dflash.verify import greedy_verify

logger = logging.getLogger(__name__)
_RANDOM = random.Random()  # seeds for unseeded requests that share a batch with seeded ones


class Verifier:
    def __init__(self, num_req_slots: int, vocab_size: int, device: torch.device | str):
        self.num_req_slots = num_req_slots
        self.vocab_size = vocab_size
        self.device = device
        self.penalties: Optional[PenaltyState] = None

    @contextlib.contextmanager
    def seeded(self, batch) -> Iterator[None]:
        """For the duration of one step, per-request seeds on `batch.sampling_info` (see above)."""
        info = batch.sampling_info
        explicit = [req.sampling_params.sampling_seed for req in batch.reqs]
        if info is None or info.sampling_seed is not None or all(s is None for s in explicit):
            yield
            return
        seeds = [s if s is not None else _RANDOM.getrandbits(63) for s in explicit]
        info.sampling_seed = torch.tensor(seeds, dtype=torch.int64).to(self.device, non_blocking=True)
        try:
            yield
        finally:
            info.sampling_seed = None

    def start_requests(self, batch) -> None:
        """Prefill / extend: reset the penalty state of the batch's requests to their outputs so
        far (none for a new request; all of them for a retracted one being prefilled again)."""
        penalized = [i for i, req in enumerate(batch.reqs) if needs_penalties(req.sampling_params)]
        if not penalized:
            return
        if self.penalties is None:
            logger.info("DFLASH: tracking output-token counts for penalties (first penalized request)")
            self.penalties = PenaltyState(self.num_req_slots, self.vocab_size, self.device)
        slots = batch.req_pool_indices[penalized]
        outputs = [batch.reqs[i].output_ids for i in penalized]
        self.penalties.reset(slots, outputs)

    def verify(
        self, batch, candidates: torch.Tensor, logits: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """candidates [bs, B]; logits [bs*B, V] target verify logits; positions [bs, B] absolute
        positions of the candidates -> accept_len [bs], out_tokens [bs, B], new bonus [bs]."""
        bs, width = candidates.shape
        info = batch.sampling_info
        penalized = self.penalties is not None and any(needs_penalties(r.sampling_params) for r in batch.reqs)
        if info.is_all_greedy and not penalized and info.logit_bias is None:
            return greedy_verify(candidates, torch.argmax(logits, dim=-1).view(bs, width))

        logits = logits.view(bs, width, -1)
        if penalized:
            params = PenaltyParams.from_reqs(batch.reqs, self.device, logit_bias=info.logit_bias)
            logits = self.penalties.adjust(logits, candidates, batch.req_pool_indices, params)
        elif info.logit_bias is not None:
            logits = logits.float() + info.logit_bias[:, None, :].float()
        rows = SamplingRows.from_sampling_info(info)
        return sampled_verify(candidates, logits, rows, positions if rows.seeds is not None else None)

    def commit(self, batch, candidates: torch.Tensor, commit_lens: torch.Tensor) -> None:
        """Fold the committed tokens (`candidates[:, :commit_len]`) into the penalty state."""
        if self.penalties is not None:
            self.penalties.commit(batch.req_pool_indices, candidates, commit_lens)

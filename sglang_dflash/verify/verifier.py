"""`Verifier`: turns one step's target verify logits into accepted tokens, per batch.

* Nothing to adjust (all greedy; no penalties, logit_bias, grammar or custom logit processor):
  `greedy_verify` on the raw argmax; sampled rows and no adjustment: `sampled_verify` on the raw
  logits. No grammar or processor work, and no host sync.
* Otherwise the logits of every window position are adjusted as the successive decode steps of
  a non-speculative engine would adjust them, in SGLang's order (`sampling_batch_info.py`,
  `apply_logits_bias`, then `layers/sampler.py`): penalties, the grammar mask, `logit_bias`
  (`penalties.py`; the mask and the bias commute, both being additive with -inf), then custom
  logit processors (`logit_processors.py`). Then `greedy_verify` on their argmax, or
  `sampled_verify`, which is exactly lossless for sampled rows and argmax for greedy ones.
  The adjusted logits are what logprobs are computed from, as in SGLang's sampler.

It owns the only cross-step state verification needs, each created on first need: the committed
output-token counts of requests that use penalties (`PenaltyState`), and the committed output
tokens of requests that use a custom logit processor (`ProcessorHistory`).

Seeds. SGLang's sampler honours `sampling_seed` only when `SamplingBatchInfo.sampling_seed` is
set, which it does only under `--enable-deterministic-inference` (not available with the CPU
engine's attention backend). While a batch holds a request with a `sampling_seed`, `seeded`
sets it for the step, giving unseeded requests a fresh random seed, so seeded requests are
reproducible in the prefill token (SGLang's sampler) and in every verified token (ours), and
unseeded ones still sample independently. Those fresh seeds come from a generator seeded with
the seed SGLang broadcasts from rank 0 (`TpModelWorker.random_seed`), so under tensor parallelism
every rank draws the same ones (the ranks see the same batches), as SGLang's own sampler does.

See docs/requests.md.
"""

from __future__ import annotations

import contextlib
import logging
import random
from typing import Iterator, Optional

import torch

from sglang_dflash.verify import logit_processors
from sglang_dflash.verify.acceptance import greedy_verify
from sglang_dflash.verify.logit_processors import ProcessorHistory
from sglang_dflash.verify.penalties import PenaltyParams, PenaltyState, needs_penalties
from sglang_dflash.verify.q_sampling import DraftQ, q_sampled_verify
from sglang_dflash.verify.sampling import BYTES_PER_LOGIT, SamplingRows, rows_per_draw, sampled_verify

logger = logging.getLogger(__name__)


class Verifier:
    def __init__(self, num_req_slots: int, vocab_size: int, device: torch.device | str, seed: int = 0):
        self.num_req_slots = num_req_slots
        self.vocab_size = vocab_size
        self.device = device
        self.penalties: Optional[PenaltyState] = None
        self.processor_history: Optional[ProcessorHistory] = None
        self._windows: list[list[int]] = []  # this step's verify windows on the host (processors only)
        # Seeds for unseeded requests that share a batch with seeded ones; the same on every rank.
        self._random = random.Random(seed)
        # Sampled verification draws this many window rows at once, bounding its memory.
        self.max_sample_rows = rows_per_draw(vocab_size)
        logger.info(
            "DFLASH sampled verification: at most %d rows at once (%.0f MB of transient memory)",
            self.max_sample_rows,
            self.max_sample_rows * vocab_size * BYTES_PER_LOGIT / 2**20,
        )

    @contextlib.contextmanager
    def seeded(self, batch) -> Iterator[None]:
        """For the duration of one step, per-request seeds on `batch.sampling_info` (see above)."""
        info = batch.sampling_info
        explicit = [req.sampling_params.sampling_seed for req in batch.reqs]
        if info is None or info.sampling_seed is not None or all(s is None for s in explicit):
            yield
            return
        seeds = [s if s is not None else self._random.getrandbits(63) for s in explicit]
        info.sampling_seed = torch.tensor(seeds, dtype=torch.int64).to(self.device, non_blocking=True)
        try:
            yield
        finally:
            info.sampling_seed = None

    def start_requests(self, batch) -> None:
        """Prefill / extend: reset the cross-step state of the batch's requests to their outputs
        so far (none for a new request; all of them for a retracted one being prefilled again)."""
        self._settle()
        penalized = [i for i, req in enumerate(batch.reqs) if needs_penalties(req.sampling_params)]
        if penalized:
            if self.penalties is None:
                logger.info("DFLASH: tracking output-token counts for penalties (first penalized request)")
                self.penalties = PenaltyState(self.num_req_slots, self.vocab_size, self.device)
            slots = batch.req_pool_indices[penalized]
            outputs = [batch.reqs[i].output_ids for i in penalized]
            self.penalties.reset(slots, outputs)
        processed = [req for req in batch.reqs if req.custom_logit_processor]
        if processed:
            if self.processor_history is None:
                logger.info("DFLASH: tracking output tokens for custom logit processors (first request)")
                self.processor_history = ProcessorHistory(self.num_req_slots)
            for req in processed:
                self.processor_history.reset(req.kv.req_pool_idx, req.output_ids)

    def verify(
        self,
        batch,
        candidates: torch.Tensor,
        logits: torch.Tensor,
        positions: torch.Tensor,
        grammar_mask=None,
        draft_q: Optional[DraftQ] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """candidates [bs, B]; logits [bs*B, V] target verify logits; positions [bs, B] absolute
        positions of the candidates; grammar_mask: SGLang `GrammarMask` over the [bs*B] rows, or
        None; draft_q: the proposals' draft distributions when a walk sampled them (None: point
        masses) -> accept_len [bs], out_tokens [bs, B], new bonus [bs], and the logits the tokens
        were chosen from ([bs*B, V]: `logits` itself, adjusted in place when float32)."""
        self._settle()
        bs, width = candidates.shape
        info = batch.sampling_info
        penalized = self.penalties is not None and any(needs_penalties(r.sampling_params) for r in batch.reqs)
        adjusted = (
            penalized
            or info.logit_bias is not None
            or grammar_mask is not None
            or info.has_custom_logit_processor
        )
        if adjusted:
            logits = self._adjust(batch, candidates, logits, grammar_mask, penalized)
        if info.is_all_greedy:
            predict = torch.argmax(logits, dim=-1).view(bs, width)
            return (*greedy_verify(candidates, predict), logits)
        rows = SamplingRows.from_sampling_info(info)
        seeded_positions = positions if rows.seeds is not None else None
        window_logits = logits.view(bs, width, -1)
        if draft_q is not None:
            # Besides p it holds the dense q and the residual: half the rows per draw (a margin,
            # not measured; scripts/bench/sampling_memory.py measures the target-only draw).
            verified = q_sampled_verify(
                candidates,
                window_logits,
                rows,
                draft_q,
                seeded_positions,
                max_rows=max(1, self.max_sample_rows // 2),
            )
        else:
            verified = sampled_verify(
                candidates, window_logits, rows, seeded_positions, max_rows=self.max_sample_rows
            )
        return (*verified, logits)

    def _adjust(self, batch, candidates, logits, grammar_mask, penalized) -> torch.Tensor:
        """[bs*B, V] -> [bs*B, V] float32, adjusted as successive decode steps (see above)."""
        bs, width = candidates.shape
        info = batch.sampling_info
        if penalized:
            params = PenaltyParams.from_reqs(batch.reqs, self.device, logit_bias=info.logit_bias)
            logits = self.penalties.adjust(
                logits.view(bs, width, -1), candidates, batch.req_pool_indices, params
            )
            logits = logits.view(bs * width, -1)
        else:
            logits = logits.float()
            if info.logit_bias is not None:
                logits = (logits.view(bs, width, -1) + info.logit_bias[:, None, :].float()).view(
                    bs * width, -1
                )
        if grammar_mask is not None:
            grammar_mask.apply(logits)
        if info.has_custom_logit_processor:
            # Processors are host code reading host token lists: the window goes to the host.
            self._windows = candidates.tolist()  # [bs][B], kept for `commit`
            slots = [req.kv.req_pool_idx for req in batch.reqs]
            row_params = self.processor_history.row_params(info, slots, self._windows)
            logit_processors.apply_over_window(logits, info, row_params)
        return logits

    def commit(self, batch, candidates: torch.Tensor, commit_lens: torch.Tensor) -> None:
        """Fold the committed tokens (`candidates[:, :commit_len]`) into the cross-step state."""
        if self.penalties is not None:
            self.penalties.commit(batch.req_pool_indices, candidates, commit_lens)
        if batch.sampling_info.has_custom_logit_processor:
            rows = [i for i, req in enumerate(batch.reqs) if req.custom_logit_processor]
            slots = [batch.reqs[i].kv.req_pool_idx for i in rows]
            windows = [self._windows[i] for i in rows]
            self.processor_history.commit(slots, windows, commit_lens[rows])

    def _settle(self) -> None:
        if self.processor_history is not None:
            self.processor_history.settle()

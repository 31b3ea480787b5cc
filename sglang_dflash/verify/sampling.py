"""Sampled block verification that is exactly lossless, and the target distribution it preserves.

Terms are those of `acceptance.py`: the verify window `candidates = [bonus, d1 .. d_{B-1}]`, one
target row per window position (row t predicts the token after `candidates[t]`), `accept_len`,
the new bonus, and `out_tokens = d1 .. d_accept, new bonus, 0 ...`.

The target's sampling distribution is the one SGLang 0.5.23's normal (non-speculative) decode
draws from. Paths below are relative to the installed `sglang` package.
  1. Logit adjustments, in SGLang's order: additive penalties (frequency, presence,
     min_new_tokens) then the repetition scaling (`sampling_batch_info.py:426-437`, the
     forward-copy path `copy_for_forward` -> `update_penalties`, `:409-424, 679-682`), then the
     grammar mask, then `logit_bias` (`:439-449`), then custom logit processors
     (`layers/sampler.py:139-146`). `penalties.penalize_block_logits` does the penalties and `logit_bias`
     per block position; the grammar mask and custom processors are `verifier.py`'s.
  2. `probs = softmax(logits / temperature)` (`layers/sampler.py:275-298`).
  3. The pytorch backend's joint filter (`top_k_top_p_min_p_sampling_from_probs_torch`,
     `layers/sampler.py:785-858`): sort descending; keep rank < top_k; keep a token when the mass
     sorted strictly before it is <= top_p, judged on the *unfiltered* sorted probabilities (so
     top-k and top-p intersect, "joint"); then drop tokens below `min_p * max_prob`. Ties at a
     boundary are split by `torch.sort`'s order; we call the same sort on the same values.
     Per row we follow the path SGLang takes for a batch of that row alone: a row with no filter
     (top_k == TOP_K_ALL, top_p == 1, min_p == 0) is not filtered at all, as in SGLang's
     `simple_sampling_case` (`:225-229, 383-388`). (In a mixed batch SGLang runs such a row
     through the filter with top_p = 1, which can drop tokens worth ~1e-7 of mass by float32
     cumsum rounding.)
  4. Greedy requests (SGLang sets top_k = 1 for temperature 0, `sampling_params.py:245-248`;
     `is_all_greedy` is `top_k <= 1`, `sampling_batch_info.py:293`) take `argmax` of the adjusted
     logits, i.e. exactly `greedy_verify`.
  On CUDA SGLang's default backend is FlashInfer (`arg_groups/overrides.py:1019-1026`), whose
  semantics differ from the pytorch backend (`layers/sampler.py:403-440`), and we do not copy them:
  (a) if any row of the batch has min_p > 0, *every* row gets top-k renorm, then top-p on the
  renormalised probabilities (sequential, not joint), then min-p; (b) FlashInfer thresholds by
  value, so tied tokens at a top-k/top-p boundary are kept or dropped together, and its top-p keeps
  the smallest prefix with mass >= top_p where the torch path also keeps a token whose preceding
  mass equals top_p exactly; (c) it refuses `sampling_seed` with any filter (`:404-406`).
  With `--sampling-backend pytorch` the two engines sample from the same distribution.

Randomness. SGLang honours `sampling_seed` only with `--enable-deterministic-inference`
(`SamplingBatchInfo.sampling_seed`, `sampling_batch_info.py:157-172`; unseeded requests then get
seed 42), which also forces the pytorch backend (`arg_groups/overrides.py:1029-1036`). It draws
`argmax(log w + Gumbel)` with the Gumbel noise a murmur3 hash of (seed, position of the input
token, column) (`multinomial_with_seed`, `layers/sampler.py:933-975`; `murmur_hash.py`); the
column is the token id when the batch has no filter (`:999-1002`) and the rank in the sorted row
when it has one (`:844-848`). We reproduce this per row (rank column iff the row itself has a
filter), so a seeded request's tokens depend only on its own seed, positions and logits, never on
the batch, and equal SGLang's non-speculative tokens whenever the verify logits equal the decode
logits. Unlike SGLang's pytorch path (`:829-833`) we also allow min_p with a seed. Without seeds
we draw `argmax(w / E)`, E ~ Exp(1) from the given generator (SGLang's own Gumbel option,
`:989-995`); that is a different stream from SGLang's `torch.multinomial`, with the same law.

Why sampled verification is exactly lossless (the draft is a point mass: DFlash proposes argmax).
`sampled_verify` draws, for every row t, a token `y_t ~ p_t` with randomness `U_t` that is
independent across rows and of everything decided before, where `p_t` is the target's filtered
distribution given the prefix and `candidates[0..t]`. It accepts while `y_t == d_{t+1}` and emits
`y_0 .. y_accept` (the accepted proposals, then the new bonus). This is the rule "accept `x` with
probability p(x); at the first rejection sample from p with x removed and renormalised; after
B-1 acceptances sample the bonus from the next p": P(y = x) = p(x), and given y != x, y has law
p(.) 1[. != x] / (1 - p(x)). Proof that the emitted stream has the target's law: the token emitted
after history h is some y_t computed on row t, and row t is reached only if y_0..y_{t-1} matched
d_1..d_t, i.e. only if the history is exactly (prefix, candidates[0..t]); then p_t is the target
conditional at h, and since U_t is independent of the event "rows 0..t-1 accepted" (a function
of U_0..U_{t-1} and of proposals fixed before the step), y_t | h ~ p(. | h). Induction over
emitted tokens (and over steps, each with fresh randomness) gives the autoregressive law.
Seeded noise is a fixed function of the absolute position, so "fresh" needs one more line: the
token at position m+1 is emitted from the row whose input sits at m exactly once, and the rows
after the first rejection, whose positions are verified again next step, influenced nothing that
was emitted. Greedy rows use argmax, so they are `greedy_verify` exactly.

See docs/requests.md ("Sampling (temperature > 0)").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from sglang_dflash import knobs
from sglang_dflash.verify.acceptance import greedy_verify

# sglang.srt.sampling.sampling_params.TOP_K_ALL ("whole vocabulary"); not imported, to keep this
# module free of sglang imports. tests/unit/verify/test_sampling.py checks that they agree.
TOP_K_ALL = 1 << 30
_MASK32 = 0xFFFFFFFF
_UINT32_MAX = 4294967295  # torch.iinfo(torch.uint32).max, as in multinomial_with_seed


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters as SGLang's sampler sees them (one row per request).

    Built from `SamplingBatchInfo` after SGLang's normalisation: temperature 0 is stored as
    temperature 1 with top_k 1, and top_k -1 as TOP_K_ALL.
    """

    # [n] float32
    temperatures: torch.Tensor
    # [n] int; TOP_K_ALL = no top-k; <= 1 means greedy
    top_ks: torch.Tensor
    # [n] float32, in (0, 1]
    top_ps: torch.Tensor
    # [n] float32, in [0, 1]
    min_ps: torch.Tensor
    # [n] int64, or None (SGLang without --enable-deterministic-inference ignores seeds)
    seeds: Optional[torch.Tensor] = None
    # Host flag: False promises no row has a filter (top_k/top_p/min_p), which skips the sort.
    need_filter: bool = True

    @classmethod
    def from_sampling_info(cls, info: Any) -> "SamplingRows":
        """From SGLang's `SamplingBatchInfo` (the worker's `batch.sampling_info`); no host sync."""
        return cls(
            temperatures=info.temperatures.reshape(-1),
            top_ks=info.top_ks,
            top_ps=info.top_ps,
            min_ps=info.min_ps,
            seeds=info.sampling_seed,
            need_filter=bool(
                info.need_top_k_sampling or info.need_top_p_sampling or info.need_min_p_sampling
            ),
        )

    @property
    def is_greedy(self) -> torch.Tensor:
        # [n] bool, SGLang's own test (`is_all_greedy`, sampling_batch_info.py:293)
        return self.top_ks <= 1

    def repeat_rows(self, width: int) -> "SamplingRows":
        """Each row repeated `width` times, for the flattened [bs * B] verify rows.

        E.g., top_ks [5, 1], width 3 -> [5, 5, 5, 1, 1, 1].
        """
        return self._per_row(lambda t: t.repeat_interleave(width))

    def rows(self, start: int, end: int) -> "SamplingRows":
        """Rows start..end-1."""
        return self._per_row(lambda t: t[start:end])

    def select(self, indices: torch.Tensor) -> "SamplingRows":
        """The rows at `indices` [r] (a device tensor: no host sync)."""
        return self._per_row(lambda t: t.index_select(0, indices))

    def _per_row(self, fn) -> "SamplingRows":
        """`fn` applied to every per-row tensor (each [n]; `need_filter` stays)."""
        return replace(
            self,
            temperatures=fn(self.temperatures.reshape(-1)),
            top_ks=fn(self.top_ks),
            top_ps=fn(self.top_ps),
            min_ps=fn(self.min_ps),
            seeds=None if self.seeds is None else fn(self.seeds),
        )


# ----------------------------------------------------------------------------- memory

# Transient bytes per logit of one draw, at its peak, rounded up: the seeded path with a filter,
# the largest (float32 probabilities and sorted weights, int64 sorted ids, int64 hash
# intermediates, float64 noise and scores), measured at 89 on CPU by
# `scripts/bench/sampling_memory.py` (docs/gpu.md); unseeded draws take 12 (no filter) to 26.
BYTES_PER_LOGIT = 96
MEMORY_ENV = "SGLANG_DFLASH_SAMPLING_MEMORY_MB"  # a positive integer, 1024 unset (`knobs.py`)


def rows_per_draw(vocab: int, memory_mb: Optional[int] = None) -> int:
    """How many rows one draw takes at once so that its transient memory stays within
    `memory_mb` (default: `SGLANG_DFLASH_SAMPLING_MEMORY_MB`, else 1024). E.g., a 151,936-token
    vocabulary and 1024 MB -> 73 rows, so a seeded verify of 48 requests x 16 positions draws
    in 11 chunks instead of holding about 10 GB at once."""
    if memory_mb is None:
        memory_mb = knobs.value(MEMORY_ENV)
    if memory_mb <= 0:
        raise ValueError(f"{MEMORY_ENV} must be positive, got {memory_mb}")
    return max(1, (memory_mb << 20) // (BYTES_PER_LOGIT * vocab))


# ----------------------------------------------------------------------------- filters


def _temperature_softmax(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """[n, V] logits, [n] or [n, 1] temperatures -> [n, V] float32 probabilities."""
    return torch.softmax(logits.float() / temperatures.reshape(-1, 1).float(), dim=-1)


def _row_has_filter(top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    # [n] bool: the row-wise form of need_top_k / need_top_p / need_min_p (sampling_batch_info.py:295-297)
    return (top_ks != TOP_K_ALL) | (top_ps != 1.0) | (min_ps > 0)


def _filter_sorted(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's joint filter on sorted probabilities (layers/sampler.py:821-835), sync-free.

    probs [n, V] -> (weights [n, V] float32: sorted probabilities with filtered ones zeroed,
    unnormalised; token_ids [n, V] int64: the token at each rank). Rows with no filter are left
    untouched (top_p treated as +inf).
    E.g., probs [.5, .3, .2], top_k 2, top_p .6 -> weights [.5, .3, 0] (.3 kept: .5 <= .6).
    """
    top_ps = torch.where(_row_has_filter(top_ks, top_ps, min_ps), top_ps.float(), torch.inf)
    weights, token_ids = probs.sort(dim=-1, descending=True)
    # Cumulative mass of the unfiltered sorted row: top-p is judged on the original
    # distribution, which is what makes top-k and top-p a joint (intersected) filter.
    mass_through = torch.cumsum(weights, dim=-1)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    weights.masked_fill_(ranks[None, :] >= top_ks.reshape(-1, 1), 0.0)
    weights.masked_fill_((mass_through - weights) > top_ps.reshape(-1, 1), 0.0)
    # Rank 0 survives both filters, so weights[:, 0] is the row's max probability.
    min_p_thresholds = weights[:, 0] * min_ps.float()
    weights.masked_fill_(weights < min_p_thresholds[:, None], 0.0)
    return weights, token_ids


def filtered_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
) -> torch.Tensor:
    """The distribution SGLang's pytorch sampler draws each row's next token from.

    logits [n, V] (already adjusted: penalties, logit_bias); temperatures [n] or [n, 1];
    top_ks, top_ps, min_ps [n] -> [n, V] float32, each row summing to 1. Greedy rows
    (top_k 1) come out as a point mass on the sort's first token. No host sync.
    """
    probs = _temperature_softmax(logits, temperatures)
    weights, token_ids = _filter_sorted(probs, top_ks, top_ps, min_ps)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, token_ids, weights)


# ----------------------------------------------------------------------------- seeded noise


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2**32 for int64 `a` in [0, 2**32) and a 32-bit constant, without overflow."""
    lo, hi = b & 0xFFFF, b >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _MASK32) | (x >> (32 - r))


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur_hash32(seeds: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """SGLang's `murmur_hash32` (kernels/ops/sampling/murmur_hash.py) in plain PyTorch.

    seeds [n] int64 (or uint64), positions [n] int, cols [m] or [n, m] int -> [n, m] int64 holding
    the uint32 hash of (seed low word, seed high word, position mod 2**32, column mod 2**32).
    Bit-identical to SGLang's Triton kernel (tests/unit/verify/test_sampling.py runs it in the Triton
    interpreter), so it can also stand in for `sgl_kernel.murmur_hash32_cpu`.
    """
    if seeds.dtype == torch.uint64:
        seeds = seeds.view(torch.int64)
    seeds = seeds.to(torch.int64)
    h = torch.zeros_like(seeds)
    h = _murmur3_mix(h, seeds & _MASK32)
    h = _murmur3_mix(h, (seeds >> 32) & _MASK32)
    h = _murmur3_mix(h, positions.to(torch.int64) & _MASK32)  # [n]: per-row part, mixed once
    cols = cols.to(torch.int64) & _MASK32
    h = _murmur3_mix(h[:, None], cols if cols.dim() == 2 else cols[None, :])
    return _fmix32(h ^ 16)


def seeded_gumbel(seeds: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[n, m] float64 Gumbel noise exactly as `multinomial_with_seed` (layers/sampler.py:955-970)."""
    x = murmur_hash32(seeds, positions, cols).to(torch.float64) / _UINT32_MAX
    x = x.log_().clamp_(min=torch.finfo(torch.float64).min, max=-(2.0**-32)).neg_()
    return x.log_().neg_()


def seeded_uniforms(seeds: torch.Tensor, positions: torch.Tensor, column: int) -> torch.Tensor:
    """Uniforms in [0, 1) from the same hash, one per position: seeds [n], positions [n] or
    [n, m] -> float64 of positions' shape. `column` names the stream (e.g., a constant no token
    id reaches), so streams of one seed and position are independent."""
    shape = positions.shape
    row_seeds = seeds.reshape(-1, *([1] * (positions.dim() - 1))).expand(shape).reshape(-1)
    cols = torch.tensor([column], dtype=torch.int64, device=positions.device)
    hashed = murmur_hash32(row_seeds, positions.reshape(-1), cols)[:, 0]
    return (hashed.double() / 2.0**32).reshape(shape)


# ----------------------------------------------------------------------------- sampling


def sample_target_tokens(
    logits: torch.Tensor,
    rows: SamplingRows,
    positions: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    max_rows: Optional[int] = None,
) -> torch.Tensor:
    """One draw per row from the target distribution (argmax for greedy rows).

    logits [n, V] adjusted; rows: n rows; positions [n] absolute position of each row's input
    token (needed when rows.seeds is set); generator: the noise source when unseeded (None = the
    device's default generator); max_rows: rows drawn at once (default `rows_per_draw`), which
    bounds the transient memory at about max_rows x V x BYTES_PER_LOGIT. Returns [n] int64. No
    host sync: the chunks are a host loop over sizes known on the host. Each row's draw depends
    only on its own logits and noise, so chunking changes nothing for seeded and greedy rows;
    unseeded rows take their noise from the generator chunk by chunk (the same law).
    """
    if rows.seeds is not None and positions is None:
        raise ValueError("sample_target_tokens: rows.seeds is set, so positions are required")
    n, vocab = logits.shape
    max_rows = max_rows or rows_per_draw(vocab)
    if n <= max_rows:
        return _draw(logits, rows, positions, generator)
    return torch.cat(
        [
            _draw(
                logits[start : start + max_rows],
                rows.rows(start, start + max_rows),
                None if positions is None else positions[start : start + max_rows],
                generator,
            )
            for start in range(0, n, max_rows)
        ]
    )


def _draw(
    logits: torch.Tensor,
    rows: SamplingRows,
    positions: Optional[torch.Tensor],
    generator: Optional[torch.Generator],
) -> torch.Tensor:
    """`sample_target_tokens` for rows drawn at once: [n, V] -> [n] int64."""
    vocab = logits.shape[-1]
    greedy_tokens = torch.argmax(logits, dim=-1)
    probs = _temperature_softmax(logits, rows.temperatures)
    token_ids = None  # [n, V]: token at each column of `weights` (None: column == token id)
    weights = probs
    if rows.need_filter:
        has_filter = _row_has_filter(rows.top_ks, rows.top_ps, rows.min_ps)[:, None]
        weights, token_ids = _filter_sorted(probs, rows.top_ks, rows.top_ps, rows.min_ps)

    if rows.seeds is not None:
        columns = torch.arange(vocab, device=logits.device)  # token ids, or ranks once sorted
        if token_ids is None:
            cols, log_weights = columns, weights.log().double()
        else:
            # SGLang hashes the rank on its filter path and the token id on its simple path;
            # it takes log in float64 on the first (:844-847) and in float32 on the second (:1001).
            cols = torch.where(has_filter, columns[None, :], token_ids)
            log_weights = torch.where(has_filter, weights.double().log(), weights.log().double())
        scores = log_weights + seeded_gumbel(rows.seeds, positions.reshape(-1), cols)
    else:
        noise = torch.empty_like(weights).exponential_(generator=generator)
        scores = weights / noise.clamp_min_(torch.finfo(torch.float32).tiny)
    picked = torch.argmax(scores, dim=-1)
    if token_ids is not None:
        picked = token_ids.gather(1, picked[:, None]).squeeze(1)
    return torch.where(rows.is_greedy, greedy_tokens, picked)


def sampled_verify(
    candidates: torch.Tensor,
    logits: torch.Tensor,
    rows: SamplingRows,
    positions: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    max_rows: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a block for a batch mixing greedy and sampled requests; exactly lossless.

    candidates [bs, B] = [bonus, d1..d_{B-1}]; logits [bs, B, V] target logits per window
    position, adjusted (`penalties.py`); rows: bs requests (`SamplingRows`);
    positions [bs, B] absolute positions of the candidates (seeded mode); generator: unseeded noise;
    max_rows: window rows drawn at once (`sample_target_tokens`).
    Returns accept_len [bs], out_tokens [bs, B] (d1..d_acc, new bonus, 0-padding), new_bonus [bs],
    the contract of `greedy_verify`. Each row t draws the target's own token (module docstring);
    the proposals are then verified against those draws exactly as `greedy_verify` does.
    E.g., candidates [5, 8, 2, 4], draws [8, 3, 9, 1] -> accept_len 1, out [8, 3, 0, 0], bonus 3.
    """
    bs, width = candidates.shape
    flat_positions = None if positions is None else positions.reshape(-1)
    draws = sample_target_tokens(
        logits.reshape(bs * width, -1), rows.repeat_rows(width), flat_positions, generator, max_rows
    )
    return greedy_verify(candidates, draws.view(bs, width).to(candidates.dtype))

"""`return_sampling_mask`: each output token's sampling support and behaviour logprob.

RL frameworks ask SGLang for the support of the distribution every output token was drawn from
(the token ids with nonzero probability after top-k / top-p / min-p) and that token's logprob
under it. SGLang's sampler builds them when it draws a token (`layers/sampler.py`,
`_build_sampling_mask_output`); DFLASH draws its tokens in the verifier, so the masks of the
verified tokens are built here, from the same adjusted verify logits the tokens were drawn from.

Per window row t of a request (the row that emitted out_tokens[t]), as SGLang's pytorch sampler
would for that request alone:
  * support: the filtered distribution's positive entries (`sampling._filter_sorted`, the same
    sort SGLang calls), in descending order of probability, at most `max_tokens` of them;
  * selected logprob: log(w[token] / sum of the support's w), w the unnormalised filtered
    probabilities; support logprobs likewise for every support token (`sampling_logprobs_mode`
    "support");
  * status: INVALID if the token is outside the support, OVERFLOW if the support is larger than
    `--sampling-mask-max-tokens`, else OK (SGLang aborts the request on either);
  * greedy requests: the token itself, logprob 0.
SGLang's scheduler keeps the first `num_accept_tokens` rows of each request (the committed
tokens), as for its built-in DFLASH (`spec_sampling_mask.py`).

SGLang accepts masks only for top_k 1 or a finite top_k up to the cap, so every sampled request
here takes the filter path, as it would in the engine without speculation.

See docs/requests.md ("Sampling masks").
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_dflash.verify.sampling import SamplingRows, _filter_sorted, _temperature_softmax

# sglang.srt.layers.logits_processor.SamplingMaskStatus; not imported, to keep this module free
# of sglang imports (tests/unit/verify/test_sampling_mask.py checks that they agree).
OK, OVERFLOW, INVALID = 0, 1, 2


def sampling_masks(
    logits: torch.Tensor,
    rows: SamplingRows,
    tokens: torch.Tensor,
    max_tokens: int,
    support_rows: Optional[torch.Tensor] = None,
) -> dict[str, Optional[torch.Tensor]]:
    """The masks of r requests' W window rows.

    logits [r*W, V] adjusted verify logits; rows: the r requests (`SamplingRows`); tokens [r, W]
    the token each row emitted; max_tokens: `--sampling-mask-max-tokens`; support_rows [s]: the
    requests (indices into r) that want every support logprob. Returns the fields of SGLang's
    `SamplingMaskOutput` but `num_accept_tokens`: token_ids [r, W, K] int32 (K = min(max_tokens,
    V)), lengths [r, W] int32, selected_logprobs [r, W] float32, support_logprobs [s, W, K]
    float32 or None, statuses [r, W] int32. No host sync.
    """
    r, width = tokens.shape
    vocab = logits.shape[-1]
    packed = min(max_tokens, vocab)
    flat = rows.repeat_rows(width)  # one row per window row
    probs = _temperature_softmax(logits, flat.temperatures)  # [r*W, V]
    weights, token_ids = _filter_sorted(probs, flat.top_ks, flat.top_ps, flat.min_ps)  # sorted
    chosen = tokens.reshape(-1, 1).long()
    # The chosen token's rank in the sorted row, then its (unnormalised) weight there.
    rank = (token_ids == chosen).int().argmax(dim=-1, keepdim=True)
    selected = weights.gather(1, rank).squeeze(1)  # [r*W]
    support = weights > 0
    mass = weights.sum(dim=-1)  # filtered entries are exactly 0
    selected_logprobs = torch.log(selected / mass)
    lengths = support.sum(dim=-1, dtype=torch.int32)
    invalid = ~((selected > 0) & (mass > 0) & torch.isfinite(selected_logprobs))
    statuses = torch.where(invalid, INVALID, torch.where(lengths > max_tokens, OVERFLOW, OK))

    # Greedy requests (top_k 1): the token itself, logprob 0, as SGLang's greedy path returns.
    greedy = flat.is_greedy
    packed_ids = torch.where(greedy[:, None], chosen, token_ids[:, :packed]).to(torch.int32)
    lengths = torch.where(greedy, 1, lengths.clamp(max=packed))
    selected_logprobs = torch.where(greedy, 0.0, selected_logprobs)
    statuses = torch.where(greedy, OK, statuses).to(torch.int32)
    support_logprobs = None
    if support_rows is not None:
        logprobs = torch.log(weights[:, :packed] / mass[:, None])  # [r*W, K]
        logprobs = torch.where(greedy[:, None], 0.0, logprobs).view(r, width, packed)
        support_logprobs = logprobs.index_select(0, support_rows)
    return {
        "token_ids": packed_ids.view(r, width, packed),
        "lengths": lengths.view(r, width),
        "selected_logprobs": selected_logprobs.float().view(r, width),
        "support_logprobs": support_logprobs,
        "statuses": statuses.view(r, width),
    }


def unsupported_reason(req, simulated_acceptance: bool) -> Optional[str]:
    """Why this worker cannot return `req`'s sampling masks, or None (it replaces SGLang's
    `validate_spec_sampling_mask_request`, which refuses what the built-in cannot serve on CPU).
    SGLang's scheduler has already checked top_k (1, or finite up to the cap)."""
    if simulated_acceptance:
        return "return_sampling_mask is not supported with simulated speculative acceptance"
    return None


def sampling_mask_output(
    batch, logits: torch.Tensor, out_tokens: torch.Tensor, commit_lens: torch.Tensor, max_tokens: int
):
    """SGLang's `SamplingMaskOutput` of one verify step for the requests that asked: each window
    row's support and logprob; SGLang's result processor keeps the committed rows.
    logits [bs*W, V] adjusted, out_tokens [bs, W], commit_lens [bs]; `max_tokens`: SGLang's
    `sampling_mask_max_tokens`."""
    from sglang.srt.layers.logits_processor import SamplingMaskOutput

    info = batch.sampling_info
    requests = info.sampling_mask_batch_indices  # [r] device rows, in batch order
    bs, width = out_tokens.shape
    masks = sampling_masks(
        logits.view(bs, width, -1).index_select(0, requests).flatten(0, 1),
        SamplingRows.from_sampling_info(info).select(requests),
        out_tokens.index_select(0, requests),
        max_tokens,
        info.sampling_support_logprobs_capture_indices,
    )
    return SamplingMaskOutput(**masks, num_accept_tokens=commit_lens.index_select(0, requests))

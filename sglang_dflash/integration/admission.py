"""Which requests this DFLASH worker serves: anything else is rejected when it arrives, with a
message naming the feature, instead of being served wrongly.

Everything a non-speculative SGLang engine serves is served, except what SGLang itself refuses
with speculative decoding (beam search; watermarking is refused at start-up), a custom logit
processor that cannot be deserialized, and `sampling_seed` with `min_p`, which SGLang's own
seeded sampler refuses. (`return_sampling_mask` is checked in `verify/sampling_mask.py`.)

See docs/requests.md.
"""

from __future__ import annotations

from typing import Optional

from sglang_dflash.verify.logit_processors import deserialize_error


def unsupported_feature(req) -> Optional[str]:
    """Why `req` (an SGLang `Req`) cannot be served with DFLASH here, or None."""
    params = req.sampling_params
    processor = getattr(req, "custom_logit_processor", None)
    if processor:
        error = deserialize_error(processor)
        if error is not None:
            # Caught here, before the request reaches a batch: SGLang deserializes processors
            # while building a batch, where a failure would take the whole batch down.
            return f"custom_logit_processor could not be deserialized: {error}"
    watermark = getattr(params, "watermark", None)
    if watermark is not None and getattr(watermark, "enabled", True) is not False:
        return (
            f"sampling_params.watermark={watermark!r}: watermarking is not supported with "
            "--speculative-algorithm DFLASH (SGLang refuses it for DFLASH)"
        )
    beam_width = getattr(params, "beam_width", None)
    if beam_width is not None and beam_width > 1:
        return (
            f"sampling_params.beam_width={beam_width}: beam search is not supported with "
            "speculative decoding (SGLang refuses it for every speculative algorithm)"
        )
    if params.sampling_seed is not None and params.min_p > 0:
        # SGLang's own seeded sampler refuses min_p (layers/sampler.py, pytorch backend).
        return (
            "sglang-dflash does not support sampling_seed together with min_p (SGLang's sampler refuses it)"
        )
    return None


def disarm(req) -> None:
    """Clear what a refused request was refused for. SGLang still runs it through a one-token
    prefill to finish it, and that prefill would deserialize its processor and hand its seed and
    min_p to SGLang's sampler, which asserts on them."""
    import copy

    req.custom_logit_processor = None
    if req.sampling_params.sampling_seed is not None:
        req.sampling_params = copy.copy(req.sampling_params)
        req.sampling_params.sampling_seed = None


def needs_own_sampling(req) -> bool:
    """Does `req` need per-token state that only this worker keeps (penalties, min_new_tokens,
    a custom logit processor)? Such requests are never mixed into a prefill batch: there SGLang's
    own sampler would draw their token, with state that never saw the tokens DFLASH committed."""
    from sglang_dflash.verify.penalties import needs_penalties

    return needs_penalties(req.sampling_params) or bool(getattr(req, "custom_logit_processor", None))

"""Which requests this DFLASH worker serves: anything else is rejected when it arrives, with a
message naming the feature, instead of being served wrongly."""

from __future__ import annotations

from typing import Optional

from sglang_dflash.penalties import needs_penalties
from sglang_dflash.sampling import unsupported_reason


def unsupported_feature(req, *, mixed_chunk: bool) -> Optional[str]:
    """Why `req` (an SGLang `Req`) cannot be served with DFLASH here, or None."""
    params = req.sampling_params
    if req.return_logprob:
        return "sglang-dflash does not return logprobs with DFLASH (return_logprob)"
    if req.return_hidden_states:
        return "sglang-dflash does not return hidden states with DFLASH (return_hidden_states)"
    reason = unsupported_reason(params, getattr(req, "custom_logit_processor", None))
    if reason is not None:
        return reason
    if params.sampling_seed is not None and params.min_p > 0:
        # SGLang's own seeded sampler refuses min_p (layers/sampler.py, pytorch backend).
        return (
            "sglang-dflash does not support sampling_seed together with min_p (SGLang's sampler refuses it)"
        )
    if mixed_chunk and needs_penalties(params):
        # In a mixed batch SGLang's own sampler draws these requests' tokens, with penalty
        # state that never sees the tokens DFLASH commits.
        return (
            "sglang-dflash does not support frequency/presence/repetition penalties or "
            "min_new_tokens together with --enable-mixed-chunk"
        )
    return None

"""Which requests this DFLASH worker serves: anything else is rejected when it arrives, with a
message naming the feature, instead of being served wrongly."""

from __future__ import annotations

from typing import Optional


def unsupported_feature(req) -> Optional[str]:
    """Why `req` (an SGLang `Req`) cannot be served with DFLASH here, or None."""
    params = req.sampling_params
    if req.return_logprob:
        return "sglang-dflash does not return logprobs with DFLASH (return_logprob)"
    for field in ("json_schema", "regex", "ebnf", "structural_tag"):
        if getattr(params, field, None):
            return f"sglang-dflash does not support constrained decoding with DFLASH ({field})"
    if req.return_hidden_states:
        return "sglang-dflash does not return hidden states with DFLASH (return_hidden_states)"
    return None

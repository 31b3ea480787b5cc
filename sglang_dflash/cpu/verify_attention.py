"""TARGET_VERIFY on SGLang's `torch_native` attention backend.

The backend's extend path reads `extend_prefix_lens`/`extend_seq_lens`, which SGLang leaves
unset for TARGET_VERIFY, and there `seq_lens` is the committed prefix only. A verify window of
width W over a prefix of length P is exactly an extend of W tokens after P, so for the call we
present it as one: prefix P, extend W, total P + W (`forward_extend`). SGLang's backend then
writes the window's K/V and runs its SDPA.

Its SDPA loops over the requests in Python and, for each, attends all P + W positions as
queries to keep only the last W rows. For the verify windows this package replaces that loop
with `chain_verify_attention`: one padded, masked SDPA for the whole batch with only the W
window queries (`run_sdpa_forward_extend`). Chosen once per process and logged:
SGLANG_DFLASH_CPU_VERIFY_ATTENTION=per-request keeps SGLang's loop (for comparisons). Layers the
batched form does not cover (sliding-window, cross-attention, non-causal) keep SGLang's loop;
SGLang's CPU engine serves no target with such layers on `torch_native`.

See docs/serving.md ("CPU").
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from contextvars import ContextVar
from typing import Optional

import torch
import torch.nn.functional as F

from sglang_dflash.draft.block import gather_rows, gather_slots

logger = logging.getLogger(__name__)

ENV = "SGLANG_DFLASH_CPU_VERIFY_ATTENTION"
MODES = ("batched", "per-request")

# The verify width of the TARGET_VERIFY forward in progress (None outside one, or when the
# per-request loop was chosen): set by `forward_extend`, read by `run_sdpa_forward_extend`.
_verify_width: ContextVar[Optional[int]] = ContextVar("dflash_verify_width", default=None)
_mode: Optional[str] = None


def mode() -> str:
    """The verify attention on `torch_native`, chosen on first use and logged once."""
    global _mode
    if _mode is None:
        value = os.environ.get(ENV, "batched")
        if value not in MODES:
            raise ValueError(f"{ENV} must be one of {MODES}, got {value!r}")
        _mode = value
        how = "one masked SDPA per layer for the batch" if value == "batched" else "SGLang's per-request loop"
        logger.info("DFLASH verify attention on torch_native: %s (%s=%s)", how, ENV, value)
    return _mode


def chain_verify_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    width: int,
    scaling: Optional[float],
    enable_gqa: bool,
) -> torch.Tensor:
    """The verify windows' attention, as one SDPA for the batch.

    query [bs*W, Hq, d], row r*W + i at position P_r + i; k_cache, v_cache [slots, Hk, d|dv]
    holding each request's prefix and window (the window's K/V written first, as SGLang does);
    prefix_lens [bs] -> [bs*W, Hq, dv]. Query i of request r sees keys 0 .. P_r + i: the chain.
    Keys are gathered padded to max(P) + W; the mask hides the padding.
    E.g., P = [2, 0], W = 2: request 0's queries see keys {0,1,2}, {0,1,2,3}; request 1's {0}, {0,1}.
    """
    bs = prefix_lens.shape[0]
    # The CPU engine's lengths live in host memory: reading their max is not a device sync.
    length = min(int(prefix_lens.max()) + width, req_to_token.shape[1])
    slots = gather_slots(req_to_token, req_pool_indices, 0, length)  # [bs, L]
    keys = gather_rows(k_cache, slots).transpose(1, 2)  # [bs, Hk, L, d]
    values = gather_rows(v_cache, slots).transpose(1, 2)  # [bs, Hk, L, dv]
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    q = query.view(bs, width, *query.shape[1:]).transpose(1, 2)  # [bs, Hq, W, d]
    q_pos = prefix_lens.to(torch.int64)[:, None] + torch.arange(width, device=query.device)  # [bs, W]
    mask = torch.arange(length, device=query.device)[None, None, :] <= q_pos[:, :, None]  # [bs, W, L]
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask[:, None], scale=scaling, enable_gqa=enable_gqa
    )  # [bs, Hq, W, dv]
    return out.transpose(1, 2).reshape(bs * width, out.shape[1], out.shape[3])


def forward_extend(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    saved = (forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, forward_batch.seq_lens)
    prefix = forward_batch.seq_lens
    width = forward_batch.spec_info.draft_token_num
    forward_batch.extend_prefix_lens = prefix
    forward_batch.extend_seq_lens = torch.full_like(prefix, width)
    forward_batch.seq_lens = prefix + width
    token = _verify_width.set(width if mode() == "batched" else None)
    try:
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        _verify_width.reset(token)
        forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, forward_batch.seq_lens = saved


def run_sdpa_forward_extend(original, self, *args, **kwargs):
    """Around SGLang's `TorchNativeAttnBackend._run_sdpa_forward_extend`: inside a verify forward
    (batched mode), plain causal self-attention layers take `chain_verify_attention`."""
    width = _verify_width.get()
    if width is not None:
        call = _sdpa_signature().bind(self, *args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        plain = a["causal"] and not a["is_cross_attn"] and a["encoder_lens"] is None
        if plain and a["sliding_window_size"] is None:
            out = chain_verify_attention(
                a["query"],
                a["k_cache"],
                a["v_cache"],
                a["req_to_token"],
                a["req_pool_indices"],
                a["extend_prefix_lens"],
                width,
                a["scaling"],
                a["enable_gqa"],
            )
            return a["output"].copy_(out)
    return original(self, *args, **kwargs)


@functools.cache
def _sdpa_signature() -> inspect.Signature:
    """SGLang's own signature (`inspect` follows hook wrappers to it through `__wrapped__`)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return inspect.signature(TorchNativeAttnBackend._run_sdpa_forward_extend)

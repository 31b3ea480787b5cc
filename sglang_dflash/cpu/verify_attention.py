"""TARGET_VERIFY on SGLang's `torch_native` attention backend.

The backend's extend path reads `extend_prefix_lens`/`extend_seq_lens`, which SGLang leaves
unset for TARGET_VERIFY, and there `seq_lens` is the committed prefix only. A verify window of
width W over a prefix of length P is exactly an extend of W tokens after P, so for the call we
present it as one: prefix P, extend W, total P + W (`forward_extend`). SGLang's backend then
writes the window's K/V and runs its SDPA.

Its SDPA loops over the requests in Python and, for each, attends all P + W positions as
queries to keep only the last W rows. For the verify windows this package replaces that loop
with `chain_verify_attention`: one padded, masked SDPA for the whole batch with only the W
window queries (`run_sdpa_forward_extend`; `paged_attention.py`), sliding-window layers and
layers with sinks included. Chosen once per process and logged:
SGLANG_DFLASH_CPU_VERIFY_ATTENTION=per-request keeps SGLang's loop (for comparisons; layers with
sinks still take the batched form, the only one that has them). Cross-attention and non-causal
layers keep SGLang's loop; no DFLASH target has them.

See docs/serving.md ("CPU").
"""

from __future__ import annotations

import functools
import inspect
import logging
from contextvars import ContextVar
from typing import Optional

import torch

from sglang_dflash import knobs
from sglang_dflash.cpu import paged_attention

logger = logging.getLogger(__name__)

ENV = "SGLANG_DFLASH_CPU_VERIFY_ATTENTION"

# The verify width of the TARGET_VERIFY forward in progress (None outside one, or when the
# per-request loop was chosen): set by `forward_extend`, read by `run_sdpa_forward_extend`.
_verify_width: ContextVar[Optional[int]] = ContextVar("dflash_verify_width", default=None)
_mode: Optional[knobs.CpuVerifyAttention] = None


def mode() -> knobs.CpuVerifyAttention:
    """The verify attention on `torch_native`, chosen on first use and logged once."""
    global _mode
    if _mode is None:
        _mode = value = knobs.value(ENV)
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
    sliding_window_size: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The verify windows' attention, as one SDPA for the batch.

    query [bs*W, Hq, d], row r*W + i at position P_r + i; k_cache, v_cache [slots, Hk, d|dv]
    holding each request's prefix and window (the window's K/V written first, as SGLang does);
    prefix_lens [bs] -> [bs*W, Hq, dv]. Query i of request r sees keys 0 .. P_r + i: the chain
    (within the layer's sliding window, if any; with its sinks, if any).
    E.g., P = [2, 0], W = 2: request 0's queries see keys {0,1,2}, {0,1,2,3}; request 1's {0}, {0,1}.
    """
    widths = torch.full_like(prefix_lens, width)
    return paged_attention.paged_attention(
        query, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, widths, scaling, enable_gqa,
        sliding_window_size, sinks,
    )  # fmt: skip


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
    (batched mode), causal self-attention layers (sliding or not, with sinks or not) take
    `chain_verify_attention`."""
    width = _verify_width.get()
    if width is not None:
        call = _sdpa_signature().bind(self, *args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        if a["causal"] and not a["is_cross_attn"] and a["encoder_lens"] is None:
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
                a["sliding_window_size"],
                paged_attention.current_sinks(),
            )
            return a["output"].copy_(out)
    return original(self, *args, **kwargs)


@functools.cache
def _sdpa_signature() -> inspect.Signature:
    """SGLang's own signature (`inspect` follows hook wrappers to it through `__wrapped__`)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return inspect.signature(TorchNativeAttnBackend._run_sdpa_forward_extend)

"""Batched attention over SGLang's paged KV cache, and the attention sinks SGLang's `torch_native`
backend lacks.

`paged_attention` runs one masked SDPA for a batch of requests, each a run of queries after its
cached prefix: the TARGET_VERIFY windows (`verify_attention.py`), and the forwards of layers with
attention sinks.

**Sinks (gpt-oss).** A per-head sink logit s_h joins each query's softmax as one more column with
no value: `out = sum_j exp(x_j) v_j / (sum_j exp(x_j) + exp(s_h))`. SGLang's `torch_native`
backend, the CPU engine's attention on hosts without AMX, takes no `sinks` argument, so gpt-oss
fails there at its first forward. `install(module)` (from `bootstrap.PATCHES`, in every CPU
engine process, with or without DFLASH) lets its `forward_extend`/`forward_decode` take `sinks`;
the layers that pass them are served by `paged_attention`, every other layer by SGLang's own
loop, unchanged. The sink is an extra key column: a zero key and a zero value, with s_h added to
its score through SDPA's additive mask (q . 0 + s_h = s_h).

See docs/serving.md ("CPU").
"""

from __future__ import annotations

import functools
from contextvars import ContextVar
from typing import Optional

import torch
import torch.nn.functional as F

from sglang_dflash.draft.block import gather_rows, gather_slots

# The sink logits of the layer whose forward is in progress ([Hq]; None for layers without).
_sinks: ContextVar[Optional[torch.Tensor]] = ContextVar("dflash_attention_sinks", default=None)


def current_sinks() -> Optional[torch.Tensor]:
    return _sinks.get()


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scaling: Optional[float],
    enable_gqa: bool,
    sliding_window_size: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves.

    query [N, Hq, d], N = sum(extend_lens), request r's rows in order, its row i at position
    P_r + i; k_cache, v_cache [slots, Hk, d|dv] already holding every request's prefix and new
    tokens at `req_to_token[req_pool_indices[r], : P_r + E_r]`; prefix_lens, extend_lens [bs];
    sliding_window_size as SGLang's layers give it (keys at positions p - window .. p); sinks
    [Hq] or None -> [N, Hq, dv] in query's dtype.
    E.g., P = [2, 0], E = [2, 1]: request 0's rows (positions 2, 3) see keys {0,1,2}, {0,1,2,3};
    request 1's row (position 0) sees {0}. Keys and queries are gathered padded to
    max(P + E) and max(E); the mask hides the padding.
    """
    bs = prefix_lens.shape[0]
    prefix, ext = prefix_lens.to(torch.int64), extend_lens.to(torch.int64)
    # The CPU engine's lengths live in host memory: reading their max is not a device sync.
    width = int(ext.max())
    length = min(int((prefix + ext).max()), req_to_token.shape[1])
    slots = gather_slots(req_to_token, req_pool_indices, 0, length)  # [bs, L]
    keys = gather_rows(k_cache, slots).transpose(1, 2)  # [bs, Hk, L, d]
    values = gather_rows(v_cache, slots).transpose(1, 2)  # [bs, Hk, L, dv]
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    uniform = query.shape[0] == bs * width  # every request has `width` rows: no padding
    if uniform:
        q = query.view(bs, width, *query.shape[1:])
    else:
        req = torch.repeat_interleave(torch.arange(bs, device=ext.device), ext)  # [N] request of each row
        starts = torch.cumsum(ext, 0) - ext  # [bs] each request's first row
        within = torch.arange(query.shape[0], device=ext.device) - starts[req]  # [N] row within it
        q = query.new_zeros(bs, width, *query.shape[1:])
        q[req, within] = query
    q = q.transpose(1, 2)  # [bs, Hq, E, d]
    q_pos = prefix[:, None] + torch.arange(width, device=ext.device)  # [bs, E]
    k_pos = torch.arange(length, device=ext.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [bs, E, L]
    if sliding_window_size is not None and sliding_window_size > -1:
        mask &= k_pos[None, None, :] >= q_pos[:, :, None] - sliding_window_size
    mask = mask[:, None]  # [bs, 1, E, L]
    if sinks is not None:
        keys = F.pad(keys, (0, 0, 0, 1))  # [bs, Hk, L + 1, d]: the sink's zero key
        values = F.pad(values, (0, 0, 0, 1))  # and zero value
        bias = torch.zeros((), dtype=query.dtype).masked_fill(~mask, float("-inf"))  # [bs, 1, E, L]
        sink = sinks.to(query.dtype)[None, :, None, None].expand(bs, -1, width, 1)  # [bs, Hq, E, 1]
        mask = torch.cat([bias.expand(-1, sink.shape[1], -1, -1), sink], dim=-1)  # [bs, Hq, E, L + 1]
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scaling, enable_gqa=enable_gqa
    )  # [bs, Hq, E, dv]
    out = out.transpose(1, 2)  # [bs, E, Hq, dv]
    return out.reshape(bs * width, *out.shape[2:]) if uniform else out[req, within]


# ---- attention sinks on SGLang's torch_native backend (installed by cpu/bootstrap.py) ----------


def _forward_with_sinks(original):
    """`forward_extend`/`forward_decode` that also take SGLang's `sinks` keyword, for the layer's
    `_run_sdpa_*` call (a layer without sinks runs exactly as before)."""

    @functools.wraps(original)
    def forward(self, q, k, v, layer, forward_batch, *args, sinks=None, **kwargs):
        token = _sinks.set(sinks)
        try:
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            _sinks.reset(token)

    return forward


def _refuse_uncausal(causal: bool, is_cross_attn: bool, encoder_lens) -> None:
    if not causal or is_cross_attn or encoder_lens is not None:
        raise NotImplementedError(
            "attention sinks on the CPU engine's torch_native backend are served for causal "
            "self-attention only (sglang_dflash/cpu/paged_attention.py)"
        )


def _extend_with_sinks(original):
    @functools.wraps(original)
    def run(
        self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
        causal=False, is_cross_attn=False, sliding_window_size=None,
    ):  # fmt: skip
        sinks = _sinks.get()
        if sinks is None:
            return original(
                self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size,
            )  # fmt: skip
        _refuse_uncausal(causal, is_cross_attn, encoder_lens)
        out = paged_attention(
            query, k_cache, v_cache, req_to_token, req_pool_indices, extend_prefix_lens, extend_seq_lens,
            scaling, enable_gqa, sliding_window_size, sinks,
        )  # fmt: skip
        return output.copy_(out)

    return run


def _decode_with_sinks(original):
    @functools.wraps(original)
    def run(
        self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
        sliding_window_size=None,
    ):  # fmt: skip
        sinks = _sinks.get()
        if sinks is None:
            return original(
                self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size,
            )  # fmt: skip
        # SGLang passes causal=False for decode (one query, the newest position): it is causal.
        _refuse_uncausal(True, is_cross_attn, encoder_lens)
        out = paged_attention(
            query, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens - 1, torch.ones_like(seq_lens),
            scaling, enable_gqa, sliding_window_size, sinks,
        )  # fmt: skip
        return output.copy_(out)

    return run


def install(module) -> None:
    """Attention sinks on `module.TorchNativeAttnBackend` (SGLang's torch_native_backend)."""
    backend = module.TorchNativeAttnBackend
    backend.forward_extend = _forward_with_sinks(backend.forward_extend)
    backend.forward_decode = _forward_with_sinks(backend.forward_decode)
    backend._run_sdpa_forward_extend = _extend_with_sinks(backend._run_sdpa_forward_extend)
    backend._run_sdpa_forward_decode = _decode_with_sinks(backend._run_sdpa_forward_decode)

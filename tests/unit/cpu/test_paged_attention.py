"""`paged_attention` (batched attention over SGLang's paged KV cache, with sliding windows and
attention sinks) against two oracles: SGLang's own per-request torch_native SDPA where SGLang has
the case (no sinks), and a hand softmax with a sink column, one request and head at a time, for
gpt-oss's sinks. Then the sinks patch on SGLang's TorchNativeAttnBackend, called as SGLang calls
it: layers with sinks are served, layers without pass through unchanged."""

import math

import pytest
import torch

from sglang_dflash.cpu import paged_attention
from tests.support.paged_attention import D, paged_case

pytestmark = pytest.mark.sglang  # SGLang's torch_native backend is an oracle


def _hand(query, k_cache, v_cache, req_to_token, rows, prefix, ext, scale, window=None, sinks=None):
    """One request, one head, one query at a time: softmax over the visible keys' scores and,
    with sinks, one more column holding the head's sink logit (no value)."""
    heads, kv_heads = query.shape[1], k_cache.shape[1]
    out = torch.zeros(query.shape[0], heads, v_cache.shape[-1])
    row = 0
    for r, (p, e) in enumerate(zip(prefix.tolist(), ext.tolist())):
        slots = req_to_token[rows[r], : p + e].long()
        for i in range(e):
            pos = p + i
            first = 0 if window is None else max(0, pos - window)
            keys, values = k_cache[slots[first : pos + 1]].float(), v_cache[slots[first : pos + 1]].float()
            for h in range(heads):
                hk = h * kv_heads // heads
                scores = [scale * float(query[row, h] @ keys[j, hk]) for j in range(len(keys))]
                column = scores + ([float(sinks[h])] if sinks is not None else [])
                top = max(column)
                weights = [math.exp(s - top) for s in column]
                total = sum(weights)
                for j in range(len(keys)):
                    out[row, h] += weights[j] / total * values[j, hk]
            row += 1
    return out


CASES = [
    # prefix lens, extend lens, heads, kv heads
    ([5, 0, 37, 12], [3, 7, 1, 4], 4, 2),  # ragged: prefill chunks of different lengths
    ([60, 3, 17], [1, 1, 1], 8, 2),  # decode-like
    ([20, 7, 0], [8, 8, 8], 4, 1),  # verify-like: one width
]


@pytest.mark.parametrize("prefix_lens, extend_lens, heads, kv_heads", CASES)
@pytest.mark.parametrize("window", [None, 6])
def test_sinks_match_a_hand_softmax_with_a_sink_column(prefix_lens, extend_lens, heads, kv_heads, window):
    query, k_cache, v_cache, req_to_token, rows, prefix, ext, sinks = paged_case(
        prefix_lens, extend_lens, heads, kv_heads
    )
    scale = D**-0.5
    got = paged_attention.paged_attention(
        query, k_cache, v_cache, req_to_token, rows, prefix, ext, scale, heads != kv_heads, window, sinks
    )
    want = _hand(query, k_cache, v_cache, req_to_token, rows, prefix, ext, scale, window, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Negative control: without the sink column the answer is measurably different.
    plain = _hand(query, k_cache, v_cache, req_to_token, rows, prefix, ext, scale, window)
    assert (plain - want).abs().max() > 1e-2


def _sglang_extend(query, k_cache, v_cache, req_to_token, rows, prefix, ext, scale, gqa, window=None):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    backend = object.__new__(TorchNativeAttnBackend)
    output = torch.empty(query.shape[0], query.shape[1], v_cache.shape[-1], dtype=query.dtype)
    stock = TorchNativeAttnBackend._run_sdpa_forward_extend
    while hasattr(stock, "__wrapped__"):  # SGLang's own, under our hooks and patches
        stock = stock.__wrapped__
    return stock(
        backend, query, output, k_cache, v_cache, req_to_token, rows, prefix + ext, prefix, ext,
        scaling=scale, enable_gqa=gqa, causal=True, sliding_window_size=window,
    )  # fmt: skip


@pytest.mark.parametrize("prefix_lens, extend_lens, heads, kv_heads", CASES)
@pytest.mark.parametrize("window", [None, 6])
def test_without_sinks_equals_sglangs_per_request_sdpa(prefix_lens, extend_lens, heads, kv_heads, window):
    query, k_cache, v_cache, req_to_token, rows, prefix, ext, _ = paged_case(
        prefix_lens, extend_lens, heads, kv_heads
    )
    gqa = heads != kv_heads
    got = paged_attention.paged_attention(
        query, k_cache, v_cache, req_to_token, rows, prefix, ext, D**-0.5, gqa, window
    )
    want = _sglang_extend(query, k_cache, v_cache, req_to_token, rows, prefix, ext, D**-0.5, gqa, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_bf16_cache_is_read_in_the_querys_dtype():
    query, k_cache, v_cache, req_to_token, rows, prefix, ext, sinks = paged_case(
        [9, 2], [2, 3], 4, 2, dtype=torch.bfloat16
    )
    got = paged_attention.paged_attention(
        query, k_cache, v_cache, req_to_token, rows, prefix, ext, D**-0.5, True, None, sinks
    )
    want = _hand(query, k_cache, v_cache, req_to_token, rows, prefix, ext, D**-0.5, None, sinks)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _Recorder:
    """Stands in for SGLang's `_run_sdpa_*` under the patch: records the calls it passes on."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return "sglang"


def _patched_backend():
    """A class shaped like TorchNativeAttnBackend, with the sinks patch installed over recorders
    for SGLang's SDPA loops and forward methods that call them as SGLang's do."""
    import types

    extend, decode = _Recorder(), _Recorder()

    class Backend:
        _run_sdpa_forward_extend = extend
        _run_sdpa_forward_decode = decode

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            f = forward_batch
            return self._run_sdpa_forward_extend(
                q, f.output, f.k_cache, f.v_cache, f.req_to_token, f.rows, f.seq_lens, f.prefix, f.ext,
                None, scaling=f.scale, enable_gqa=True, causal=True, is_cross_attn=False,
                sliding_window_size=f.window,
            )  # fmt: skip

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            f = forward_batch
            return self._run_sdpa_forward_decode(
                q, f.output, f.k_cache, f.v_cache, f.req_to_token, f.rows, f.seq_lens, None,
                scaling=f.scale, enable_gqa=True, causal=False, is_cross_attn=False,
                sliding_window_size=f.window,
            )  # fmt: skip

    paged_attention.install(types.SimpleNamespace(TorchNativeAttnBackend=Backend))
    return Backend(), extend, decode


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_the_patched_backend_serves_layers_with_sinks_and_passes_the_rest_through(mode):
    import types

    prefix_lens, extend_lens = ([5, 0, 37, 12], [3, 7, 1, 4]) if mode == "extend" else ([5, 0, 37], [1, 1, 1])
    query, k_cache, v_cache, req_to_token, rows, prefix, ext, sinks = paged_case(
        prefix_lens, extend_lens, 4, 2
    )
    batch = types.SimpleNamespace(
        output=torch.empty_like(query), k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
        rows=rows, seq_lens=prefix + ext, prefix=prefix, ext=ext, scale=D**-0.5, window=6,
    )  # fmt: skip
    backend, extend, decode = _patched_backend()
    forward = backend.forward_extend if mode == "extend" else backend.forward_decode
    got = forward(query, None, None, None, batch, save_kv_cache=True, sinks=sinks)
    assert extend.calls == decode.calls == 0  # served here
    want = _hand(query, k_cache, v_cache, req_to_token, rows, prefix, ext, D**-0.5, 6, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert forward(query, None, None, None, batch, save_kv_cache=True) == "sglang"  # no sinks: SGLang's
    assert extend.calls + decode.calls == 1
    assert paged_attention.current_sinks() is None  # the layer's sinks do not leak to the next


def test_sinks_on_cross_attention_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="causal self-attention only"):
        paged_attention._refuse_uncausal(True, True, None)

"""The batched chain-verify attention on `torch_native` against SGLang's own per-request extend
SDPA given the same windows as extends (what served verify windows before), on ragged batches."""

import pytest
import torch

from sglang_dflash.cpu import verify_attention
from tests.support.paged_attention import paged_case

pytestmark = pytest.mark.sglang  # SGLang's torch_native backend is the oracle


def _case(prefix_lens, width, heads, kv_heads, dtype, seed=0):
    """test_paged_attention's random cache and queries, every request a window of `width`."""
    query, k_cache, v_cache, req_to_token, rows, prefix, _, _ = paged_case(
        prefix_lens, [width] * len(prefix_lens), heads, kv_heads, seed, dtype
    )
    return query, k_cache, v_cache, req_to_token, rows, prefix


def _sglang_per_request(query, k_cache, v_cache, req_to_token, rows, prefix, width, scale, gqa):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    backend = object.__new__(TorchNativeAttnBackend)
    output = torch.empty(query.shape[0], query.shape[1], v_cache.shape[-1], dtype=query.dtype)
    stock = TorchNativeAttnBackend._run_sdpa_forward_extend
    stock = getattr(stock, "__wrapped__", stock)  # SGLang's own, if our hook is installed
    widths = torch.full_like(prefix, width)
    return stock(
        backend, query, output, k_cache, v_cache, req_to_token, rows, prefix + width, prefix, widths,
        scaling=scale, enable_gqa=gqa, causal=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "prefix_lens, width, heads, kv_heads, dtype",
    [
        ([5, 0, 37, 12], 4, 4, 2, torch.float32),
        ([1], 8, 4, 4, torch.float32),
        ([60, 3, 17, 0, 9, 44, 2, 30], 16, 8, 2, torch.float32),
        ([20, 7, 0], 8, 4, 1, torch.bfloat16),  # a bf16 cache, fp32 queries
    ],
)
def test_batched_equals_sglangs_per_request_extend(prefix_lens, width, heads, kv_heads, dtype):
    query, k_cache, v_cache, req_to_token, rows, prefix = _case(prefix_lens, width, heads, kv_heads, dtype)
    scale = 16**-0.5
    got = verify_attention.chain_verify_attention(
        query, k_cache, v_cache, req_to_token, rows, prefix, width, scale, heads != kv_heads
    )
    want = _sglang_per_request(
        query, k_cache, v_cache, req_to_token, rows, prefix, width, scale, heads != kv_heads
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_wrong_mask_is_caught():
    """Negative control: a window that also saw its own later positions differs."""
    prefix_lens, width = [5, 0, 37, 12], 4
    query, k_cache, v_cache, req_to_token, rows, prefix = _case(prefix_lens, width, 4, 2, torch.float32)
    got = verify_attention.chain_verify_attention(
        query, k_cache, v_cache, req_to_token, rows, prefix + 1, width, None, True
    )
    want = _sglang_per_request(query, k_cache, v_cache, req_to_token, rows, prefix, width, 16**-0.5, True)
    assert (got - want).abs().max() > 1e-2


def test_the_mode_is_chosen_once_and_checked(monkeypatch):
    monkeypatch.setattr(verify_attention, "_mode", None)
    monkeypatch.setenv(verify_attention.ENV, "fastest")
    with pytest.raises(ValueError, match="'fastest' is not batched or per-request"):
        verify_attention.mode()
    monkeypatch.setenv(verify_attention.ENV, "per-request")
    assert verify_attention.mode() == "per-request"
    monkeypatch.setenv(verify_attention.ENV, "batched")
    assert verify_attention.mode() == "per-request"  # chosen once per process


def test_the_hook_takes_verify_windows_and_passes_everything_else_through():
    """Called as SGLang's forward_extend calls it: positional tensors, keyword options."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    prefix_lens, width = [5, 0, 37, 12], 4
    query, k_cache, v_cache, req_to_token, rows, prefix = _case(prefix_lens, width, 4, 2, torch.float32)
    stock = TorchNativeAttnBackend._run_sdpa_forward_extend
    stock = getattr(stock, "__wrapped__", stock)
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return stock(*args, **kwargs)

    backend = object.__new__(TorchNativeAttnBackend)
    widths = torch.full_like(prefix, width)

    def run(**options):
        output = torch.empty_like(query)
        args = (backend, query, output, k_cache, v_cache, req_to_token, rows, prefix + width, prefix, widths)
        return verify_attention.run_sdpa_forward_extend(original, *args, None, scaling=0.25, **options)

    token = verify_attention._verify_width.set(width)
    try:
        got = run(enable_gqa=True, causal=True)
        got_sliding = run(enable_gqa=True, causal=True, sliding_window_size=8)
        assert not calls  # both served by the batched form
        run(enable_gqa=True, causal=False)
        assert len(calls) == 1  # a non-causal layer keeps SGLang's loop
    finally:
        verify_attention._verify_width.reset(token)
    want = run(enable_gqa=True, causal=True)  # outside a verify forward: SGLang's loop
    want_sliding = run(enable_gqa=True, causal=True, sliding_window_size=8)
    assert len(calls) == 3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_sliding, want_sliding, rtol=1e-5, atol=1e-5)
    assert (got_sliding - got).abs().max() > 1e-2  # the window mattered (prefixes up to 37)

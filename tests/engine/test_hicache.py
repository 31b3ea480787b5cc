"""HiCache (`--enable-hierarchical-cache`) backs up and reloads the draft's K/V with the target's.

A long prompt is served, then pushed out of the device KV pool by other prompts, so its prefix
lives only in host memory; the same prompt, extended, is then served from there ("warm"), and
once more after `flush_cache` from nothing ("cold"). The draft's raw proposals at every decode
step (the proposal trace) must be identical: the reloaded slots hold the prompt's draft K/V.
With the draft left out of HiCache's backups (a test-only knob) the reloaded slots hold stale
draft K/V, and the same check fails; the tokens stay identical either way (the target verifies).
With the draft's window ring, a mixed draft's full layer is backed up and its sliding layer's
window re-prefilled from the reloaded prefix: the same check holds.
On CPU, SGLang's host-pool copies run on `sglang_dflash/cpu/kvcacheio.py`.
"""

import os

import pytest
import torch

from tests.support import engines

pytestmark = pytest.mark.sglang

PROMPT = engines.prompts(1, seed=31, min_len=320, max_len=320)[0]
FILLERS = [engines.prompts(1, seed=200 + i, min_len=320, max_len=320)[0] for i in range(4)]
SHORT = {"max_new_tokens": 4, "temperature": 0}
SAMPLING = {"max_new_tokens": 24, "temperature": 0}
HICACHE = dict(enable_hierarchical_cache=True, hicache_ratio=4, max_total_tokens=1024, page_size=1)


def _mixed_draft(tiny) -> tuple[str, str]:
    """Draft "b" (two layers, block 8) with its first layer sliding (window 32), and its target."""

    def first_layer_sliding(config):
        config.update(
            layer_types=["sliding_attention", "full_attention"], sliding_window=32, use_sliding_window=True
        )

    target, _ = tiny.pair("b")
    return target, tiny.edited_draft("b", "first-layer-sliding", first_layer_sliding)


def _run(tiny, trace_path, skip_draft_backup: bool, window_ring: bool = False):
    env = {"SGLANG_DFLASH_TRACE_PROPOSALS": str(trace_path)}
    if skip_draft_backup:
        env["SGLANG_DFLASH_TEST_SKIP_DRAFT_HICACHE"] = "1"
    if window_ring:  # --max-total-tokens caps the pool, where `auto` would keep every token
        env["SGLANG_DFLASH_DRAFT_WINDOW_POOL"] = "1"
    os.environ.update(env)
    try:
        # Fixed width: the warm and cold runs must verify the same windows to compare them.
        pair = _mixed_draft(tiny) if window_ring else tiny.pair("a")
        engine = engines.start(*pair, 8, fixed_width=True, **HICACHE)
    finally:
        for key in env:
            os.environ.pop(key)
    try:
        engine.generate(input_ids=PROMPT, sampling_params=SHORT)
        for filler in FILLERS:  # 4 x 320 tokens through a 1024-token device pool
            engine.generate(input_ids=filler, sampling_params=SHORT)
        prompt = PROMPT + [7, 8, 9, 10]
        warm = engine.generate(input_ids=prompt, sampling_params=SAMPLING, rid="warm")
        engines.flush_cache(engine)
        cold = engine.generate(input_ids=prompt, sampling_params=SAMPLING, rid="cold")
        state = engines.server_state(engine)
    finally:
        engines.shutdown(engine)
    steps = engines.proposal_steps(trace_path)
    assert len(steps["warm"]) >= 2 and len(steps["cold"]) >= 2
    return warm, cold, steps["warm"], steps["cold"], state


def _host_hit(output) -> int:
    details = output["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("host", 0))


def test_a_prefix_reloaded_from_host_gives_the_same_draft_proposals(tiny, tmp_path):
    warm, cold, warm_steps, cold_steps, _ = _run(tiny, tmp_path / "trace.jsonl", skip_draft_backup=False)
    assert _host_hit(warm) >= len(PROMPT) // 2, warm["meta_info"]  # the prefix came from host
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["output_ids"] == cold["output_ids"]
    assert warm_steps == cold_steps


def test_with_a_window_ring_the_full_layer_is_reloaded_and_the_window_re_prefilled(tiny, tmp_path):
    """A draft whose first layer keeps a window ring: HiCache backs up and reloads its full
    layer (the draft pool holds the full layers only), and the reloaded prefix's last window is
    prefilled again, filling the ring. The same proposals as from nothing, no step without its
    window. (Without the full layer's backup, or without the re-prefill, the proposals differ:
    the test below, and tests/engine/test_window_pool.py.)"""
    warm, cold, warm_steps, cold_steps, state = _run(
        tiny, tmp_path / "trace.jsonl", skip_draft_backup=False, window_ring=True
    )
    kv = state["dflash_draft_kv"]
    assert kv["sliding_layers_windowed"] is True and kv["full_layers"] == [1], kv
    assert _host_hit(warm) >= len(PROMPT) // 2, warm["meta_info"]
    assert warm["output_ids"] == cold["output_ids"]
    assert warm_steps == cold_steps
    assert state["dflash_window_misses"] == {"requests": 0, "positions": 0}


@pytest.mark.slow  # the demonstration that the check above can fail: one more engine, with --run-slow
def test_check_fails_without_the_draft_backup(tiny, tmp_path):
    warm, cold, warm_steps, cold_steps, _ = _run(tiny, tmp_path / "trace.jsonl", skip_draft_backup=True)
    assert _host_hit(warm) >= len(PROMPT) // 2, warm["meta_info"]
    assert warm["output_ids"] == cold["output_ids"]  # still lossless: only the draft is wrong
    assert warm_steps != cold_steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_copies_move_each_tokens_rows_between_the_layouts(dtype):
    """The CPU stand-ins against indexing: a backup puts device layer l's row d at host token h,
    layer l; a load puts host token h, layer l back at device row d."""
    from sglang_dflash.cpu.kvcacheio import transfer_kv_all_layer_lf_pf, transfer_kv_per_layer_pf_lf

    layers, rows, tokens, heads, dim = 3, 40, 64, 2, 8
    device_k = [torch.randn(rows, heads, dim).to(dtype) for _ in range(layers)]
    device_v = [torch.randn(rows, heads, dim).to(dtype) for _ in range(layers)]
    host_k, host_v = (
        torch.zeros(tokens, layers, heads, dim, dtype=dtype),
        torch.zeros(tokens, layers, heads, dim, dtype=dtype),
    )
    item = heads * dim * host_k.element_size()
    d_idx, h_idx = torch.tensor([3, 17, 39, 5]), torch.tensor([60, 0, 11, 12])

    def table(buffers):
        return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)

    transfer_kv_all_layer_lf_pf(
        table(device_k), host_k, table(device_v), host_v, d_idx, h_idx, item, item * layers, layers
    )
    for layer in range(layers):
        assert torch.equal(host_k[h_idx, layer], device_k[layer][d_idx])
        assert torch.equal(host_v[h_idx, layer], device_v[layer][d_idx])
    untouched = torch.ones(tokens, dtype=torch.bool)
    untouched[h_idx] = False
    assert not host_k[untouched].any() and not host_v[untouched].any()

    for layer in range(layers):
        back_k, back_v = torch.zeros_like(device_k[layer]), torch.zeros_like(device_v[layer])
        transfer_kv_per_layer_pf_lf(host_k, back_k, host_v, back_v, h_idx, d_idx, layer, item, item * layers)
        assert torch.equal(back_k[d_idx], device_k[layer][d_idx])
        assert torch.equal(back_v[d_idx], device_v[layer][d_idx])

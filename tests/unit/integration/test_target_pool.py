"""The draft store's size from the target's KV pool, for every pool shape SGLang hands over."""

import pytest

pytestmark = pytest.mark.sglang


def _bare(cls, **fields):
    """An instance of an SGLang pool class without its buffers: only the fields read here."""
    obj = object.__new__(cls)
    for key, value in fields.items():
        setattr(obj, key, value)
    return obj


def test_sized_from_the_full_attention_pool_of_every_known_shape():
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from sglang_dflash.integration.target_pool import num_target_slots

    full = _bare(MHATokenToKVPool, size=1000, page_size=1)
    assert num_target_slots(full) == 1001
    assert num_target_slots(_bare(MLATokenToKVPool, size=64, page_size=16)) == 80
    # Hybrid linear attention: layer 0 may be a linear layer; the full-attention layers live in
    # full_kv_pool. Sliding window: the SWA pool is smaller, slot ids are the full pool's.
    assert num_target_slots(_bare(HybridLinearKVPool, full_kv_pool=full, size=7)) == 1001
    swa = _bare(SWAKVPool, full_kv_pool=full, swa_kv_pool=_bare(MHATokenToKVPool, size=500, page_size=1))
    assert num_target_slots(swa) == 1001


def test_real_sglang_pools_built_on_cpu():
    """The pools SGLang builds for sliding-window (gpt-oss, Gemma-4) and MLA (DeepSeek-V3,
    Kimi-K2.5) targets, which its CPU engine cannot serve with torch_native: the store covers
    every slot id the allocator hands out, which for SWA is the full pool's, not layer 0's."""
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from sglang_dflash.integration.target_pool import num_target_slots

    common = dict(dtype=torch.float32, device="cpu", enable_memory_saver=False)
    swa = SWAKVPool(
        size=256,
        size_swa=64,
        page_size=1,
        head_num=2,
        head_dim=8,
        swa_attention_layer_ids=[0, 2],
        full_attention_layer_ids=[1, 3],
        **common,
    )
    assert swa.get_key_buffer(0).shape[0] == 65  # layer 0 is a sliding layer: the small pool
    assert num_target_slots(swa) == 257
    allocator = SWATokenToKVPoolAllocator(
        size=256, size_swa=64, page_size=1, dtype=torch.float32, device="cpu", kvcache=swa, need_sort=False
    )
    ids = []
    for _ in range(8):  # as a long context: older tokens leave the window and free their SWA slots
        ids.append(allocator.alloc(32))
        allocator.free_swa(ids[-1])
    ids = torch.cat(ids)
    assert int(ids.max()) > 64  # beyond the SWA pool: slot ids are the full pool's
    assert int(ids.max()) < num_target_slots(swa)

    mla = MLATokenToKVPool(size=128, page_size=16, kv_lora_rank=32, qk_rope_head_dim=8, layer_num=2, **common)
    assert num_target_slots(mla) == 144 == mla.get_key_buffer(0).shape[0]
    paged = MHATokenToKVPool(size=128, page_size=16, head_num=2, head_dim=8, layer_num=2, **common)
    assert num_target_slots(paged) == 144 == paged.get_key_buffer(0).shape[0]


def test_post_capture_kv_sizing_is_refused():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_dflash.integration.target_pool import num_target_slots

    pool = _bare(MHATokenToKVPool, size=1000, page_size=1, post_capture_active=True)
    with pytest.raises(ValueError, match="SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"):
        num_target_slots(pool)


def test_an_unknown_pool_is_refused_naming_it():
    from sglang_dflash.integration.target_pool import num_target_slots

    class SomeNewPool:
        size, page_size = 10, 1

    with pytest.raises(ValueError, match="SomeNewPool"):
        num_target_slots(SomeNewPool())

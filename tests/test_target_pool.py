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

    from sglang_dflash.target_pool import num_target_slots

    full = _bare(MHATokenToKVPool, size=1000, page_size=1)
    assert num_target_slots(full) == 1001
    assert num_target_slots(_bare(MLATokenToKVPool, size=64, page_size=16)) == 80
    # Hybrid linear attention: layer 0 may be a linear layer; the full-attention layers live in
    # full_kv_pool. Sliding window: the SWA pool is smaller, slot ids are the full pool's.
    assert num_target_slots(_bare(HybridLinearKVPool, full_kv_pool=full, size=7)) == 1001
    swa = _bare(SWAKVPool, full_kv_pool=full, swa_kv_pool=_bare(MHATokenToKVPool, size=500, page_size=1))
    assert num_target_slots(swa) == 1001


def test_an_unknown_pool_is_refused_naming_it():
    from sglang_dflash.target_pool import num_target_slots

    class SomeNewPool:
        size, page_size = 10, 1

    with pytest.raises(ValueError, match="SomeNewPool"):
        num_target_slots(SomeNewPool())

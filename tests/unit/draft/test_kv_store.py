"""The draft KV store's dtype, bytes and memory region, against SGLang's own resolution, budget
and memory saver; and an fp8 store read by the SDPA draft attention, against SDPA over the same
K/V rounded through fp8 (SGLang's CPU engine serves an fp8 KV cache only with Intel AMX, so
this is where the fp8 path is checked on CPU)."""

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.attention import SdpaDraftAttention
from sglang_dflash.draft.kv_store import DraftKVStore, kv_cache_region, resolve_draft_kv_dtype
from sglang_dflash.draft.tensor_parallel import TensorParallel
from tests.support.tiny import draft_config_dict

pytestmark = pytest.mark.sglang  # imports SGLang's resolution and budget functions


def _runtime(monkeypatch, kv_cache_dtype, draft_kv_cache_dtype=None, memory_saver=False):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_model", lambda: SimpleNamespace(kv_cache_dtype=kv_cache_dtype))
    spec = SimpleNamespace(
        speculative_draft_kv_cache_dtype=draft_kv_cache_dtype, speculative_draft_attention_backend=None
    )
    monkeypatch.setattr(rc, "get_spec", lambda: spec)
    features = SimpleNamespace(enable_memory_saver=memory_saver)
    monkeypatch.setattr(rc, "get_exec", lambda: SimpleNamespace(features=features))


@pytest.mark.parametrize(
    "kv, draft_kv, want",
    [
        ("auto", None, torch.bfloat16),
        ("fp8_e4m3", None, torch.float8_e4m3fn),
        ("fp8_e4m3", "bf16", torch.bfloat16),
        ("auto", "fp8_e4m3", torch.float8_e4m3fn),
    ],
)
@pytest.mark.parametrize("tp_size", [1, 2])
def test_store_dtype_and_bytes_are_what_sglang_budgets(monkeypatch, kv, draft_kv, want, tp_size):
    """Per rank under tensor parallelism: the store holds this rank's KV heads."""
    from sglang.srt.speculative.dflash_utils import dflash_draft_cell_size_per_token

    _runtime(monkeypatch, kv, draft_kv)
    dtype = resolve_draft_kv_dtype(torch.bfloat16)
    assert dtype == want
    layers, kv_heads, head_dim, slots = 3, 2, 16, 100
    store = DraftKVStore(
        num_slots=slots,
        num_layers=layers,
        num_kv_heads=TensorParallel(size=tp_size).split(kv_heads, "KV heads"),  # as the worker does
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
    )
    draft_model_config = SimpleNamespace(
        get_num_kv_heads=lambda tp: kv_heads // tp, head_dim=head_dim, v_head_dim=head_dim
    )
    per_token = dflash_draft_cell_size_per_token(
        draft_model_config=draft_model_config,
        draft_num_layers=layers,
        draft_kv_cache_dtype=dtype,
        tp_size=tp_size,
    )
    assert store.nbytes == slots * per_token


def test_a_kv_dtype_the_store_cannot_hold_is_refused_naming_the_flags(monkeypatch):
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no fp4 dtype")
    _runtime(monkeypatch, "nvfp4")
    with pytest.raises(
        ValueError, match="--kv-cache-dtype nvfp4 .* pass --speculative-draft-kv-cache-dtype bf16"
    ):
        resolve_draft_kv_dtype(torch.bfloat16)
    _runtime(monkeypatch, "nvfp4", "bf16")
    assert resolve_draft_kv_dtype(torch.bfloat16) == torch.bfloat16


def test_fp8_store_round_trips_through_sdpa_draft_attention():
    torch.manual_seed(0)
    config = DFlashDraftConfig.from_dict(draft_config_dict())
    kv_heads, d, heads, block = config.num_key_value_heads, config.head_dim, config.num_attention_heads, 4
    shape = dict(num_slots=64, num_layers=1, num_kv_heads=kv_heads, head_dim=d, device="cpu")
    fp8 = DraftKVStore(dtype=torch.float8_e4m3fn, **shape)
    exact = DraftKVStore(dtype=torch.float32, **shape)
    rounded = DraftKVStore(dtype=torch.float32, **shape)  # the oracle: K/V rounded through fp8
    slots = torch.randperm(63)[:40] + 1
    k, v = torch.randn(1, 40, kv_heads, d), torch.randn(1, 40, kv_heads, d)
    for store in (fp8, exact):
        store.write(slots, k, v)
    rounded.write(slots, k.to(torch.float8_e4m3fn).float(), v.to(torch.float8_e4m3fn).float())
    assert fp8.nbytes * 4 == exact.nbytes

    req_to_token = torch.zeros(2, 32, dtype=torch.int64)
    req_to_token[0, :25], req_to_token[1, :15] = slots[:25], slots[25:]
    lens = torch.tensor([25, 15])
    q = torch.randn(2 * block, heads, d)
    kb, vb = torch.randn(2 * block, kv_heads, d), torch.randn(2 * block, kv_heads, d)

    def attend(store):
        attention = SdpaDraftAttention(config, store).bind(req_to_token, torch.arange(2), lens, lens, block)
        return attention(0, q, kb, vb)

    got, want, unrounded = attend(fp8), attend(rounded), attend(exact)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got - unrounded).abs().max() > 1e-3  # the store really holds fp8
    torch.testing.assert_close(got, unrounded, rtol=0.1, atol=0.1)


def test_persistent_buffers_go_to_the_memory_savers_kv_region(monkeypatch):
    from sglang.srt.utils import torch_memory_saver_adapter as tms

    regions = []
    monkeypatch.setattr(
        tms._TorchMemorySaverAdapterReal, "region", lambda self, tag, **kw: regions.append(tag)
    )
    _runtime(monkeypatch, "auto", memory_saver=True)
    kv_cache_region()
    assert regions == ["kv_cache"]
    _runtime(monkeypatch, "auto", memory_saver=False)
    with kv_cache_region():  # a no-op without --enable-memory-saver
        pass
    assert regions == ["kv_cache"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_size", [1, 4])
def test_the_pool_sglang_reads_is_the_stores_memory(monkeypatch, dtype, page_size):
    """SGLang's view of the store (`DraftKVPool`, what PD transfer registers) covers the target
    pool's rows of the same tensors: no copy, and every byte SGLang's transfer reads at a slot
    is the store's K/V at that slot. Scratch rows past the target's range are not in it."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_dflash.integration.draft_pool import DraftKVPool

    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")  # the pool stays slot-major regardless
    size, layers, kv_heads, head_dim, scratch = 32, 3, 2, 16, 24
    target = MHATokenToKVPool(
        size=size, page_size=page_size, dtype=torch.float32, head_num=kv_heads, head_dim=head_dim,
        layer_num=4, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
        kv_cache_layout="nhd",
    )  # fmt: skip
    rows = size + page_size
    store = DraftKVStore(
        num_slots=rows + scratch,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
    )
    pool = DraftKVPool(store, target, enable_memory_saver=False)
    slots = torch.tensor([1, 5, rows - 1])
    k, v = torch.randn(layers, 3, kv_heads, head_dim), torch.randn(layers, 3, kv_heads, head_dim)
    store.write(slots, k, v)

    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    row_bytes = kv_heads * head_dim * store.k.element_size()
    assert ptrs == [store.k[i].data_ptr() for i in range(layers)] + [
        store.v[i].data_ptr() for i in range(layers)
    ]
    assert lens == [rows * row_bytes] * (2 * layers)
    assert item_lens == [page_size * row_bytes] * (2 * layers)
    assert sum(pool.get_kv_size_bytes()) == store.nbytes * rows // store.num_slots
    for layer in range(layers):
        for buffer, tensor in (
            (pool.get_key_buffer(layer), store.k),
            (pool.get_value_buffer(layer), store.v),
        ):
            assert buffer.data_ptr() == tensor[layer].data_ptr()
            assert torch.equal(buffer[slots].view(dtype), tensor[layer, slots])
    assert (pool.size, pool.page_size, pool.layer_num, pool.head_num) == (size, page_size, layers, kv_heads)


def test_a_store_smaller_than_the_target_pool_is_refused():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_dflash.integration.draft_pool import DraftKVPool

    target = MHATokenToKVPool(
        size=32, page_size=1, dtype=torch.float32, head_num=2, head_dim=16, layer_num=1, device="cpu",
        enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip
    store = DraftKVStore(
        num_slots=20, num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu"
    )
    with pytest.raises(ValueError, match="20 slots; the target pool has 33"):
        DraftKVPool(store, target, enable_memory_saver=False)

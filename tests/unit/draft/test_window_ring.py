"""The window ring (`sglang_dflash/draft/window_ring.py`): its rows by hand, and the draft
attention over a store whose windowed layer keeps a ring against the same attention over a
store that keeps every token (the reference), through a schedule of chunked extends, decode
steps with uncommitted tokens, and request slots reused. In a running engine:
tests/engine/test_window_pool.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.attention import SdpaDraftAttention
from sglang_dflash.draft.kv_plan import DraftKVPlan
from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.window_misses import WindowMisses
from sglang_dflash.draft.window_ring import WindowRing
from tests.support.tiny import draft_config_dict

WINDOW, BLOCK, HEADS, KV_HEADS, HEAD_DIM = 8, 4, 4, 2, 16
# tests/gpu_kit/check.sh runs this file's GPU test.
gpu = pytest.mark.gpu


def test_rows_by_hand():
    ring = WindowRing(rows_per_request=4, num_requests=3)
    assert (ring.sink, ring.num_rows) == (12, 13)
    # One request (slot 2) at positions 0..5, all kept: the last 4 land, the first 2 go to the sink.
    rows = ring.write_rows(torch.full((6,), 2), torch.arange(6))
    assert rows.tolist() == [12, 12, 10, 11, 8, 9]
    # Two requests in one write; tokens not kept (not committed) go to the sink, and do not
    # count as the request's last position.
    reqs, positions = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([3, 4, 9, 10, 11])
    keep = torch.tensor([True, True, True, True, False])
    assert ring.write_rows(reqs, positions, keep).tolist() == [3, 0, 5, 6, 12]
    assert ring.read_rows(torch.tensor([1, 2]), torch.tensor([6, 0]), 3).tolist() == [[6, 7, 4], [8, 9, 10]]
    assert ring.for_reach(32, 16, 5) == WindowRing(48, 5)
    assert ring.nbytes(bytes_per_layer_token=100, num_layers=2) == 13 * 200
    assert ring.pays(token_slots=14) and not ring.pays(token_slots=13)


def _config() -> DFlashDraftConfig:
    """Layer 0 sliding (window 8), layer 1 full; block 4."""
    raw = draft_config_dict(
        num_layers=2, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK
    )
    raw.update(
        use_sliding_window=True, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    )
    return DFlashDraftConfig.from_dict(raw)


class Server:
    """Request slots, target slots, and two stores written alike: one keeping every token, one
    with the sliding layer in a ring of `rows_per_request`."""

    def __init__(
        self,
        rows_per_request: int,
        num_requests: int = 4,
        max_context: int = 96,
        dtype=torch.float32,
        device: str = "cpu",
    ):
        kw = dict(num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, device=device)
        self.device = device
        self.full = DraftKVStore(num_slots=1024, **kw)
        self.ring = WindowRing(rows_per_request, num_requests)
        self.ringed = DraftKVStore(num_slots=1024, ring=self.ring, windowed_layers=(0,), **kw)
        self.req_to_token = torch.zeros(num_requests, max_context, dtype=torch.int64, device=device)
        self.lens = [0] * num_requests
        self.next_slot = 1  # slot 0: the sink
        self.gen = torch.Generator().manual_seed(0)

    def write(self, req: int, count: int, committed: int | None = None) -> None:
        """`count` new positions of request slot `req`, the first `committed` of them kept (a
        decode step's window: the rest go to slot 0)."""
        committed = count if committed is None else committed
        start = self.lens[req]
        on = dict(device=self.device)
        positions = torch.arange(start, start + count, **on)
        slots = torch.arange(self.next_slot, self.next_slot + count, **on)
        self.next_slot += count
        slots[committed:] = 0
        self.req_to_token[req, start : start + committed] = slots[:committed]
        self.lens[req] += committed
        k = torch.randn(2, count, KV_HEADS, HEAD_DIM, generator=self.gen).to(self.device)
        v = torch.randn(2, count, KV_HEADS, HEAD_DIM, generator=self.gen).to(self.device)
        self.full.write(slots, k, v)
        rows = self.ring.write_rows(torch.full((count,), req, **on), positions, slots != 0)
        self.ringed.write(slots, k, v, rows)

    def restart(self, req: int) -> None:
        """The request in slot `req` finished; a new one starts there from position 0."""
        self.lens[req] = 0

    def attention_outputs(self, store: DraftKVStore, reqs: list[int]) -> list[torch.Tensor]:
        lens = torch.tensor([self.lens[r] for r in reqs])
        attention = SdpaDraftAttention(_config(), store).bind(
            self.req_to_token, torch.tensor(reqs, device=self.device), lens.to(self.device), lens, BLOCK
        )
        gen = torch.Generator().manual_seed(1)
        n = len(reqs) * BLOCK
        q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(self.device)
        k, v = torch.randn(2, n, KV_HEADS, HEAD_DIM, generator=gen).to(self.device)
        return [attention(layer, q, k, v) for layer in range(2)]


def _schedule(server: Server) -> list[list[int]]:
    """Extends (one chunk longer than the ring), decode steps, a slot reused; after each, the
    requests a draft step reads."""
    reads = []
    server.write(0, 30)  # a prefill chunk of 30 > R: only its last R land in the ring
    server.write(1, 5)
    reads.append([0, 1])
    for step in range(12):
        server.write(0, BLOCK, committed=1 + step % BLOCK)
        server.write(1, BLOCK, committed=1 + (step * 3) % BLOCK)
        reads.append([0, 1])
    server.write(2, 3)  # a chunked prefill: 3, then 20, then 2
    server.write(2, 20)
    server.write(2, 2)
    reads.append([2, 0])
    server.restart(1)  # slot 1 reused by a new request
    server.write(1, 11)
    reads.append([1, 2, 0])
    return reads


# Both stores round K/V through their dtype alike (an fp8 store: tests/unit/draft/test_kv_store.py).
# On CUDA, the path SGLANG_DFLASH_DRAFT_WINDOW_POOL=1 serves there: SDPA over the ring.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_windowed_layer_in_its_ring_attends_as_over_every_token(dtype, device):
    server = Server(rows_per_request=WINDOW + BLOCK, dtype=dtype, device=device)
    for reqs in _schedule(server):
        full, ringed = (
            server.attention_outputs(server.full, reqs),
            server.attention_outputs(server.ringed, reqs),
        )
        for layer in range(2):  # the ring's gather is narrower: SDPA sums in another order
            torch.testing.assert_close(ringed[layer], full[layer], rtol=1e-5, atol=1e-6)
    # The ring holds R rows of each request slot instead of a row per target slot.
    assert server.ringed.ring_k.shape == (1, 4 * (WINDOW + BLOCK) + 1, KV_HEADS, HEAD_DIM)
    assert server.ringed.ring_k.dtype == server.ringed.k.dtype == dtype
    assert server.ringed.k.shape[0] == 1  # the full layer only
    assert server.ringed.nbytes < server.full.nbytes


def test_a_ring_shorter_than_the_window_reads_overwritten_rows():
    """The check can fail: the block's first query sees the window's last WINDOW - 1 context
    positions, so a ring of WINDOW - 2 rows has overwritten one the sliding layer reads, and its
    outputs differ (the full layer's do not)."""
    server = Server(rows_per_request=WINDOW - 2)
    reqs = _schedule(server)[-1]
    full, ringed = server.attention_outputs(server.full, reqs), server.attention_outputs(server.ringed, reqs)
    torch.testing.assert_close(ringed[1], full[1], rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ringed[0], full[0])


def test_the_plan_with_a_ring_costs_the_full_layers_per_token_and_the_ring():
    plan = DraftKVPlan.for_draft(
        _config(), context_window=None, num_kv_heads=KV_HEADS, itemsize=4, store_slots=1000,
        ring=WindowRing.for_reach(WINDOW, BLOCK, 4),
    )  # fmt: skip
    per_layer = 2 * KV_HEADS * HEAD_DIM * 4  # 256 B
    assert plan.windowed and plan.ring_bytes == (4 * 12 + 1) * per_layer
    assert plan.store_bytes == 1000 * per_layer + plan.ring_bytes
    assert "window ring of 12 rows x 4 request slots" in plan.describe()
    info = plan.server_info()
    assert (info["window_ring_rows_per_request"], info["window_ring_request_slots"]) == (12, 4)


class _Req:
    """What `WindowMisses` reads of SGLang's `Req`."""

    def __init__(self, rid: str, slot: int, prompt_len: int):
        self.rid, self.kv = rid, SimpleNamespace(req_pool_idx=slot)
        self.origin_input_ids, self.output_ids = [0] * prompt_len, []
        self.retraction_count = 0


def test_window_misses_count_requests_that_draft_without_part_of_their_window():
    misses = WindowMisses(reach=32)
    a = _Req("a", 1, 50)
    misses.extend([a], [0], [40])  # a fresh prefill in two chunks: nothing missing
    misses.extend([a], [40], [10])
    a.output_ids = [7]
    misses.extend([a], [50], [1])  # a decoding, mixed into an extend batch
    assert misses.describe() == {"requests": 0, "positions": 0}
    b = _Req("b", 2, 120)
    misses.extend([b], [100], [8])  # a radix-cache hit of 100, in chunks of 8 and 12: judged
    misses.extend([b], [108], [12])  # at the last, positions 88..99 missing
    assert misses.describe() == {"requests": 1, "positions": 12}
    c = _Req("c", 1, 42)
    misses.extend([c], [2], [20])  # a's old slot, a shared prefix of 2, in two chunks:
    misses.extend([c], [22], [20])  # its window starts at 10, after them
    misses.extend([_Req("d", 1, 11)], [10], [1])  # slot 1 last written by c: 10 missing
    assert misses.describe() == {"requests": 2, "positions": 22}
    b.retraction_count, b.output_ids = 1, [7] * 10  # b retracted, back in its slot: judged again,
    misses.extend([b], [129], [1])  # its rows from 100 on still there: 98 and 99 missing
    assert misses.describe() == {"requests": 3, "positions": 24}
    b.retraction_count = 2
    misses.extend([_Req("e", 2, 5)], [0], [5])
    misses.extend([b], [129], [1])  # back after e wrote the slot: 31 missing
    assert misses.describe() == {"requests": 4, "positions": 55}

"""`DeferredInjection` (`sglang_dflash/draft/deferred_injection.py`): the queue of steps at W = 1,
against injecting every step into a real draft KV store; its order, copies and capacity; and
where the worker turns it off. In a running engine: `test_draft_kv_reuse.py`."""

from __future__ import annotations

import torch

from sglang_dflash import ops
from sglang_dflash.draft.deferred_injection import DeferredInjection, why_not_deferred
from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.model import DFlashDraftModel
from tests.support.tiny import make_draft


def _draft_and_store(tmp_path):
    from sglang_dflash.checkpoint.config import DFlashDraftConfig

    path = make_draft(str(tmp_path / "draft"), num_layers=2, num_kv_heads=1, target_layer_ids=[0, 2])
    config = DFlashDraftConfig.from_pretrained(path)
    draft = DFlashDraftModel.from_pretrained(path, config, 2)
    store = DraftKVStore(
        num_slots=64, num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.float32, device="cpu"
    )
    return draft, store


def test_bulk_injection_equals_injecting_every_step(tmp_path):
    """Four steps of 3 requests (one row each), capacity 8: the third push injects the first
    two steps' 6 rows, the last flush the rest; the store equals per-step injection, and a
    slot written twice (freed and reused) keeps its later owner's K/V."""
    draft, each = _draft_and_store(tmp_path)
    _, bulk = _draft_and_store(tmp_path)
    gen = torch.Generator().manual_seed(0)
    steps = []
    for step in range(4):
        captured = torch.randn(3, 2 * 64, generator=gen)  # [bs, C*H]
        positions = torch.tensor([10, 20, 30]) + step
        slots = torch.tensor([1, 2, 3]) + 3 * step
        steps.append((captured, positions, slots))
    steps[3][2][0] = 2  # slot 2, step 0's, reused by step 3
    calls = []

    reqs = torch.tensor([4, 5, 6])

    def inject(captured, positions, slots, token_reqs):
        calls.append(len(slots))
        assert token_reqs.tolist() == reqs.repeat(len(slots) // 3).tolist()  # carried with each row
        ops.inject_context_kv(draft, bulk, captured, positions, slots)

    queue = DeferredInjection(inject, capacity=8)
    with torch.no_grad():
        for captured, positions, slots in steps:
            ops.inject_context_kv(draft, each, captured, positions, slots)
            queue.push(captured, positions, slots, reqs)
            captured.zero_()  # the queue holds copies (a graph's output buffer is rewritten)
        assert calls == [6] and queue.rows == 6
        queue.flush()
        queue.flush()  # nothing left: no call
    assert calls == [6, 6] and queue.rows == 0
    assert each.k[:, 2].abs().sum() > 0  # the reused slot was written
    torch.testing.assert_close(bulk.k, each.k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bulk.v, each.v, rtol=1e-6, atol=1e-6)


def test_a_push_larger_than_the_queue_is_injected_at_once():
    calls = []
    queue = DeferredInjection(lambda c, p, s, token_reqs: calls.append(s.tolist()), capacity=4)
    queue.push(torch.zeros(2, 8), torch.arange(2), torch.tensor([5, 6]), torch.ones(2, dtype=torch.int64))
    queue.push(torch.zeros(6, 8), torch.arange(6), torch.arange(10, 16), torch.ones(6, dtype=torch.int64))
    assert calls == [[5, 6], list(range(10, 16))] and queue.rows == 0


def test_where_the_worker_defers():
    base = dict(switched_off=False, offloads=False, disaggregation="null", last_tokens=False)
    assert why_not_deferred(**base) is None
    assert why_not_deferred(**{**base, "switched_off": True}) == "SGLANG_DFLASH_DEFERRED_INJECTION=0"
    assert "hierarchical cache" in why_not_deferred(**{**base, "offloads": True})
    assert why_not_deferred(**{**base, "disaggregation": "decode"}) == "a PD decode engine"
    assert "last-token store" in why_not_deferred(**{**base, "last_tokens": True})

"""The window ring's share of SGLang's pool budget (`sglang_dflash/integration/draft_budget.py`),
against hand-computed bytes, and what SGLANG_DFLASH_DRAFT_WINDOW_POOL=1 refuses by name. The
budget in a running engine: tests/engine/test_window_pool.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.integration import draft_budget
from sglang_dflash.integration.draft_budget import DraftBudget, why_not_window_pool


@pytest.fixture
def declared():
    # The shipped draft re-declared all-sliding: 2 layers of 1024 B per token (fp32), window 32 + block 16.
    budget = DraftBudget(num_layers=2, num_full_layers=0, ring_bytes_per_request=48 * 2048)
    draft_budget.declare(budget)
    yield budget
    draft_budget.declare(None)
    draft_budget._set_aside = None


def test_the_cell_keeps_the_full_layers_share_and_never_zero():
    assert DraftBudget(5, 1, 0).cell_size(20480) == 4096  # Gemma-4's draft: 1 full layer of 5
    assert DraftBudget(2, 0, 0).cell_size(2048) == 1  # 0 would mean layer-count scaling to SGLang


def test_the_ring_is_set_aside_for_the_most_request_slots_sglang_can_give():
    budget = DraftBudget(2, 0, 1000)
    assert budget.ring_bytes(32) == 34 * 1000  # req_to_token's 33 rows and the sink
    assert budget.ring_bytes(64, dp_size=2) == 34 * 1000  # per DP worker
    assert budget.ring_bytes(None) == (draft_budget.MAX_REQUEST_SLOTS + 2) * 1000


def test_the_hooks_charge_sglang_the_declared_split(declared, monkeypatch):
    from sglang.srt import runtime_context

    assert draft_budget.cell_size_hook(lambda **kw: 2048, draft_num_layers=2) == 1
    configurator = SimpleNamespace(
        is_draft_worker=False, spec_algorithm=SimpleNamespace(is_dflash_family=lambda: True), attn_dp_size=1
    )
    monkeypatch.setattr(runtime_context, "get_schedule", lambda: SimpleNamespace(max_running_requests=32))
    available = draft_budget.available_bytes_hook(lambda self, pre: 10**8, configurator, 0)
    assert available == 10**8 - 34 * 48 * 2048
    draft_budget.check_set_aside(33 * 48 * 2048 + 2048)  # the ring allocate() makes: fits
    with pytest.raises(RuntimeError, match="exceeds"):
        draft_budget.check_set_aside(35 * 48 * 2048)


def test_an_unhooked_budget_is_refused_at_allocation(declared):
    with pytest.raises(RuntimeError, match="did not set the draft's window ring aside"):
        draft_budget.check_set_aside(1)


def test_without_a_declaration_sglang_charges_as_it_does():
    assert draft_budget.cell_size_hook(lambda **kw: 2048) == 2048
    assert draft_budget.available_bytes_hook(lambda self, pre: 123, SimpleNamespace(), 0) == 123


def test_what_the_window_pool_refuses_by_name():
    ok = dict(
        device_type="cpu", windowed_layers=(0, 1), disaggregation="null", hicache=False, page_size=1,
        kv_dtype=torch.float32,
    )  # fmt: skip
    assert why_not_window_pool(**ok) is None
    refused = {
        "windowed_layers": ((), "no windowed layer"),
        "device_type": ("cuda", "CPU only"),
        "disaggregation": ("prefill", "PD prefill engine"),
        "hicache": (True, "--enable-hierarchical-cache"),
        "page_size": (16, "--page-size 16"),
        "kv_dtype": (torch.float8_e4m3fn, "float8_e4m3fn"),
    }
    for field, (value, named) in refused.items():
        assert named in why_not_window_pool(**{**ok, field: value}), field

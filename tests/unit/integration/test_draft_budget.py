"""The window ring's share of SGLang's pool budget (`sglang_dflash/integration/draft_budget.py`),
against hand-computed bytes, and what SGLANG_DFLASH_DRAFT_WINDOW_POOL=1 refuses by name. The
budget in a running engine: tests/engine/test_window_pool.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_dflash.integration import draft_budget
from sglang_dflash.integration.draft_budget import DraftBudget, why_not_window_pool


@pytest.fixture
def declared():
    # The shipped draft re-declared all-sliding: 2 layers of 1024 B per token (fp32), window 32 + block 16.
    budget = DraftBudget(num_layers=2, num_full_layers=0, ring_bytes_per_request=48 * 2048)
    draft_budget.declare(budget)
    yield budget
    draft_budget.declare(None)
    draft_budget._set_aside = draft_budget._declined = draft_budget._every_token_cell = None


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
    ok = dict(device_type="cpu", windowed_layers=(0, 1), disaggregation="null", offloads=None)
    assert why_not_window_pool(**ok) is None
    refused = {
        "windowed_layers": ((), "no windowed layer"),
        "device_type": ("xpu", "a xpu device (the window ring is served on CPU and CUDA)"),
        "disaggregation": ("prefill", "PD prefill engine"),
        "offloads": ("--hicache-storage-backend file", "--hicache-storage-backend file (not tested"),
    }
    for field, (value, named) in refused.items():
        assert named in why_not_window_pool(**{**ok, field: value}), field
    assert why_not_window_pool(**{**ok, "device_type": "cuda"}) is None  # served when asked for


@pytest.mark.parametrize(
    "mode, server, want",
    [
        ("off", {}, "SGLANG_DFLASH_DRAFT_WINDOW_POOL=0"),
        ("auto", {}, None),  # declared: the budget decides (`available_bytes_hook`)
        ("on", {}, None),
        (
            "auto",
            {"device_type": "cuda"},
            "on CUDA the window ring's FlashInfer layout has not run on a GPU yet",
        ),
        ("on", {"device_type": "cuda"}, None),  # asked for: FlashInfer over the ring
        ("auto", {"disaggregation": "decode"}, "a PD decode engine"),
        ("on", {"disaggregation": "decode"}, ValueError),
        ("off", {"disaggregation": "decode"}, "SGLANG_DFLASH_DRAFT_WINDOW_POOL=0"),
    ],
)
def test_each_mode_keeps_refuses_or_declares(mode, server, want):
    server = {**dict(device_type="cpu", windowed_layers=(0,), disaggregation="null", offloads=None), **server}
    if want is ValueError:
        with pytest.raises(ValueError, match="SGLANG_DFLASH_DRAFT_WINDOW_POOL=1 does not serve a PD decode"):
            draft_budget.why_no_window_ring(mode, **server)
        return
    got = draft_budget.why_no_window_ring(mode, **server)
    assert got == want if want is None else want in got, got


def test_auto_keeps_every_token_on_cuda_until_the_rings_gpu_tests_have_run():
    """On CUDA the ring's FlashInfer layout has run on CPU only (a stand-in of FlashInfer's
    kernels): `auto` keeps every token there, and says how to choose the ring."""
    assert draft_budget.why_auto_declines("cpu") is None
    why = draft_budget.why_auto_declines("cuda")
    assert "has not run on a GPU yet" in why and "SGLANG_DFLASH_DRAFT_WINDOW_POOL=1" in why


# ------------------------------------------------------- SGLANG_DFLASH_DRAFT_WINDOW_POOL=auto


def _auto_budget(monkeypatch, max_total_tokens=None):
    """The shipped draft all-sliding under `auto`, beside a target of 1000 B per token: SGLang's
    pool sizing stood in for by bytes // (target + draft cell), capped by --max-total-tokens."""
    from sglang.srt import runtime_context

    draft_budget.declare(DraftBudget(2, 0, 48 * 2048, reach=32, auto=True))
    schedule = SimpleNamespace(max_running_requests=32, max_total_tokens=max_total_tokens, page_size=1)
    monkeypatch.setattr(runtime_context, "get_schedule", lambda: schedule)

    def pool_tokens(configurator, budget_bytes):
        tokens = budget_bytes // (1000 + configurator.dflash_draft_cell_size_per_token)
        return min(tokens, max_total_tokens) if max_total_tokens else tokens

    monkeypatch.setattr(draft_budget, "pool_tokens", pool_tokens)
    configurator = SimpleNamespace(
        is_draft_worker=False, spec_algorithm=SimpleNamespace(is_dflash_family=lambda: True), attn_dp_size=1
    )
    # What KVCacheConfigurator.__post_init__ does: SGLang's cell for both layers, through the hook.
    configurator.dflash_draft_cell_size_per_token = draft_budget.cell_size_hook(lambda **kw: 2048)
    return configurator


@pytest.fixture
def undeclare():
    yield
    draft_budget.declare(None)
    draft_budget._set_aside = draft_budget._declined = draft_budget._every_token_cell = None


def test_auto_keeps_the_ring_where_the_target_gets_more_tokens(monkeypatch, undeclare):
    configurator = _auto_budget(monkeypatch)
    ring = 34 * 48 * 2048
    assert draft_budget.available_bytes_hook(lambda self, pre: 10**8, configurator, 0) == 10**8 - ring
    assert configurator.dflash_draft_cell_size_per_token == 1  # (10**8 - ring) // 1001 > 10**8 // 3048
    assert draft_budget.ring_chosen() and draft_budget.declined() is None
    assert draft_budget.reprefill_hook(lambda self, req: 0, None) == 32


def test_auto_keeps_the_store_of_every_token_where_the_ring_gains_nothing(monkeypatch, undeclare):
    """--max-total-tokens caps both pools at 20,000 tokens: the ring would cost memory for none.
    The cell goes back to SGLang's, nothing is set aside, a cache hit re-prefills nothing."""
    configurator = _auto_budget(monkeypatch, max_total_tokens=20000)
    assert draft_budget.available_bytes_hook(lambda self, pre: 10**8, configurator, 0) == 10**8
    assert configurator.dflash_draft_cell_size_per_token == 2048
    assert not draft_budget.ring_chosen()
    assert "20000 tokens with the ring" in draft_budget.declined()
    assert draft_budget.reprefill_hook(lambda self, req: 0, None) == 0


def test_auto_declines_a_ring_larger_than_the_budget(monkeypatch, undeclare):
    configurator = _auto_budget(monkeypatch)
    assert draft_budget.available_bytes_hook(lambda self, pre: 10**6, configurator, 0) == 10**6
    assert "would take the whole budget" in draft_budget.declined()
    assert configurator.dflash_draft_cell_size_per_token == 2048


def test_the_pool_tokens_are_sglangs_own_sizing(monkeypatch):
    """`pool_tokens` asks SGLang's pool configurator for the budget, and caps it as SGLang does."""
    from sglang.srt import runtime_context
    from sglang.srt.model_executor import pool_configurator

    sizes = {}

    class Configurator:
        def __init__(self, kvc):
            self.kvc = kvc

        def calculate_pool_sizes(self, budget, page_size):
            sizes[budget] = page_size
            return SimpleNamespace(max_total_num_tokens=budget // self.kvc.cell)

    monkeypatch.setattr(pool_configurator, "create_memory_pool_configurator", Configurator)
    schedule = SimpleNamespace(max_total_tokens=None, page_size=1)
    monkeypatch.setattr(runtime_context, "get_schedule", lambda: schedule)
    assert draft_budget.pool_tokens(SimpleNamespace(cell=10), 1000) == 100
    schedule.max_total_tokens = 30
    assert draft_budget.pool_tokens(SimpleNamespace(cell=10), 1000) == 30
    assert sizes == {1000: 1}

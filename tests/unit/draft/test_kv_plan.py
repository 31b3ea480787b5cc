"""`DraftKVPlan` against hand-computed costs: which draft layers are windowed, their bytes per
token apart from the full layers', and what the start-up line and server info say of them."""

from __future__ import annotations

import json

from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.kv_plan import DraftKVPlan
from tests.support import paths
from tests.support.tiny import draft_config_dict

GEMMA_4 = paths.REPO / "tests" / "data" / "published_drafts" / "z-lab__gemma-4-31B-it-DFlash.json"


def _sliding_draft(num_layers: int, window: int, sliding: int) -> DFlashDraftConfig:
    raw = draft_config_dict(num_layers=num_layers, num_kv_heads=2, head_dim=64)
    types = ["sliding_attention"] * sliding + ["full_attention"] * (num_layers - sliding)
    raw.update(use_sliding_window=True, sliding_window=window, layer_types=types)
    return DFlashDraftConfig.from_dict(raw)


def test_an_all_sliding_draft_costs_its_layers_bytes_and_says_they_are_held_for_every_token():
    # 2 layers, window 32, 2 KV heads x 64, fp32: 2 (K and V) x 2 x 64 x 4 = 1024 B per layer-token.
    plan = DraftKVPlan.for_draft(
        _sliding_draft(2, 32, sliding=2), context_window=None, num_kv_heads=2, itemsize=4, store_slots=1000
    )
    assert plan.reach == (32, 32)
    assert (plan.full_layers, plan.sliding_layers) == ((), (0, 1))
    assert (plan.full_bytes_per_token, plan.sliding_bytes_per_token) == (0, 2048)
    assert plan.store_bytes == 1000 * 2048
    assert "sliding: layers [0, 1] (window 32), 2048 B/token, held for every token" in plan.describe()
    assert plan.server_info()["sliding_windows"] == [32, 32]
    assert plan.server_info()["sliding_layers_windowed"] is False


def test_the_published_gemma_4_draft_keeps_four_fifths_of_its_kv_for_tokens_it_never_reads():
    """z-lab's gemma-4-31B-it draft: four sliding layers of 2048 tokens, then a full one; 8 KV heads
    x 128 in bf16 = 4096 B per layer-token, so 16384 B/token for the sliding layers, 4096 full."""
    config = DFlashDraftConfig.from_dict(json.loads(GEMMA_4.read_text()))
    plan = DraftKVPlan.for_draft(config, context_window=None, num_kv_heads=8, itemsize=2, store_slots=1 << 20)
    assert plan.reach == (2048,) * 4 + (None,)
    assert (plan.full_bytes_per_token, plan.sliding_bytes_per_token) == (4096, 16384)
    assert plan.store_bytes == 20 * 2**30  # 1M slots: 16 GiB of it in the sliding layers


def test_the_draft_window_size_caps_every_layer_and_a_layers_own_window_caps_it_further():
    config = _sliding_draft(3, 32, sliding=1)  # layer 0 sliding (32), layers 1-2 full
    plan = DraftKVPlan.for_draft(config, context_window=64, num_kv_heads=1, itemsize=2, store_slots=10)
    assert plan.reach == (32, 64, 64)
    assert plan.full_layers == ()
    assert "window 32/64" in plan.describe()
    unset = DraftKVPlan.for_draft(config, context_window=None, num_kv_heads=1, itemsize=2, store_slots=10)
    assert (unset.full_layers, unset.sliding_layers) == ((1, 2), (0,))
    assert "full: layers [1, 2], 512 B/token" in unset.describe()

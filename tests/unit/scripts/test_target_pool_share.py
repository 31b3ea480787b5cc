"""scripts/bench/target_pool_share.py: the window-pool estimate and the draft variants, against hand
oracles (no engine)."""

import json

import pytest

from scripts.bench import target_pool_share as bench
from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.kv_plan import DraftKVPlan


def test_windowed_estimate_hand_oracle():
    # t = 2048 B, d = 512 full + 512 sliding: r = 2048 / 3072. A budget of 3000 plain tokens is
    # 6,144,000 B; the ring takes 48 rows x 32 requests x 512 B = 786,432 B of it; what is left
    # over 2048 + 512 B per token is 2092.8 tokens.
    assert bench.windowed_estimate(3000, 2048 / 3072, 512, 512, 48) == 2092
    # All sliding, no ring rows: every plain token back.
    assert bench.windowed_estimate(3000, 2048 / 3072, 0, 1024, 0) == 3000


@pytest.mark.parametrize(
    "variant, kinds",
    [
        ("all-sliding", ["sliding_attention"] * 2),
        ("mixed", ["sliding_attention", "full_attention"]),
    ],
)
def test_draft_variants_are_parsed_as_declared(tmp_path, variant, kinds):
    from sglang_dflash.assets import tiny_pair

    _, draft = tiny_pair()
    path = bench.draft_variant(draft, variant, 32, str(tmp_path))
    with open(f"{path}/config.json") as f:
        assert json.load(f)["layer_types"] == kinds
    config = DFlashDraftConfig.from_pretrained(path)
    plan = DraftKVPlan.for_draft(config, context_window=None, num_kv_heads=2, itemsize=2, store_slots=0)
    assert [plan.reach[i] for i in plan.sliding_layers] == [32] * kinds.count("sliding_attention")
    assert len(plan.full_layers) == kinds.count("full_attention")
    assert bench.draft_variant(draft, "published", 32, str(tmp_path)) == draft

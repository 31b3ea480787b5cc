"""Greedy losslessness: DFLASH output ids equal the same engine's output without speculation.

Matrix: 16 prompts x batch sizes {1, 4, 16} (and one batch of 32): verify width B in {4, 16} with
overlap scheduling on and 8 with it off on one target/draft shape, B 8 with it on on another (see
tests/support/tiny/__init__.py).
"""

import pytest

from tests.support import engines

pytestmark = pytest.mark.sglang

GREEDY = {"max_new_tokens": 24, "temperature": 0.0}
PROMPTS = engines.prompts(16, seed=0)
PROMPTS_32 = engines.prompts(32, seed=1)  # one full batch of 32

# (pair, verify width B, overlap scheduling)
CONFIGS = [
    ("a", 4, True),
    ("a", 8, False),
    ("a", 16, True),
]
CONFIGS += [("b", 8, True)]


@pytest.fixture(scope="module")
def reference_outputs(tiny):
    """Output ids of the non-speculative engine per target, computed before any DFLASH engine
    starts (one engine at a time per process)."""
    outputs = {}
    for name in ("a", "b"):
        engine = engines.start(tiny.target(name))
        try:
            for prompts in (PROMPTS, PROMPTS_32):
                out = engines.generate(engine, prompts, GREEDY, len(prompts))
                outputs[name, len(prompts)] = [o["output_ids"] for o in out]
        finally:
            engines.shutdown(engine)
    return outputs


@pytest.fixture(
    scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}-B{c[1]}-{'overlap' if c[2] else 'sync'}"
)
def dflash_engine(request, tiny, reference_outputs):
    pair, width, overlap = request.param
    target, draft = tiny.pair(pair)
    engine = engines.start(target, draft, width, disable_overlap_schedule=not overlap)
    yield pair, engine
    engines.shutdown(engine)


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_greedy_matches_target(dflash_engine, reference_outputs, batch_size):
    pair, engine = dflash_engine
    expected = reference_outputs[pair, len(PROMPTS)]
    out = engines.generate(engine, PROMPTS, GREEDY, batch_size)
    assert engines.server_state(engine)["dflash_implementation"].startswith("sglang-dflash")
    got = [o["output_ids"] for o in out]
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, (
        f"prompts {mismatches} differ, e.g. {got[mismatches[0]]} vs {expected[mismatches[0]]}"
    )
    for o in out:
        meta = o["meta_info"]
        # SGLang's per-request speculative metrics are present and consistent.
        assert meta["spec_verify_ct"] >= 1
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])


def test_greedy_matches_target_in_a_batch_of_32(dflash_engine, reference_outputs):
    pair, engine = dflash_engine
    out = engines.generate(engine, PROMPTS_32, GREEDY, len(PROMPTS_32))
    assert [o["output_ids"] for o in out] == reference_outputs[pair, len(PROMPTS_32)]
    assert engines.server_state(engine)["avg_spec_accept_length"] >= 1.0

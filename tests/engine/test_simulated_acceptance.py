"""SGLANG_SIMULATE_ACC_LEN (benchmarking only) forces the commit length of every verify step."""

import pytest

from tests.support import engines

pytestmark = pytest.mark.sglang


def simulated_meta(tiny, monkeypatch, new_tokens: int, method=None) -> list[dict]:
    """meta_info of 4 requests at simulated acceptance 3, every step at the full width."""
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_LEN", "3")
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_TOKEN_MODE", "real-draft-token")
    monkeypatch.setenv("SGLANG_DFLASH_ADAPTIVE_WIDTH", "0")
    if method is not None:
        monkeypatch.setenv("SGLANG_DFLASH_SIMULATE_ACC_METHOD", method)
    engine = engines.start(*tiny.pair("a"), 8)
    try:
        sampling = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        out = engines.generate(engine, engines.prompts(4, seed=9), sampling, 4)
    finally:
        engines.shutdown(engine)
    return [o["meta_info"] for o in out]


def test_simulated_acceptance_length(tiny, monkeypatch):
    for meta in simulated_meta(tiny, monkeypatch, 31):
        # The prefill emits 1 token, then every step commits exactly 3: 1 + 10 * 3 = 31.
        assert meta["completion_tokens"] == 31
        assert meta["spec_verify_ct"] == 10


def test_geometric_simulated_acceptance(tiny, monkeypatch):
    """SGLANG_DFLASH_SIMULATE_ACC_METHOD=geometric: each request draws its own commit lengths,
    mean 3 at the full width (rate 0.682 at B = 8): over 4 requests of 121 tokens the mean
    commit per verify is near 3, and the requests differ (SGLang's draw is one per batch)."""
    metas = simulated_meta(tiny, monkeypatch, 121, method="geometric")
    steps = [meta["spec_verify_ct"] for meta in metas]
    mean = sum(meta["completion_tokens"] - 1 for meta in metas) / sum(steps)
    assert 2.6 < mean < 3.4, steps
    assert len(set(steps)) > 1, steps

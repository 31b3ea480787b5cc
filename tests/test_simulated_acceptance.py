"""SGLANG_SIMULATE_ACC_LEN (benchmarking only) forces the commit length of every verify step."""

import pytest

from tests import engines

pytestmark = pytest.mark.sglang


def test_simulated_acceptance_length(tiny, monkeypatch):
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_LEN", "3")
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_TOKEN_MODE", "real-draft-token")
    monkeypatch.setenv("SGLANG_DFLASH_ADAPTIVE_WIDTH", "0")  # every step at the full width
    engine = engines.start(*tiny.pair("a"), 8)
    try:
        sampling = {"max_new_tokens": 31, "temperature": 0.0, "ignore_eos": True}
        out = engines.generate(engine, engines.prompts(4, seed=9), sampling, 4)
    finally:
        engines.shutdown(engine)
    for o in out:
        meta = o["meta_info"]
        # The prefill emits 1 token, then every step commits exactly 3: 1 + 10 * 3 = 31.
        assert meta["completion_tokens"] == 31
        assert meta["spec_verify_ct"] == 10

"""The load-adaptive verify width in a running engine (`sglang_dflash/width_policy.py`).

Each engine writes its step records (`SGLANG_DFLASH_STEP_TIMING`), which carry the chosen
width and the phases that ran; the first WARMUP decode steps (the policy's first probes, and its
first estimates) are left out of the counts.
"""

import json

import pytest

from tests import engines

pytestmark = pytest.mark.sglang

WARMUP = 32
PROMPTS = engines.prompts(3, seed=5)
GREEDY = {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True}


def decode_steps(path) -> list[dict]:
    records = [json.loads(line) for line in open(path)]
    return [r for r in records if r["kind"] == "decode"][WARMUP:]


def run_engine(tiny, tmp_path, monkeypatch, env: dict, name: str):
    timing = tmp_path / f"{name}.jsonl"
    monkeypatch.setenv("SGLANG_DFLASH_STEP_TIMING", str(timing))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    engine = engines.start(*tiny.pair("a"), 8)
    try:
        out = engines.generate(engine, PROMPTS, GREEDY, 1)
    finally:
        engines.shutdown(engine)
    return [o["output_ids"] for o in out], decode_steps(timing)


@pytest.fixture(scope="module")
def reference(tiny):
    engine = engines.start(tiny.target("a"))
    try:
        return [o["output_ids"] for o in engines.generate(engine, PROMPTS, GREEDY, 1)]
    finally:
        engines.shutdown(engine)


@pytest.mark.parametrize("off_forward", ["verify", "decode"])
def test_a_random_draft_turns_speculation_off(tiny, tmp_path, monkeypatch, reference, off_forward):
    """Pair a's draft is random weights: its proposals are almost never accepted, so after the
    warm-up the policy verifies width 1, and those steps run no draft forward; width 1 through
    either target forward (the CPU default, a verify over one token, or the decode forward)."""
    env = {"SGLANG_DFLASH_WIDTH1_FORWARD": off_forward}
    out, steps = run_engine(tiny, tmp_path, monkeypatch, env, f"random-{off_forward}")
    assert out == reference
    off = [s for s in steps if s["width"] == 1]
    assert len(off) >= 0.8 * len(steps), [s["width"] for s in steps]
    assert all("draft" not in s["phases"] for s in off)
    assert all("draft" in s["phases"] for s in steps if s["width"] > 1)


def test_fixed_width_switch(tiny, tmp_path, monkeypatch, reference):
    """SGLANG_DFLASH_ADAPTIVE_WIDTH=0 verifies the full width every step (and is lossless)."""
    out, steps = run_engine(tiny, tmp_path, monkeypatch, {"SGLANG_DFLASH_ADAPTIVE_WIDTH": "0"}, "fixed")
    assert out == reference
    assert {s["width"] for s in steps} == {8}


def test_always_accepted_drafts_keep_the_full_width(tiny, tmp_path, monkeypatch):
    """Simulated acceptance of every proposal (benchmark mode): the full width pays."""
    env = {
        "SGLANG_SIMULATE_ACC_LEN": "8",
        "SGLANG_SIMULATE_ACC_METHOD": "match-expected",
        "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token",
    }
    _, steps = run_engine(tiny, tmp_path, monkeypatch, env, "simulated")
    full = [s for s in steps if s["width"] == 8]
    assert len(full) >= 0.8 * len(steps), [s["width"] for s in steps]

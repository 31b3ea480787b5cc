"""Radix-cache reuse of draft K/V, checked through the draft's raw proposals.

Greedy losslessness cannot catch a wrong draft K/V (it only lowers acceptance). Here the same
request runs twice: once with its prompt served from the radix cache, including tokens that
an earlier request committed while *decoding*, and once cold after `flush_cache`. The draft's
proposals at every block must be identical. With decode-time injection switched off (a
test-only knob), the same check must fail: that shows it can see a missing injection.
"""

import os

import pytest

from tests import engines

pytestmark = pytest.mark.sglang

PROMPT = engines.prompts(1, seed=21, min_len=24, max_len=24)[0]


def _run(tiny, trace_path, skip_decode_injection: bool, width1_steps: int = 0):
    env = {"SGLANG_DFLASH_TRACE_PROPOSALS": str(trace_path)}
    if skip_decode_injection:
        env["SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION"] = "1"
    if width1_steps:
        env["SGLANG_DFLASH_TEST_WIDTH1_STEPS"] = str(width1_steps)
    os.environ.update(env)
    try:
        # Fixed width: the warm and cold runs must verify the same windows to compare them.
        engine = engines.start(*tiny.pair("a"), 8, fixed_width=True)
    finally:
        for key in env:
            os.environ.pop(key)
    try:
        first = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 40, "temperature": 0})
        # The first 32 generated tokens were committed by decode steps (verify + injection).
        prompt = PROMPT + first["output_ids"][:32]
        sampling = {"max_new_tokens": 24, "temperature": 0}
        warm = engine.generate(input_ids=prompt, sampling_params=sampling, rid="warm")
        engines.flush_cache(engine)
        cold = engine.generate(input_ids=prompt, sampling_params=sampling, rid="cold")
    finally:
        engines.shutdown(engine)
    assert warm["meta_info"]["cached_tokens"] >= len(PROMPT) + 16
    assert cold["meta_info"]["cached_tokens"] == 0
    steps = engines.proposal_steps(trace_path)
    assert len(steps["warm"]) >= 2 and len(steps["cold"]) >= 2
    return warm, cold, steps["warm"], steps["cold"]


@pytest.mark.parametrize("width1_steps", [0, 20], ids=["speculating", "after-width-1-steps"])
def test_cached_prefix_gives_the_same_draft_proposals(tiny, tmp_path, width1_steps):
    """With `after-width-1-steps`, the first 20 tokens of the cached prefix's generated part
    were committed by steps with speculation off (no draft forward, well within the first
    request): their injection alone keeps the draft store current."""
    warm, cold, warm_steps, cold_steps = _run(
        tiny, tmp_path / "trace.jsonl", skip_decode_injection=False, width1_steps=width1_steps
    )
    assert warm["output_ids"] == cold["output_ids"]
    assert warm_steps == cold_steps


@pytest.mark.slow  # the demonstration that the check above can fail: one more engine, with --run-slow
def test_check_fails_without_decode_time_injection(tiny, tmp_path):
    warm, cold, warm_steps, cold_steps = _run(tiny, tmp_path / "trace.jsonl", skip_decode_injection=True)
    assert warm["output_ids"] == cold["output_ids"]  # still lossless: only the draft is wrong
    assert warm_steps != cold_steps

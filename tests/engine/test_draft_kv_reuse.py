"""Radix-cache reuse of draft K/V, and the injection deferred at W = 1, checked through the
draft's raw proposals.

Greedy losslessness cannot catch a wrong draft K/V (it only lowers acceptance). Here the same
request runs twice: once with its prompt served from the radix cache, including tokens that
an earlier request committed while *decoding*, and once cold after `flush_cache`. The draft's
proposals at every block must be identical. With decode-time injection switched off (a
test-only knob), the same check must fail: that shows it can see a missing injection.

Steps without a draft (W = 1) queue their injection (`draft/deferred_injection.py`); it must
land before the next draft reads the store and before an extend writes it. The same requests
with the injection deferred and injected every step must give the same proposals.
"""

import os

import pytest

from tests.support import engines

pytestmark = pytest.mark.sglang

PROMPT = engines.prompts(1, seed=21, min_len=24, max_len=24)[0]


def _start(tiny, env: dict, **kwargs):
    os.environ.update(env)
    try:
        # Fixed width: runs to compare must verify the same windows.
        return engines.start(*tiny.pair("a"), 8, fixed_width=True, **kwargs)
    finally:
        for key in env:
            os.environ.pop(key)


def _run(tiny, trace_path, skip_decode_injection: bool, width1_steps: int = 0):
    env = {"SGLANG_DFLASH_TRACE_PROPOSALS": str(trace_path)}
    if skip_decode_injection:
        env["SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION"] = "1"
    if width1_steps:
        env["SGLANG_DFLASH_TEST_WIDTH1_STEPS"] = str(width1_steps)
    engine = _start(tiny, env)
    try:
        first = engine.generate(
            input_ids=PROMPT, sampling_params={"max_new_tokens": 40, "temperature": 0}, rid="first"
        )
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


# "speculating" with --run-slow only (suite time): "after-width-1-steps" speculates after its
# first 20 steps, so its cached prefix holds tokens committed by verify steps too.
@pytest.mark.parametrize(
    "width1_steps",
    [pytest.param(0, marks=pytest.mark.slow), 20, 39],
    ids=["speculating", "after-width-1-steps", "finished-at-width-1"],
)
def test_cached_prefix_gives_the_same_draft_proposals(tiny, tmp_path, width1_steps):
    """With `after-width-1-steps`, the first 20 tokens of the cached prefix's generated part
    were committed by steps with speculation off (no draft forward, well within the first
    request): their injection alone keeps the draft store current. With `finished-at-width-1`
    the first request decodes every token without a draft, so all its injections are still
    queued when the warm request's prefill arrives, which must inject them first."""
    trace = tmp_path / "trace.jsonl"
    warm, cold, warm_steps, cold_steps = _run(
        tiny, trace, skip_decode_injection=False, width1_steps=width1_steps
    )
    assert warm["output_ids"] == cold["output_ids"]
    assert warm_steps == cold_steps
    first = engines.proposal_steps(trace)["first"]
    assert [not p for _, p in first].count(True) == width1_steps  # its steps at W = 1
    assert width1_steps < 39 or len(first) == 39  # finished-at-width-1: every token at W = 1


@pytest.mark.slow  # the demonstration that the check above can fail: one more engine, with --run-slow
def test_check_fails_without_decode_time_injection(tiny, tmp_path):
    warm, cold, warm_steps, cold_steps = _run(tiny, tmp_path / "trace.jsonl", skip_decode_injection=True)
    assert warm["output_ids"] == cold["output_ids"]  # still lossless: only the draft is wrong
    assert warm_steps != cold_steps


def test_deferred_injection_gives_the_same_proposals(tiny, tmp_path):
    """Three requests decode their first 16 steps without a draft, one finishing there; then the
    other two draft (the queue must be injected first), and a fourth request reuses the
    finished one's prefix. Every request's proposals at every step equal those of the same run
    with the injection made every step (SGLANG_DFLASH_DEFERRED_INJECTION=0)."""
    prompts = engines.prompts(3, seed=4, min_len=8, max_len=30)
    lengths = [10, 40, 40]
    runs = []
    for deferred in ("1", "0"):
        trace = tmp_path / f"trace-{deferred}.jsonl"
        env = {
            "SGLANG_DFLASH_TRACE_PROPOSALS": str(trace),
            "SGLANG_DFLASH_TEST_WIDTH1_STEPS": "16",
            "SGLANG_DFLASH_DEFERRED_INJECTION": deferred,
        }
        engine = _start(tiny, env)
        try:
            first = engine.generate(  # one batch: the three prefill together
                input_ids=prompts,
                sampling_params=[{"max_new_tokens": n, "temperature": 0} for n in lengths],
                rid=[f"r{i}" for i in range(3)],
            )
            again = prompts[0] + first[0]["output_ids"] + [5, 6, 7]
            last = engine.generate(
                input_ids=again, sampling_params={"max_new_tokens": 16, "temperature": 0}, rid="again"
            )
        finally:
            engines.shutdown(engine)
        assert last["meta_info"]["cached_tokens"] >= len(prompts[0]) + 8
        runs.append(([o["output_ids"] for o in first] + [last["output_ids"]], engines.proposal_steps(trace)))
    (outputs, steps), (want_outputs, want_steps) = runs
    assert outputs == want_outputs
    assert steps == want_steps
    assert all(not p for _, p in steps["r0"]) and any(p for _, p in steps["r1"])


def test_a_reused_slot_gets_its_new_owners_draft_kv(tiny, tmp_path):
    """No radix cache and a pool of 256 slots: two requests decode without a draft (their
    injections queued) and free their slots; the third request's prompt takes some of the
    first one's decode slots, and its draft must read its own K/V there, not the queued writes of the
    slot's earlier owner (the queue is injected before each prefill's own injection)."""
    # r0's decode slots come first in the free list once the untouched ones run out, which the
    # long third prompt makes happen.
    prompts = [engines.prompts(1, seed=8 + i, min_len=n, max_len=n)[0] for i, n in enumerate((8, 80, 120))]
    sampling = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    runs = []
    for deferred in ("1", "0"):
        trace = tmp_path / f"trace-{deferred}.jsonl"
        env = {
            "SGLANG_DFLASH_TRACE_PROPOSALS": str(trace),
            "SGLANG_DFLASH_TEST_WIDTH1_STEPS": "38",  # the first two requests' 19 decode steps each
            "SGLANG_DFLASH_DEFERRED_INJECTION": deferred,
        }
        engine = _start(tiny, env, max_total_tokens=256, disable_radix_cache=True)
        try:
            outputs = [
                engine.generate(input_ids=p, sampling_params=sampling, rid=f"r{i}")["output_ids"]
                for i, p in enumerate(prompts)
            ]
        finally:
            engines.shutdown(engine)
        runs.append((outputs, engines.proposal_steps(trace)))
    (outputs, steps), (want_outputs, want_steps) = runs
    assert outputs == want_outputs
    assert all(not p for _, p in steps["r0"] + steps["r1"]) and all(p for _, p in steps["r2"])
    assert steps["r2"] == want_steps["r2"]

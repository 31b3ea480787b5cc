"""The load-adaptive verify width in a running engine (`sglang_dflash/width/policy.py`).

Each engine writes its step records (`SGLANG_DFLASH_STEP_TIMING`), which carry the chosen
width, whether it was a probe, and the phases that ran; the first WARMUP decode steps (the
policy's first estimates) and the probes are left out of the counts.
"""

import json

import numpy as np
import pytest

from tests.support import engines

pytestmark = pytest.mark.sglang

WARMUP = 32
PROMPTS = engines.prompts(3, seed=5)
GREEDY = {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True}


def decode_steps(path) -> list[dict]:
    records = [json.loads(line) for line in open(path)]
    return [r for r in records if r["kind"] == "decode"][WARMUP:]


def trace(steps: list[dict]) -> str:
    """The widths in order, probes as '.' (for failure messages)."""
    return "".join("." if s["probe"] else str(s["width"]) for s in steps)


def chosen(steps: list[dict]) -> list[dict]:
    """The steps whose width the policy chose as the best (not its probes)."""
    return [s for s in steps if not s["probe"]]


def run_engine(tiny, tmp_path, monkeypatch, env: dict, name: str, sampling=GREEDY):
    timing = tmp_path / f"{name}.jsonl"
    monkeypatch.setenv("SGLANG_DFLASH_STEP_TIMING", str(timing))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    engine = engines.start(*tiny.pair("a"), 8)
    try:
        out = engines.generate(engine, PROMPTS, sampling, 1)
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
def test_never_accepted_drafts_turn_speculation_off(tiny, tmp_path, monkeypatch, reference, off_forward):
    """Proposals that are never accepted (simulated acceptance of length 1: every verify commits
    only the target's own token, so outputs stay the target's): after the warm-up the policy
    verifies width 1, and those steps run no draft forward; width 1 through either target
    forward (the CPU default, a verify over one token, or the decode forward)."""
    env = {
        "SGLANG_DFLASH_WIDTH1_FORWARD": off_forward,
        "SGLANG_SIMULATE_ACC_LEN": "1",
        "SGLANG_SIMULATE_ACC_METHOD": "match-expected",
        "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token",
    }
    out, steps = run_engine(tiny, tmp_path, monkeypatch, env, f"never-{off_forward}")
    assert out == reference
    off = [s for s in chosen(steps) if s["width"] == 1]
    assert len(off) >= 0.8 * len(chosen(steps)), trace(steps)
    assert all("draft" not in s["phases"] for s in off)
    assert {s["counts"]["target_attention_plans"] for s in steps} == {1}
    assert all("draft" in s["phases"] for s in steps if s["width"] > 1)


# With --run-slow only (suite time): make test's rehearsal of make gpu-first cycles one DFLASH run
# through every width on the trained pair against the plain engine (test_gpu_kit_rehearsal.py).
@pytest.mark.slow
def test_every_width_in_turn_is_lossless(tiny, tmp_path, monkeypatch, reference):
    """Decode steps forced through every width 1..B in turn (SGLANG_DFLASH_TEST_WIDTHS): greedy
    outputs equal the plain engine's, and every width ran."""
    cycle = {"SGLANG_DFLASH_TEST_WIDTHS": "1,2,3,4,5,6,7,8"}
    out, steps = run_engine(tiny, tmp_path, monkeypatch, cycle, "every-width")
    assert out == reference
    assert {s["width"] for s in steps} == set(range(1, 9)), trace(steps)


def test_per_width_backends_are_lossless(tiny, tmp_path, monkeypatch, reference):
    """Each verify width with its own attention backend, swapped in around its verify
    (SGLANG_DFLASH_VERIFY_GRAPHS=eager: the CPU rehearsal of the per-width CUDA graphs), the
    steps forced through the widths that get one, {1, 2, 4, 8} for B = 8: greedy outputs equal
    the plain engine's, and each narrower step planned its attention on its own width's
    backend, the full width on SGLang's."""
    env = {"SGLANG_DFLASH_VERIFY_GRAPHS": "eager", "SGLANG_DFLASH_TEST_WIDTHS": "1,2,4,8"}
    out, steps = run_engine(tiny, tmp_path, monkeypatch, env, "per-width")
    assert out == reference
    assert {s["width"] for s in steps} == {1, 2, 4, 8}, trace(steps)
    for s in steps:
        own = {name: n for name, n in s["counts"].items() if name.startswith("target_attention_plans_w")}
        assert s["counts"]["target_attention_plans"] == 1
        assert own == ({} if s["width"] == 8 else {f"target_attention_plans_w{s['width']}": 1}), s


def test_fixed_width_switch(tiny, tmp_path, monkeypatch, reference):
    """SGLANG_DFLASH_ADAPTIVE_WIDTH=0 verifies the full width every step (and is lossless)."""
    out, steps = run_engine(tiny, tmp_path, monkeypatch, {"SGLANG_DFLASH_ADAPTIVE_WIDTH": "0"}, "fixed")
    assert out == reference
    assert {s["width"] for s in steps} == {8}
    # One plan of the target's attention per verify forward (prepare_for_verify leaves it to the
    # forward; planning there as well made it two).
    assert {s["counts"]["target_attention_plans"] for s in steps} == {1}


def timed_steps(path) -> list[dict]:
    """The decode steps after the warm-up that another decode step followed, each with its
    committed tokens per second when every step commits its whole width (simulated full
    acceptance): its width over its interval, from its start to the next one's."""
    records = [json.loads(line) for line in open(path)]
    timed = [
        dict(step, rate=step["width"] / (after["t_start"] - step["t_start"]))
        for step, after in zip(records, records[1:])
        if step["kind"] == after["kind"] == "decode"
    ]
    return timed[WARMUP:]


def test_always_accepted_drafts_keep_to_the_widths_that_pay(tiny, tmp_path, monkeypatch):
    """Simulated acceptance of every proposal (benchmark mode), so every step commits its width:
    no chosen step goes without the draft, and the chosen steps commit tokens at least 80% as
    fast as the best width measured in the same run (the median of its steps). Which draft
    width is best is the machine's: where the scheduler's per-token work dominates the step,
    widths 6 to 8 tie within the noise (a CI run chose 6, 7 and 8 alike). A policy that did
    not learn the acceptance (its prior, 0.6 a position) would settle on narrow widths, at a
    fraction of the rate."""
    env = {
        "SGLANG_SIMULATE_ACC_LEN": "8",
        "SGLANG_SIMULATE_ACC_METHOD": "match-expected",
        "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token",
    }
    # 8 tokens a step: longer outputs, for as many steps as the other tests.
    sampling = dict(GREEDY, max_new_tokens=600)
    _, steps = run_engine(tiny, tmp_path, monkeypatch, env, "simulated", sampling)
    assert all(s["width"] > 1 for s in chosen(steps)), trace(steps)
    timed = timed_steps(tmp_path / "simulated.jsonl")
    by_width: dict[int, list[float]] = {}
    for s in timed:
        by_width.setdefault(s["width"], []).append(s["rate"])
    medians = {w: float(np.median(r)) for w, r in by_width.items() if len(r) >= 3}
    chosen_rate = float(np.mean([s["rate"] for s in chosen(timed)]))
    assert chosen_rate >= 0.8 * max(medians.values()), (trace(steps), chosen_rate, medians)

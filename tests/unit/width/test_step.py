"""StepWidth: each step's verify width, fixed or adaptive, forced widths, and how a step without draft
runs the target."""

import pytest

from sglang_dflash.knobs import Knobs
from sglang_dflash.width.policy import WidthPolicy
from sglang_dflash.width.step import COLD_DECODE_STEPS, StepWidth, decode_when_off


def _width(num_draft_tokens=8, device="cpu", tp_size=1, **knobs):
    return StepWidth(num_draft_tokens, device, tp_size, Knobs(**knobs))


def test_the_width_is_fixed_or_adaptive_as_chosen_at_start_up():
    assert _width(adaptive_width=False).policy is None
    assert _width(adaptive_width=False).choose(4, 100, ["a"] * 4) == 8
    assert isinstance(_width().policy, WidthPolicy)  # CPU default
    assert _width(device="cuda").policy is None  # verify graphs exist for the full width only
    assert _width(tp_size=2, adaptive_width=True).policy is None
    assert "fixed: SGLANG_DFLASH_ADAPTIVE_WIDTH=0" in _width(adaptive_width=False).describe()


def test_width1_steps_turn_the_draft_off_for_the_first_steps():
    width = _width(adaptive_width=False, width1_steps=2)
    assert [width.choose(1, 10, ["a"]) for _ in range(4)] == [1, 1, 8, 8]


def test_forced_widths_are_taken_in_turn():
    width = _width(widths=(1, 2, 8), width1_steps=1)
    assert [width.choose(3, 10, ["a"] * 3) for _ in range(7)] == [1, 2, 8, 1, 2, 8, 1]
    with pytest.raises(ValueError, match="SGLANG_DFLASH_TEST_WIDTHS"):
        _width(widths=(9,))


def test_the_policy_is_fed_only_steady_decode_intervals():
    """The server's first COLD_DECODE_STEPS steps and the step after an extend are not measured."""
    width = _width(adaptive_width=True)
    seen = []
    width.policy.observe_step = lambda bs, w, seconds, context: seen.append(bs)
    width.policy.choose = lambda bs, context, rids: 8
    for bs in range(1, COLD_DECODE_STEPS + 4):
        width.choose(bs, 0, [])
    # Step k's interval is fed at step k+1, and only when step k came after the cold steps.
    assert seen == [COLD_DECODE_STEPS + 1, COLD_DECODE_STEPS + 2]
    width.not_decoding()  # an extend step
    width.choose(50, 0, [])
    width.choose(51, 0, [])
    assert seen == [COLD_DECODE_STEPS + 1, COLD_DECODE_STEPS + 2]  # the step after it is not fed
    width.choose(52, 0, [])
    assert seen[-1] == 51


def test_a_bulk_injection_is_left_out_of_the_step_that_ran_it(monkeypatch):
    """Seconds excluded during a step come off that step's interval only."""
    from sglang_dflash.width import step as step_module

    clock = iter(float(t) for t in range(0, 1000, 10))  # each step starts 10 s after the last
    monkeypatch.setattr(step_module.time, "perf_counter", lambda: next(clock))
    width = _width(adaptive_width=True)
    seen = []
    width.policy.observe_step = lambda bs, w, seconds, context: seen.append(seconds)
    width.policy.choose = lambda bs, context, rids: 8
    for _ in range(COLD_DECODE_STEPS + 1):
        width.choose(4, 0, [])
    width.exclude(2.5)  # this step flushed the queue
    width.choose(4, 0, [])
    width.choose(4, 0, [])
    assert seen == [7.5, 10.0]


def test_how_a_step_without_draft_runs_the_target():
    assert decode_when_off("cpu", None, "batched")[0] is False  # a verify over one token
    assert decode_when_off("cpu", None, "per-request")[0] is True
    assert decode_when_off("cuda", None, "batched")[0] is True
    assert decode_when_off("cpu", "decode", "batched") == (
        True,
        "decode forward (SGLANG_DFLASH_WIDTH1_FORWARD=decode)",
    )

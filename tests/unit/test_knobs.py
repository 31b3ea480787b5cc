"""Knobs: every environment variable the worker reads, read once."""

from sglang_dflash import knobs as knobs_module
from sglang_dflash.knobs import Knobs


def test_every_knob_is_read_from_its_variable():
    env = {
        "SGLANG_DFLASH_GRAMMAR_PROPOSALS": "0",
        "SGLANG_DFLASH_ADAPTIVE_WIDTH": "1",
        "SGLANG_DFLASH_FAIR_SLACK": "off",
        "SGLANG_DFLASH_WIDTH1_FORWARD": "decode",
        "SGLANG_DFLASH_DRAFT_CUDA_GRAPH": "0",
        "SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN": "512",
        "SGLANG_DFLASH_VERIFY_GRAPHS": "eager",
        "SGLANG_DFLASH_DEFERRED_INJECTION": "0",
        "SGLANG_DFLASH_STEP_TIMING": "steps.jsonl",
        "SGLANG_ENABLE_LILICORR_SAMPLING": "0",
        "SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION": "1",
        "SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER": "1",
        "SGLANG_DFLASH_TEST_SKIP_DRAFT_HICACHE": "1",
        "SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT": "1",
        "SGLANG_DFLASH_TEST_WIDTH1_STEPS": "3",
        "SGLANG_DFLASH_TEST_WIDTHS": "1,4, 2",
        "SGLANG_DFLASH_CHECK_RANKS": "1",
        "SGLANG_DFLASH_TRACE_PROPOSALS": "trace.jsonl",
    }
    got = Knobs.from_env(env, simulated=False)
    assert got == Knobs(
        grammar_proposals=False,
        adaptive_width="1",
        fair_slack="off",
        width1_forward="decode",
        draft_graphs="0",
        draft_plan_free="512",
        verify_graphs="eager",
        deferred_injection=False,
        step_timing="steps.jsonl",
        lilicorr_sampling=False,
        skip_decode_injection=True,
        skip_draft_transfer=True,
        skip_draft_hicache=True,
        skip_state_commit=True,
        width1_steps=3,
        widths=(1, 4, 2),
        check_ranks=True,
        trace_proposals="trace.jsonl",
    )
    assert len(got.aids_on()) == 9
    # Unset: the defaults, and no aid in the start-up line.
    assert Knobs.from_env({}, simulated=False) == Knobs()
    assert Knobs().aids_on() == []
    # "1" switches a test aid on; anything else leaves it off, as before.
    assert not Knobs.from_env({"SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION": "yes"}, simulated=False).aids_on()


def test_the_knobs_module_lists_every_variable_it_reads():
    """Each `*_ENV` name is documented in the module's docstring, one line each."""
    names = [value for key, value in vars(knobs_module).items() if key.endswith("_ENV")]
    assert len(names) == 20
    for name in names:
        assert name in knobs_module.__doc__, name

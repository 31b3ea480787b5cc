"""Sampled requests through SGLang with DFLASH, against the non-speculative engine.

* The sampling distribution over the first generated positions equals the target's (a
  two-sample chi-square test on a flat, high-entropy tiny target), also under a grammar, where
  every sample must match it; the DFLASH engine takes every verify width 1..4 in turn.
* Greedy requests with penalties, min_new_tokens and logit_bias stay token-identical.
* Greedy requests stay token-identical when they share batches with sampled ones.
* A request's `sampling_seed` gives the same tokens run after run.

The non-speculative reference runs with overlap scheduling off: in SGLang 0.5.23 its overlap
path applies output penalties one token late.
"""

import os
from unittest import mock

import pytest

from tests.support import engines
from tests.support.favoured_targets import favoured_target
from tests.support.sampled_requests import FILTERED, N_SAMPLES, PROMPT, SEEDED
from tests.support.stats import ALPHA, homogeneity_pvalue
from tests.support.tiny import add_selector

pytestmark = pytest.mark.sglang


GREEDY = {"max_new_tokens": 24, "temperature": 0.0}
PENALIZED = [
    dict(GREEDY, frequency_penalty=0.8),
    dict(GREEDY, presence_penalty=1.5),
    dict(GREEDY, repetition_penalty=1.6),
    dict(GREEDY, min_new_tokens=12, stop_token_ids=[7, 9, 11]),
    dict(GREEDY, logit_bias={"5": 3.0, "17": -100.0}),
    dict(GREEDY, frequency_penalty=0.4, presence_penalty=0.4, repetition_penalty=1.2, logit_bias={"9": 2.0}),
]
PROMPTS = engines.prompts(len(PENALIZED), seed=12)
MIXED = [(p, GREEDY) for p in engines.prompts(6, seed=13)] + [
    (p, dict(FILTERED, max_new_tokens=24)) for p in engines.prompts(6, seed=14)
]


# Two or three letters from a-h: tokens of one and two letters compete at every position.
GRAMMAR_REGEX = "[a-h]{2,3}"
CONSTRAINED = {"temperature": 1.0, "max_new_tokens": 4, "regex": GRAMMAR_REGEX}


def _sample(engine):
    def run(sampling):
        return engines.generate(engine, [PROMPT] * N_SAMPLES, sampling, 64)

    constrained = run(CONSTRAINED)
    return {
        "samples": [tuple(o["output_ids"]) for o in run(FILTERED)],
        "constrained": [tuple(o["output_ids"]) for o in constrained],
        "constrained_texts": [o["text"] for o in constrained],
    }


def _greedy(engine):
    """On the peaked target "a": greedy choices there are far from ties."""
    penalized = engines.generate_concurrently(engine, list(zip(PROMPTS, PENALIZED)))
    mixed = engines.generate_concurrently(engine, MIXED)
    return {
        "penalized": [o["output_ids"] for o in penalized],
        "mixed_greedy": [o["output_ids"] for o, (_, s) in zip(mixed, MIXED) if s is GREEDY],
    }


def _with_engine(run, *args, **kwargs):
    engine = engines.start(*args, **kwargs)
    try:
        return run(engine)
    finally:
        engines.shutdown(engine)


@pytest.fixture(scope="module")
def reference(tiny):
    samples = _with_engine(_sample, tiny.target("flat"), disable_overlap_schedule=True)
    greedy = _with_engine(_greedy, tiny.target("a"), disable_overlap_schedule=True)
    return dict(greedy, **samples)


@pytest.fixture(scope="module")
def dflash(tiny, reference):
    def sample_and_seed(engine):  # and the seeded requests, on the same engine
        return dict(_sample(engine), seeded=_seeded_twice(engine))

    # Every width 1..4 in turn, so the samples hold every width's verify.
    with mock.patch.dict(os.environ, {"SGLANG_DFLASH_TEST_WIDTHS": "1,2,3,4"}):
        samples = _with_engine(sample_and_seed, tiny.target("flat"), tiny.draft("a"), 4)
    greedy = _with_engine(_greedy, *tiny.pair("a"), 4)
    return dict(greedy, **samples)


def _sample_with_acceptance(engine):
    out = engines.generate(engine, [PROMPT] * N_SAMPLES, FILTERED, 64)
    constrained = engines.generate(engine, [PROMPT] * N_SAMPLES, CONSTRAINED, 64)
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in out)
    # Every token but the prefill's comes from a verify step; the rest are accepted drafts.
    verified = sum(len(o["output_ids"]) - 1 for o in out)
    return {
        "samples": [tuple(o["output_ids"]) for o in out],
        "accepted_per_step": (verified - steps) / max(steps, 1),
        "constrained": [tuple(o["output_ids"]) for o in constrained],
        "constrained_texts": [o["text"] for o in constrained],
    }


@pytest.fixture(scope="module")
def dflash2(tiny):
    """A DFlash2 draft on a target that favours one token (its candidates often hold the
    target's likely tokens), flattened (`output_multiplier`) so that q is far from p: sampled
    requests walk its selector at their temperature, the verify accepts with the walk's q
    (`verify/q_sampling.py`), and a wrong q shows in the output."""
    target = favoured_target(tiny, "llama")
    reference = _with_engine(_sample_with_acceptance, target, disable_overlap_schedule=True)
    flat = tiny.edited_draft(
        "a", "dflash2-sampling", lambda d: d["dflash_config"].update(output_multiplier=0.2)
    )
    return reference, _with_engine(_sample_with_acceptance, target, add_selector(flat, scale=0.3), 4)


@pytest.mark.parametrize("positions", [(0, 1), (1, 2), (2,)], ids=["tokens-1-2", "tokens-2-3", "token-3"])
def test_dflash2_sampled_walks_keep_the_targets_distribution(dflash2, positions):
    reference, got = dflash2
    pick = lambda seqs: [tuple(s[i] for i in positions) for s in seqs]  # noqa: E731
    assert homogeneity_pvalue(pick(reference["samples"]), pick(got["samples"])) > ALPHA
    print(f"DFlash2 sampled: {got['accepted_per_step']:.2f} drafts accepted per step")
    assert got["accepted_per_step"] > 0.05  # sampled proposals are accepted: the test has power


def test_dflash2_under_a_grammar_keeps_the_targets_distribution(dflash2):
    import re

    reference, got = dflash2
    pick = lambda seqs: [tuple(s[i] if i < len(s) else -1 for i in (0, 1)) for s in seqs]  # noqa: E731
    assert homogeneity_pvalue(pick(reference["constrained"]), pick(got["constrained"])) > ALPHA
    assert all(re.fullmatch(GRAMMAR_REGEX, text) for text in got["constrained_texts"])


@pytest.mark.parametrize("positions", [(0, 1), (1, 2), (2,)], ids=["tokens-1-2", "tokens-2-3", "token-3"])
def test_sampled_distribution_matches_the_target(reference, dflash, positions):
    pick = lambda seqs: [tuple(s[i] for i in positions) for s in seqs]  # noqa: E731
    assert homogeneity_pvalue(pick(reference["samples"]), pick(dflash["samples"])) > ALPHA


@pytest.mark.parametrize("positions", [(0,), (0, 1)], ids=["token-1", "tokens-1-2"])
def test_sampled_distribution_under_a_grammar_matches_the_target(reference, dflash, positions):
    pick = lambda seqs: [tuple(s[i] if i < len(s) else -1 for i in positions) for s in seqs]  # noqa: E731
    assert homogeneity_pvalue(pick(reference["constrained"]), pick(dflash["constrained"])) > ALPHA


def test_sampled_outputs_under_a_grammar_match_it(reference, dflash):
    import re

    assert all(re.fullmatch(GRAMMAR_REGEX, text) for text in dflash["constrained_texts"])
    assert len({s[0] for s in dflash["constrained"]}) >= 8  # the test above has power


def test_samples_are_not_degenerate(reference, dflash):
    """The test above has power: the flat target spreads the second token over many values."""
    assert len({s[1] for s in reference["samples"]}) >= 8
    assert len({s[1] for s in dflash["samples"]}) >= 8


def test_greedy_with_penalties_and_logit_bias(reference, dflash):
    for params, want, got in zip(PENALIZED, reference["penalized"], dflash["penalized"]):
        assert got == want, params


def test_greedy_requests_in_batches_with_sampled_ones(reference, dflash):
    assert dflash["mixed_greedy"] == reference["mixed_greedy"]


def _seeded(engine):
    return [o["output_ids"] for o in engines.generate_concurrently(engine, [(PROMPT, s) for s in SEEDED])]


def _seeded_twice(engine) -> tuple:
    first, second = _seeded(engine), _seeded(engine)
    # Unseeded requests sharing the batch still sample independently.
    unseeded = engines.generate_concurrently(engine, [(PROMPT, dict(s, sampling_seed=None)) for s in SEEDED])
    return first, second, [o["output_ids"] for o in unseeded]


def test_seeded_sampling_is_reproducible(dflash):
    first, second, unseeded = dflash["seeded"]
    assert first == second
    assert len({tuple(x) for x in first}) > 1  # different seeds, different samples
    assert len({tuple(x) for x in unseeded}) > 1

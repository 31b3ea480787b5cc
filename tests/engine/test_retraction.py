"""A KV pool too small for the batch makes SGLang retract requests and prefill them again
later (prompt + outputs so far); DFLASH output stays the target's, and the draft K/V and
penalty state are rebuilt for the re-prefilled requests."""

import pytest

from tests.support import engines

pytestmark = pytest.mark.sglang

PROMPTS = engines.prompts(16, seed=3, min_len=30, max_len=40)
SAMPLING = [
    {
        "max_new_tokens": 64,
        "temperature": 0.0,
        "ignore_eos": True,
        **({"frequency_penalty": 0.5} if i % 2 else {}),
    }
    for i in range(len(PROMPTS))
]


def _run(*args, **kwargs):
    engine = engines.start(*args, **kwargs)
    try:
        return engines.generate_concurrently(engine, list(zip(PROMPTS, SAMPLING)))
    finally:
        engines.shutdown(engine)


def test_retracted_requests_stay_lossless(tiny):
    target, draft = tiny.pair("a")
    want = _run(target, disable_overlap_schedule=True)
    got = _run(target, draft, 8, max_total_tokens=900)
    assert sum(o["meta_info"]["num_retractions"] for o in got) >= 1, (
        "the pool was large enough: no retraction"
    )
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]

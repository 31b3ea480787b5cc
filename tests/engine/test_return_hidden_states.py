"""`--return-hidden-states-mode last`: the server keeps one hidden state per request, its last
token's. With DFLASH the worker hands SGLang's result processor the target's final hidden
states in the layout it reads in that mode (one row per request after a prefill, one per
committed token after a verify); checked against the non-speculative engine to 1e-4. (The FULL
mode is covered by `test_request_features.py`.)"""

import numpy as np
import pytest

from tests.support import engines

pytestmark = pytest.mark.sglang

PROMPTS = engines.prompts(3, seed=27)
# One new token: the state returned is the prefill's; ten: the last verify step's.
SAMPLINGS = [{"max_new_tokens": n, "temperature": 0.0} for n in (1, 10)]


def _run(engine):
    requests = [
        dict(input_ids=p, sampling_params=s, return_hidden_states="last") for s in SAMPLINGS for p in PROMPTS
    ]
    return engines.submit(engine, requests)


def test_last_mode_hidden_states_equal_the_reference(tiny):
    engine = engines.start(tiny.target("a"), return_hidden_states_mode="last")
    try:
        want = _run(engine)
    finally:
        engines.shutdown(engine)
    engine = engines.start(*tiny.pair("a"), 8, return_hidden_states_mode="last")
    try:
        got = _run(engine)
    finally:
        engines.shutdown(engine)
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        ours, theirs = g["meta_info"]["hidden_states"], w["meta_info"]["hidden_states"]
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-4)

"""DFLASH under the scheduler's other paths, each checked against the non-speculative engine:
chunked prefill, prefix (radix) cache hits, staggered mixed batches, max_new_tokens 1 and 2,
stop tokens and stop strings, aborts, and that KV and request slots return to idle.

SGLang's idle invariant checker runs in strict mode here, so a leaked slot crashes the engine.
"""

import os

import pytest

from tests.support import engines

pytestmark = pytest.mark.sglang

CHUNK = 16  # chunked prefill size, smaller than the long prompts
SERVING = dict(chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK * 4)
GREEDY = {"max_new_tokens": 20, "temperature": 0.0}

SHARED_PREFIX = engines.prompts(1, seed=7, min_len=48, max_len=48)[0]
LONG = engines.prompts(4, seed=5, min_len=40, max_len=70)
SHORT = engines.prompts(6, seed=6, min_len=3, max_len=12)
STOP_PROMPTS = engines.prompts(6, seed=8)


def _cases():
    cases = {f"long{i}": (p, GREEDY) for i, p in enumerate(LONG)}
    cases.update({f"short{i}": (p, GREEDY) for i, p in enumerate(SHORT)})
    cases.update({f"prefix{i}": (SHARED_PREFIX + s, GREEDY) for i, s in enumerate(SHORT[:3])})
    for n in (1, 2):
        cases.update({f"max{n}_{i}": (p, dict(GREEDY, max_new_tokens=n)) for i, p in enumerate(SHORT[:3])})
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def expected(tiny):
    """Non-speculative outputs for every case (and the stop cases, derived from them)."""
    engine = engines.start(tiny.target("a"), **SERVING)
    try:
        out = {name: engines.generate(engine, [ids], s, 1)[0] for name, (ids, s) in CASES.items()}
        # Stops: stop at the 5th generated token of each prompt's greedy continuation, once
        # as a stop token id and once as a stop string (that token's decoded text).
        plain = engines.generate(engine, STOP_PROMPTS, GREEDY, len(STOP_PROMPTS))
        stops = []
        for ids, o in zip(STOP_PROMPTS, plain):
            token = o["output_ids"][4]
            for sampling in (
                dict(GREEDY, stop_token_ids=[token]),
                dict(GREEDY, stop=[engine.tokenizer_manager.tokenizer.decode([token])]),
            ):
                stops.append((ids, sampling, engines.generate(engine, [ids], sampling, 1)[0]))
        return out, stops
    finally:
        engines.shutdown(engine)


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sync-mixed-chunk"])
def engine(request, tiny, expected):
    os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"
    target, draft = tiny.pair("a")
    overlap = request.param
    extra = {} if overlap else {"enable_mixed_chunk": True}
    eng = engines.start(target, draft, 8, disable_overlap_schedule=not overlap, **SERVING, **extra)
    idle = engines.load(eng)
    yield eng
    # Everything below ran on this engine: its pools must be back at the idle level.
    engines.flush_cache(eng)
    after = engines.idle_load(eng, idle)
    assert (after.num_used_tokens, after.num_running_reqs) == (idle.num_used_tokens, 0)
    engines.shutdown(eng)


def test_chunked_prefill_and_short_prompts(engine, expected):
    want, _ = expected
    names = [n for n in CASES if n.startswith(("long", "short"))]
    out = engines.generate(engine, [CASES[n][0] for n in names], GREEDY, len(names))
    for name, o in zip(names, out):
        assert o["output_ids"] == want[name]["output_ids"], name


def test_prefix_cache_hit(engine, expected):
    want, _ = expected
    engines.flush_cache(engine)
    for i, name in enumerate(n for n in CASES if n.startswith("prefix")):
        ids, sampling = CASES[name]
        o = engines.generate(engine, [ids], sampling, 1)[0]
        assert o["output_ids"] == want[name]["output_ids"], name
        if i > 0:  # the shared prefix was cached by the first request
            assert o["meta_info"]["cached_tokens"] >= len(SHARED_PREFIX) - 1


def test_staggered_mixed_batches(engine, expected):
    """Long prompts arrive while short ones decode: prefill chunks, extends and decodes mix."""
    want, _ = expected
    names = [n for n in CASES if n.startswith(("short", "long"))]
    out = engines.generate_concurrently(engine, [CASES[n] for n in names], stagger=0.05)
    for name, o in zip(names, out):
        assert o["output_ids"] == want[name]["output_ids"], name


@pytest.mark.parametrize("n", [1, 2])
def test_max_new_tokens_1_and_2(engine, expected, n):
    want, _ = expected
    names = [name for name in CASES if name.startswith(f"max{n}_")]
    out = engines.generate_concurrently(engine, [CASES[name] for name in names])
    for name, o in zip(names, out):
        assert o["output_ids"] == want[name]["output_ids"], name
        assert len(o["output_ids"]) == n


def test_stop_tokens_and_strings(engine, expected):
    _, stops = expected
    out = engines.generate_concurrently(engine, [(ids, sampling) for ids, sampling, _ in stops])
    for (_, sampling, want), got in zip(stops, out):
        assert got["text"] == want["text"], sampling
        assert got["output_ids"] == want["output_ids"], sampling
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], sampling


def test_abort_mid_generation(engine, expected):
    want, _ = expected
    ids = LONG[0]
    last = engines.generate_and_abort(
        engine, ids, dict(GREEDY, max_new_tokens=200), rid="to-abort", after_chunks=3
    )
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    # The engine keeps serving, and serves correctly.
    o = engines.generate(engine, [ids], GREEDY, 1)[0]
    assert o["output_ids"] == want["long0"]["output_ids"]


def test_sampled_request_completes(engine):
    o = engines.generate(
        engine, [SHORT[0]], {"max_new_tokens": 8, "temperature": 0.8, "ignore_eos": True}, 1
    )[0]
    assert len(o["output_ids"]) == 8


def test_unsupported_features_are_rejected(engine):
    """Rejected as a bad request (HTTP 400 on the server) naming the feature: sampling_seed with
    min_p, which SGLang's own seeded sampler refuses too."""
    sampling = dict(GREEDY, temperature=0.8, min_p=0.1, sampling_seed=3)
    with pytest.raises(ValueError, match="sampling_seed.*min_p"):
        engine.generate(input_ids=SHORT[0], sampling_params=sampling)

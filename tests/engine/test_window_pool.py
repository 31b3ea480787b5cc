"""The draft's window ring in a running engine (`sglang_dflash/draft/window_ring.py`), on the
shipped pair with its draft re-declared all-sliding (window 32, block 8: a ring of 40 rows per
request slot). The ring engine runs SGLANG_DFLASH_DRAFT_WINDOW_POOL's default (auto): nothing
caps the pool, so the ring gives the target more tokens and is chosen; the store of every token
runs with it set to 0.

Three engines at the same memory settings, nothing capping the pool: no speculation, DFLASH
with the draft's K/V for every token (today's store), and DFLASH with the ring (and the ring at
tensor parallel size 2, and under SGLang's retraction aid on a target paged by 8 tokens). Prompts run four
at a time, prefilled in chunks of 24 tokens, every third decode step without the draft (W = 1:
its K/V injection deferred to the next draft), to contexts of 6 to 9 windows. Oracles: the
plain engine's greedy tokens, the other store's per-request acceptance (the same proposals),
and the plain engine's pool size.
"""

from __future__ import annotations

import json
import os
import shutil
from unittest import mock

import pytest

from sglang_dflash.assets import tiny_pair, tiny_pair_prompts
from tests.support import engines

pytestmark = pytest.mark.sglang

WINDOW = 32
GREEDY = {"max_new_tokens": 160, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 96, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 11}
ENGINE = dict(engines.CPU_ENGINE, max_total_tokens=None, mem_fraction_static=0.08, chunked_prefill_size=24)
DFLASH = {"SGLANG_DFLASH_ADAPTIVE_WIDTH": "0", "SGLANG_DFLASH_TEST_WIDTHS": "8,8,1"}
RING = DFLASH  # the default, auto
EVERY_TOKEN = {**DFLASH, "SGLANG_DFLASH_DRAFT_WINDOW_POOL": "0"}
# SGLang's test aid: every third decode step retracts a request, which comes back later (in
# whichever request slot is free) and prefills its prompt and outputs again. That engine pages
# the target's KV cache by 8 tokens too: radix-cache hits then end on a page boundary.
RETRACTING = {**RING, "SGLANG_TEST_RETRACT": "1"}
PAGE = 8  # a divisor of the prefill chunk (24), as SGLang requires
TP2_WITHOUT_REPREFILL = {
    **DFLASH,
    "SGLANG_DFLASH_DRAFT_WINDOW_POOL": "1",
    "SGLANG_DFLASH_TEST_SKIP_WINDOW_REPREFILL": "1",
    "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
}


def _all_sliding(draft: str, root) -> str:
    path = os.path.join(root, "draft-all-sliding")
    shutil.copytree(draft, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(
        layer_types=["sliding_attention"] * config["num_hidden_layers"],
        sliding_window=WINDOW,
        use_sliding_window=True,
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair()[0])
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in tiny_pair_prompts()[:8]]


def _run(env: dict, prompt_ids, draft=None, again=(), sampled=False, **engine_args):
    """Outputs, server info, the outputs of `again` (prompts re-sent: radix-cache hits) and
    server info after them; with `sampled`, then seeded sampled outputs of four prompts."""
    target = tiny_pair()[0]
    kwargs = dict(ENGINE, model_path=target, **engine_args)
    if draft is not None:
        kwargs.update(speculative_algorithm="DFLASH", speculative_draft_model_path=draft)
    import sglang as sgl

    with mock.patch.dict(os.environ, env):
        engine = sgl.Engine(**kwargs)
    try:
        out = engines.generate(engine, prompt_ids, GREEDY, 4)
        info = engine.get_server_info()
        repeated = engines.generate(engine, list(again), GREEDY, 2) if again else []
        after = engine.get_server_info()
        samples = engines.generate(engine, prompt_ids[4:8], SEEDED, 4) if sampled else []
        return out, info, repeated, after, samples
    finally:
        engines.shutdown(engine)


@pytest.fixture(scope="module")
def runs(prompt_ids, tmp_path_factory):
    draft = _all_sliding(tiny_pair()[1], tmp_path_factory.mktemp("window-pool"))
    again = prompt_ids[:2]
    return {
        "plain": _run({}, prompt_ids),
        # The ring right after the plain engine: both measure the memory as free as it gets.
        "ring": _run(RING, prompt_ids, draft, again, sampled=True),
        "every-token": _run(EVERY_TOKEN, prompt_ids, draft, again, sampled=True),
        # Each rank's ring holds its KV head; one core a rank (test_tensor_parallel.py). And a
        # radix-cache hit there reuses its whole prefix (the test aid): the window goes missing.
        "ring-tp2": _run(TP2_WITHOUT_REPREFILL, prompt_ids[:4], draft, again, tp_size=2),
        "ring-retracting-paged": _run(RETRACTING, prompt_ids[:4], draft, again, page_size=PAGE),
    }


def _ids(outputs):
    return [o["output_ids"] for o in outputs]


def test_the_ring_is_lossless_past_the_window(runs, prompt_ids):
    plain, ring = runs["plain"][0], runs["ring"][0]
    assert _ids(ring) == _ids(plain)
    assert min(len(p) for p in prompt_ids) + GREEDY["max_new_tokens"] >= 6 * WINDOW


def test_the_ring_proposes_what_the_store_of_every_token_proposes(runs):
    """Per request, the accepted-draft counts of every verify step equal the other store's: the
    sliding layers read the same K/V from the ring. (With a ring that lost rows the trained
    draft's proposals change, and its acceptance drops: tests/unit/draft/test_window_ring.py.)"""
    every, ring = runs["every-token"][0], runs["ring"][0]
    hist = [o["meta_info"]["spec_correct_drafts_histogram"] for o in ring]
    assert hist == [o["meta_info"]["spec_correct_drafts_histogram"] for o in every]
    assert sum(sum(n * c for n, c in enumerate(h)) for h in hist) > 0  # drafts were accepted


def test_seeded_sampling_gives_the_store_of_every_tokens_samples(runs):
    """Sampled verification draws the same numbers for the same seed, and the ring proposes what
    the store of every token proposes: the same sampled tokens (the sampling itself against the
    target's distribution: tests/engine/test_sampling.py)."""
    ring, every = runs["ring"][4], runs["every-token"][4]
    assert _ids(ring) == _ids(every)
    assert len({tuple(ids) for ids in _ids(ring)}) == 4


def test_each_tensor_parallel_rank_keeps_its_heads_ring(runs):
    """At TP 2 each rank rings its own KV head: the same tokens, and the same proposals."""
    tp2, ring = runs["ring-tp2"][0], runs["ring"][0][:4]
    assert _ids(tp2) == _ids(runs["plain"][0][:4])
    hist = [o["meta_info"]["spec_correct_drafts_histogram"] for o in tp2]
    assert hist == [o["meta_info"]["spec_correct_drafts_histogram"] for o in ring]


def test_the_target_gets_the_memory_back(runs):
    plain = runs["plain"][1]["max_total_num_tokens"]
    every, ring = (runs[k][1] for k in ("every-token", "ring"))
    assert ring["max_total_num_tokens"] >= 0.95 * plain
    assert every["max_total_num_tokens"] < 0.8 * plain  # today's store: a row per token
    kv = ring["internal_states"][0]["dflash_draft_kv"]
    assert kv["sliding_layers_windowed"] is True
    assert kv["window_ring_rows_per_request"] == WINDOW + 8
    assert kv["window_ring_bytes"] == kv["store_bytes"]  # all-sliding: nothing per token
    assert kv["window_ring_why_not"] is None  # auto chose it
    every_kv = every["internal_states"][0]["dflash_draft_kv"]
    assert every_kv["sliding_layers_windowed"] is False
    assert every_kv["window_ring_why_not"] == "SGLANG_DFLASH_DRAFT_WINDOW_POOL=0"


def _misses(info) -> dict:
    return info["internal_states"][0]["dflash_window_misses"]


def test_a_radix_cache_hit_re_prefills_the_window_and_proposes_as_todays_store(runs):
    """The first two prompts again, on both DFLASH engines: the radix cache serves all but their
    last 32 tokens, which the target prefills again, filling the new request slot's ring. The
    same tokens, the same proposals as the store of every token makes on its cache hit (which
    holds the prefix's draft K/V), and no request drafts without its window."""
    plain, (_, info, repeated, after, _) = runs["plain"][0], runs["ring"]
    assert _ids(repeated) == _ids(plain[:2])
    hist = [o["meta_info"]["spec_correct_drafts_histogram"] for o in repeated]
    assert hist == [o["meta_info"]["spec_correct_drafts_histogram"] for o in runs["every-token"][2]]
    assert repeated[0]["meta_info"]["cached_tokens"] > 0  # the prefix was served from the cache
    assert _misses(after) == _misses(info) == {"requests": 0, "positions": 0}


def test_a_radix_cache_hit_without_the_re_prefill_is_lossless_and_counted(runs):
    """The check can fail: with the re-prefill switched off (SGLANG_DFLASH_TEST_SKIP_WINDOW_REPREFILL)
    the hit reuses all but the last token, whose window the new slot's ring does not hold:
    each request is counted, with its window's 31 positions before that token."""
    plain, (_, info, repeated, after, _) = runs["plain"][0], runs["ring-tp2"]
    assert _ids(repeated) == _ids(plain[:2])
    before, now = _misses(info), _misses(after)
    assert now["requests"] - before["requests"] == 2
    assert now["positions"] - before["positions"] == 2 * (WINDOW - 1)


def _accepted(outputs) -> int:
    return sum(
        sum(n * c for n, c in enumerate(o["meta_info"]["spec_correct_drafts_histogram"])) for o in outputs
    )


def test_retracted_requests_rebuild_their_ring_and_keep_their_acceptance(runs):
    """Retracted dozens of times each, the requests give the plain engine's tokens, and their
    drafts are accepted as often as without retraction (the re-prefill rebuilds the ring in the
    new slot: proposals over another request's rows would lose most of that). The retraction
    schedule differs from run to run, and the verify widths cycle over the batch's steps: the
    same acceptance, not the same histograms."""
    got, info = runs["ring-retracting-paged"][:2]
    assert _ids(got) == _ids(runs["plain"][0][:4])
    assert sum(o["meta_info"]["num_retractions"] for o in got) >= 4 * 4
    assert _accepted(got) >= 0.9 * _accepted(runs["ring"][0][:4])
    assert _misses(info) == {"requests": 0, "positions": 0}
    assert info["internal_states"][0]["dflash_draft_kv"]["sliding_layers_windowed"] is True


def test_a_paged_radix_cache_hit_re_prefills_the_window(runs):
    """With pages of 8 the cache serves whole pages only, ending at or before the re-prefill's
    limit: the window is still prefilled again, the same tokens, no request without it."""
    _, _, repeated, after, _ = runs["ring-retracting-paged"]
    assert _ids(repeated) == _ids(runs["plain"][0][:2])
    cached = [o["meta_info"]["cached_tokens"] for o in repeated]
    assert cached[0] > 0 and all(c % PAGE == 0 for c in cached), cached
    assert _misses(after) == {"requests": 0, "positions": 0}


def _engine(env: dict, draft: str, **engine_args):
    import sglang as sgl

    kwargs = dict(ENGINE, model_path=tiny_pair()[0], speculative_algorithm="DFLASH")
    kwargs.update(speculative_draft_model_path=draft, **engine_args)
    with mock.patch.dict(os.environ, env):
        return sgl.Engine(**kwargs)


def test_two_data_parallel_replicas_each_keep_a_ring(runs, prompt_ids, tmp_path):
    env = {**RING, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # one core per replica
    engine = _engine(env, _all_sliding(tiny_pair()[1], tmp_path), dp_size=2)
    try:
        got = engines.generate(engine, prompt_ids[:4], GREEDY, 4)
        states = engine.get_server_info()["internal_states"]
    finally:
        engines.shutdown(engine)
    assert _ids(got) == _ids(runs["plain"][0][:4])
    assert [s["dflash_draft_kv"]["sliding_layers_windowed"] for s in states] == [True, True]
    assert {o["meta_info"]["dp_rank"] for o in got} == {0, 1}

"""Tensor parallelism on SGLang's CPU engine. With PyNccl kept off CPU process groups
(`cpu/bootstrap.py`), a TP=2 engine serves the TP=1 engine's greedy tokens. DFLASH at TP=2,
with the draft sharded like the target (`draft/tensor_parallel.py`), serves the TP=2 plain engine's
greedy tokens, and verifies the same proposals as DFLASH at TP=1: sharding changed nothing but
placement. SGLang's strict idle checker runs in every rank's scheduler, so a leaked KV or
request slot on any rank crashes the engine."""

import pytest

from tests.support import engines

# The sampling workload of test_sampling_engine: a flat, high-entropy target, top-k/top-p/min-p.
from tests.support.sampled_requests import FILTERED as SAMPLED
from tests.support.sampled_requests import N_SAMPLES, SEEDED
from tests.support.sampled_requests import PROMPT as SAMPLE_PROMPT
from tests.support.stats import ALPHA, homogeneity_pvalue
from tests.support.tiny import add_selector

pytestmark = pytest.mark.sglang

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
# Structured output: the draft's full-vocab logits are gathered across ranks to rank its
# candidates under the grammar (`TargetHead.logits`), instead of the vocab-parallel argmax.
CONSTRAINED = {"max_new_tokens": 16, "temperature": 0.0, "regex": "[a-z_ ]{4,40}"}
PROMPTS = engines.prompts(8, seed=50)


@pytest.fixture
def two_ranks(monkeypatch):
    # One core per rank; this machine has one NUMA node, fewer than the ranks.
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "1")
    # Every decode step, the ranks' proposals and committed tokens are compared; a rank that
    # drew other random numbers, or proposed other tokens, crashes the engine.
    monkeypatch.setenv("SGLANG_DFLASH_CHECK_RANKS", "1")


def _pair(tiny, name: str) -> tuple[str, str, list[list[int]]]:
    """(target, draft, prompts). "shipped" is the trained pair, on its held-out code prompts
    (its draft gets proposals accepted); the tiny random pairs take random token ids."""
    if name != "shipped":
        return (*tiny.pair(name), PROMPTS)
    from transformers import AutoTokenizer

    from sglang_dflash.assets import tiny_pair, tiny_pair_prompts

    target, draft = tiny_pair()
    tokenizer = AutoTokenizer.from_pretrained(target)
    return target, draft, [tokenizer(text).input_ids[-48:] for text in tiny_pair_prompts()[: len(PROMPTS)]]


def _generate(engine, prompts, batch_size: int) -> list[dict]:
    return engines.generate(engine, prompts, GREEDY, batch_size)


def _ids(outputs) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


def _verify_counts(outputs) -> list[int]:
    return [o["meta_info"]["spec_verify_ct"] for o in outputs]


def _run(target, draft=None, prompts=PROMPTS, batch_sizes=(8,), **kwargs) -> dict:
    """Greedy outputs by batch size, and under "constrained" the grammar-constrained ones."""
    engine = engines.start(target, draft, **kwargs)
    try:
        idle = engines.load(engine)
        out: dict = {bs: _generate(engine, prompts, bs) for bs in batch_sizes}
        out["constrained"] = engines.generate(engine, prompts, CONSTRAINED, 8)
        engines.flush_cache(engine)  # the radix cache holds the finished prompts' slots
        after = engines.idle_load(engine, idle)
        assert (after.num_used_tokens, after.num_running_reqs) == (idle.num_used_tokens, 0)
        if draft is not None:
            impl = engines.server_state(engine)["dflash_implementation"]
            assert impl.startswith("sglang-dflash")
        return out
    finally:
        engines.shutdown(engine)


@pytest.mark.parametrize("pair", ["shipped", "b-tp"])
def test_dflash_at_tp2_is_lossless_and_verifies_the_tp1_proposals(tiny, two_ranks, pair):
    """The shipped pair (target: 4 heads, 2 KV heads, vocab 2048, split in two) and target
    "b" (6 heads, 2 KV heads) with a draft of 4 heads and 2 KV heads; 8 prompts at batch
    sizes 1 and 8, overlap scheduling on, greedy and under a regex. The TP=1 DFLASH engine
    (lossless against TP=1 without speculation: test_lossless.py) gives the TP=2 plain
    engine's tokens, so the TP=2 plain engine is the TP=1 one's too. The TP=1 engine runs for
    the shipped pair only: the random "b-tp" draft has no proposal accepted (0 of 192 tokens at
    TP=1, batch 8), so its verify counts at TP=1 and TP=2 would agree whatever it proposed
    (suite time)."""
    target, draft, prompts = _pair(tiny, pair)
    plain = _run(target, prompts=prompts, tp_size=2)
    want, want_constrained = _ids(plain[8]), _ids(plain["constrained"])
    out = _run(target, draft, prompts, (1, 8), tp_size=2)
    for batch_size in (1, 8):
        assert _ids(out[batch_size]) == want, batch_size
    assert _ids(out["constrained"]) == want_constrained
    if pair != "shipped":
        return
    tp1 = _run(target, draft, prompts, fixed_width=True)
    assert _ids(tp1[8]) == want
    assert _ids(tp1["constrained"]) == want_constrained
    # The same verify steps per request as at TP=1: the sharded draft proposed the same tokens
    # (the width is fixed at TP > 1; the TP=1 engine above is fixed too).
    for key in (8, "constrained"):
        assert _verify_counts(out[key]) == _verify_counts(tp1[key]), key
    # Its trained draft is accepted, so the comparison is not of empty drafts.
    assert sum(len(o["output_ids"]) - 1 - o["meta_info"]["spec_verify_ct"] for o in tp1[8]) > 0


def test_dflash_at_tp2_refuses_a_draft_whose_kv_heads_do_not_split(tiny, two_ranks):
    with pytest.raises(Exception, match=r"KV heads \(1\) do not divide by the tensor-parallel size \(2\)"):
        engine = engines.start(*tiny.pair("b"), tp_size=2)
        engines.shutdown(engine)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(enable_dp_attention=True, dp_size=2, tp_size=2), "enable_dp_attention"),
        (dict(pp_size=2), "pp_size=2"),
    ],
    ids=["dp-attention", "pipeline"],
)
def test_other_parallelism_is_refused_by_name(tiny, kwargs, named):
    with pytest.raises(ValueError, match=named):
        engines.shutdown(engines.start(*tiny.pair("a"), **kwargs))


_PLAIN_SAMPLES: list = []  # the plain TP=2 engine's samples, shared by both drafts


@pytest.mark.parametrize("kind", ["plain", "dflash2"])
def test_sampled_verification_at_tp2_matches_the_plain_tp2_distribution(tiny, two_ranks, kind):
    """Unseeded sampling: every rank must draw the same random numbers, or the ranks commit
    different tokens (and their collectives stop matching). "dflash2": a DFlash2 draft, whose
    sampled walk over the vocab-parallel top-K candidates is verified with its q."""

    def samples(draft=None):
        engine = engines.start(tiny.target("flat"), draft, tp_size=2)
        try:
            outputs = engines.generate(engine, [SAMPLE_PROMPT] * N_SAMPLES, SAMPLED, 64)
            if draft is not None:
                proposals = engines.server_state(engine)["dflash_proposals"]
                assert proposals.startswith("candidate selector" if kind == "dflash2" else "argmax")
                _seeded_beside_unseeded(engine)
            return [tuple(o["output_ids"][:2]) for o in outputs]
        finally:
            engines.shutdown(engine)

    def _seeded_beside_unseeded(engine):
        """Seeded requests share batches with unseeded ones, which then draw fresh seeds: the
        same on both ranks (the rank check above), and the seeded tokens are reproducible."""
        requests = [(SAMPLE_PROMPT, s) for s in SEEDED] + [
            (SAMPLE_PROMPT, dict(s, sampling_seed=None)) for s in SEEDED
        ]
        first, second = (
            [o["output_ids"] for o in engines.generate_concurrently(engine, requests)] for _ in range(2)
        )
        assert first[: len(SEEDED)] == second[: len(SEEDED)]
        assert first[len(SEEDED) :] != second[len(SEEDED) :]  # unseeded requests still vary

    if not _PLAIN_SAMPLES:
        _PLAIN_SAMPLES.append(samples())
    draft = tiny.draft("a")
    if kind == "dflash2":
        draft = add_selector(tiny.edited_draft("a", "dflash2-tp", lambda d: None))
    plain, ours = _PLAIN_SAMPLES[0], samples(draft)
    assert homogeneity_pvalue([s[:1] for s in plain], [s[:1] for s in ours]) > ALPHA
    assert homogeneity_pvalue(plain, ours) > ALPHA
    assert len({s[0] for s in ours}) >= 8  # the test has power

"""Hybrid linear-attention targets on SGLang's CPU engine: Qwen3-Next (MoE), Qwen3.5 (dense),
Qwen3.5-MoE and the Qwen3.5 multimodal wrappers (dense and MoE) serving text, tiny and random
(tests/support/tiny/hybrid.py), served with the CPU stand-ins for the Gated DeltaNet ops
(sglang_dflash/cpu/).

* The non-speculative engine against Hugging Face transformers' own forward: greedy ids
  identical, log-probabilities within fp32 tolerance.
* DFLASH against the non-speculative engine: greedy ids identical over 16 prompts at batch sizes
  4 and 16 and over 4 of them at batch size 1, B in {4, 8}, chunked prefill smaller than the
  prompts, a prefix-cache round, an abort; KV and mamba slots back at idle afterwards (SGLang's
  strict idle checker is on).
* The same comparison fails with the post-verify state commit switched off (`--run-slow`).
* Sampled DFLASH against the non-speculative engine: a chi-square test on one target.

On CPU, SGLang 0.5.23 serves these targets with `--mamba-radix-cache-strategy no_buffer` and
overlap scheduling off (`extra_buffer` needs GPU state snapshots), which is what `auto` (the
default) resolves to there; the Qwen3-Next engine runs with the defaults. The conv state is kept in
fp32 here (SGLANG_MAMBA_CONV_DTYPE), as transformers keeps it: its default bf16 would make the
engine differ from transformers, though not DFLASH from the engine.
"""

import os

import pytest
import torch

from tests.support import engines
from tests.support.stats import ALPHA, homogeneity_pvalue

pytestmark = pytest.mark.sglang

HYBRID = dict(
    mamba_radix_cache_strategy="no_buffer",
    disable_overlap_schedule=True,
    chunked_prefill_size=16,  # smaller than most prompts
    max_prefill_tokens=64,
)
GREEDY = {"max_new_tokens": 24, "temperature": 0.0}
PROMPTS = engines.prompts(16, seed=0)
SHARED_PREFIX = engines.prompts(1, seed=7, min_len=40, max_len=40)[0]
PREFIXED = [SHARED_PREFIX + p for p in engines.prompts(3, seed=6, min_len=3, max_len=8)]
SAMPLED = {"temperature": 2.5, "top_k": 8, "max_new_tokens": 3, "ignore_eos": True}  # flat enough to spread
N_SAMPLES = 1000
SAMPLE_PROMPT = PROMPTS[3]

TARGETS = ["next", "q35", "q35moe", "q35vl", "q35moevl"]
# (target, verify width B, state commit on, verify width: "fixed" at B, "adaptive" (width 1 as a
# verify over one token, the CPU default), or "adaptive-decode" (width 1 as the target's decode
# forward, which advances the linear-attention state itself)); the no-commit one shows the
# comparison can fail.
CONFIGS = [
    ("next", 4, True, "fixed"),
    ("q35", 8, True, "fixed"),
    ("q35moe", 4, True, "adaptive"),
    ("q35vl", 4, True, "fixed"),
    ("q35moevl", 4, True, "fixed"),
    ("next", 4, True, "adaptive-decode"),
    # Draft "a" re-declared sliding (window 16) with the window ring (SGLANG_DFLASH_DRAFT_WINDOW_POOL;
    # tests/engine/test_window_pool.py): the ring beside a hybrid pool and its radix cache.
    ("q35", 4, True, "window-ring"),
    # The demonstration that the comparison can fail: one more engine, with --run-slow only.
    pytest.param(("q35", 4, False, "fixed"), marks=pytest.mark.slow),
]
DEFAULT_FLAGS = {"next"}  # started without the mamba flags above


@pytest.fixture(scope="module", autouse=True)
def fp32_conv_state():
    saved = {
        k: os.environ.get(k)
        for k in ("SGLANG_MAMBA_CONV_DTYPE", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE")
    }
    os.environ["SGLANG_MAMBA_CONV_DTYPE"] = "float32"
    os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _serve(engine, name: str) -> dict:
    out = {"greedy": [o["output_ids"] for o in engines.generate(engine, PROMPTS, GREEDY, len(PROMPTS))]}
    out["prefixed"] = [engines.generate(engine, [p], GREEDY, 1)[0]["output_ids"] for p in PREFIXED]
    if name == "q35":
        samples = engines.generate(engine, [SAMPLE_PROMPT] * N_SAMPLES, SAMPLED, 50)
        out["samples"] = [tuple(o["output_ids"]) for o in samples]
    return out


@pytest.fixture(scope="module")
def reference(tiny, fp32_conv_state):
    """The non-speculative engine's outputs per target, plus its log-probabilities over two
    prompts and their continuations (for the comparison with transformers)."""
    out = {}
    for name in TARGETS:
        engine = engines.start(tiny.hybrid_target(name), **HYBRID, **engines.MAMBA_CACHE)
        try:
            out[name] = _serve(engine, name)
            scored = [p + o for p, o in zip(PROMPTS[:2], out[name]["greedy"][:2])]
            meta = [
                o["meta_info"]
                for o in engine.generate(
                    input_ids=scored,
                    sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                    return_logprob=True,
                    logprob_start_len=0,
                )
            ]
            out[name]["scored"] = [[lp for lp, _, _ in m["input_token_logprobs"][1:]] for m in meta]
        finally:
            engines.shutdown(engine)
    return out


@pytest.mark.parametrize("name", TARGETS)
def test_engine_matches_transformers(tiny, reference, name):
    import transformers

    wrappers = {"q35vl": "Qwen3_5ForConditionalGeneration", "q35moevl": "Qwen3_5MoeForConditionalGeneration"}
    cls = getattr(transformers, wrappers.get(name, "AutoModelForCausalLM"))
    model = cls.from_pretrained(tiny.hybrid_target(name), dtype=torch.float32).eval()
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS[:4]):
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
            want = reference[name]["greedy"][i]
            assert ids.tolist()[: len(want)] == want, f"prompt {i}"
        for i, prompt in enumerate(PROMPTS[:2]):
            seq = torch.tensor([prompt + reference[name]["greedy"][i]])
            logprobs = torch.log_softmax(model(seq).logits[0, :-1].float(), -1)
            want = logprobs.gather(1, seq[0, 1:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(reference[name]["scored"][i]), want, atol=1e-4, rtol=0)


def _sliding(window: int):
    def edit(config: dict) -> None:
        layers = config["num_hidden_layers"]
        config.update(
            layer_types=["sliding_attention"] * layers, sliding_window=window, use_sliding_window=True
        )

    return edit


@pytest.fixture(
    scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}-B{c[1]}{'' if c[2] else '-no-commit'}-{c[3]}"
)
def dflash(request, tiny, reference):
    name, width, commit, mode = request.param
    if not commit:
        os.environ["SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT"] = "1"
    if mode == "adaptive-decode":
        os.environ["SGLANG_DFLASH_WIDTH1_FORWARD"] = "decode"
    draft = tiny.draft("a")
    if mode == "window-ring":
        os.environ["SGLANG_DFLASH_DRAFT_WINDOW_POOL"] = "1"
        draft = tiny.edited_draft("a", "sliding-16", _sliding(16))
    try:
        flags = (
            {k: v for k, v in HYBRID.items() if "mamba" not in k and "overlap" not in k}
            if name in DEFAULT_FLAGS
            else HYBRID
        )
        # Every engine's Mamba pool is sized, the default-flag ones included (tests/support/engines.py).
        flags = {**flags, **engines.MAMBA_CACHE}
        engine = engines.start(
            tiny.hybrid_target(name), draft, width, fixed_width=mode in ("fixed", "window-ring"), **flags
        )
    finally:
        for knob in ("TEST_SKIP_STATE_COMMIT", "WIDTH1_FORWARD", "DRAFT_WINDOW_POOL"):
            os.environ.pop(f"SGLANG_DFLASH_{knob}", None)
    idle = engines.load(engine)
    yield name, commit, mode, engine
    # Everything below ran on this engine: KV and mamba slots must be back at idle.
    engines.flush_cache(engine)
    after = engines.idle_load(engine, idle)
    assert (after.num_used_tokens, after.num_running_reqs) == (idle.num_used_tokens, 0)
    engines.shutdown(engine)


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_greedy_matches_target(dflash, reference, batch_size):
    name, commit, mode, engine = dflash
    if not commit and batch_size != 4:
        pytest.skip("the no-commit engine runs one batch size")
    # Batch 1 over the first four prompts (suite time), batches 4 and 16 over all sixteen.
    prompts = PROMPTS[:4] if batch_size == 1 else PROMPTS
    out = engines.generate(engine, prompts, GREEDY, batch_size)
    got, want = [o["output_ids"] for o in out], reference[name]["greedy"][: len(prompts)]
    mismatches = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if not commit:
        # Without the commit the linear-attention state never moves past the prompt.
        assert len(mismatches) >= len(prompts) // 2, mismatches
        return
    assert not mismatches, f"prompts {mismatches} differ, e.g. {got[mismatches[0]]} vs {want[mismatches[0]]}"
    assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in out)
    if mode != "fixed" or batch_size == 1:
        # The policy may rightly turn speculation off; the fixed engines show it commits, over
        # all sixteen prompts.
        return
    # Some verify committed accepted proposals too, not only the bonus token (the first token
    # comes from the prefill, each verify commits the bonus plus what it accepted).
    meta = [o["meta_info"] for o in out]
    assert sum(m["completion_tokens"] - 1 - m["spec_verify_ct"] for m in meta) > len(PROMPTS)


def test_prefix_cache_round_and_abort(dflash, reference):
    name, commit, _, engine = dflash
    if not commit:
        pytest.skip("served correctly only with the commit")
    engines.flush_cache(engine)
    for i, prompt in enumerate(PREFIXED):
        o = engines.generate(engine, [prompt], GREEDY, 1)[0]
        assert o["output_ids"] == reference[name]["prefixed"][i], i
        if i > 0:  # the shared prefix was cached by the first request
            assert o["meta_info"]["cached_tokens"] > 0
    last = engines.generate_and_abort(engine, PROMPTS[5], dict(GREEDY, max_new_tokens=200), "abort-me", 3)
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    o = engines.generate(engine, [PROMPTS[5]], GREEDY, 1)[0]
    assert o["output_ids"] == reference[name]["greedy"][5]


def test_sampled_distribution_matches_the_target(dflash, reference):
    name, commit, mode, engine = dflash
    if name != "q35" or not commit or mode == "window-ring":
        pytest.skip("sampled on one target, one engine")
    got = [tuple(o["output_ids"]) for o in engines.generate(engine, [SAMPLE_PROMPT] * N_SAMPLES, SAMPLED, 50)]
    want = reference[name]["samples"]
    assert len({s[1] for s in want}) >= 6 and got.count(want[0]) < N_SAMPLES  # the test has power
    for positions in [(0, 1), (2,)]:
        pick = lambda seqs: [tuple(s[i] for i in positions) for s in seqs]  # noqa: E731
        assert homogeneity_pvalue(pick(want), pick(got)) > ALPHA, positions


def test_a_strategy_the_device_cannot_serve_is_refused_at_start_up(tiny):
    with pytest.raises(Exception, match="extra_buffer"):
        engines.start(
            tiny.hybrid_target("q35"), tiny.draft("a"), 4, mamba_radix_cache_strategy="extra_buffer"
        )

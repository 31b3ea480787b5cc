"""The shipped tiny pair (`sglang_dflash.assets.tiny_pair`): trained acceptance through SGLang,
and agreement with z-lab's reference `dflash_generate` on the same weights.

Both sides decode greedily with verify width B = 8 (the draft's block size), ignore EOS, and
run the same prompts: the first 16 of `prompts.json`, cut from standard-library files held out
of the pair's training corpus. Acceptance is pooled over verify steps (tokens / steps, as
SGLang's `avg_spec_accept_length`); on this machine it measures 3.49 against the 3.0 floor.

How the two sides are made comparable. SGLang stops a request once it has N = max_new_tokens
tokens and records, per verify step, how many drafts the target accepted (the last step is a
full block too; its extra tokens are cut from the output). The reference shortens its last
verify block to the tokens still allowed (`verify_size = min(block_size, ...)`) and clips the
last step's count. So the reference runs with N + B new tokens: every step SGLang runs (each
starts with fewer than N tokens out) is then a full, unclipped block of the reference too. On
the reference side we keep the steps that start with fewer than N tokens out: exactly the
steps SGLang runs, if both sides make the same proposals. Per request, the compared quantity
is the multiset of accepted-draft counts over those steps (SGLang's
`spec_correct_drafts_histogram`); the acceptance length is the mean of count + 1 over them.
"""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch

from sglang_dflash.assets import TINY_PAIR, tiny_pair, tiny_pair_dflash2_draft, tiny_pair_prompts
from tests.support import engines

pytestmark = pytest.mark.sglang

B = 8  # verify width = the draft's block size
N = 128  # max_new_tokens (the demo's length)
NUM_PROMPTS = 16
MIN_ACCEPTANCE = 3.0
MIN_ACCEPTANCE_DFLASH2 = 3.9  # the shipped DFlash2 draft measures 4.33 (docs/training.md)
REFERENCE_TOLERANCE = 0.02
GREEDY = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair()[0])
    texts = tiny_pair_prompts()[:NUM_PROMPTS]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _processor_requests(prompt_ids):
    """A history-dependent processor (no token may repeat the one before it, from the third
    output on), on a pair whose drafts are often accepted: every verify row's history counts."""
    from tests.support.processors import BanAfterK

    sampling = dict(GREEDY, max_new_tokens=64, custom_params={"k": 2, "ban": []})
    return [
        dict(input_ids=p, sampling_params=sampling, custom_logit_processor=BanAfterK.to_str())
        for p in prompt_ids[:8]
    ]


@pytest.fixture(scope="module")
def served(prompt_ids):
    """Outputs without speculation (overlap scheduling off, which shows a processor the exact
    history), then with DFLASH; one engine alive at a time."""
    target, draft = tiny_pair()
    flags = dict(enable_custom_logit_processor=True)
    engine = engines.start(target, disable_overlap_schedule=True, **flags)
    try:
        base = engines.generate(engine, prompt_ids, GREEDY, len(prompt_ids))
        base_processed = engines.submit(engine, _processor_requests(prompt_ids))
    finally:
        engines.shutdown(engine)
    engine = engines.start(target, draft, B, fixed_width=True, **flags)  # measures the draft
    try:
        spec = engines.generate(engine, prompt_ids, GREEDY, len(prompt_ids))
        implementation = engines.server_state(engine)["dflash_implementation"]
        spec_processed = engines.submit(engine, _processor_requests(prompt_ids))
    finally:
        engines.shutdown(engine)
    return base, spec, implementation, (base_processed, spec_processed)


@pytest.fixture(scope="module")
def served_dflash2(prompt_ids):
    """The DFlash2 draft's outputs and proposer, on the same prompts and width."""
    engine = engines.start(tiny_pair()[0], tiny_pair_dflash2_draft(), B, fixed_width=True)
    try:
        return engines.generate(engine, prompt_ids, GREEDY, len(prompt_ids)), engines.server_state(engine)
    finally:
        engines.shutdown(engine)


def test_custom_logit_processor_sees_each_rows_history(served):
    base, spec = served[3]
    for b, s in zip(base, spec):
        assert s["output_ids"] == b["output_ids"]
        ids = s["output_ids"]
        assert all(ids[i] != ids[i - 1] for i in range(2, len(ids)))
    steps = sum(s["meta_info"]["spec_verify_ct"] for s in spec)
    assert sum(len(s["output_ids"]) for s in spec) / steps > 1.5  # rows past the first mattered


def accepted_counts(histogram: list[int]) -> collections.Counter:
    """SGLang's per-request histogram (index = drafts accepted in a step) as a Counter."""
    return collections.Counter({k: n for k, n in enumerate(histogram) if n})


def acceptance_length(per_request: list[collections.Counter]) -> float:
    """Mean tokens committed per verify step (accepted drafts + 1) over all requests' steps."""
    steps = sum(sum(c.values()) for c in per_request)
    return sum((k + 1) * n for c in per_request for k, n in c.items()) / steps


def test_pair_files_and_held_out_prompts():
    from sglang_dflash.checkpoint.config import DFlashDraftConfig

    target, draft = tiny_pair()
    config = DFlashDraftConfig.from_pretrained(draft)
    assert config.block_size == B
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(target, f)), f
    assert len(tiny_pair_prompts()) >= NUM_PROMPTS
    assert os.path.isfile(os.path.join(TINY_PAIR, "build_info.json"))


def test_acceptance_and_lossless(served):
    base, spec, implementation, _ = served
    assert implementation.startswith("sglang-dflash")
    mismatches = [i for i, (s, b) in enumerate(zip(spec, base)) if s["output_ids"] != b["output_ids"]]
    assert not mismatches, f"prompts {mismatches}: DFLASH output differs from no speculation"
    assert all(len(s["output_ids"]) == N for s in spec)
    tau = acceptance_length([accepted_counts(s["meta_info"]["spec_correct_drafts_histogram"]) for s in spec])
    reported = sum(s["meta_info"]["completion_tokens"] for s in spec) / sum(
        s["meta_info"]["spec_verify_ct"] for s in spec
    )
    print(f"\nSGLang, B={B}, {len(spec)} prompts: acceptance length {tau:.3f} (tokens/verify {reported:.3f})")
    assert tau >= MIN_ACCEPTANCE, f"mean acceptance length {tau:.3f} < {MIN_ACCEPTANCE}"


def test_the_dflash2_draft_is_lossless_and_accepted(served, served_dflash2):
    """The shipped DFlash2 draft (its candidate selector's greedy walk proposes) gives the engine's
    tokens without speculation, and is accepted on the held-out prompts."""
    base = served[0]
    spec, state = served_dflash2
    assert "candidate selector" in state["dflash_proposals"], state["dflash_proposals"]
    mismatches = [i for i, (s, b) in enumerate(zip(spec, base)) if s["output_ids"] != b["output_ids"]]
    assert not mismatches, f"prompts {mismatches}: DFLASH output differs from no speculation"
    tau = acceptance_length([accepted_counts(s["meta_info"]["spec_correct_drafts_histogram"]) for s in spec])
    print(f"\nDFlash2 draft, B={B}, {len(spec)} prompts: acceptance length {tau:.3f}")
    assert tau >= MIN_ACCEPTANCE_DFLASH2, f"mean acceptance length {tau:.3f} < {MIN_ACCEPTANCE_DFLASH2}"


def reference_runs(prompt_ids: list[list[int]], monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(output ids, accepted drafts per step) per prompt, from z-lab's `dflash_generate`."""
    reference = pytest.importorskip("dflash.model", reason="z-lab reference not installed")
    from transformers import AutoModelForCausalLM

    # Its statistics path times with torch.cuda.synchronize(); on the CPU, a plain clock.
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)

    target_dir, draft_dir = tiny_pair()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = reference.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    assert draft.block_size == B
    runs = []
    for ids in prompt_ids:
        out = reference.dflash_generate(
            draft,
            target,
            torch.tensor([ids]),
            max_new_tokens=N + B,
            stop_token_ids=None,
            temperature=0.0,
            block_size=B,
            return_stats=True,
        )
        output = out.output_ids[0, len(ids) :].tolist()
        # Keep the steps that start with fewer than N tokens out (1 from the prefill).
        accepted, produced = [], 1
        for n in out.acceptance_lengths:
            if produced >= N:
                break
            accepted.append(n - 1)
            produced += n
        runs.append((output, accepted))
    return runs


def test_matches_reference(served, prompt_ids, monkeypatch):
    _, spec, _, _ = served
    runs = reference_runs(prompt_ids, monkeypatch)
    ours = [accepted_counts(s["meta_info"]["spec_correct_drafts_histogram"]) for s in spec]
    theirs = [collections.Counter(accepted) for _, accepted in runs]
    for i, (s, (output, _)) in enumerate(zip(spec, runs)):
        assert s["output_ids"] == output[:N], f"prompt {i}: output differs from the reference"
    tau_ours, tau_ref = acceptance_length(ours), acceptance_length(theirs)
    same = sum(a == b for a, b in zip(ours, theirs))
    print(
        f"\nacceptance length: SGLang {tau_ours:.3f}, reference {tau_ref:.3f}; "
        f"identical per-step counts for {same}/{len(ours)} requests"
    )
    assert abs(tau_ours - tau_ref) <= REFERENCE_TOLERANCE * tau_ref, (tau_ours, tau_ref)


def test_grammar_aware_proposals_do_not_lower_acceptance():
    """On a JSON-schema workload (`scripts/serving/grammar_acceptance.py`, the shipped pair's held-out
    prompts), proposals the grammar allows are accepted at least as often as the draft's own,
    and the outputs are the same: both are lossless. The verify width is fixed: the width that
    adapts to load follows step timings, which made the two runs' acceptance differ by chance
    (1.030 against 1.033 in one CI run, 1.37 against 1.02 in the next)."""
    from unittest import mock

    from scripts.serving.grammar_acceptance import measure

    target, draft = tiny_pair()
    args = dict(engines.CPU_ENGINE, max_running_requests=4)
    with mock.patch.dict(os.environ, {engines.ADAPTIVE_WIDTH: "0"}):
        result = measure(target, draft, tiny_pair_prompts()[:6], 64, args, unconstrained=False)
    aware = result["acceptance"]["json, grammar-aware proposals"]
    plain = result["acceptance"]["json, plain proposals"]
    assert result["identical"]
    assert aware >= plain, (aware, plain)

"""DFLASH on SGLang classes that have no DFlash capture hook of their own, which SGLang's built-in
refuses (`draft/target_capture.py`): Qwen2, Qwen2-MoE and GLM-4.5's MoE (`Glm4MoeForCausalLM`),
through their EAGLE-3 hook; MiniMax-M2 the same way, on the CPU engine with its q/k norm's
PyTorch stand-in (`cpu/triton_ops.py`); Gemma-3, whose own capture records the wrong tensor,
through the residual stream the plugin's hook records.

Each class is a tiny random checkpoint written by transformers (`make_family_target`), served by
one DFLASH engine with draft "a" (reading layer 2), or on Qwen2 with a draft the training recipe
trained for it and exported, against transformers' greedy ids on the same weights:
token-identical at batch 1 and 4, acceptance above 1 (the targets favour one token), and a
prefix-cache round. The capture itself is checked against transformers' hidden states: what
the draft reads for a prompt (SGLANG_DFLASH_TRACE_FEATURES) is transformers' `hidden_states[k + 1]`
for its layer ids k. (The draft's proposals cannot show it: on these targets the favoured token
dominates them whatever the context.)
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.support import engines
from tests.support.tiny import make_family_target

pytestmark = pytest.mark.sglang

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PROMPTS = engines.prompts(8, seed=40, min_len=20, max_len=40)  # longer than Gemma-3's window (8)
SHARED_PREFIX = engines.prompts(1, seed=7, min_len=40, max_len=40)[0]
PREFIXED = [SHARED_PREFIX + p for p in engines.prompts(2, seed=6, min_len=3, max_len=8)]

# name -> (seed, favour, engine flags, minimum acceptance), the family named as the class's module.
CLASSES = {
    "qwen2": (0, 40.0, {}, 1.05),
    # The favoured token is not the greedy choice on this tiny MoE at any favour tried (up to 40):
    # acceptance is what the untrained draft gets right, just above 1.
    "qwen2_moe": (0, 12.0, {}, 1.0),
    "glm4_moe": (0, 8.0, {}, 1.2),
    "minimax_m2": (0, 3.0, {}, 1.05),
    # As Gemma-4 starts (no attention backend named: torch_native on a host without AMX).
    "gemma3": (0, 3.0, {"attention_backend": None}, 1.1),
}
ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
SLIDING = {"gemma3"}  # SGLang's SWA radix cache keeps part of a shared prefix, or none
# Classes served with a draft trained for them by the recipe (`python -m sglang_dflash.train`, a
# few steps on CPU) and exported, in place of draft "a": the export serves through SGLang.
TRAINED = {"qwen2"}


def _draft(tiny, name: str, target: str) -> str:
    """Draft "a", or for TRAINED classes a one-layer draft trained on the target and exported."""
    if name not in TRAINED:
        return tiny.draft("a")
    from sglang_dflash.train.cli import main

    out = os.path.join(tiny.root, f"trained-{name}")
    if not os.path.isdir(out):
        data = os.path.join(tiny.root, "train.jsonl")
        with open(data, "w") as f:  # token-id examples: the tiny tokenizer has no real words
            f.writelines(json.dumps({"input_ids": p}) + "\n" for p in engines.prompts(16, seed=3, min_len=40))
        argv = ["--target", target, "--data", data, "--out", out, "--max-length", "40"]
        argv += ["--num-draft-layers", "1", "--block-size", "8", "--num-anchors", "4", "--max-steps", "4"]
        argv += ["--save-every", "0", "--no-progress", "--device", "cpu", "--export-dtype", "float32"]
        assert main(argv) == 0
    return out


def _ids(outputs) -> list:
    return [o["output_ids"] for o in outputs]


@pytest.fixture(scope="module", params=list(CLASSES))
def served(request, tiny):
    """(name, target path, DFLASH outputs, server state, the features traced), one class at a time."""
    name = request.param
    seed, favour, flags, _ = CLASSES[name]
    target = os.path.join(tiny.root, f"captured-{name}")
    if not os.path.isdir(target):
        make_family_target(target, family=name, seed=seed, favour=favour)
    trace = os.path.join(tiny.root, f"features-{name}.jsonl")
    if os.path.exists(trace):  # the worker appends
        os.remove(trace)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SGLANG_DFLASH_TRACE_FEATURES", trace)
        engine = engines.start(target, _draft(tiny, name, target), fixed_width=True, **flags)
    try:
        out = {
            1: engines.generate(engine, PROMPTS[:4], GREEDY, 1),
            4: engines.generate(engine, PROMPTS, GREEDY, 4),
        }
        out["prefixed"] = [engines.generate(engine, [p], GREEDY, 1)[0] for p in PREFIXED]
        state = engines.server_state(engine)
    finally:
        engines.shutdown(engine)
    with open(trace) as f:
        features = [json.loads(line) for line in f]
    return name, target, out, state, features


def _oracle(target: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def _greedy(model, prompt: list) -> list:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=GREEDY["max_new_tokens"], do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, ids.shape[1] :].tolist()


def test_dflash_is_greedy_lossless_and_accepts(served):
    from sglang.srt.utils.hf_transformers.config import get_config

    name, target, out, state, _ = served
    assert get_config(target, trust_remote_code=False).architectures == [ARCHITECTURES[name]]
    assert state["dflash_implementation"].startswith("sglang-dflash")
    model = _oracle(target)
    want = [_greedy(model, p) for p in PROMPTS]
    for batch_size, prompts in ((1, 4), (4, 8)):
        got = _ids(out[batch_size])
        assert got == want[:prompts], (
            f"{name} at batch {batch_size}: prompts {[i for i in range(prompts) if got[i] != want[i]]}"
        )
    meta = [o["meta_info"] for o in out[4]]
    accepted = sum(m["completion_tokens"] for m in meta) / sum(m["spec_verify_ct"] for m in meta)
    assert accepted > CLASSES[name][3], f"{name}: {accepted:.2f} tokens per verify"
    # A prefix-cache round: the second request reuses the shared prefix (on Gemma-3, what SGLang's
    # SWA radix cache keeps of it), and both are still transformers' ids.
    assert _ids(out["prefixed"]) == [_greedy(model, p) for p in PREFIXED], name
    cached = out["prefixed"][1]["meta_info"]["cached_tokens"]
    if name not in SLIDING:
        assert cached >= len(SHARED_PREFIX) - 1, (name, cached)


def test_the_draft_reads_the_layer_transformers_gives(served, tiny):
    """The features the draft's fc read for prompt 0's prefill (the worker's feature trace) equal
    transformers' `hidden_states[k + 1]` (the output of layer k, before the final norm) for the
    draft's ids k, token by token. A capture one layer off, or of another tensor, fails here."""
    from sglang_dflash.checkpoint.config import DFlashDraftConfig

    name, target, _, _, features = served
    with open(os.path.join(_draft(tiny, name, target), "config.json")) as f:
        ids = DFlashDraftConfig.from_dict(json.load(f)).resolve_target_layer_ids(4)
    prompt = PROMPTS[0]
    prefill = next(r for r in features if r["positions"] == list(range(len(prompt))))  # batch 1, first
    with torch.no_grad():
        states = _oracle(target)(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([states[k + 1][0] for k in ids], dim=-1)  # [T, K*H]
    torch.testing.assert_close(torch.tensor(prefill["features"]), want, rtol=1e-3, atol=1e-3, msg=name)

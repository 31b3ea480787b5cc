"""Structured outputs, logprobs, custom logit processors and hidden states through DFLASH, each
against the non-speculative engine on the same target (overlap scheduling off there: SGLang's
overlap path shows processors and penalties the history one token late).

DFLASH runs with overlap scheduling, and without it with mixed chunked prefill; requests of
every kind share batches. Outputs of greedy requests are token-identical; logprobs and hidden
states agree to 1e-4 (fp32 tiny models); sampled logprobs are checked against the target's
logits for the same tokens (teacher forcing).
"""

import json
import os
import re

import pytest

from tests.support import engines
from tests.support.processors import BanAfterK

pytestmark = pytest.mark.sglang

VOCAB = 384
GREEDY = {"max_new_tokens": 40, "temperature": 0.0}
FLAGS = dict(
    enable_custom_logit_processor=True,
    constrained_json_disable_any_whitespace=True,
    enable_return_hidden_states=True,
)
SERVING = dict(chunked_prefill_size=16, max_prefill_tokens=64)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{0,8}$"},
        "ok": {"type": "boolean"},
        "n": {"enum": [1, 2, 3]},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
TOOL_CALL = {  # what a strict tool call constrains the output to
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "get_time"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                "days": {"enum": [1, 2, 3]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{3}"
EBNF = 'root ::= "(" item ("," item)? ")"\nitem ::= "a" | "b" | [0-9] [0-9]?'
EBNF_AS_REGEX = r"\((a|b|[0-9][0-9]?)(,(a|b|[0-9][0-9]?))?\)"


def _validate_json(schema):
    from jsonschema import Draft202012Validator

    return lambda text: Draft202012Validator(schema).validate(json.loads(text)) is None


GRAMMARS = {
    "json_schema": ({"json_schema": json.dumps(SCHEMA)}, _validate_json(SCHEMA)),
    "regex": ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
    "ebnf": ({"ebnf": EBNF}, lambda text: re.fullmatch(EBNF_AS_REGEX, text) is not None),
    "tool_call": ({"json_schema": json.dumps(TOOL_CALL)}, _validate_json(TOOL_CALL)),
}
PROMPTS = engines.prompts(4, seed=21)
GRAMMAR_CASES = [(name, tuple(p)) for name in GRAMMARS for p in PROMPTS]  # 16 requests


def _grammar_request(name, prompt, **extra):
    sampling = dict(GREEDY, max_new_tokens=64, **GRAMMARS[name][0], **extra.pop("s", {}))
    return dict(input_ids=list(prompt), sampling_params=sampling, **extra)


LOGPROB_PROMPTS = engines.prompts(4, seed=22)
LOGPROBS = dict(return_logprob=True, top_logprobs_num=3, token_ids_logprob=[5, 17, 100], logprob_start_len=0)
LOGPROB_SAMPLING = [
    dict(GREEDY, max_new_tokens=16),
    dict(GREEDY, max_new_tokens=16, frequency_penalty=0.7, logit_bias={"9": 2.0}),
    dict(GREEDY, max_new_tokens=16, **GRAMMARS["regex"][0]),
    dict(GREEDY, max_new_tokens=16, repetition_penalty=1.5),
]
SAMPLED = [dict(max_new_tokens=12, temperature=t, top_k=k) for t, k in ((0.7, 20), (1.0, -1), (1.3, 50))]

PROCESSOR = BanAfterK.to_str()
PROCESSOR_PROMPTS = engines.prompts(4, seed=23)
PROCESSOR_PARAMS = [
    {"k": k, "ban": ban} for k, ban in ((0, [5, 6]), (3, [7]), (6, list(range(2, 40))), (10, []))
]

HIDDEN_PROMPTS = engines.prompts(2, seed=24)

# Requests whose sampling needs per-token state only the worker keeps, and long prompts that
# arrive while they decode (several prefill chunks each, so prefill batches meet them).
PENALIZED = [
    dict(GREEDY, frequency_penalty=0.8),
    dict(GREEDY, presence_penalty=1.5),
    dict(GREEDY, repetition_penalty=1.6),
    dict(GREEDY, min_new_tokens=30, stop_token_ids=[7, 9, 11]),
]
PENALIZED_PROMPTS = engines.prompts(len(PENALIZED), seed=25, max_len=8)
LONG_PROMPTS = engines.prompts(8, seed=26, min_len=60, max_len=70)


def _processor_requests():
    return [
        dict(
            input_ids=p,
            sampling_params=dict(GREEDY, max_new_tokens=24, custom_params=params),
            custom_logit_processor=PROCESSOR,
        )
        for p, params in zip(PROCESSOR_PROMPTS, PROCESSOR_PARAMS)
    ]


def _logprob_requests():
    return [
        dict(input_ids=p, sampling_params=s, **LOGPROBS) for p, s in zip(LOGPROB_PROMPTS, LOGPROB_SAMPLING)
    ]


def _penalized_requests():
    return [dict(input_ids=p, sampling_params=s) for p, s in zip(PENALIZED_PROMPTS, PENALIZED)]


def _hidden_requests():
    return [
        dict(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=12), return_hidden_states=True)
        for p in HIDDEN_PROMPTS
    ]


@pytest.fixture(scope="module")
def reference(tiny):
    """The non-speculative engine's outputs for every case. (It is shut down before DFLASH
    starts: two engines in one process share SGLang's process-wide speculative settings.)"""
    engine = engines.start(tiny.target("a"), disable_overlap_schedule=True, **FLAGS, **SERVING)
    try:
        grammar = engines.submit(engine, [_grammar_request(name, p) for name, p in GRAMMAR_CASES])
        return {
            "grammar": dict(zip(GRAMMAR_CASES, grammar)),
            "logprobs": engines.submit(engine, _logprob_requests()),
            "processor": engines.submit(engine, _processor_requests()),
            "hidden": [engines.submit(engine, [r])[0] for r in _hidden_requests()],
            "penalized": engines.submit(engine, _penalized_requests()),
        }
    finally:
        engines.shutdown(engine)


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sync-mixed-chunk"])
def dflash(request, tiny, reference, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "proposals.jsonl"
    os.environ["SGLANG_DFLASH_TRACE_PROPOSALS"] = str(trace)
    extra = {} if request.param else {"disable_overlap_schedule": True, "enable_mixed_chunk": True}
    try:
        engine = engines.start(*tiny.pair("a"), 8, **FLAGS, **SERVING, **extra)
    finally:
        del os.environ["SGLANG_DFLASH_TRACE_PROPOSALS"]
    assert engines.server_state(engine)["dflash_implementation"].startswith("sglang-dflash")
    engine.trace_path = trace
    yield engine
    engines.shutdown(engine)


# ------------------------------------------------------------------------------ grammar


@pytest.mark.parametrize("batch_size", [1, 8])
def test_grammar_outputs_equal_the_reference_and_validate(dflash, reference, batch_size):
    want = reference
    requests = [
        _grammar_request(name, p, rid=f"g{batch_size}-{i}") for i, (name, p) in enumerate(GRAMMAR_CASES)
    ]
    got = []
    for i in range(0, len(requests), batch_size):
        got += engines.submit(dflash, requests[i : i + batch_size])
    for case, o in zip(GRAMMAR_CASES, got):
        assert o["output_ids"] == want["grammar"][case]["output_ids"], case
        assert o["meta_info"]["finish_reason"]["type"] == "stop", case  # the grammar completed
        assert GRAMMARS[case[0]][1](o["text"]), (case, o["text"])
    assert sum(o["meta_info"]["spec_verify_ct"] for o in got) < sum(len(o["output_ids"]) for o in got)
    # The server info counts the grammar-aware proposals, and those the draft did not rank.
    beyond, _, chosen, *_ = engines.server_state(dflash)["dflash_grammar_proposals"].split()
    assert int(chosen) > 0 and 0 <= int(beyond) <= int(chosen)


def test_the_draft_plans_with_exact_host_lengths(dflash):
    """Every traced decode step's host committed lengths (`batch.seq_lens_cpu`, which the draft's
    attention plans with) equal the device ones, with overlap scheduling and without: FlashInfer's
    split-KV plan is only right with exact host lengths (`attention.planning_lens`)."""
    engines.generate(dflash, engines.prompts(8, seed=5), {"max_new_tokens": 32, "temperature": 0}, 8)
    steps = [json.loads(line) for line in open(dflash.trace_path)]
    assert len(steps) > 30
    wrong = [s for s in steps if s["host_prefix_len"] != s["prefix_len"]]
    assert not wrong, wrong[:5]


def test_grammar_aware_proposals_are_legal(dflash, tiny):
    """Replays every traced step of the grammar requests with a fresh xgrammar matcher: the
    matcher takes the request's output up to the step's bonus, then each proposal in turn."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from transformers import AutoTokenizer

    requests = [_grammar_request(name, p, rid=f"trace-{i}") for i, (name, p) in enumerate(GRAMMAR_CASES)]
    outputs = {r["rid"]: (r, o) for r, o in zip(requests, engines.submit(dflash, requests))}
    tokenizer = AutoTokenizer.from_pretrained(tiny.target("a"))
    backend = XGrammarGrammarBackend(tokenizer, VOCAB, [0], any_whitespace=False)
    checked = 0
    for line in open(dflash.trace_path):
        step = json.loads(line)
        if step["rid"] not in outputs:
            continue
        request, out = outputs[step["rid"]]
        done = step["prefix_len"] - len(request["input_ids"]) + 1  # outputs through the bonus
        if done > len(out["output_ids"]):
            continue  # a step run for a request that had already finished (overlap)
        params = request["sampling_params"]
        grammar = backend.dispatch_json(params["json_schema"]) if "json_schema" in params else None
        grammar = grammar or (backend.dispatch_regex(params["regex"]) if "regex" in params else None)
        grammar = grammar or backend.dispatch_ebnf(params["ebnf"])
        for token in out["output_ids"][:done]:
            grammar.accept_token(token)
        for token in step["proposals"]:
            if grammar.is_terminated():
                break
            grammar.accept_token(token)  # raises if the grammar does not allow it
            checked += 1
    assert checked > 100


# ------------------------------------------------------------------------------ logprobs


def _assert_logprobs_close(got, want, tol=1e-4):
    """Lists of (logprob, token id, text) from meta_info."""
    assert [g[1] for g in got] == [w[1] for w in want]
    for g, w in zip(got, want):
        assert abs(g[0] - w[0]) <= tol, (g, w)


def _assert_top_close(got, want, tol=1e-4):
    """Per position, the top entries; entries at the float32 floor (grammar-masked ties) are
    compared by value only."""
    assert len(got) == len(want)
    for g_row, w_row in zip(got, want):
        finite = [w for w in w_row if w[0] > -1e30]
        assert [g[1] for g in g_row[: len(finite)]] == [w[1] for w in finite]
        for g, w in zip(g_row, w_row):
            assert abs(g[0] - w[0]) <= tol or (g[0] < -1e30 and w[0] < -1e30), (g, w)


def _assert_rows_close(got, want, tol=1e-4):
    """Per position, entries for fixed token ids (`token_ids_logprob`)."""
    assert len(got) == len(want)
    for g_row, w_row in zip(got, want):
        assert [g[1] for g in g_row] == [w[1] for w in w_row]
        for g, w in zip(g_row, w_row):
            assert abs(g[0] - w[0]) <= tol or (g[0] < -1e30 and w[0] < -1e30), (g, w)


def test_logprobs_equal_the_reference(dflash, reference):
    """Greedy, with penalties, logit_bias and a grammar: output logprobs (the chosen token's,
    top-3 and chosen ids) and input logprobs from position 0."""
    want = reference
    got = engines.submit(dflash, _logprob_requests())
    for sampling, g, w in zip(LOGPROB_SAMPLING, got, want["logprobs"]):
        assert g["output_ids"] == w["output_ids"], sampling
        gm, wm = g["meta_info"], w["meta_info"]
        assert len(gm["output_token_logprobs"]) == len(g["output_ids"])
        _assert_logprobs_close(gm["output_token_logprobs"], wm["output_token_logprobs"])
        _assert_top_close(gm["output_top_logprobs"], wm["output_top_logprobs"])
        _assert_rows_close(gm["output_token_ids_logprobs"], wm["output_token_ids_logprobs"])
        assert gm["input_token_logprobs"][0][0] is None
        _assert_logprobs_close(gm["input_token_logprobs"][1:], wm["input_token_logprobs"][1:])
        _assert_top_close(gm["input_top_logprobs"][1:], wm["input_top_logprobs"][1:])


def test_sampled_logprobs_equal_the_targets_logits(dflash):
    """Sampled tokens differ from run to run, so the oracle is the target fed the same tokens:
    input logprobs over the whole vocabulary at each output position give the raw
    log-distribution, from which the sampled request's logprobs are log_softmax(raw / T). Input
    logprobs come from SGLang's own prefill forward (the same code with and without DFLASH; the
    test above checks them against the non-speculative engine), so they are asked of this engine."""
    import torch

    engine = dflash
    prompt = LOGPROB_PROMPTS[0]
    got = engines.submit(
        dflash,
        [dict(input_ids=prompt, sampling_params=s, return_logprob=True, top_logprobs_num=3) for s in SAMPLED],
    )
    teacher = engines.submit(
        engine,
        [
            dict(
                input_ids=prompt + o["output_ids"],
                sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                return_logprob=True,
                logprob_start_len=len(prompt) - 1,
                top_logprobs_num=VOCAB,
            )
            for o in got
        ],
    )
    for sampling, g, t in zip(SAMPLED, got, teacher):
        rows = t["meta_info"]["input_top_logprobs"][1:]  # row j: the distribution of output j
        for j, (token, logprob) in enumerate(zip(g["output_ids"], g["meta_info"]["output_token_logprobs"])):
            raw = torch.full((VOCAB,), -torch.inf, dtype=torch.float64)
            for value, token_id, _ in rows[j]:
                raw[token_id] = value
            scaled = torch.log_softmax(raw / sampling["temperature"], dim=-1)
            assert logprob[1] == token
            assert abs(logprob[0] - float(scaled[token])) <= 1e-4, (sampling, j)
            top = g["meta_info"]["output_top_logprobs"][j]
            assert [e[1] for e in top] == scaled.topk(3).indices.tolist(), (sampling, j)


# ------------------------------------------------------------------------------ sampling masks

MASKED = [  # SGLang takes masks for top_k 1 (greedy) or a finite top_k up to its cap
    dict(max_new_tokens=12, temperature=0.8, top_k=8, top_p=0.9),
    dict(max_new_tokens=12, temperature=1.2, top_k=24, min_p=0.05),
    dict(max_new_tokens=12, temperature=0.0),
]


def test_sampling_masks_equal_the_samplers_own(dflash):
    """`return_sampling_mask`: every output token's support (token ids, most likely first) and
    its logprobs equal what SGLang's own sampler returns for that position. The oracle is the
    same prefix sent as a new request for one token, whose mask SGLang's sampler builds in the
    prefill (the support does not depend on which token is drawn); all requests share batches."""
    masked = dict(return_sampling_mask=True, sampling_logprobs_mode="support")
    prompt = LOGPROB_PROMPTS[1]
    got = engines.submit_raw(dflash, [dict(input_ids=prompt, sampling_params=s, **masked) for s in MASKED])
    verified = 0
    for sampling, g in zip(MASKED, got):
        assert not isinstance(g, Exception), g
        output, meta = g["output_ids"], g["meta_info"]
        masks, logprobs = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
        assert len(masks) == len(logprobs) == len(output), sampling
        teacher = engines.submit_raw(
            dflash,
            [
                dict(
                    input_ids=prompt + output[:j], sampling_params={**sampling, "max_new_tokens": 1}, **masked
                )
                for j in range(len(output))
            ],
        )
        for j, (token, mask, row, t) in enumerate(zip(output, masks, logprobs, teacher)):
            want_mask = t["meta_info"]["output_token_sampling_mask"][0]
            want_row = t["meta_info"]["output_token_sampling_logprobs"][0]
            assert token in mask, (sampling, j)
            assert list(mask) == list(want_mask), (sampling, j)
            assert max(abs(a - b) for a, b in zip(row, want_row)) <= 1e-4, (sampling, j)
            if sampling["temperature"] == 0.0:
                assert list(mask) == [token] and list(row) == [0.0]
        verified += meta["spec_verify_ct"]
    assert verified > 0  # the verifier, not only the prefill, produced masks


# ------------------------------------------------------------------------------ processors, hidden states


def test_custom_logit_processor_outputs_equal_the_reference(dflash, reference):
    want = reference
    got = engines.submit(dflash, _processor_requests())
    for prompt, params, g, w in zip(PROCESSOR_PROMPTS, PROCESSOR_PARAMS, got, want["processor"]):
        assert g["output_ids"] == w["output_ids"], params
        sequence = prompt + g["output_ids"]
        for i, token in enumerate(g["output_ids"]):
            if i >= params["k"]:  # output i is drawn once the request has i outputs
                assert token not in params["ban"] and token != sequence[len(prompt) + i - 1], (params, i)


def test_hidden_states_equal_the_reference(dflash, reference):
    import numpy as np

    want = reference
    # One at a time: SGLang returns a request's hidden states differently when it runs in a
    # mixed prefill batch (with and without DFLASH), and the reference runs unmixed.
    got = [engines.submit(dflash, [r])[0] for r in _hidden_requests()]
    for g, w in zip(got, want["hidden"]):
        assert g["output_ids"] == w["output_ids"]
        ours, theirs = g["meta_info"]["hidden_states"], w["meta_info"]["hidden_states"]
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


# ------------------------------------------------------------------------------ together, and errors


def test_every_kind_of_request_in_one_batch(dflash, reference):
    """Grammar, logprob, processor, hidden-state, plain greedy and sampled (with and without a
    grammar) requests arrive staggered, so they share prefill, mixed and decode batches."""
    want = reference
    grammar = [_grammar_request(name, p) for name, p in GRAMMAR_CASES[::3]]
    sampled = [  # ignore_eos: a sampled row may draw EOS (token 0), and these must run 20 tokens
        dict(input_ids=p, sampling_params=dict(max_new_tokens=20, temperature=0.9, ignore_eos=True))
        for p in PROMPTS
    ]
    sampled_grammar = [_grammar_request(name, p, s={"temperature": 1.0}) for name, p in GRAMMAR_CASES[1::5]]
    groups = [
        grammar,
        _logprob_requests(),
        _processor_requests(),
        _hidden_requests(),
        sampled,
        sampled_grammar,
    ]
    requests = [r for group in groups for r in group]
    order = list(range(len(requests)))
    order = order[::2] + order[1::2]  # interleave the kinds
    results = dict(zip(order, engines.submit(dflash, [requests[i] for i in order], stagger=0.03)))
    out = [results[i] for i in range(len(requests))]
    n = [len(g) for g in groups]
    starts = [sum(n[:i]) for i in range(len(n))]
    for case, o in zip(GRAMMAR_CASES[::3], out[starts[0] :]):
        assert o["output_ids"] == want["grammar"][case]["output_ids"], case
    for g, w in zip(out[starts[1] :], want["logprobs"]):
        assert g["output_ids"] == w["output_ids"]
        _assert_logprobs_close(
            g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        )
    for g, w in zip(out[starts[2] :], want["processor"]):
        assert g["output_ids"] == w["output_ids"]
    for g, w in zip(out[starts[3] :], want["hidden"]):
        assert g["output_ids"] == w["output_ids"]
    for o in out[starts[4] : starts[5]]:
        assert len(o["output_ids"]) == 20
    for (name, _), o in zip(GRAMMAR_CASES[1::5], out[starts[5] :]):
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            assert GRAMMARS[name][1](o["text"]), (name, o["text"])


def test_stateful_requests_decode_exactly_while_prompts_prefill(dflash, reference):
    """Penalized requests decode while long prompts are prefilled in chunks. With mixed chunked
    prefill SGLang would mix them into those prefill batches, where its own sampler, without the
    penalty state, would draw their tokens; the worker keeps them out (`integration/scheduler_hooks.py`)."""
    want = reference
    long = [dict(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=4)) for p in LONG_PROMPTS]
    out = engines.submit(dflash, _penalized_requests() + long, stagger=0.05)
    for params, g, w in zip(PENALIZED, out, want["penalized"]):
        assert g["output_ids"] == w["output_ids"], params


def test_bad_requests_fail_alone_with_a_clear_error(dflash, reference):
    want = reference
    good = [_grammar_request(name, p) for name, p in GRAMMAR_CASES[:4]]
    bad_schema = dict(input_ids=PROMPTS[0], sampling_params=dict(GREEDY, json_schema='{"type": "objekt"}'))
    bad_processor = dict(
        input_ids=PROMPTS[1], sampling_params=GREEDY, custom_logit_processor='{"callable": "00ff"}'
    )
    out = engines.submit(dflash, [good[0], bad_schema, good[1], bad_processor, good[2], good[3]])
    assert isinstance(out[1], ValueError) and "json" in str(out[1]).lower(), out[1]
    assert isinstance(out[3], ValueError) and "custom_logit_processor" in str(out[3]), out[3]
    for case, o in zip(GRAMMAR_CASES[:4], [out[0], out[2], out[4], out[5]]):
        assert o["output_ids"] == want["grammar"][case]["output_ids"], case

"""`python -m sglang.launch_server --speculative-algorithm DFLASH` on CPU: our worker serves it,
and HTTP clients get the responses a server without speculation gives: native /generate, and
the OpenAI completions and chat endpoints, streamed and not, with logprobs, JSON mode
(`response_format`) and required or named tool calls.

Both servers run the same target greedily; the reference runs first, then DFLASH, and every
response is compared field by field (logprobs to 1e-4).
"""

import json

import pytest

from tests.support import engines

pytestmark = pytest.mark.sglang

PROMPTS = engines.prompts(4, seed=3)
GREEDY = {"max_new_tokens": 16, "temperature": 0.0}
MESSAGES = [{"role": "user", "content": "Write a JSON encoder."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
CHAT = {"model": "default", "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
ARGS = ("--constrained-json-disable-any-whitespace",)


def _stream(server, path: str, payload: dict) -> list:
    """The data chunks of a streamed response."""
    import requests

    chunks = []
    with requests.post(server.url + path, json=dict(payload, stream=True), stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[len(b"data: ") :]))
    return chunks


def _joined(texts: list, logprobs: list) -> tuple:
    """A stream's text and logprobs, joined over its chunks.

    How many tokens one chunk carries depends on timing (the server coalesces the outputs of
    steps that finish before the previous chunk is sent, and a DFLASH step commits several
    tokens), so streams are compared as the whole text and the concatenated per-token fields.
    Completions logprobs are a dict of per-token lists; chat logprobs hold them under "content".
    """
    joined: dict = {}
    for part in logprobs:
        for key, values in part.items():
            joined.setdefault(key, []).extend(values or [])
    return "".join(texts), joined


def _queries(server) -> dict:
    """Every request this module checks, and the parts of the responses that must agree."""
    out = {}
    gen = server.post("/generate", {"input_ids": PROMPTS, "sampling_params": GREEDY})
    out["generate"] = [o["output_ids"] for o in gen]
    gen = server.post(
        "/generate",
        {
            "input_ids": PROMPTS[:2],
            "sampling_params": GREEDY,
            "return_logprob": True,
            "top_logprobs_num": 3,
            "logprob_start_len": 0,
        },
    )
    out["generate_logprobs"] = [
        {
            k: o["meta_info"][k]
            for k in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs")
        }
        for o in gen
    ]
    completion = {
        "model": "default",
        "prompt": "def encode(",
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": 3,
    }
    c = server.post("/v1/completions", completion)["choices"][0]
    out["completions_logprobs"] = (c["text"], c["logprobs"])
    choices = [ch["choices"][0] for ch in _stream(server, "/v1/completions", completion) if ch["choices"]]
    out["completions_stream"] = _joined(
        [c["text"] for c in choices],
        [c["logprobs"] for c in choices if c.get("logprobs")],
    )
    chat = dict(CHAT, logprobs=True, top_logprobs=3)
    c = server.post("/v1/chat/completions", chat)["choices"][0]
    out["chat_logprobs"] = (c["message"]["content"], c["logprobs"])
    choices = [ch["choices"][0] for ch in _stream(server, "/v1/chat/completions", chat) if ch["choices"]]
    out["chat_stream"] = _joined(
        [c["delta"].get("content") or "" for c in choices],
        [c["logprobs"] for c in choices if c.get("logprobs")],
    )
    for name, fmt in (
        ("json_object", {"type": "json_object"}),
        ("json_schema", {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}),
    ):
        c = server.post("/v1/chat/completions", dict(CHAT, max_tokens=96, response_format=fmt))["choices"][0]
        out[name] = c["message"]["content"]
    for name, choice in (
        ("tool_required", "required"),
        ("tool_named", {"type": "function", "function": {"name": "get_weather"}}),
    ):
        c = server.post("/v1/chat/completions", dict(CHAT, max_tokens=96, tools=TOOLS, tool_choice=choice))
        message = c["choices"][0]["message"]
        out[name] = (message.get("content"), [t["function"] for t in message.get("tool_calls") or []])
    return out


@pytest.fixture(scope="module")
def expected(tiny):
    server = engines.Server(tiny.target("a"), None, None, *ARGS)
    try:
        return _queries(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tiny, expected):
    server = engines.Server(*tiny.pair("a"), 8, *ARGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def got(server):
    return _queries(server)


def test_server_info_names_our_worker(server):
    info = server.get("/server_info")
    assert info["internal_states"][0]["dflash_implementation"].startswith("sglang-dflash")
    assert info["speculative_algorithm"] == "DFLASH"


def test_native_generate(server, expected, got):
    assert got["generate"] == expected["generate"]
    out = server.post("/generate", {"input_ids": PROMPTS, "sampling_params": GREEDY})
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in out)


def test_return_sampling_mask_gives_a_mask_per_output_token(server):
    """The RL rollout field, over HTTP as SGLang's own DFLASH server test asks it: 200, and one
    mask per output token (greedy: the token itself, logprob 0). test_request_features.py checks
    sampled masks against SGLang's sampler."""
    import requests

    payload = {"input_ids": PROMPTS[0], "sampling_params": GREEDY, "return_sampling_mask": True}
    response = requests.post(server.url + "/generate", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    masks = out["meta_info"]["output_token_sampling_mask"]
    assert masks == [[token] for token in out["output_ids"]]
    assert out["meta_info"]["output_token_sampling_logprobs"] == [0.0] * len(masks)  # selected mode


def _close(a, b, tol=1e-4) -> bool:
    """Nested responses equal, floats to `tol` (logprobs at the float32 floor compare equal)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol or (a < -1e30 and b < -1e30)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    return a == b


@pytest.mark.parametrize(
    "query",
    ["generate_logprobs", "completions_logprobs", "completions_stream", "chat_logprobs", "chat_stream"],
)
def test_logprobs(expected, got, query):
    if query == "chat_stream":
        # SGLang's chat stream drops the logprobs of a step whose text delta is empty (an
        # incomplete UTF-8 character held back; serving_chat.py, "an empty-delta step has no
        # chunk to attach to"), and which steps those are depends on chunk timing, on either
        # server. So the stream's entries are an in-order subset of the same server's
        # non-streamed chat logprobs, which test_logprobs[chat_logprobs] compares with the
        # plain engine's.
        text, logprobs = got[query]
        assert text == expected[query][0]
        whole = iter(got["chat_logprobs"][1]["content"])
        assert all(any(_close(entry, other) for other in whole) for entry in logprobs["content"])
    else:
        assert _close(got[query], expected[query]), query
    if query.endswith("_stream"):
        text, logprobs = got[query]
        assert text and all(logprobs.values()), logprobs  # the stream carried tokens and logprobs


def test_openai_chat_completions(server, expected, got):
    assert got["chat_logprobs"][0] == expected["chat_logprobs"][0]


@pytest.mark.parametrize("query", ["json_object", "json_schema"])
def test_json_mode(expected, got, query):
    assert got[query] == expected[query]
    json.loads(got[query])


@pytest.mark.parametrize("query", ["tool_required", "tool_named"])
def test_tool_calls(expected, got, query):
    assert got[query] == expected[query]
    content, calls = got[query]
    for call in calls:
        json.loads(call["arguments"])
    assert calls or json.loads(content)

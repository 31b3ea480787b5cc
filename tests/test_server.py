"""`python -m sglang.launch_server --speculative-algorithm DFLASH` on CPU: our worker serves it,
and HTTP clients (native /generate, OpenAI chat) get the target's own greedy output."""

import pytest

from tests import engines

pytestmark = pytest.mark.sglang

PROMPTS = engines.prompts(4, seed=3)
GREEDY = {"max_new_tokens": 16, "temperature": 0.0}
MESSAGES = [{"role": "user", "content": "Write a JSON encoder."}]


@pytest.fixture(scope="module")
def expected(tiny):
    engine = engines.start(tiny.target("a"))
    try:
        ids = [o["output_ids"] for o in engines.generate(engine, PROMPTS, GREEDY, len(PROMPTS))]
        prompt = engine.tokenizer_manager.tokenizer.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=True
        )
        chat = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})["text"]
        return ids, chat
    finally:
        engines.shutdown(engine)


@pytest.fixture(scope="module")
def server(tiny, expected):
    server = engines.Server(*tiny.pair("a"), 8)
    yield server
    server.stop()


def test_server_info_names_our_worker(server):
    info = server.get("/server_info")
    assert info["internal_states"][0]["dflash_implementation"].startswith("sglang-dflash")
    assert info["speculative_algorithm"] == "DFLASH"


def test_native_generate(server, expected):
    ids, _ = expected
    out = server.post(
        "/generate", {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    )
    assert [o["output_ids"] for o in out] == ids
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in out)


def test_openai_chat_completions(server, expected):
    _, chat = expected
    out = server.post(
        "/v1/chat/completions",
        {"model": "default", "messages": MESSAGES, "max_tokens": 16, "temperature": 0},
    )
    assert out["choices"][0]["message"]["content"] == chat

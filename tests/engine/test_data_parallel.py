"""Serving past one engine: data-parallel replicas.

Data-parallel replicas (`--dp-size 2`) on SGLang's CPU engine: SGLang's data-parallel controller
starts one scheduler per replica and spreads the requests over them; each replica must be
served by this package, and the greedy tokens must be the plain engine's.

LMCache and the decode side's KV offload do not carry the draft's K/V: they are refused at
start-up by name, never served with drafts that silently lack their context. Prefill/decode
disaggregation and HiCache do carry it: tests/engine/test_pd_disaggregation.py and
tests/engine/test_hicache.py."""

import pytest

from tests.support import engines

pytestmark = pytest.mark.sglang

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PROMPTS = engines.prompts(16, seed=61)


def test_two_replicas_are_both_ours_and_serve_the_plain_engines_tokens(tiny, monkeypatch):
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")  # one core per replica
    target, draft = tiny.pair("a")
    plain = engines.start(target)
    try:
        expected = [o["output_ids"] for o in engines.generate(plain, PROMPTS, GREEDY, 16)]
    finally:
        engines.shutdown(plain)
    engine = engines.start(target, draft, 8, dp_size=2)
    try:
        got = engines.generate(engine, PROMPTS, GREEDY, 16)
        states = engine.get_server_info()["internal_states"]
    finally:
        engines.shutdown(engine)
    assert len(states) == 2
    assert all(state["dflash_implementation"].startswith("sglang-dflash") for state in states)
    assert [o["output_ids"] for o in got] == expected
    # Both replicas verified requests: each request names its replica.
    assert {o["meta_info"]["dp_rank"] for o in got} == {0, 1}
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in got)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(enable_lmcache=True), "enable_lmcache"),
        (
            dict(disaggregation_decode_enable_offload_kvcache=True),
            "disaggregation_decode_enable_offload_kvcache",
        ),
    ],
    ids=["lmcache", "decode-offload"],
)
def test_what_cannot_carry_the_draft_kv_is_refused_by_name(tiny, kwargs, named):
    with pytest.raises(ValueError, match=f"does not support {named} with DFLASH.*SGLANG_DFLASH_IMPL=builtin"):
        engines.shutdown(engines.start(*tiny.pair("a"), **kwargs))

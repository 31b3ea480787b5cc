"""Tensor parallelism on SGLang's CPU engine, without speculation: with PyNccl kept off CPU
process groups (`cpu/bootstrap.py`), a TP=2 engine serves the same greedy tokens as TP=1.
DFLASH itself is still refused at TP > 1, by name."""

import pytest

from tests import engines

pytestmark = pytest.mark.sglang

GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
PROMPTS = engines.prompts(8, seed=50)


def _outputs(target, **kwargs):
    engine = engines.start(target, **kwargs)
    try:
        return [o["output_ids"] for o in engines.generate(engine, PROMPTS, GREEDY, 4)]
    finally:
        engines.shutdown(engine)


def test_tp2_serves_the_tp1_tokens(tiny, monkeypatch):
    target = tiny.target("a")  # 4 heads, 2 KV heads: both split in two
    want = _outputs(target)
    # One core per rank; this machine has one NUMA node, fewer than the ranks.
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    assert _outputs(target, tp_size=2) == want


def test_dflash_at_tp2_is_refused_naming_it(tiny):
    with pytest.raises(ValueError, match="tp_size=2"):
        engine = engines.start(*tiny.pair("a"), tp_size=2)
        engines.shutdown(engine)

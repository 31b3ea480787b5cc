"""Sampled requests the sampling tests compare, with and without DFLASH."""

from tests.support import engines

N_SAMPLES = 1200
PROMPT = engines.prompts(1, seed=11, min_len=12, max_len=12)[0]
FILTERED = {
    "temperature": 0.9,
    "top_k": 8,
    "top_p": 0.9,
    "min_p": 0.05,
    "max_new_tokens": 3,
    "ignore_eos": True,
}
# Seeds with top-k and top-p (SGLang's seeded sampler refuses min_p).
SEEDED = [dict(FILTERED, min_p=0.0, max_new_tokens=16, sampling_seed=s) for s in range(6)]

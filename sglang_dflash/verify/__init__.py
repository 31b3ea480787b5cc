"""Proposals to accepted tokens, exactly: the greedy rule (`acceptance.py`), exact sampled
verification (`sampling.py`, and `q_sampling.py` for proposals the draft sampled), the logit
adjustments of decode steps at every verify row (`penalties.py`, `logit_processors.py`), the
sampling masks (`sampling_mask.py`), and `Verifier`, which applies them per batch
(`verifier.py`).

Imports nothing of ours outside this folder. No SGLang at import time.
See docs/requests.md ("Sampling (temperature > 0)").
"""

"""The draft's hidden states to proposed tokens, one proposer per checkpoint family
(`proposers.py`): the target's argmax, DFlash2's candidate selector (`selector.py`), LiLiCorr's
lattice head with its store of each request's last-token feature (`lilicorr.py`), Domino's GRU
rollout (`domino.py`), and grammar-aware proposals with the window's grammar masks (`grammar.py`).

Imports `verify/` (a sampled walk's q and its seeded noise) and `checkpoint/`. No SGLang at
import time. See docs/serving.md ("Draft families and options").
"""

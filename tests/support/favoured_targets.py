"""Targets of a family that favour one token (make_family_target), built once per session in the tiny
models' folder."""

from __future__ import annotations

import os

from tests.support.tiny import make_family_target

# Tiny targets: family -> (seed, favour), chosen so that the favoured token is about half of
# the greedy choices (see `make_family_target`); the draft then proposes it and is often right.
TARGETS = {"llama": (3, 6.0), "qwen3_moe": (3, 6.0)}


def favoured_target(tiny, family: str) -> str:
    """The session's `family` target of TARGETS, built on first use."""
    path = os.path.join(tiny.root, f"family-{family}")
    if not os.path.isdir(path):
        seed, favour = TARGETS[family]
        make_family_target(path, family=family, seed=seed, favour=favour)
    return path

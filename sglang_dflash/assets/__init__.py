"""Checkpoints shipped with the package.

`tiny_pair()`: a tiny Qwen3 code model and its DFlash draft, trained on CPU by this repo's
recipe from Python standard-library sources (`scripts/build_tiny_pair.py` rebuilds them), and
`tiny_pair_dflash2_draft()`, a DFlash2 draft for the same target by the same recipe.
They are the default models of `make demo` and of the acceptance tests.

See docs/training.md ("The shipped tiny pair").
"""

from __future__ import annotations

import json
import os

TINY_PAIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_pair")


def tiny_pair() -> tuple[str, str]:
    """(target_dir, draft_dir): a Hugging Face Qwen3 target with its tokenizer, and a
    z-lab-format DFlash draft (block size 8) for it."""
    return os.path.join(TINY_PAIR, "target"), os.path.join(TINY_PAIR, "draft")


def tiny_pair_dflash2_draft() -> str:
    """A DFlash2 draft (`DFlash2DraftModel`: grouped convolution, candidate selector) for the tiny
    pair's target, trained by the same recipe with `--family dflash2`."""
    return os.path.join(TINY_PAIR, "draft-dflash2")


def tiny_pair_prompts() -> list[str]:
    """Completion prompts cut from standard-library files held out of the pair's training."""
    with open(os.path.join(TINY_PAIR, "prompts.json")) as f:
        return [p["text"] for p in json.load(f)]

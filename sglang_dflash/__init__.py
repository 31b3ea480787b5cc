"""sglang-dflash: DFlash speculative decoding for SGLang, installed as a plugin.

Importing this package is cheap: SGLang loads the plugin entry point (`plugin.register`) in
every process, and everything heavy is imported where it is used.

The folders follow one decode step; imports flow down this list, never up (docs/architecture.md,
"Imports flow one way"):

    plugin.py        the entry point: SGLang's hooks hand DFLASH to `worker.py`
    worker.py        the orchestrator: draft -> verify -> accept -> commit -> inject, per step
    runtime.py       the draft side of an engine, assembled from the stages in SGLang's start-up
    step_timer.py    the worker's optional per-phase step timing
    integration/ width/ where we meet SGLang's scheduler, pools and arguments; the verify width
    ops/ cpu/        kernel entry points; SGLang's CPU engine without sgl-kernel
    draft/           the draft network and its step
    propose/         the draft's hidden states -> proposed tokens, per family
    verify/          proposals -> accepted tokens, exactly
    checkpoint/      what a draft checkpoint may hold, parsed and checked
    knobs.py         every environment variable, read once

`train/` (the training recipe) sits beside the worker and imports `draft/` and `checkpoint/`.
"""

import os

__version__ = "0.1.0"
IMPL_NAME = "sglang-dflash"
IMPL_ENV = "SGLANG_DFLASH_IMPL"  # sglang-dflash (default) | builtin: who serves DFLASH
BUILTIN = "builtin"

__all__ = ["BUILTIN", "IMPL_ENV", "IMPL_NAME", "__version__", "use_builtin"]


def use_builtin() -> bool:
    """SGLANG_DFLASH_IMPL=builtin hands DFLASH back to SGLang's built-in worker."""
    value = os.environ.get(IMPL_ENV, IMPL_NAME).strip().lower()
    if value not in (IMPL_NAME, BUILTIN):
        raise ValueError(f"{IMPL_ENV} must be {IMPL_NAME!r} or {BUILTIN!r}, got {value!r}")
    return value == BUILTIN

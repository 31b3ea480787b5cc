"""sglang-dflash: DFlash speculative decoding for SGLang, installed as a plugin.

Importing this package is cheap: SGLang loads the plugin entry point (`plugin.register`) in
every process, and everything heavy is imported where it is used.

The folders follow one decode step, and imports flow one way between them: the layout, its
layers and the module map are in docs/architecture.md ("Layout").
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

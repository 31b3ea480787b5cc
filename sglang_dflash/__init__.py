"""sglang-dflash: DFlash speculative decoding for SGLang, installed as a plugin.

Importing this package is cheap: SGLang loads the plugin entry point (`plugin.register`) in
every process, and everything heavy is imported where it is used.

The folders follow one decode step, and imports flow one way between them: the layout, its
layers and the module map are in docs/architecture.md ("Layout").
"""

__version__ = "0.1.0"
IMPL_NAME = "sglang-dflash"  # who serves DFLASH (SGLANG_DFLASH_IMPL: `knobs.use_builtin`)

__all__ = ["IMPL_NAME", "__version__"]

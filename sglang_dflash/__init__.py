"""sglang-dflash: DFlash speculative decoding for SGLang, installed as a plugin.

Importing this package is cheap: SGLang loads the plugin entry point (`plugin.register`) in
every process, and everything heavy is imported where it is used.
"""

__version__ = "0.1.0"
IMPL_NAME = "sglang-dflash"

__all__ = ["IMPL_NAME", "__version__"]

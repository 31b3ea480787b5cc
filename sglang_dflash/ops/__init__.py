"""Kernel entry points. Each has a pure-PyTorch reference (`reference.py`) that is both the
test oracle and the path used where no faster implementation applies."""

from sglang_dflash.ops.reference import inject_context_kv

__all__ = ["inject_context_kv"]

"""The GPU serving kit's two import-time adjustments to SGLang (`make gpu-proof`).

Python imports this file at start-up in every process, SGLang's schedulers too, when its folder
is on PYTHONPATH. It changes nothing unless SGLANG_DFLASH_GPU_KIT=1 (the kit sets it), and then
says what it changed, once per process, on stderr:

1. `sglang.kernels.ops.gemm.cutedsl_dual_gemm` imports nvidia-cutlass-dsl (the CuTe DSL), which
   the kit does not carry; SGLang imports that module for every dense MLP on CUDA. Where
   `cutlass` is not importable, a stand-in module answers `can_use_dual_gemm` with False (the
   kernel is Blackwell-only, tcgen05, so a Hopper GPU never uses it).
2. FlashInfer's ragged prefill wrapper: SGLang asks for backend "auto", which on Hopper means
   FlashInfer's sm90 kernels and minutes of JIT compilation at the first prefill. The kit asks
   for "fa2", as SGLang's own paged wrappers do.
"""

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

DUAL_GEMM = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"
FLASHINFER_BACKEND = "sglang.srt.layers.attention.flashinfer_backend"


def _say(what: str) -> None:
    print(f"[sglang-dflash GPU kit] {what}", file=sys.stderr, flush=True)


class DualGemmQuantMode(enum.IntEnum):  # as in SGLang's module
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self != DualGemmQuantMode.UNQUANT


def dual_gemm_standin() -> types.ModuleType:
    module = types.ModuleType(DUAL_GEMM, "sglang-dflash GPU kit stand-in: no CuTe DSL, no dual GEMM")
    module.DualGemmQuantMode = DualGemmQuantMode
    module.MAX_DUAL_GEMM_DECODE_TOKENS = 16
    module.can_use_dual_gemm = lambda *args, **kwargs: False
    return module


def ragged_fa2(wrapper_cls):
    """FlashInfer's ragged prefill wrapper class, with backend "auto" read as "fa2"."""

    class RaggedFa2(wrapper_cls):
        def __init__(self, *args, backend="auto", **kwargs):
            super().__init__(*args, backend="fa2" if backend == "auto" else backend, **kwargs)

    RaggedFa2.__name__ = RaggedFa2.__qualname__ = wrapper_cls.__name__
    return RaggedFa2


class _Loader(importlib.abc.Loader):
    def __init__(self, make=None, real=None, after=None):
        self.make, self.real, self.after = make, real, after

    def create_module(self, spec):
        return self.make() if self.make else self.real.create_module(spec)

    def exec_module(self, module):
        if self.real is not None:
            self.real.exec_module(module)
        if self.after is not None:
            self.after(module)


def cute_dsl_available() -> bool:
    """Whether nvidia-cutlass-dsl's `cutlass.cute` imports (another top-level `cutlass`, such
    as CUTLASS's Python package, does not count)."""
    try:
        return importlib.util.find_spec("cutlass.cute") is not None
    except ImportError:
        return False


class KitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == DUAL_GEMM and not cute_dsl_available():
            _say(f"{DUAL_GEMM}: stand-in (nvidia-cutlass-dsl is not installed; no dual GEMM)")
            return importlib.machinery.ModuleSpec(name, _Loader(make=dual_gemm_standin))
        if name == FLASHINFER_BACKEND:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None:
                return None

            def patch(module):
                wrapper = getattr(module, "BatchPrefillWithRaggedKVCacheWrapper", None)
                if wrapper is None:  # SGLang imports FlashInfer's wrappers on CUDA only
                    _say(f"{FLASHINFER_BACKEND} has no FlashInfer wrappers here (no CUDA): nothing to adjust")
                    return
                module.BatchPrefillWithRaggedKVCacheWrapper = ragged_fa2(wrapper)
                _say("FlashInfer's ragged prefill wrapper: backend 'auto' served as 'fa2'")

            spec.loader = _Loader(real=spec.loader, after=patch)
            return spec
        return None


if os.environ.get("SGLANG_DFLASH_GPU_KIT") == "1":
    sys.meta_path.insert(0, KitFinder())

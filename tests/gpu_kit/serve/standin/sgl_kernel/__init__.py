"""NOT sgl-kernel: sglang-dflash's labelled stand-in for it, for the GPU serving kit only.

`make gpu-proof` serves SGLang on a GPU machine that has PyTorch and no sgl-kernel wheel
for its torch. SGLang's dense CUDA path (FlashInfer attention, PyTorch sampling, TP 1, no prefill
CUDA graph) imports a few dozen sgl_kernel names and calls a handful. This package gives it:

* the kernels it calls, through FlashInfer with the same signatures: `rmsnorm`,
  `fused_add_rmsnorm`, Gemma's two norms, `silu_and_mul`, `gelu_and_mul`, `gelu_tanh_and_mul`
  (for float32 inputs, which FlashInfer's kernels do not take, in PyTorch: `float32.py`),
  `top_k_renorm_prob(s)`, `top_p_renorm_prob(s)`, `merge_state_v2`; and `weak_ref_tensor`
  (a non-owning alias, compiled on first use with the machine's C++ compiler);
* the MoE runner's `moe_align_block_size` (through SGLang's kernel registry) and
  `moe_sum_reduce`, in PyTorch (`moe.py`);
* the names SGLang imports, or its kernel registry names, and never calls there (quantized
  GEMMs, `moe_sum`, DeepSeek's fused A GEMM, HiCache transfers, GGUF): importable, and each
  raises NotImplementedError naming itself if called;
* nothing else: any other name or submodule (`allreduce`, `flash_attn`, `scalar_type`, ...) is
  an ImportError, so SGLang's guarded imports take their non-sgl_kernel path.

It works only when asked: SGLANG_DFLASH_SGL_KERNEL_STANDIN=1 (the kit sets it). Without it, or
where a real sgl_kernel is importable further down sys.path, importing it raises ImportError.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys

OPT_IN = "SGLANG_DFLASH_SGL_KERNEL_STANDIN"
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def real_sgl_kernel_path():
    """Where a real sgl_kernel would be imported from, were this stand-in not first (a folder
    further down sys.path, or an installed distribution, editable installs included); or None."""
    from importlib import metadata

    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sgl_kernel", others)
    if spec is not None:
        return spec.origin or str(spec.submodule_search_locations)
    for name in ("sglang-kernel", "sgl-kernel"):
        try:
            return f"the {name} {metadata.version(name)} distribution"
        except metadata.PackageNotFoundError:
            pass
    return None


if os.environ.get(OPT_IN) != "1":
    raise ImportError(
        f"this sgl_kernel is sglang-dflash's stand-in for the GPU serving kit ({__file__}); "
        f"set {OPT_IN}=1 to use it, or take its folder off PYTHONPATH"
    )
_real = real_sgl_kernel_path()
if _real is not None:
    raise ImportError(f"a real sgl_kernel is installed ({_real}): take the stand-in ({_HERE}) off PYTHONPATH")

__version__ = "0.0.0+sglang-dflash-standin"
IS_STANDIN = True
print(f"[sgl_kernel] sglang-dflash's FlashInfer stand-in, not sgl-kernel ({__file__})", file=sys.stderr)


def _flashinfer(module: str):
    # Imported on first call: FlashInfer's import must not run inside SGLang's guarded imports,
    # whose `except ImportError` would not catch its other errors.
    return importlib.import_module(f"flashinfer.{module}")


def _unsupported(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by sglang-dflash's stand-in (GPU serving kit): "
            "this path needs the real sgl-kernel"
        )

    call.__name__ = call.__qualname__ = name
    return call


# ---- provided ---------------------------------------------------------------------------


import torch  # noqa: E402  (after the opt-in check: a refused import stays quick)


def _float32():
    from sgl_kernel import float32

    return float32


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    if input.dtype == torch.float32:
        return _float32().rmsnorm(input, weight, eps, out=out)
    return _flashinfer("norm").rmsnorm(input, weight, eps, out=out, enable_pdl=enable_pdl)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    if input.dtype == torch.float32:
        return _float32().fused_add_rmsnorm(input, residual, weight, eps)
    _flashinfer("norm").fused_add_rmsnorm(input, residual, weight, eps, enable_pdl=enable_pdl)


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    if input.dtype == torch.float32:
        return _float32().rmsnorm(input, weight, eps, out=out, gemma=True)
    return _flashinfer("norm").gemma_rmsnorm(input, weight, eps, out=out, enable_pdl=enable_pdl)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    if input.dtype == torch.float32:
        return _float32().fused_add_rmsnorm(input, residual, weight, eps, gemma=True)
    _flashinfer("norm").gemma_fused_add_rmsnorm(input, residual, weight, eps, enable_pdl=enable_pdl)


def silu_and_mul(input, out=None):
    if input.dtype == torch.float32:
        return _float32().gated(input, out, "silu")
    return _flashinfer("activation").silu_and_mul(input, out=out)


def gelu_and_mul(input, out=None):
    if input.dtype == torch.float32:
        return _float32().gated(input, out, "gelu")
    return _flashinfer("activation").gelu_and_mul(input, out=out)


def gelu_tanh_and_mul(input, out=None):
    if input.dtype == torch.float32:
        return _float32().gated(input, out, "gelu_tanh")
    return _flashinfer("activation").gelu_tanh_and_mul(input, out=out)


def top_k_renorm_probs(probs, top_k):
    return _flashinfer("sampling").top_k_renorm_probs(probs, top_k)


def top_p_renorm_probs(probs, top_p):
    return _flashinfer("sampling").top_p_renorm_probs(probs, top_p)


top_k_renorm_prob = top_k_renorm_probs
top_p_renorm_prob = top_p_renorm_probs


def merge_state_v2(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None):
    """Two attention partials [T, H, D] with their natural-log log-sum-exps [T, H] -> the merged
    pair, as sgl-kernel's. FlashInfer's merge works in base 2, so the LSEs are scaled in and out."""
    import math

    import torch

    to_base2 = 1 / math.log(2)
    v, s = _flashinfer("cascade").merge_state(
        v_a, s_a.to(torch.float32) * to_base2, v_b, s_b.to(torch.float32) * to_base2
    )
    s = s / to_base2
    if v_merged is not None:
        v_merged.copy_(v)
        v = v_merged
    if s_merged is not None:
        s_merged.copy_(s)
        s = s_merged
    return v, s


from sgl_kernel.moe import moe_align_block_size, moe_sum_reduce  # noqa: E402,F401


def weak_ref_tensor(tensor):
    """A tensor on `tensor`'s memory that does not keep it alive (at::from_blob, no deleter), as
    sgl-kernel's; anything else passes through."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return tensor
    from sgl_kernel import _weak_ref

    return _weak_ref.op()(tensor)


# ---- imported on the dense CUDA path, never called there --------------------------------

for _name in ("int8_scaled_mm", "moe_sum", "dsv3_fused_a_gemm"):
    globals()[_name] = _unsupported(_name)
del _name

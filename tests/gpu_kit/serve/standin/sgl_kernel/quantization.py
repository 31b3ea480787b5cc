"""GGUF kernels: imported by SGLang's quantization registry, called only for GGUF models (the
stand-in raises if called; see sgl_kernel/__init__.py)."""

from sgl_kernel import _unsupported

NAMES = ("ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8")
globals().update({name: _unsupported(f"quantization.{name}") for name in NAMES})

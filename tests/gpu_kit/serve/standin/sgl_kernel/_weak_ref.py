"""`weak_ref_tensor`'s one C++ line, compiled on first use (torch.utils.cpp_extension)."""

from __future__ import annotations

import functools

SOURCE = """
#include <torch/extension.h>
// Same pointer, sizes, strides and dtype; no deleter, so the result owns nothing.
torch::Tensor weak_ref_tensor(const torch::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), "weak_ref_tensor: expected a CUDA tensor");
  return torch::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
}
"""


@functools.cache
def op():
    from torch.utils.cpp_extension import load_inline

    module = load_inline("sglang_dflash_standin_weak_ref", SOURCE, functions=["weak_ref_tensor"])
    return module.weak_ref_tensor

"""The compiled operator library `sglang_dflash._C`: lazy loading, Python-side registrations, and
the model-level wrapper around `torch.ops.sglang_dflash.inject_context_kv`.

Only `sglang_dflash.ops` imports this module. Loading `_C` runs its `TORCH_LIBRARY` schema and
CUDA kernel registrations; this module then registers the fake (meta) implementation and the
pure-PyTorch CPU kernel (`reference.fused_inject_reference`), so the op works under
`torch.compile` and `torch.library.opcheck` runs on CPU.
"""

from __future__ import annotations

import functools
import importlib
import weakref
from typing import Optional

import torch

from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.ops import reference

OP_NAME = "sglang_dflash::inject_context_kv"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BUILD_HINT = (
    "reinstall with `pip install --no-build-isolation .` on a machine with nvcc "
    "(SGLANG_DFLASH_BUILD_CUDA=1 makes a failed build an error)"
)


@functools.cache
def load_error() -> Optional[str]:
    """Load `sglang_dflash._C` once; None if it loaded, else why not."""
    try:
        importlib.import_module("sglang_dflash._C")
    except ImportError as error:
        return f"sglang_dflash._C is not built ({error}); {BUILD_HINT}"
    _register_python_impls()
    return None


def op() -> torch._ops.OpOverload:
    error = load_error()
    if error is not None:
        raise RuntimeError(error)
    return torch.ops.sglang_dflash.inject_context_kv.default


def _register_python_impls() -> None:
    torch.library.register_fake(OP_NAME)(_fake_inject_context_kv)
    torch.library.impl(OP_NAME, "CPU")(reference.fused_inject_reference)


def _fake_inject_context_kv(
    target_features,
    positions,
    slots,
    fc_weight,
    kv_weight,
    kv_bias,
    k_norm_weight,
    inv_freq,
    hidden_norm_eps,
    k_norm_eps,
    attention_scaling,
    k_cache,
    v_cache,
) -> None:
    num_layers, _, num_kv_heads, head_dim = k_cache.shape
    num_tokens, in_features = target_features.shape
    torch._check(v_cache.shape == k_cache.shape, lambda: "v_cache must have k_cache's shape")
    torch._check(fc_weight.shape[1] == in_features, lambda: "fc_weight must be [H, K*H]")
    kv_cols = num_layers * 2 * num_kv_heads * head_dim
    torch._check(tuple(kv_weight.shape) == (kv_cols, fc_weight.shape[0]), lambda: "kv_weight shape")
    torch._check(kv_bias is None or tuple(kv_bias.shape) == (kv_cols,), lambda: "kv_bias shape")
    torch._check(tuple(k_norm_weight.shape) == (num_layers, head_dim), lambda: "k_norm_weight shape")
    torch._check(tuple(inv_freq.shape) == (head_dim // 2,), lambda: "inv_freq shape")
    torch._check(tuple(positions.shape) == (num_tokens,), lambda: "positions shape")
    torch._check(tuple(slots.shape) == (num_tokens,), lambda: "slots shape")
    for t in (target_features, fc_weight, kv_weight, k_norm_weight, v_cache):
        torch._check(t.dtype == k_cache.dtype, lambda: "every float input must have k_cache's dtype")
    return None


def unsupported_reason(model: DFlashDraftModel, store: DraftKVStore) -> Optional[str]:
    """Why the fused CUDA op cannot serve this model and store, or None if it can."""
    device, dtype = store.k.device, store.k.dtype
    if device.type != "cuda":
        return f"the draft KV store is on {device.type}"
    if store.ring is not None:
        return "the draft KV store keeps its windowed layers in a window ring (the op writes slot ids only)"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not one of {SUPPORTED_DTYPES}"
    weight = model.fc.weight
    if weight.device != device or weight.dtype != dtype:
        return (
            f"the draft weights ({weight.device}, {weight.dtype}) differ from the store ({device}, {dtype})"
        )
    if model.config.head_dim > 1024:
        return f"head_dim {model.config.head_dim} > 1024"
    reason = reference.fusion_unsupported_reason(model)
    if reason is not None:
        return reason
    return load_error()


# model -> its fused weights; built on first use, dropped with the model.
_WEIGHTS: "weakref.WeakKeyDictionary[DFlashDraftModel, reference.FusedKVWeights]" = (
    weakref.WeakKeyDictionary()
)


def fused_weights(model: DFlashDraftModel) -> reference.FusedKVWeights:
    """The model's stacked, folded weights, prepared once (no per-step weight copies)."""
    weights = _WEIGHTS.get(model)
    if weights is None:
        weights = _WEIGHTS[model] = reference.fuse_weights(model)
    return weights


def forget_weights(model: DFlashDraftModel) -> None:
    _WEIGHTS.pop(model, None)


def inject_context_kv(
    model: DFlashDraftModel,
    store: DraftKVStore,
    target_features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rows=None,
) -> None:
    """`ops.inject_context_kv` through the fused CUDA op (same contract as the reference; no
    window ring: `unsupported_reason`)."""
    weights = fused_weights(model)
    if target_features.dtype != store.k.dtype:
        target_features = target_features.to(store.k.dtype)
    op()(target_features, positions, slots, *weights.op_args(), store.k, store.v)

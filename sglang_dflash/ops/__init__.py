"""Kernel entry points. Each has a pure-PyTorch reference (`reference.py`) that is both the
test oracle and the path used where no faster implementation applies.

`inject_context_kv` picks its implementation once per draft model (in serving: once per
process), logs the choice with the reason, and then always calls that one: an error in the
chosen implementation propagates; nothing falls back at run time.

SGLANG_DFLASH_OPS: `auto` (default: the CUDA op where it applies; else the fused op's maths in
PyTorch, `reference.fused_inject_reference` on the op's stacked weights, where the draft can be
fused; else the module-by-module reference), `reference` (always the module-by-module
reference), `cuda` (the CUDA op, or an error saying why not).

See docs/gpu.md.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, Optional

import torch

from sglang_dflash import knobs
from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.ops import reference

__all__ = ["choose_inject_context_kv", "forget", "inject_context_kv"]

logger = logging.getLogger(__name__)

ENV = "SGLANG_DFLASH_OPS"

InjectFn = Callable[..., None]  # (model, store, target_features, positions, slots, rows) -> None

# model -> (implementation name, function), decided on first use.
_CHOSEN: "weakref.WeakKeyDictionary[DFlashDraftModel, tuple[str, InjectFn]]" = weakref.WeakKeyDictionary()


def inject_context_kv(
    model: DFlashDraftModel,
    store: DraftKVStore,
    target_features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
) -> None:
    """Feature fusion and KV injection for committed tokens (see `reference.inject_context_kv`).

    target_features [N, K*H], positions [N], slots [N] (slot 0: rows to drop) -> the draft
    K/V of every layer written into `store` at `slots`; with a window ring, its layers' at ring
    `rows` [N] (`WindowRing.write_rows`).
    """
    chosen = _CHOSEN.get(model)
    if chosen is None:
        chosen = _choose(model, store)
    chosen[1](model, store, target_features, positions, slots, rows)


def choose_inject_context_kv(model: DFlashDraftModel, store: DraftKVStore) -> str:
    """Make (or recall) the choice for this model now; returns `"cuda"` or `"reference"`.

    Call it at start-up: choosing the CUDA op also builds its stacked weights (one extra copy of
    every layer's K/V projection), so that memory is taken before serving starts.
    """
    chosen = _CHOSEN.get(model)
    if chosen is None:
        chosen = _choose(model, store)
    return chosen[0]


def forget(model: DFlashDraftModel) -> None:
    """Drop the choice and the fused op's prepared weights for `model`. Call it after changing
    the draft's weights in place (the fused op reads its own stacked copy of them)."""
    from sglang_dflash.ops import _cuda

    _CHOSEN.pop(model, None)
    _cuda.forget_weights(model)


def _fused_torch(
    model: DFlashDraftModel,
    store: DraftKVStore,
    target_features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
) -> None:
    """The fused op's maths in PyTorch, on its stacked weights: two GEMMs for every layer's K/V
    instead of the module reference's projections layer by layer (0.29 against 0.59 ms for 16
    tokens of the shipped pair on one CPU core)."""
    from sglang_dflash.ops import _cuda

    weights = _cuda.fused_weights(model)
    features = target_features.to(weights.fc_weight.dtype)
    if features.shape[0] == 0:
        return
    k, v = reference.fused_context_kv(features, positions, *weights.op_args())
    store.write(slots, k, v, rows)


def _choose(model: DFlashDraftModel, store: DraftKVStore) -> tuple[str, InjectFn]:
    from sglang_dflash.ops import _cuda

    mode: knobs.OpsMode = knobs.value(ENV)
    reason = f"{ENV}=reference" if mode == "reference" else _cuda.unsupported_reason(model, store)
    if reason is None:
        weights = _cuda.fused_weights(model)  # allocate now (start-up), not at the first prefill
        logger.info(
            "DFLASH context-KV injection: fused CUDA op (sglang_dflash._C; stacked K/V weight %.1f MB)",
            weights.kv_weight.numel() * weights.kv_weight.element_size() / 2**20,
        )
        chosen: tuple[str, InjectFn] = ("cuda", _cuda.inject_context_kv)
    elif mode == "cuda":
        raise RuntimeError(f"{ENV}=cuda, but the fused CUDA op cannot run: {reason}")
    elif mode == "auto" and reference.fusion_unsupported_reason(model) is None:
        weights = _cuda.fused_weights(model)
        logger.info(
            "DFLASH context-KV injection: the fused op's maths in PyTorch (%s; stacked K/V weight %.1f MB)",
            reason,
            weights.kv_weight.numel() * weights.kv_weight.element_size() / 2**20,
        )
        chosen = ("fused-torch", _fused_torch)
    else:
        # On a CUDA store the reference is a real slowdown: say so louder.
        log = logger.warning if store.k.device.type == "cuda" and mode == "auto" else logger.info
        log("DFLASH context-KV injection: PyTorch reference (%s)", reason)
        chosen = ("reference", reference.inject_context_kv)
    _CHOSEN[model] = chosen
    return chosen

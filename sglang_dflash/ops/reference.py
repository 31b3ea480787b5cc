"""Pure-PyTorch reference implementations of the package's kernels."""

from __future__ import annotations

import torch

from sglang_dflash.draft_model import DFlashDraftModel
from sglang_dflash.kv_store import DraftKVStore


def inject_context_kv(
    model: DFlashDraftModel,
    store: DraftKVStore,
    target_features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Feature fusion and KV injection for committed tokens.

    target_features [N, K*H] -> fc -> hidden_norm -> every layer's k_proj/v_proj, k_norm,
    RoPE at `positions` [N] -> stored at `slots` [N] for every draft layer.
    """
    context = model.fuse_target_features(target_features.to(model.fc.weight.dtype))
    k, v = model.context_kv(context, positions)
    store.write(slots, k, v)

"""The trained draft in the z-lab `DFlashDraftModel` checkpoint format.

`draft_config_dict` is the one place that decides the draft's shape: the recipe builds its
`DFlashDraftConfig` by parsing this dict, so training and serving read the same fields.
The export is `config.json` + `model.safetensors`, loadable by this package, by SGLang's
built-in DFLASH and by the z-lab `dflash` package.
"""

from __future__ import annotations

import torch

from sglang_dflash.checkpoint.config import ARCHITECTURE
from sglang_dflash.checkpoint.contract import SELECTOR_ARCHITECTURES
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.train.config import TrainConfig


def _rope_parameters(target_config) -> dict:
    params = getattr(target_config, "rope_parameters", None)
    if params is None:  # older configs: rope_theta / rope_scaling
        params = dict(getattr(target_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(target_config, "rope_theta", 10000.0))
    params = {k: v for k, v in dict(params).items() if v is not None}
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def draft_config_dict(
    target_config, cfg: TrainConfig, *, layer_ids: tuple[int, ...], mask_token_id: int
) -> dict:
    """config.json of the draft: Qwen3 fields (head shape and RoPE from the target unless set)
    plus the DFlash fields; with --family dflash2, DFlash2's class and its convolution and
    selector fields (in `dflash_config`, where SGLang reads them)."""
    t = target_config
    heads = cfg.num_attention_heads or t.num_attention_heads
    head_dim = cfg.head_dim or getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    rope = _rope_parameters(t)
    layer_types = list(cfg.resolved_layer_types)
    sliding = "sliding_attention" in layer_types
    dflash = {"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id}
    architecture = ARCHITECTURE
    if cfg.family == "dflash2":
        architecture = SELECTOR_ARCHITECTURES[0]  # DFlash2DraftModel
        dflash.update({k: v for k, v in cfg.dflash2.items() if k != "selector_loss_weight"})
    return {
        "architectures": [architecture],
        "model_type": "qwen3",
        "hidden_size": t.hidden_size,
        "num_hidden_layers": cfg.num_draft_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.num_key_value_heads or getattr(t, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "intermediate_size": cfg.intermediate_size or t.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": getattr(t, "rms_norm_eps", 1e-6),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": getattr(t, "initializer_range", 0.02),
        # Both spellings: transformers v5 reads rope_parameters, older readers rope_theta/_scaling.
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None
        if rope["rope_type"] == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"},
        "max_position_embeddings": t.max_position_embeddings,
        "layer_types": layer_types,
        # transformers' Qwen3Config drops sliding_window unless use_sliding_window is set.
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window if sliding else None,
        "tie_word_embeddings": False,
        "vocab_size": t.vocab_size,
        "dtype": cfg.export_dtype,
        "block_size": cfg.block_size,
        "num_target_layers": t.num_hidden_layers,
        "dflash_config": dflash,
    }


def export_draft(draft: DFlashDraftModel, raw_config: dict, path: str) -> None:
    """Write `path/config.json` and `path/model.safetensors` in `raw_config["dtype"]`."""
    draft.save_pretrained(path, raw_config, dtype=getattr(torch, raw_config["dtype"]))

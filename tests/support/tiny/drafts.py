"""DFlash drafts in the z-lab checkpoint format (`draft_config_dict`, `make_draft`) and the edits
that make one a draft of another family: DFlash2's candidate selector (`add_selector`), Domino's
projector (`add_domino`), a LiLiCorr head (`add_lilicorr`) and Laguna's gates (`add_laguna`); and the
config fields of z-lab's Gemma-4 drafts, at tiny scale (`as_gemma4_published`)."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from tests.support.tiny.tokenizer import MASK_ID


def draft_config_dict(
    *,
    hidden_size: int = 64,
    num_layers: int = 1,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    block_size: int = 8,
    target_layer_ids: Optional[list[int]] = None,
    num_target_layers: int = 4,
    mask_token_id: int = MASK_ID,
    vocab_size: int = 384,
) -> dict:
    dflash = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = target_layer_ids
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "layer_types": ["full_attention"] * num_layers,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": dflash,
    }


def make_draft(path: str, *, seed: int = 1, prefix: str = "", **config_kwargs) -> str:
    """A random draft in the z-lab format; `prefix="model."` exercises the prefixed names."""
    from sglang_dflash.checkpoint.config import DFlashDraftConfig
    from sglang_dflash.draft.model import DFlashDraftModel

    raw = draft_config_dict(**config_kwargs)
    config = DFlashDraftConfig.from_dict(raw)
    num_features = len(config.resolve_target_layer_ids(raw["num_target_layers"]))
    torch.manual_seed(seed)
    model = DFlashDraftModel(config, num_features)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path, raw)
    if prefix:
        from safetensors.torch import load_file, save_file

        file = os.path.join(path, "model.safetensors")
        save_file({prefix + k: v for k, v in load_file(file).items()}, file)
    return path


def add_selector(
    path: str,
    *,
    rank: int = 4,
    top_k: int = 4,
    scale: float = 0.1,
    seed: int = 2,
    architecture="DFlash2DraftModel",
) -> str:
    """Make the draft at `path` a DFlash2 draft: its class, `selector_rank` / `selector_top_k`,
    and random selector weights whose pair scores are `scale`-sized beside the unary logits."""
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = [architecture]
    config["dflash_config"].update(selector_rank=rank, selector_top_k=top_k)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    gen = torch.Generator().manual_seed(seed)
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["candidate_selector.predecessor_codebook"] = scale * torch.randn(vocab, rank, generator=gen)
    tensors["candidate_selector.successor_codebook"] = scale * torch.randn(vocab, rank, generator=gen)
    tensors["candidate_selector.hidden_projection.weight"] = (
        torch.randn(rank, hidden, generator=gen) / hidden**0.5
    )
    save_file(tensors, file)
    return path


def add_domino(
    path: str,
    *,
    gru_hidden_dim: int = 16,
    emb_dim: int = 24,
    shift_label: bool = False,
    scale: float = 0.1,
    seed: int = 3,
) -> str:
    """Give the draft at `path` Domino's projector: `projector_type: domino` and its fields, and
    random GRU and projection weights whose corrections are `scale`-sized beside the base logits."""
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["dflash_config"].update(
        projector_type="domino",
        shift_label=shift_label,
        pure_draft_prefix_len=1,
        gru_hidden_dim=gru_hidden_dim,
        emb_dim=emb_dim,
    )
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    gen = torch.Generator().manual_seed(seed)
    vocab, hidden, g = config["vocab_size"], config["hidden_size"], gru_hidden_dim
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["prefix_gru.weight_ih_l0"] = torch.randn(3 * g, hidden, generator=gen) / hidden**0.5
    tensors["prefix_gru.weight_hh_l0"] = torch.randn(3 * g, g, generator=gen) / g**0.5
    tensors["embed_proj.0.weight"] = torch.randn(emb_dim, hidden + g, generator=gen) / (hidden + g) ** 0.5
    tensors["embed_proj.2.weight"] = scale * torch.randn(vocab, emb_dim, generator=gen)
    save_file(tensors, file)
    return path


LILICORR_FIELDS = {
    "lilicorr_candidate_topk": 4,
    "lilicorr_hidden_size": 0,
    "lilicorr_num_layers": 1,
    "lilicorr_num_heads": 2,
    "lilicorr_mlp_ratio": 2.0,
    "lilicorr_factor_dim": 8,
    "lilicorr_vector_eps": 1e-6,
    "lilicorr_logit_scale": 4.0,
}


def lilicorr_weights(
    hidden: int, block_size: int, fields: dict, *, rank0: float = 0.0, seed: int = 5
) -> dict:
    """Random weights of a LiLiCorr head with `fields` (named as in a checkpoint, under
    `lilicorr.`): linear weights of unit gain, biases and norm scales near their defaults. With
    `rank0` > 0 the head leans to each slot's top candidate: the rank embedding pushes rank 0
    one way and the others the other, and the pair heads share their weights, so a candidate
    scores best after its own kind."""
    from sglang_dflash.checkpoint.fields import parse_lilicorr
    from sglang_dflash.propose.lilicorr import LiLiCorrHead

    shape = parse_lilicorr(fields, "LiLiCorrDraftModel", hidden)["lilicorr"]
    head = LiLiCorrHead(hidden, block_size, 1e-6, shape)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in head.named_parameters():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif p.dim() == 2 and not name.endswith("slot_bias"):
            value = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
        else:
            value = 0.1 * torch.randn(p.shape, generator=gen)
        tensors[name] = value
    if rank0:
        width = tensors["rank_embedding"].shape[-1]
        direction = torch.randn(width, generator=gen)
        direction *= rank0 * width**0.5 / direction.norm()
        tensors["rank_embedding"][..., 0, :] += direction
        tensors["rank_embedding"][..., 1:, :] -= direction
        tensors["in_head.weight"] = tensors["out_head.weight"].clone()
        tensors["in_head.bias"] = tensors["out_head.bias"].clone()
    return {"lilicorr." + k: v.contiguous() for k, v in tensors.items()}


def add_lilicorr(path: str, *, rank0: float = 2.0, seed: int = 5, **fields) -> str:
    """Make the draft at `path` a LiLiCorr draft: its class, `dflash_config.lilicorr_*`
    (`LILICORR_FIELDS`, updated with `fields`) and random head weights (`lilicorr_weights`)."""
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = ["LiLiCorrDraftModel"]
    head_fields = dict(LILICORR_FIELDS, **{f"lilicorr_{k}": v for k, v in fields.items()})
    config["dflash_config"].update(head_fields)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update(
        lilicorr_weights(config["hidden_size"], config["block_size"], head_fields, rank0=rank0, seed=seed)
    )
    save_file(tensors, file)
    return path


def add_laguna(path: str, *, gating="per-element", gate_scale: float = 0.1, seed: int = 4) -> str:
    """Make the draft at `path` a Laguna draft (`DFlashLagunaForCausalLM`, `model_type: laguna`):
    `gating`, one norm per captured feature slice (near 1) and a gate projection per layer (small,
    so each gate is near softplus(0))."""
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(architectures=["DFlashLagunaForCausalLM"], model_type="laguna", gating=gating)
    if config.get("sliding_window") is None:  # LagunaConfig takes an int (its default: 512)
        config.pop("sliding_window", None)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    gen = torch.Generator().manual_seed(seed)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    width = {"per-head": heads, "per-element": heads * config["head_dim"]}.get(gating, 0)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    features = tensors["fc.weight"].shape[1] // hidden
    for j in range(features):
        tensors[f"aux_hidden_norms.{j}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    for i in range(config["num_hidden_layers"]):
        if width:
            tensors[f"layers.{i}.self_attn.g_proj.weight"] = gate_scale * torch.randn(
                width, hidden, generator=gen
            )
    save_file(tensors, file)
    return path


def as_gemma4_published(config: dict) -> None:
    """Edit a tiny draft's config.json dict in place to carry what z-lab's Gemma-4 drafts carry,
    where they carry it (tests/data/published_drafts/z-lab__gemma-4-26B-A4B-it-DFlash.json): their
    target head's soft-cap at the top level, Qwen3's window switches, every layer sliding but the
    last (a one-layer draft's only layer is full), a window (8 here, 2048 there), no tied
    embeddings. The layers keep their weights: sliding ones only narrow what a query sees."""
    layers = config["num_hidden_layers"]
    config.update(
        model_type="qwen3",
        final_logit_softcapping=30.0,
        use_sliding_window=True,
        max_window_layers=layers,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        sliding_window=8,
        tie_word_embeddings=False,
    )

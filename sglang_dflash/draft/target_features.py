"""The target's captured hidden states, laid out the way the draft's `fc` reads them.

The draft's `fc` reads one chunk of hidden_size per entry of `target_layer_ids`, in listed order.
SGLang captures differently: its model's layer loop asks `if i in layers_to_capture`, so each
listed layer is captured once, in layer order. The two agree only when the ids strictly increase.

    ids [1, 9, 17]  captured [h1, h9, h17]   fc reads [h1, h9, h17]   (nothing to do)
    ids [1, 1]      captured [h1]            fc reads [h1, h1]        (z-lab's default for a
                                                                       2-layer draft on a 4-layer target)
    ids [9, 1, 9]   captured [h1, h9]        fc reads [h9, h1, h9]

`FeatureLayout` maps the captured chunks to fc's, with one gather. SGLang's packed capture
buffer (`AuxHiddenStatePacker`) may hold one chunk per listed id with only the first
`len(set(ids))` written; the gather reads only those.

See docs/serving.md ("Draft checkpoints").
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

# SGLang 0.5.23's DFLASH target classes that also capture after their last layer (pre-norm): their
# models check `num_hidden_layers` (or `end_layer`, `len(layers)`) against `layers_to_capture`
# past the layer loop, so the id L-1, mapped to L by `set_dflash_layers_to_capture`, is captured.
# On every other class nothing would be captured for it. Subclasses inherit it (checked by MRO).
CAPTURES_AFTER_LAST_LAYER = frozenset(
    {
        "MiMoV2ForCausalLM", "GptOssForCausalLM", "LagunaForCausalLM", "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM", "Lfm2VlForConditionalGeneration", "Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration", "NemotronHForCausalLM", "NemotronH_Nano_VL_V2",
        "MiniMaxM3SparseForConditionalGeneration",
    }
)  # fmt: skip

# Drafts whose ids are layer *outputs* on a Muse Glimmer target, which captures layer inputs:
# SGLang captures id + 1 for them (model_runner_components/spec_aux_hidden_state.py).
MUSE_LAYER_OUTPUT_DRAFTS = frozenset({"DFlash2DraftModel", "MuseGlimmerAssistantModel"})


def captured_layer_ids(
    layer_ids: Sequence[int], target_model_type: str, draft_architecture: str
) -> list[int]:
    """The layers SGLang captures for the draft's `target_layer_ids`: the same ids, or on a Muse
    Glimmer target (`model_type` muse_glimmer) for the drafts above, each id + 1. The capture
    order, and so the `fc` layout below, is the same either way (the shift keeps the order)."""
    shift = target_model_type == "muse_glimmer" and draft_architecture in MUSE_LAYER_OUTPUT_DRAFTS
    return [i + 1 for i in layer_ids] if shift else list(layer_ids)


def target_depth(text_config) -> int:
    """The number of target layers the draft's `target_layer_ids` count, as SGLang counts them:
    on a loop model (Nanbeige's `num_loops`), which runs its layers `num_loops` times, the ids
    are unrolled steps, `loop * num_hidden_layers + layer`; e.g. 22 layers x 2 loops: ids in
    [0, 44) (`spec_aux_hidden_state.py`, SGLang 0.5.23)."""
    return int(text_config.num_hidden_layers) * int(getattr(text_config, "num_loops", 1) or 1)


def captures_after_last_layer(model) -> Optional[str]:
    """The name of `model`'s class (or the ancestor) in `CAPTURES_AFTER_LAST_LAYER`; None if none.
    `model` is the target model, or its class (the launching process checks before loading)."""
    cls = model if isinstance(model, type) else type(model)
    return next((c.__name__ for c in cls.__mro__ if c.__name__ in CAPTURES_AFTER_LAST_LAYER), None)


def captured_chunk_of(layer_ids: Sequence[int]) -> Optional[tuple[int, ...]]:
    """For each listed id, the index of its chunk among SGLang's captures (distinct ids in layer
    order); None when that is the identity. E.g., [9, 1, 9] -> (1, 0, 1); [1, 9] -> None."""
    order = sorted(set(layer_ids))
    chunks = tuple(order.index(layer_id) for layer_id in layer_ids)
    return None if chunks == tuple(range(len(layer_ids))) else chunks


class FeatureLayout:
    """Arranges SGLang's captured target features into the draft's `fc` input."""

    def __init__(self, layer_ids: Sequence[int], hidden_size: int, device):
        self.layer_ids = list(layer_ids)
        self.hidden_size = hidden_size
        chunks = captured_chunk_of(layer_ids)
        self.num_captured = len(set(layer_ids))
        # [K] chunk index per fc input; None: the captured layout is already fc's.
        self.gather = None if chunks is None else torch.tensor(chunks, dtype=torch.long, device=device)

    @property
    def is_identity(self) -> bool:
        return self.gather is None

    def describe(self) -> str:
        """For the start-up log."""
        if self.is_identity:
            return "as captured"
        captured = sorted(set(self.layer_ids))
        return f"captured layers {captured} gathered into {self.layer_ids}"

    def arrange(self, captured: torch.Tensor) -> torch.Tensor:
        """[T, C*H] captured features (C >= distinct ids) -> [T, K*H] in listed order."""
        if self.gather is None:
            return captured
        tokens = captured.shape[0]
        chunks = captured.view(tokens, -1, self.hidden_size)[:, : self.num_captured]  # [T, C', H]
        return chunks.index_select(1, self.gather).reshape(tokens, -1)  # [T, K, H] -> [T, K*H]

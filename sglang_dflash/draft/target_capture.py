"""The target's DFlash capture hook, on SGLang classes that lack `set_dflash_layers_to_capture`.

SGLang's start-up (`configure_aux_hidden_state_capture`) calls
`model.set_dflash_layers_to_capture(ids)` and refuses a target class without it. What the hook
must do, as Qwen3's and Llama's do: for each id k, record the output of decoder layer k, before the
final norm, per token (transformers' `hidden_states[k + 1]`). Their models record the residual
stream entering each layer in `layers_to_capture`, so the hook sets that to `[k + 1 ...]`.

`complete_capture` gives the classes below that hook, as an attribute of the loaded model (SGLang's
`hasattr` sees it; no SGLang file is changed):

* INNER_CAPTURE_MISSING: the Qwen3-VL wrappers call the hook on their inner text model, which lacks
  it in SGLang 0.5.23 (start-up failed with an AttributeError, for the built-in too). The inner
  model gets what SGLang intends: `layers_to_capture` = the ids it is handed (already + 1).
* THROUGH_EAGLE3: classes whose EAGLE-3 hook records exactly that. `set_eagle3_layers_to_capture(ids)`
  sets `layers_to_capture = [k + 1 ...]` on a layer loop that records the residual stream
  (`capture=` / `capture_gathered=` at the attention boundary: the previous layer's output plus
  its residual, complete over TP). Their DFlash hook calls it with the ids, never with None (which
  would pick EAGLE-3's default layers).
* RESIDUAL_STREAM: Gemma-3, whose layer loop records the wrong tensor. Its decoder layer returns the
  MLP branch and the residual unsummed, and the loop appends the branch alone (on CUDA, the next
  fused add-norm then overwrites it in place with the normed input). The hook turns that capture
  off and records the sum instead, entering each listed layer (so, as on Qwen3, not id L-1).

Other classes with only an EAGLE-3 or DSpark hook stay refused by name (`refusal`), as SGLang
refuses them: each is served once its capture has been checked against transformers' hidden
states on tiny weights (tests/engine/test_captured_targets.py), as these were.

See docs/targets.md and docs/serving.md ("Targets").
"""

from __future__ import annotations

from typing import Optional, Sequence

# SGLang 0.5.23's Qwen3-VL wrappers (and subclasses: Qwen3-VL-MoE), by MRO.
INNER_CAPTURE_MISSING = frozenset({"Qwen3VLForConditionalGeneration"})

# Exact class names: SGLang's subclasses of these may run other layer loops, so none is taken in
# by inheritance.
THROUGH_EAGLE3 = frozenset(
    {"Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM"}
)
RESIDUAL_STREAM = frozenset({"Gemma3ForCausalLM"})

# Of those, the classes whose layer loop skips the capture under two-batch overlap
# (`forward_batch.can_run_tbo`): the draft would read nothing for those batches.
TBO_SKIPS_CAPTURE = frozenset({"Qwen2MoeForCausalLM", "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM"})

# Classes SGLang gives an EAGLE-3 or DSpark capture and sglang-dflash does not serve, with why.
NOT_SERVED = {
    "DeepseekV4ForCausalLM": (
        "its only capture (DSpark's) records the mean of the four hyper-connection residual streams, "
        "while its published DFlash draft reads all four (16384 values per layer), in the Speculators "
        "config format"
    ),
    "Gemma3ForConditionalGeneration": "its capture records the MLP branch without the residual",
    "MindSporeForCausalLM": "its model runs in MindSpore, outside SGLang",
}


def capture_route(cls: type) -> Optional[str]:
    """How `cls` (a target model class) captures for DFlash: "own" (its own hook), "inner",
    "eagle3", "residual_stream" (completed here), or None (refused)."""
    if cls.__name__ in THROUGH_EAGLE3:
        return "eagle3"
    if cls.__name__ in RESIDUAL_STREAM:
        return "residual_stream"
    if any(c.__name__ in INNER_CAPTURE_MISSING for c in cls.__mro__):
        return "inner"
    return "own" if hasattr(cls, "set_dflash_layers_to_capture") else None


def refusal(cls: type, two_batch_overlap: bool) -> Optional[str]:
    """Why DFLASH cannot capture on target class `cls` (None: it can)."""
    name = cls.__name__
    route = capture_route(cls)
    if route is None:
        why = NOT_SERVED.get(name)
        if why is None:
            why = f"{name} has no set_dflash_layers_to_capture"
            if hasattr(cls, "set_eagle3_layers_to_capture") or hasattr(cls, "set_dspark_layers_to_capture"):
                why += " (its EAGLE-3/DSpark capture is not one sglang-dflash has checked against DFlash's)"
        return f"cannot capture the hidden states DFLASH needs: {why}"
    if two_batch_overlap and name in TBO_SKIPS_CAPTURE:
        return (
            f"with --enable-two-batch-overlap: {name}'s layer loop skips the hidden-state capture on "
            "two-batch-overlap batches, which DFLASH's draft reads on every batch"
        )
    return None


COMPLETED = "_dflash_capture_completed"  # on a model `complete_capture` gave a hook: its route


def complete_capture(model) -> Optional[str]:
    """Give the loaded target `model` the DFlash hook SGLang calls, where its class lacks it;
    returns how (`capture_route`), None when nothing was done. Idempotent: a model given its hook
    once keeps it (a second call would wrap the forward a second time)."""
    route = capture_route(type(model))
    if getattr(model, COMPLETED, None) is not None:
        return None
    if route in ("eagle3", "residual_stream"):
        setattr(model, COMPLETED, route)
    if route == "eagle3":
        model.set_dflash_layers_to_capture = _through_eagle3(model)
    elif route == "residual_stream":
        model.set_dflash_layers_to_capture = _residual_stream(model)
    elif route == "inner":
        inner = getattr(model, "model", None)
        if inner is None or hasattr(inner, "set_dflash_layers_to_capture"):
            return None

        def set_inner_layers(layer_ids: Sequence[int]) -> None:
            inner.layers_to_capture = list(layer_ids)

        inner.set_dflash_layers_to_capture = set_inner_layers
    else:
        return None
    return route


def _through_eagle3(model):
    def set_dflash_layers_to_capture(layer_ids: Sequence[int]) -> None:
        if layer_ids is None:  # EAGLE-3's hook would pick its own default layers
            raise ValueError("DFLASH requires explicit layer_ids for aux hidden capture")
        model.set_eagle3_layers_to_capture(list(layer_ids))

    return set_dflash_layers_to_capture


def _residual_stream(model):
    """Gemma-3's hook: the residual stream entering layer k + 1 for each id k (ids start at 0 and
    end at L-2, `resolve_target_layer_ids`), recorded by forward pre-hooks on those layers while
    the model's own capture is off. The captured list is what its forward returns beside the
    normed hidden states, as SGLang's capture is."""
    inner = model.model
    captured: list = []  # [T, H] per listed layer, in layer order, during one forward

    def record(module, args, kwargs):
        # Gemma3DecoderLayer(hidden_states=MLP branch of the layer before, residual=its residual).
        captured.append(kwargs["hidden_states"] + kwargs["residual"])

    forward = inner.forward

    def forward_capturing(*args, **kwargs):
        captured.clear()
        hidden = forward(*args, **kwargs)
        out = list(captured)
        captured.clear()
        return (hidden, out) if out else hidden

    hooks: list = []  # the pre-hooks of the last call: a new call replaces them, never adds

    def set_dflash_layers_to_capture(layer_ids: Sequence[int]) -> None:
        if layer_ids is None:
            raise ValueError("DFLASH requires explicit layer_ids for aux hidden capture")
        for hook in hooks:
            hook.remove()
        hooks.clear()
        for k in sorted(set(layer_ids)):  # SGLang's order: each layer once, in layer order
            hooks.append(inner.layers[k + 1].register_forward_pre_hook(record, with_kwargs=True))
        inner.layers_to_capture = []  # its own (wrong) capture off
        model.capture_aux_hidden_states = True
        inner.forward = forward_capturing

    return set_dflash_layers_to_capture

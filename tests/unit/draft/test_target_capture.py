"""The DFlash capture hook given to SGLang classes that lack it (draft/target_capture.py).

The oracle for what each route sets is SGLang's own hooks: Qwen3's `set_dflash_layers_to_capture`
sets `layers_to_capture = [k + 1 ...]`, and each class's EAGLE-3 hook, called by ours, must set the
same. That the captured tensors are transformers' `hidden_states[k + 1]` is checked end to end on
tiny weights in tests/engine/test_captured_targets.py.
"""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch

from sglang_dflash.draft import target_capture
from sglang_dflash.draft.target_capture import capture_route, complete_capture, refusal


def _bare(cls):
    """An instance of SGLang's class `cls` without its __init__ (plain attributes only)."""
    model = object.__new__(cls)
    object.__setattr__(model, "__dict__", {})
    return model


@pytest.mark.sglang  # SGLang's own Qwen3-VL capture method is the oracle
def test_qwen3_vl_captures_through_its_inner_model():
    """SGLang 0.5.23's Qwen3VLForConditionalGeneration.set_dflash_layers_to_capture calls its inner
    model's method, which `Qwen3LLMModel` lacks: it raises AttributeError as shipped, and after
    `complete_capture` sets what SGLang intends (the ids + 1: "after layer k")."""
    from sglang.srt.models.qwen3_vl import Qwen3VLForConditionalGeneration

    class Inner:  # Qwen3LLMModel's part that matters: a layers_to_capture list, no method
        layers_to_capture: list = []

    class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):  # a subclass, as SGLang's
        pass

    def target():
        model = _bare(Qwen3VLMoeForConditionalGeneration)
        model.__dict__.update(model=Inner(), pp_group=types.SimpleNamespace(is_last_rank=True))
        return model

    method = Qwen3VLForConditionalGeneration.set_dflash_layers_to_capture
    with pytest.raises(AttributeError, match="set_dflash_layers_to_capture"):
        method(target(), [1, 3])  # as SGLang ships it
    model = target()
    assert complete_capture(model) == "inner"
    method(model, [1, 3])
    assert model.model.layers_to_capture == [2, 4] and model.capture_aux_hidden_states
    assert complete_capture(model) is None  # the inner model has it now: nothing to do


# The SGLang module of each class the hook is given to.
MODULES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "Gemma3ForCausalLM": "gemma3_causal",
}


def _eagle3_target(name: str):
    """SGLang's class `name`, bare, with what its EAGLE-3 hook touches."""
    import importlib

    module = MODULES[name]
    cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), name)
    model = _bare(cls)
    inner = types.SimpleNamespace(layers_to_capture=[], layers=[types.SimpleNamespace() for _ in range(6)])
    if name == "Qwen2MoeForCausalLM":  # its inner model's own hook: the list, and a flag per layer
        inner.set_eagle3_layers_to_capture = lambda ids: (
            setattr(inner, "layers_to_capture", ids),
            [setattr(inner.layers[i], "_is_layer_to_capture", True) for i in ids],
        )
    model.__dict__.update(model=inner, pp_group=types.SimpleNamespace(is_last_rank=True), config=None)
    return model, module


@pytest.mark.sglang  # SGLang's own EAGLE-3 hooks
@pytest.mark.parametrize("name", sorted(target_capture.THROUGH_EAGLE3))
def test_the_eagle3_route_sets_what_qwen3s_dflash_hook_sets(name):
    model, module = _eagle3_target(name)
    assert not hasattr(type(model), "set_dflash_layers_to_capture")  # what SGLang 0.5.23 lacks
    parallel = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True))
    with mock.patch(f"sglang.srt.models.{module}.get_parallel", lambda: parallel, create=True):
        assert complete_capture(model) == "eagle3"
        model.set_dflash_layers_to_capture([0, 2, 4])
        with pytest.raises(ValueError, match="explicit layer_ids"):  # never EAGLE-3's default layers
            model.set_dflash_layers_to_capture(None)
    assert model.model.layers_to_capture == [1, 3, 5] and model.capture_aux_hidden_states


def test_gemma3s_hook_records_the_residual_stream_entering_each_listed_layer():
    """Gemma-3's layers are handed (MLP branch, residual) unsummed; the hook records their sum
    entering layer k + 1, in layer order, and turns the model's own capture (the branch) off."""

    class Layer(torch.nn.Module):  # Gemma3DecoderLayer's calling convention, a toy update
        def forward(self, *, hidden_states, residual):
            total = hidden_states if residual is None else hidden_states + residual
            return torch.tanh(total), total

    class Model(torch.nn.Module):  # Gemma3TextModel's loop, its own capture as SGLang's records it
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(4))
            self.layers_to_capture = []

        def forward(self, hidden):
            residual, own = None, []
            for i, layer in enumerate(self.layers):
                if i in self.layers_to_capture:
                    own.append(hidden)
                hidden, residual = layer(hidden_states=hidden, residual=residual)
            normed = hidden + residual
            return (normed, own) if own else normed

    Gemma3ForCausalLM = type("Gemma3ForCausalLM", (), {})
    target = Gemma3ForCausalLM()
    target.model = Model()
    x = torch.randn(3, 8)
    streams, h, r = [], x, None  # the residual stream after each layer, by hand
    for layer in target.model.layers:
        h, r = layer(hidden_states=h, residual=r)
        streams.append(h + r)

    assert complete_capture(target) == "residual_stream"
    target.set_dflash_layers_to_capture([2, 0, 2])
    normed, captured = target.model(x)
    assert target.model.layers_to_capture == [] and target.capture_aux_hidden_states
    assert len(captured) == 2
    torch.testing.assert_close(captured[0], streams[0])  # id 0: the output of layer 0
    torch.testing.assert_close(captured[1], streams[2])
    torch.testing.assert_close(normed, streams[3])
    _, again = target.model(x)  # a second forward records afresh
    assert len(again) == 2
    # Completed twice and set again (another runner over the same model): still once per layer.
    assert complete_capture(target) is None
    target.set_dflash_layers_to_capture([1])
    normed, captured = target.model(x)
    assert len(captured) == 1
    torch.testing.assert_close(captured[0], streams[1])
    torch.testing.assert_close(normed, streams[3])


def test_classes_without_a_checked_capture_are_refused_by_name():
    Apertus = type("ApertusForCausalLM", (), {"set_eagle3_layers_to_capture": lambda self, ids: None})
    assert "its EAGLE-3/DSpark capture is not one sglang-dflash has checked" in refusal(Apertus, False)
    DeepseekV4 = type("DeepseekV4ForCausalLM", (), {"set_dspark_layers_to_capture": lambda self, ids: None})
    assert "four hyper-connection residual streams" in refusal(DeepseekV4, False)
    Plain = type("Plain", (), {})
    assert refusal(Plain, False).endswith("Plain has no set_dflash_layers_to_capture")
    Qwen3 = type("Qwen3ForCausalLM", (), {"set_dflash_layers_to_capture": lambda self, ids: None})
    assert refusal(Qwen3, True) is None and capture_route(Qwen3) == "own"
    # Served classes, but not where their layer loop skips the capture.
    for name in sorted(target_capture.THROUGH_EAGLE3 | target_capture.RESIDUAL_STREAM):
        cls = type(name, (), {})
        assert refusal(cls, False) is None
        assert (refusal(cls, True) is not None) == (name in target_capture.TBO_SKIPS_CAPTURE)
    # Not by inheritance: a subclass may run another layer loop.
    assert capture_route(type("Child", (type("Qwen2ForCausalLM", (), {}),), {})) is None


@pytest.mark.sglang  # reads SGLang's model sources
def test_the_tbo_classes_are_those_whose_loop_skips_the_capture():
    import importlib.util
    import pathlib

    assert set(MODULES) == target_capture.THROUGH_EAGLE3 | target_capture.RESIDUAL_STREAM
    for name, module in MODULES.items():
        source = pathlib.Path(importlib.util.find_spec(f"sglang.srt.models.{module}").origin).read_text()
        assert ("can_run_tbo" in source) == (name in target_capture.TBO_SKIPS_CAPTURE), name

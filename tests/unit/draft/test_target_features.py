"""Drafts whose `target_layer_ids` repeat a layer or are not increasing (draft/target_features.py).

SGLang captures each listed layer once, in layer order. The oracle for the engine test is an
equivalent draft: fc([h2, h1, h2]) with fc.weight [A | B | C] equals fc([h1, h2]) with
[B | A + C], so a draft listing [2, 1, 2] must propose exactly what the folded draft listing
[1, 2] proposes. Without the gather, the [2, 1, 2] draft dies at its first prefill (fc reads
3 chunks from 2), and a reordered one proposes from the wrong layers.
"""

import pathlib
import re

import pytest
import torch

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.draft.target_features import (
    CAPTURES_AFTER_LAST_LAYER,
    FeatureLayout,
    captured_chunk_of,
    captures_after_last_layer,
    target_depth,
)
from tests.support.tiny import draft_config_dict

H = 4


def _captured(layer_ids, hidden):
    """What SGLang hands over: each distinct layer once, in layer order. hidden: {id: [T, H]}."""
    return torch.cat([hidden[i] for i in sorted(set(layer_ids))], dim=-1)


@pytest.mark.parametrize(
    "layer_ids",
    [[1, 9, 17], [1, 1], [9, 1, 9], [3, 2, 1], [5]],
    ids=["increasing", "z-lab-2-on-4", "mixed", "reversed", "one"],
)
def test_the_gather_gives_fc_its_layers_in_listed_order(layer_ids):
    hidden = {i: torch.randn(3, H) for i in set(layer_ids)}
    expected = torch.cat([hidden[i] for i in layer_ids], dim=-1)  # [T, K*H], what fc reads
    layout = FeatureLayout(layer_ids, H, "cpu")
    torch.testing.assert_close(layout.arrange(_captured(layer_ids, hidden)), expected, rtol=0, atol=0)
    assert layout.is_identity == (layer_ids == sorted(set(layer_ids)))


def test_the_gather_reads_a_packed_buffer_with_unwritten_chunks():
    """SGLang's packed capture buffer may hold one chunk per listed id, only the distinct ones
    written (the rest is whatever the buffer held)."""
    layer_ids = [9, 1, 9]
    hidden = {1: torch.randn(2, H), 9: torch.randn(2, H)}
    packed = torch.cat([_captured(layer_ids, hidden), torch.full((2, H), float("nan"))], dim=-1)
    out = FeatureLayout(layer_ids, H, "cpu").arrange(packed)
    torch.testing.assert_close(out, torch.cat([hidden[9], hidden[1], hidden[9]], dim=-1))


def test_the_default_ids_of_a_two_layer_draft_on_a_four_layer_target_repeat_a_layer():
    config = DFlashDraftConfig.from_dict(draft_config_dict(num_layers=2, num_target_layers=4))
    assert config.resolve_target_layer_ids(4) == (1, 1)
    assert captured_chunk_of([1, 1]) == (0, 0)


def test_the_last_layer_is_served_where_sglangs_class_captures_after_it():
    """Id L-1 (after the last layer): served when the target's class (or an ancestor) captures
    past its layer loop, refused by name otherwise."""
    config = DFlashDraftConfig.from_dict(draft_config_dict(target_layer_ids=[0, 3]))

    class GptOssForCausalLM:  # named as SGLang's
        pass

    class Derived(GptOssForCausalLM):
        pass

    class LlamaForCausalLM:
        pass

    assert captures_after_last_layer(Derived()) == "GptOssForCausalLM"
    assert captures_after_last_layer(Derived) == "GptOssForCausalLM"  # the launching process's check
    assert captures_after_last_layer(LlamaForCausalLM()) is None
    # Served end to end on Gemma-4, gpt-oss and Laguna targets: test_target_classes.py.
    assert config.check_target(
        hidden_size=64, vocab_size=384, num_layers=4, after_last_layer=captures_after_last_layer(Derived())
    ) == (0, 3)
    with pytest.raises(CheckpointError, match=r"out of range \[0, 2\] .*whose SGLang class captures past"):
        config.check_target(hidden_size=64, vocab_size=384, num_layers=4, after_last_layer=None)
    with pytest.raises(CheckpointError, match=r"has 4 at index 1, out of range \[0, 3\] for a target with 4"):
        DFlashDraftConfig.from_dict(draft_config_dict(target_layer_ids=[0, 4])).check_target(
            hidden_size=64, vocab_size=384, num_layers=4, after_last_layer="GptOssForCausalLM"
        )


def test_a_loop_models_layer_ids_count_its_unrolled_steps():
    """Nanbeige runs its layers num_loops times and SGLang counts the draft's ids over the
    unrolled steps (its spec_aux_hidden_state.py); every other target, over its layers. Served
    end to end on a Nanbeige loop target: test_target_classes.py."""
    from types import SimpleNamespace

    assert target_depth(SimpleNamespace(num_hidden_layers=22, num_loops=2)) == 44
    assert target_depth(SimpleNamespace(num_hidden_layers=22)) == 22
    config = DFlashDraftConfig.from_dict(draft_config_dict(num_layers=1))
    # SGLang's default ids for a one-layer draft: the middle of the unrolled depth.
    assert config.check_target(
        hidden_size=64,
        vocab_size=384,
        num_layers=target_depth(SimpleNamespace(num_hidden_layers=4, num_loops=2)),
    ) == (4,)


# class -> (the SGLang module defining it, the module whose model captures past its layer loop)
CAPTURING = {
    "MiMoV2ForCausalLM": ("mimo_v2", "mimo_v2"),
    "GptOssForCausalLM": ("gpt_oss", "gpt_oss"),
    "LagunaForCausalLM": ("laguna", "laguna"),
    "Lfm2ForCausalLM": ("lfm2", "lfm2"),
    "Lfm2MoeForCausalLM": ("lfm2_moe", "lfm2_moe"),
    "Lfm2VlForConditionalGeneration": ("lfm2_vl", "lfm2"),
    "Gemma4ForCausalLM": ("gemma4_causal", "gemma4_causal"),
    "Gemma4ForConditionalGeneration": ("gemma4_mm", "gemma4_causal"),
    "NemotronHForCausalLM": ("nemotron_h", "nemotron_h"),
    "NemotronH_Nano_VL_V2": ("nano_nemotron_vl", "nemotron_h"),
    "MiniMaxM3SparseForConditionalGeneration": ("minimax_m3_vl", "minimax_m3"),
}
# Classes that capture only inside their layer loop (a sample of the common targets).
NOT_CAPTURING = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
AFTER_THE_LOOP = re.compile(
    r"(num_hidden_layers|num_layers|end_layer|len\(self\.layers\)) in self\.layers_to_capture"
)


def _sglang_model_source(module: str) -> str:
    import importlib.util

    return pathlib.Path(importlib.util.find_spec(f"sglang.srt.models.{module}").origin).read_text()


@pytest.mark.sglang  # reads SGLang's model sources
def test_the_classes_named_are_sglangs_that_capture_after_the_last_layer():
    assert set(CAPTURING) == CAPTURES_AFTER_LAST_LAYER
    for name, (defining, capturing) in CAPTURING.items():
        source = _sglang_model_source(defining)
        assert re.search(rf"^class {name}\(", source, re.M), name
        assert "def set_dflash_layers_to_capture" in source, name
        assert AFTER_THE_LOOP.search(_sglang_model_source(capturing)), name
    for name, module in NOT_CAPTURING.items():
        source = _sglang_model_source(module)
        assert re.search(rf"^class {name}\(", source, re.M) and not AFTER_THE_LOOP.search(source), name

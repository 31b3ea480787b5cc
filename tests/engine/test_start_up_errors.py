"""A draft that does not fit its target, a missing field, a bad weight: each refused at launch, naming
the field and its value."""

import os
from unittest import mock

import pytest
import torch

from sglang_dflash.checkpoint.config import CheckpointError
from sglang_dflash.knobs import KnobError
from tests.support import engines


def _expect_startup_error(
    target, draft, message, num_draft_tokens=None, error_type=CheckpointError, **kwargs
):
    with pytest.raises(error_type) as error:
        engine = engines.start(target, draft, num_draft_tokens, **kwargs)
        engines.shutdown(engine)  # only reached if the bad input was accepted
    assert message in str(error.value), str(error.value)


@pytest.mark.sglang
def test_missing_draft_path(tiny):
    _expect_startup_error(tiny.target("a"), "/nonexistent/draft", "'/nonexistent/draft' is not a directory")


@pytest.mark.sglang
def test_missing_config_field(tiny):
    draft = tiny.edited_draft("a", "no-heads", lambda d: d.pop("num_attention_heads"))
    _expect_startup_error(tiny.target("a"), draft, "missing the field 'num_attention_heads'")


@pytest.mark.sglang
def test_hidden_size_mismatch(tiny):
    draft = tiny.edited_draft("a", "hidden", lambda d: d.update(hidden_size=32))
    _expect_startup_error(
        tiny.target("a"), draft, "field 'hidden_size' is 32 but the target's hidden_size is 64"
    )


@pytest.mark.sglang
def test_mask_token_beyond_vocab(tiny):
    draft = tiny.edited_draft("a", "mask", lambda d: d["dflash_config"].update(mask_token_id=384))
    _expect_startup_error(
        tiny.target("a"), draft, "'mask_token_id' is 384, at or beyond the target's vocab_size 384"
    )


@pytest.mark.sglang
def test_target_layer_ids_out_of_range(tiny):
    draft = tiny.edited_draft("a", "ids", lambda d: d["dflash_config"].update(target_layer_ids=[7]))
    _expect_startup_error(
        tiny.target("a"),
        draft,
        "'target_layer_ids' has 7 at index 0, out of range [0, 2] for a target with 4 layers",
    )


OTHER_TARGET = (
    "the draft was made for another target (set SGLANG_DFLASH_ALLOW_OTHER_TARGET=1 to serve it anyway)"
)


@pytest.mark.sglang
def test_a_draft_for_a_target_of_another_depth_is_refused(tiny):
    """SGLang's built-in serves it with a warning; the draft would read features it was not trained on."""
    draft = tiny.edited_draft("a", "depth60", lambda d: d.update(num_target_layers=60))
    message = f"draft config field 'num_target_layers' is 60 but the target has 4 layers: {OTHER_TARGET}"
    _expect_startup_error(tiny.target("a"), draft, message)


@pytest.mark.sglang
def test_a_plain_draft_for_another_vocabulary_is_refused(tiny):
    """Draft "a" proposes through the target's embedding and LM head: another vocab_size is another target."""
    draft = tiny.edited_draft("a", "vocab151936", lambda d: d.update(vocab_size=151936))
    message = f"draft config field 'vocab_size' is 151936 but the target's vocab_size is 384: {OTHER_TARGET}"
    _expect_startup_error(tiny.target("a"), draft, message)


@pytest.mark.sglang
def test_the_knob_serves_a_draft_for_another_target(tiny):
    """With SGLANG_DFLASH_ALLOW_OTHER_TARGET=1 the launch goes past that check (only warning), to the
    next: here a misshapen weight (the edited heads), so that no engine has to start."""

    def edit(d):
        d.update(num_target_layers=60, vocab_size=151936, num_attention_heads=8, num_key_value_heads=4)

    draft = tiny.edited_draft("a", "other-target-bad-q", edit)
    with mock.patch.dict(os.environ, {"SGLANG_DFLASH_ALLOW_OTHER_TARGET": "1"}):
        _expect_startup_error(tiny.target("a"), draft, "'layers.0.self_attn.q_proj.weight' has shape")


@pytest.mark.sglang
def test_draft_window_below_the_block_size(tiny):
    _expect_startup_error(
        tiny.target("a"),
        tiny.draft("a"),
        "--speculative-draft-window-size 12 is below the DFLASH draft's block size 16",
        error_type=ValueError,
        speculative_draft_window_size=12,
    )


@pytest.mark.sglang
def test_draft_sink_is_refused(tiny):
    _expect_startup_error(
        tiny.target("a"),
        tiny.draft("a"),
        "--speculative-draft-sink-size is not supported with DFLASH",
        error_type=ValueError,
        speculative_draft_window_size=32,
        speculative_draft_sink_size=4,
    )


@pytest.mark.sglang
def test_num_draft_tokens_above_block_size(tiny):
    _expect_startup_error(
        tiny.target("a"),
        tiny.draft("a"),
        "--speculative-num-draft-tokens 17 must be between 2 and the draft checkpoint's block_size 16",
        num_draft_tokens=17,
    )


@pytest.mark.sglang
def test_a_bad_knob_is_refused_at_launch_on_cpu(tiny):
    """A CUDA-only knob's bad value fails the launch on CPU too, in the launching process, naming
    the variable, the value and what it takes (the schedulers would inherit the environment)."""
    with mock.patch.dict(os.environ, {"SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN": "banana"}):
        _expect_startup_error(
            tiny.target("a"),
            tiny.draft("a"),
            "SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN='banana' is not a non-negative integer",
            error_type=KnobError,
        )


@pytest.mark.sglang
def test_target_without_hidden_state_capture(tiny, tmp_path):
    """Apertus has an EAGLE-3 capture that sglang-dflash has not checked against DFlash's: refused,
    as SGLang refuses it, naming the class."""
    import json
    import shutil

    target = str(tmp_path / "apertus-target")
    shutil.copytree(tiny.target("a"), target)
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=["ApertusForCausalLM"])
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    _expect_startup_error(target, tiny.draft("a"), "target architecture 'ApertusForCausalLM' cannot capture")


@pytest.mark.sglang
def test_grammar_backend_not_installed(tiny, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llguidance" else find_spec(name, *a)
    )
    _expect_startup_error(
        tiny.target("a"),
        tiny.draft("a"),
        "--grammar-backend llguidance: the 'llguidance' package is not installed",
        error_type=ValueError,
        grammar_backend="llguidance",
    )


@pytest.mark.sglang
def test_outlines_under_a_reasoning_parser(tiny):
    _expect_startup_error(
        tiny.target("a"),
        tiny.draft("a"),
        "--grammar-backend outlines with --reasoning-parser qwen3 is not supported with DFLASH",
        error_type=ValueError,
        grammar_backend="outlines",
        reasoning_parser="qwen3",
    )


def _draft_with_weights(tiny, tmp_path, name: str, edit) -> str:
    """A copy of draft "a" whose tensors dict is passed through `edit(dict)`."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = str(tmp_path / name)
    shutil.copytree(tiny.draft("a"), path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return path


@pytest.mark.sglang
@pytest.mark.parametrize(
    "name, edit, message",
    [
        ("no-fc", lambda t: t.pop("fc.weight"), "missing the weight 'fc.weight' (expected shape (64, 64))"),
        (
            "short-q",
            lambda t: t.update({"layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)}),
            "'layers.0.self_attn.q_proj.weight' has shape (32, 64), expected (64, 64)",
        ),
        (
            "narrow-fc",
            lambda t: t.update({"fc.weight": torch.zeros(64, 128)}),
            "'fc.weight' has shape (64, 128): its input width 128 is not 1 target layer(s) "
            "(target_layer_ids) x the target's hidden_size 64 = 64; the draft was made for another "
            "target or other target_layer_ids",
        ),
        (
            "conv",
            lambda t: t.update({"layers.0.mlp_conv.base_kernel": torch.zeros(2, 3, 64)}),
            "draft checkpoint tensor 'layers.0.mlp_conv.base_kernel' belongs to grouped dynamic "
            "convolution, which its config does not declare (dflash_config.conv_kernel_size and "
            "conv_group_size); serve it with SGLang's built-in DFLASH (SGLANG_DFLASH_IMPL=builtin)",
        ),
    ],
    ids=["missing", "misshapen", "fc-for-another-target", "another-family"],
)
def test_bad_weights_fail_in_the_launching_process(tiny, tmp_path, name, edit, message):
    """One line naming the tensor (and both shapes, or the family it belongs to), before any
    scheduler process starts."""
    _expect_startup_error(tiny.target("a"), _draft_with_weights(tiny, tmp_path, name, edit), message)


@pytest.mark.sglang
def test_two_batch_overlap_is_refused_where_it_drops_the_capture(tiny, tmp_path):
    """Qwen2-MoE's layer loop skips the hidden-state capture on two-batch-overlap batches
    (`draft/target_capture.TBO_SKIPS_CAPTURE`): refused at launch, naming the class and the flag."""
    from tests.support.tiny import make_family_target

    target = make_family_target(str(tmp_path / "qwen2-moe"), family="qwen2_moe")
    _expect_startup_error(
        target,
        tiny.draft("a"),
        "'Qwen2MoeForCausalLM' with --enable-two-batch-overlap: Qwen2MoeForCausalLM's layer loop skips",
        enable_two_batch_overlap=True,
    )

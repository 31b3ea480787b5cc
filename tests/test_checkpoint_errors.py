"""Bad checkpoints, bad pairings and unusable grammar-backend settings fail at start-up with an
error naming the field and value.

The engine-level cases go through `sglang.Engine(...)`: our argument resolution runs in the
launching process, so they raise before any subprocess starts (no engine is left running).
"""

import os
import re

import pytest
import torch

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig, build_target_layer_ids
from tests import engines
from tests.tiny_models import draft_config_dict


def test_reference_default_layer_ids():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(28, 1) == [14]
    assert build_target_layer_ids(4, 2) == [1, 1]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.pop("block_size"), "missing the field 'block_size'"),  # without a default
        (lambda d: d.update(architectures=["Qwen3ForCausalLM"]), "'architectures' must contain"),
        (lambda d: d.update(block_size="16"), "'block_size' must be an integer >= 2, got '16'"),
        (lambda d: d.update(num_hidden_layers=0), "'num_hidden_layers' must be an integer >= 1, got 0"),
        (lambda d: d.update(layer_types=["full_attention"] * 3), "'layer_types' must list"),
        (lambda d: d.update(hidden_act="gelu"), "'hidden_act' must be 'silu' or 'swigluoai', got 'gelu'"),
        (lambda d: d["dflash_config"].update(target_layer_ids=[]), "'target_layer_ids' must be a non-empty"),
        (lambda d: d.update(num_key_value_heads=3), "must be a multiple of 'num_key_value_heads' (3)"),
    ],
)
def test_invalid_config_fields(edit, message):
    raw = draft_config_dict()
    edit(raw)
    with pytest.raises(CheckpointError) as error:
        DFlashDraftConfig.from_dict(raw)
    assert message in str(error.value)


def test_a_missing_block_size_takes_the_default():
    """SGLang's built-in drafts blocks of --speculative-num-draft-tokens, else 16."""
    raw = draft_config_dict()
    raw.pop("block_size")
    config = DFlashDraftConfig.from_dict(raw, default_block_size=16)
    assert (config.block_size, config.declares_block_size) == (16, False)
    raw["dflash_config"]["block_size"] = 8
    config = DFlashDraftConfig.from_dict(raw, default_block_size=16)
    assert (config.block_size, config.declares_block_size) == (8, True)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny targets' tokenizer: 384 tokens, mask_token "<|MASK|>" with id MASK_ID."""
    import transformers

    from tests.tiny_models import make_tokenizer

    path = str(tmp_path_factory.mktemp("tokenizer"))
    make_tokenizer(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def _mask_config(**dflash) -> DFlashDraftConfig:
    raw = draft_config_dict()
    raw["dflash_config"] = {k: v for k, v in dflash.items() if v is not None}
    return DFlashDraftConfig.from_dict(raw)


def test_the_mask_token_id_is_resolved_from_the_tokenizer_as_sglang_does(tokenizer):
    """SGLang's built-in (speculative/dflash_worker_v2.py, _resolve_mask_token_id)."""
    from sglang_dflash.checkpoint.mask_token import resolve_mask_token_id

    vocab = tokenizer.get_vocab()
    # No mask_token_id, no mask_token: the default "<|MASK|>" is the tokenizer's mask token.
    assert resolve_mask_token_id(_mask_config(), tokenizer, 384).mask_token_id == tokenizer.mask_token_id
    # A token in the vocabulary.
    word = next(t for t, i in vocab.items() if i == 57)
    assert resolve_mask_token_id(_mask_config(mask_token=word), tokenizer, 384).mask_token_id == 57
    # A given id that contradicts the tokenizer's id for the mask token.
    contradiction = re.escape("the target's tokenizer gives its mask_token '<|MASK|>' the id 1")
    with pytest.raises(CheckpointError, match=contradiction):
        resolve_mask_token_id(_mask_config(mask_token_id=7), tokenizer, 384)
    # Without a tokenizer, an id is needed.
    with pytest.raises(CheckpointError, match="needs the target's tokenizer"):
        resolve_mask_token_id(_mask_config(mask_token="<|new|>"), None, 384)
    # A new token is added to the tokenizer; its id must fit the target's embedding.
    with pytest.raises(CheckpointError, match=r"has the id 384, at or beyond the target's vocab_size 384"):
        resolve_mask_token_id(_mask_config(mask_token="<|new|>"), tokenizer, 384)
    assert resolve_mask_token_id(_mask_config(mask_token="<|new|>"), tokenizer, 512).mask_token_id == 384


def test_dflash_keys_fall_back_to_top_level():
    raw = draft_config_dict()
    raw["mask_token_id"] = raw.pop("dflash_config")["mask_token_id"]
    assert DFlashDraftConfig.from_dict(raw).mask_token_id == 1


def test_pairing_checks():
    config = DFlashDraftConfig.from_dict(draft_config_dict(target_layer_ids=[0, 3]))
    with pytest.raises(CheckpointError, match=r"'target_layer_ids' has 3 at index 1, out of range \[0, 2\]"):
        config.check_target(hidden_size=64, vocab_size=384, num_layers=4)
    assert config.check_target(hidden_size=64, vocab_size=384, num_layers=5) == (0, 3)
    with pytest.raises(CheckpointError, match="'mask_token_id' is 1, at or beyond the target's vocab_size 1"):
        config.check_target(hidden_size=64, vocab_size=1, num_layers=5)


# ---------------------------------------------------------------- through sglang.Engine


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
    _expect_startup_error(tiny.target("a"), draft, "'target_layer_ids' has 7 at index 0, out of range [0, 2]")


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
def test_target_without_hidden_state_capture(tiny, tmp_path):
    import json
    import shutil

    target = str(tmp_path / "qwen2-target")
    shutil.copytree(tiny.target("a"), target)
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    _expect_startup_error(target, tiny.draft("a"), "target architecture 'Qwen2ForCausalLM' cannot capture")


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
            "'fc.weight' has shape (64, 128), expected (64, 64): "
            "fc reads 1 captured target layer(s) of hidden_size 64",
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

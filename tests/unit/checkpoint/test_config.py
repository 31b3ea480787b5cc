"""Bad checkpoints, bad pairings and unusable grammar-backend settings fail at start-up with an
error naming the field and value.

The engine-level cases go through `sglang.Engine(...)`: our argument resolution runs in the
launching process, so they raise before any subprocess starts (no engine is left running).
"""

import re

import pytest

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig, build_target_layer_ids
from tests.support.tiny import draft_config_dict


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

    from tests.support.tiny import make_tokenizer

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

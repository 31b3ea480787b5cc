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


# ------------------------------------------------------------- a draft made for another target

OTHER_TARGET = (
    "the draft was made for another target (set SGLANG_DFLASH_ALLOW_OTHER_TARGET=1 to serve it anyway)"
)


def test_a_draft_for_a_target_of_another_depth_is_refused_naming_both():
    config = DFlashDraftConfig.from_dict(draft_config_dict(num_target_layers=60))
    with pytest.raises(CheckpointError) as error:
        config.check_made_for(num_layers=6, vocab_size=384)
    want = f"draft config field 'num_target_layers' is 60 but the target has 6 layers: {OTHER_TARGET}"
    assert str(error.value) == want
    # A loop model's depth is its unrolled steps (`target_depth`), named with its runs.
    with pytest.raises(
        CheckpointError, match=re.escape("is 4 but the target has 8 layers (4 layers run 2 times)")
    ):
        DFlashDraftConfig.from_dict(draft_config_dict()).check_made_for(num_layers=8, vocab_size=384, loops=2)
    assert config.check_made_for(num_layers=60, vocab_size=384) == []
    # The knob serves it, the finding returned for the warning.
    found = config.check_made_for(num_layers=6, vocab_size=384, allow_other_target=True)
    assert found == ["draft config field 'num_target_layers' is 60 but the target has 6 layers"]


def test_a_plain_draft_for_another_vocabulary_is_refused_naming_both():
    config = DFlashDraftConfig.from_dict(draft_config_dict(vocab_size=151936))
    with pytest.raises(CheckpointError) as error:
        config.check_made_for(num_layers=4, vocab_size=1500)
    want = f"draft config field 'vocab_size' is 151936 but the target's vocab_size is 1500: {OTHER_TARGET}"
    assert str(error.value) == want
    both = DFlashDraftConfig.from_dict(draft_config_dict(vocab_size=151936, num_target_layers=60))
    with pytest.raises(CheckpointError, match="'num_target_layers' is 60 .*; .*'vocab_size' is 151936"):
        both.check_made_for(num_layers=6, vocab_size=1500)
    # A difference within a config's padding of its rows may be one tokenizer's: served.
    assert config.check_made_for(num_layers=4, vocab_size=152064) == []
    mimo = DFlashDraftConfig.from_dict(draft_config_dict(vocab_size=152064))  # MiMo-V2.5-Pro's draft
    assert mimo.check_made_for(num_layers=4, vocab_size=152576) == []  # MiMo-V2-Flash's config
    # A file without vocab_size says nothing of its target (the 151936 read is Qwen3Config's default).
    raw = draft_config_dict()
    raw.pop("vocab_size")
    config = DFlashDraftConfig.from_dict(raw)
    assert (config.vocab_size, config.declares_vocab_size) == (151936, False)
    assert config.check_made_for(num_layers=4, vocab_size=1500) == []


@pytest.mark.parametrize(
    "family",
    [{"selector_rank": 2, "selector_top_k": 4}, {"own_embedding": True}, {"projector_type": "gru"}],
    ids=["selector-codebooks", "own-embedding", "domino"],
)
def test_drafts_whose_own_tensors_index_the_vocabulary_keep_their_own_rules(family):
    """A selector's codebooks and Nemotron-3.5's embedding may be padded past the target's
    vocabulary; Domino's projector must match it, refused by `check_target` in its own words."""
    import dataclasses

    config = dataclasses.replace(DFlashDraftConfig.from_dict(draft_config_dict(vocab_size=512)), **family)
    assert config.check_made_for(num_layers=4, vocab_size=384) == []


def test_an_fc_of_another_input_width_is_refused_naming_both_widths(tmp_path):
    """fc reads len(target_layer_ids) x hidden_size features: a checkpoint whose fc reads another
    number was made for another target, or for other layer ids."""
    from sglang_dflash.draft.model import DFlashDraftModel
    from tests.support.tiny import make_draft

    path = make_draft(str(tmp_path / "draft"), num_layers=2, target_layer_ids=[0, 1, 2])
    config = DFlashDraftConfig.from_pretrained(str(path))
    DFlashDraftModel.check_checkpoint(str(path), config, 3)
    with pytest.raises(CheckpointError) as error:
        DFlashDraftModel.check_checkpoint(str(path), config, 2)
    assert str(error.value) == (
        "draft weight 'fc.weight' has shape (64, 192): its input width 192 is not 2 target layer(s) "
        "(target_layer_ids) x the target's hidden_size 64 = 128; the draft was made for another target "
        "or other target_layer_ids"
    )


# ---------------------------------------------------------------- through sglang.Engine

"""Domino's projector (`propose/domino.py`, `propose/proposers.py`, `DominoProposer`).

* One decode step's proposals equal SGLang 0.5.23's own `domino_greedy_rollout`, run on CPU with
  the same weights and hidden states: the full vocabulary and a candidate pool, with and without
  `shift_label`. The projector changes the proposals (they are not the plain argmax), so
  ignoring any of its parts fails the comparison.
* Under a grammar, each slot's corrected logits rank the candidates: their argmax is the rollout.
* The config is read as SGLang's `parse_dflash_draft_config` reads it, and the checkpoint's four
  projector tensors load (a missing one is named).
The engine test (greedy lossless, acceptance above 1) is the "domino" shape of
test_target_shapes.py.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.propose.domino import PrefixGRU, embed_projector
from sglang_dflash.propose.proposers import DominoProposer, ProposalInputs, proposer_for
from tests.support.tiny import add_domino, draft_config_dict, make_draft

H, G, E, V, B, BS = 32, 16, 24, 200, 7, 4
PROJECTOR = (
    "prefix_gru.weight_ih_l0",
    "prefix_gru.weight_hh_l0",
    "embed_proj.0.weight",
    "embed_proj.2.weight",
)


def _projector(seed: int = 0):
    """Random Domino weights with corrections about as large as the base logits, the target's
    embedding and LM head, as ours and as SGLang's modules."""
    gen = torch.Generator().manual_seed(seed)
    gru = PrefixGRU(H, G)
    proj = embed_projector(H, G, E, V)
    for p in (*gru.parameters(), *proj.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    proj[2].weight.data.mul_(3.0)
    theirs = nn.GRU(H, G, num_layers=1, batch_first=True, bias=False)
    theirs.load_state_dict(gru.state_dict())
    embedding = nn.Embedding(V, H)
    embedding.weight.data.copy_(torch.randn(V, H, generator=gen))
    lm_head = torch.randn(V, H, generator=gen) / H**0.5
    window = torch.randn(BS, B, H, generator=gen)  # the draft's final hidden states, rows 0..B-1
    bonus = torch.randint(0, V, (BS,), generator=gen)
    return gru, proj, theirs, embedding, lm_head, window, bonus


def _proposer(gru, proj, embedding, lm_head, shift: bool, pool: int) -> DominoProposer:
    model = SimpleNamespace(prefix_gru=gru, embed_proj=proj, config=SimpleNamespace(shift_label=shift))
    head = SimpleNamespace(vocab_size=V, logits=lambda h: h @ lm_head.T, embed=embedding)
    return DominoProposer(model, head, pool)


def _sglang_rollout(theirs, proj, embedding, lm_head, block, bonus, shift: bool, pool: int):
    """SGLang 0.5.23's proposals over the draft's hidden states of the whole block [bs, B, H]."""
    from sglang.srt.speculative.domino_utils import domino_greedy_rollout

    return domino_greedy_rollout(
        draft_hidden=block,
        bonus_tokens=bonus,
        target_embedding=embedding,
        lm_head_weight=lm_head,
        prefix_gru=theirs,
        embed_proj=proj,
        vocab_size=V,
        shift_label=shift,
        candidate_pool_size=pool,
        in_cuda_graph=False,
    )


@pytest.mark.parametrize("shift", [False, True], ids=["rows-1-on", "shift-label"])
@pytest.mark.parametrize("pool", [0, 16, V], ids=["full-vocab", "pool-16", "pool-V"])
def test_rollout_equals_sglangs(shift, pool):
    gru, proj, theirs, embedding, lm_head, window, bonus = _projector()
    with torch.no_grad():
        want = _sglang_rollout(theirs, proj, embedding, lm_head, window, bonus, shift, pool)
        got = _proposer(gru, proj, embedding, lm_head, shift, pool)(window, ProposalInputs(bonus, None))
        z = window[:, :-1] if shift else window[:, 1:]
        plain = (z @ lm_head.T).argmax(-1)
    assert got.q is None and got.logits is None  # point masses
    assert torch.equal(got.tokens, want)
    assert torch.equal(got.tokens[:, 0], plain[:, 0])  # slot 1 is the head's argmax
    assert not torch.equal(got.tokens, plain)  # the correction changes later slots


def test_a_narrower_window_takes_the_blocks_pool():
    """An adaptive width verifies W < B: the window's proposals are the first W-1 of SGLang's
    rollout over the whole block, whose pool spans the block's slots (pool 4, W 4, B 7)."""
    gru, proj, theirs, embedding, lm_head, block, bonus = _projector(2)
    pool, width = 4, 4
    with torch.no_grad():
        want = _sglang_rollout(theirs, proj, embedding, lm_head, block, bonus, False, pool)[:, : width - 1]
        proposer = _proposer(gru, proj, embedding, lm_head, False, pool)
        got = proposer(block[:, :width], ProposalInputs(bonus, None, block_hidden=block))
        window_pool = proposer(block[:, :width], ProposalInputs(bonus, None))
    assert torch.equal(got.tokens, want)
    assert not torch.equal(window_pool.tokens, want)  # a pool over the window alone differs


@pytest.mark.parametrize("pool", [0, 16])
def test_a_grammar_ranks_by_each_slots_corrected_logits(pool):
    gru, proj, _, embedding, lm_head, window, bonus = _projector(1)
    proposer = _proposer(gru, proj, embedding, lm_head, False, pool)
    with torch.no_grad():
        plain = proposer(window, ProposalInputs(bonus, None))
        ranked = proposer(window, ProposalInputs(bonus, None, grammar_rows=[True] * BS))
    assert ranked.logits.shape == (BS, B - 1, V)
    assert torch.equal(ranked.logits.argmax(-1), ranked.tokens) and torch.equal(ranked.tokens, plain.tokens)
    if pool:  # slot 1 ranks the whole vocabulary, later slots their pool
        finite = torch.isfinite(ranked.logits).sum(-1)
        assert (finite[:, 0] == V).all() and (finite[:, 1:] == pool).all()
        assert torch.equal(ranked.fallback, window[:, 1:] @ lm_head.T)  # past the pool: the head's


def _sglang_reading(raw: dict):
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from transformers import PretrainedConfig

    return parse_dflash_draft_config(draft_hf_config=PretrainedConfig(**raw))


def _domino_raw(where: str, **fields) -> dict:
    raw = draft_config_dict()
    values = dict(projector_type="domino", shift_label=True, pure_draft_prefix_len=1)
    values.update(gru_hidden_dim=G, emb_dim=E)
    values.update(fields)
    (raw["dflash_config"] if where == "nested" else raw).update(values)
    return raw


@pytest.mark.sglang
@pytest.mark.parametrize("where", ["nested", "top"])
def test_the_config_reads_as_sglang_reads_it(where):
    raw = _domino_raw(where)
    ours, theirs = DFlashDraftConfig.from_dict(raw), _sglang_reading(raw)
    assert theirs.is_domino and ours.projector_type == "domino"
    assert (ours.shift_label, ours.gru_hidden_dim, ours.emb_dim) == (
        theirs.shift_label,
        theirs.gru_hidden_dim,
        theirs.emb_dim,
    )
    assert "Domino rollout" in " ".join(ours.options_in_use())
    assert not ours.options_in_use("forward")  # the fused draft forward still applies
    for bad in (dict(pure_draft_prefix_len=2), dict(shift_label="yes"), dict(gru_hidden_dim=None)):
        raw = _domino_raw(where, **bad)
        with pytest.raises(ValueError):
            _sglang_reading(raw)
        with pytest.raises(CheckpointError):
            DFlashDraftConfig.from_dict(raw)
    raw = _domino_raw("nested")
    raw["emb_dim"] = E + 1  # both places, disagreeing
    with pytest.raises(ValueError, match="emb_dim differs"):
        _sglang_reading(raw)
    with pytest.raises(CheckpointError, match="'emb_dim' differs"):
        DFlashDraftConfig.from_dict(raw)


def test_a_domino_checkpoint_loads_its_projector(tmp_path):
    from safetensors.torch import load_file, save_file

    from sglang_dflash.draft.model import DFlashDraftModel

    path = add_domino(make_draft(str(tmp_path / "draft")), shift_label=True)
    config = DFlashDraftConfig.from_pretrained(path).with_target_vocab(draft_config_dict()["vocab_size"])
    features = len(config.resolve_target_layer_ids(config.num_target_layers))
    DFlashDraftModel.check_checkpoint(path, config, features)
    model = DFlashDraftModel.from_pretrained(path, config, features)
    saved = load_file(f"{path}/model.safetensors")
    for name in PROJECTOR:
        assert torch.equal(model.get_parameter(name), saved[name])
    proposer = proposer_for(model, SimpleNamespace(vocab_size=config.vocab_size), domino_pool_size=16)
    assert isinstance(proposer, DominoProposer)
    assert "pool of 16" in proposer.name and "shift_label" in proposer.name
    with pytest.raises(CheckpointError, match="Domino's projector scores the target's vocabulary"):
        config.check_target(hidden_size=config.hidden_size, vocab_size=config.vocab_size + 1, num_layers=4)
    del saved["embed_proj.2.weight"]
    save_file(saved, f"{path}/model.safetensors")
    with pytest.raises(CheckpointError, match="missing the weight 'embed_proj.2.weight'"):
        DFlashDraftModel.check_checkpoint(path, config, features)

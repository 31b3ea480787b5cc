"""LiLiCorr's lattice correction head (`propose/lilicorr.py`, `propose/proposers.py`).

* The lattice and the walk (greedy and sampled, with q) equal SGLang 0.5.23's own
  `LiLiCorrHead.select_with_proposal`, run eagerly on CPU with the same weights: a head as wide
  as the draft and a narrower one (`token_proj`), the whole trained block and a narrower window,
  anchors known and unknown. Ignoring the anchor, or the candidates' log-probabilities, fails it.
* One decode step's proposals equal SGLang's pipeline (`propose_lilicorr_block`'s steps: the
  full-vocabulary log_softmax top-K of the target's head, the target's embedding of the
  candidates, the head) from the same draft hidden states.
* The candidates' log-probabilities are the full vocabulary's, also under tensor parallelism.
* The anchor store keeps each request's last committed context feature, and a row whose KV slot
  moved on reads as unknown.
* The config is read as SGLang's `_parse_lilicorr_config` reads it, and the checkpoint's head
  loads (missing or extra tensors named), whole on every tensor-parallel rank.
The engine test (greedy lossless, acceptance above 1, every anchor known, sampled requests) is
the "window16-lilicorr" shape of test_target_shapes.py.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.checkpoint.fields import parse_lilicorr
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.draft.target_head import TargetHead
from sglang_dflash.draft.tensor_parallel import TensorParallel
from sglang_dflash.propose.lilicorr import LastTokenStore, LiLiCorrHead
from sglang_dflash.propose.proposers import LiLiCorrProposer, ProposalInputs, proposer_for
from sglang_dflash.propose.selector import walk
from tests.support.sampling_info import greedy_and_sampled
from tests.support.thread_group import ThreadGroup
from tests.support.tiny import (
    LILICORR_FIELDS,
    add_lilicorr,
    draft_config_dict,
    lilicorr_weights,
    make_draft,
)

H, V, B, BS = 32, 60, 6, 5


def _fields(**changes) -> dict:
    return dict(LILICORR_FIELDS, **{f"lilicorr_{k}": v for k, v in changes.items()})


def _heads(width: int = 0, seed: int = 0):
    """Our head and SGLang's, with the same random weights (ours loaded from SGLang's state)."""
    from sglang.srt.models.lilicorr import LiLiCorrHead as SGLangHead
    from sglang.srt.speculative.lilicorr_utils import LiLiCorrConfig

    fields = _fields(hidden_size=width)
    ours = _our_head(width, seed)
    config = LiLiCorrConfig(**{f.removeprefix("lilicorr_"): v for f, v in fields.items()})
    theirs = SGLangHead(model_hidden_size=H, block_size=B, rms_norm_eps=1e-6, config=config)
    theirs.load_state_dict(ours.state_dict(), strict=True)  # the same names: the checkpoint's
    return ours, theirs


def _our_head(width: int = 0, seed: int = 0) -> LiLiCorrHead:
    fields = _fields(hidden_size=width)
    head = LiLiCorrHead(H, B, 1e-6, parse_lilicorr(fields, "LiLiCorrDraftModel", H)["lilicorr"])
    weights = lilicorr_weights(H, B, fields, seed=seed)
    head.load_state_dict({k.removeprefix("lilicorr."): v for k, v in weights.items()}, strict=True)
    return head


def _step_inputs(slots: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    k = LILICORR_FIELDS["lilicorr_candidate_topk"]
    logits = 3 * torch.randn(BS, slots, V, generator=gen)
    log_probs, candidates = logits.log_softmax(-1).topk(k, dim=-1)
    return SimpleNamespace(
        embeddings=torch.randn(BS, slots, k, H, generator=gen),
        candidates=candidates,
        log_probs=log_probs,
        hidden=torch.randn(BS, slots, H, generator=gen),
        anchor=torch.randn(BS, H, generator=gen),
        valid=torch.tensor([True, True, False, True, True]),
        uniforms=torch.rand(BS, slots, generator=gen),
        temperatures=torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0]),
        greedy=torch.tensor([True, False, False, True, False]),
    )


def _sglang_walk(theirs, x, slots: int):
    theirs.set_active_block_size(slots + 1)
    theirs.materialize_inference_buffers(torch.device("cpu"), torch.float32)
    with torch._dynamo.config.patch(disable=True), torch.no_grad():
        return theirs.select_with_proposal(
            token_embeddings=x.embeddings,
            candidate_tokens=x.candidates,
            candidate_log_probs=x.log_probs,
            pass_hidden=x.hidden,
            anchor_hidden=x.anchor,
            anchor_valid=x.valid,
            uniforms=x.uniforms,
            temperatures=x.temperatures,
            greedy_mask=x.greedy,
        )


def _our_walk(ours, x, **changes):
    inputs = dict(vars(x), **changes)
    with torch.no_grad():
        scores = ours.lattice(
            inputs["embeddings"], inputs["log_probs"], inputs["hidden"], inputs["anchor"], inputs["valid"]
        )
    return walk(x.candidates, scores, x.uniforms, x.temperatures, x.greedy)


@pytest.mark.sglang  # imports SGLang's model module
@pytest.mark.parametrize("width", [0, 24], ids=["draft-wide", "token-proj"])
@pytest.mark.parametrize("slots", [B - 1, 2], ids=["block", "narrower-window"])
def test_lattice_and_walk_equal_sglangs(width, slots):
    ours, theirs = _heads(width)
    x = _step_inputs(slots)
    want_tokens, want_q = _sglang_walk(theirs, x, slots)
    tokens, q = _our_walk(ours, x)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(q, want_q)
    assert not torch.equal(want_q.argmax(-1), torch.zeros_like(want_tokens))  # not just the top-1s
    # The controls: the anchor and the candidates' log-probabilities both change the walk.
    for changed in ({"valid": torch.zeros(BS, dtype=torch.bool)}, {"log_probs": x.log_probs.flip(-1)}):
        other, other_q = _our_walk(ours, x, **changed)
        assert not (torch.equal(other, want_tokens) and torch.allclose(other_q, want_q)), changed


def _target_head(lm_head: torch.Tensor, embedding: nn.Embedding, tp=TensorParallel()):
    """A `TargetHead` over a plain LM head weight [V, H] (this rank's rows under `tp`)."""
    head = TargetHead.__new__(TargetHead)
    rows = -(-V // tp.size)
    head.vocab_size, head.tp, head.quant_method = V, tp, None
    head.vocab_start, head.num_valid = tp.rank * rows, max(0, min(rows, V - tp.rank * rows))
    local = torch.zeros(rows, lm_head.shape[1])
    local[: head.num_valid] = lm_head[head.vocab_start : head.vocab_start + head.num_valid]
    head.weight, head.local_width = local, rows
    head.embedding = head.embed = embedding
    return head


@pytest.mark.parametrize("size", [1, 2, 3])
def test_candidates_are_the_full_vocabularys_log_probabilities(size):
    gen = torch.Generator().manual_seed(size)
    lm_head, hidden = torch.randn(V, H, generator=gen), torch.randn(4, 3, H, generator=gen)
    want_lp, want_ids = (hidden @ lm_head.T).log_softmax(-1).topk(4, dim=-1)
    embedding = nn.Embedding(V, H)
    results = ThreadGroup(size).run(lambda tp: _target_head(lm_head, embedding, tp).topk_log_probs(hidden, 4))
    for log_probs, ids in results:
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(log_probs, want_lp)


@pytest.mark.sglang
def test_a_decode_steps_proposals_equal_sglangs_pipeline():
    """Our proposer from the draft's hidden states against SGLang's steps in `propose_lilicorr_block`
    (its `lilicorr_candidates` needs SGLang's TP context, so the top-K is torch's here)."""
    ours, theirs = _heads(24)
    gen = torch.Generator().manual_seed(3)
    lm_head, embedding = torch.randn(V, H, generator=gen), nn.Embedding(V, H)
    block = torch.randn(BS, B, H, generator=gen)  # the draft's final hidden states
    anchors = LastTokenStore(8, H, torch.float32, "cpu")
    req_to_token = torch.arange(8 * 40).view(8, 40)
    req_pool_indices = torch.tensor([3, 0, 5, 1, 7])
    seq_lens = torch.tensor([10, 4, 22, 9, 31])
    context = torch.randn(BS, H, generator=gen)
    anchors.write(req_pool_indices, context, req_to_token[req_pool_indices, seq_lens - 1])
    anchors.write(req_pool_indices[2:3], context[2:3], torch.tensor([0]))  # request 2's moved on

    proposer = LiLiCorrProposer(ours, _target_head(lm_head, embedding))
    proposer.last_tokens = anchors
    positions = seq_lens[:, None] + torch.arange(B)
    inputs = ProposalInputs(torch.zeros(BS, dtype=torch.int64), positions)
    inputs.req_to_token, inputs.req_pool_indices = req_to_token, req_pool_indices
    with torch.no_grad():
        got = proposer(block, inputs)

    log_probs, candidates = (block[:, 1:] @ lm_head.T).log_softmax(-1).topk(4, dim=-1)
    x = SimpleNamespace(
        embeddings=embedding(candidates).detach(),
        candidates=candidates,
        log_probs=log_probs,
        hidden=block[:, 1:],
        anchor=context,
        valid=torch.tensor([True, True, False, True, True]),
        uniforms=torch.zeros(BS, B - 1),
        temperatures=torch.ones(BS),
        greedy=torch.ones(BS, dtype=torch.bool),
    )
    want, _ = _sglang_walk(theirs, x, B - 1)
    assert torch.equal(got.tokens, want) and got.q is None  # greedy requests: point masses
    assert anchors.describe() == "4 of 5 draft steps' requests had their last token's feature"


def test_the_last_token_store_knows_each_requests_last_token():
    store = LastTokenStore(4, 3, torch.float32, "cpu")
    store.write(torch.tensor([2, 0]), torch.tensor([[1.0, 2, 3], [4, 5, 6]]), torch.tensor([17, 9]))
    features, valid = store.read(torch.tensor([0, 2, 1]), torch.tensor([9, 18, 0]))
    assert valid.tolist() == [True, False, False]  # request 2's last token is at slot 18 now
    assert features[0].tolist() == [4, 5, 6]
    store.write(torch.tensor([2]), torch.tensor([[7.0, 8, 9]]), torch.tensor([18]))
    features, valid = store.read(torch.tensor([2]), torch.tensor([18]))
    assert valid.tolist() == [True] and features[0].tolist() == [7, 8, 9]


# ----------------------------------------------------------------------- the checkpoint


def _config(**dflash) -> dict:
    raw = draft_config_dict(hidden_size=H, block_size=B)
    raw["architectures"] = ["LiLiCorrDraftModel"]
    raw["dflash_config"].update(_fields(), **dflash)
    return raw


def test_the_config_is_read_as_sglang_reads_it():
    config = DFlashDraftConfig.from_dict(_config(lilicorr_hidden_size=24))
    assert config.lilicorr.candidate_topk == 4 and config.lilicorr.width(H) == 24
    assert "LiLiCorr head (top 4, 1 layer(s) of width 24)" in config.options_in_use()
    assert DFlashDraftConfig.from_dict(_config(lilicorr_enabled=True)).lilicorr is not None


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r["dflash_config"].pop("lilicorr_logit_scale"), "missing the field 'dflash_config.lilicorr_logit_scale'"),  # noqa: E501
        (lambda r: r["dflash_config"].update(lilicorr_candidate_topk=6), "must be a power of two up to 16"),
        (lambda r: r["dflash_config"].update(lilicorr_candidate_topk=32), "must be a power of two up to 16"),
        (lambda r: r["dflash_config"].update(lilicorr_enabled=False), "a LiLiCorr draft without its head"),
        (lambda r: r["dflash_config"].update(lilicorr_num_heads=3), "must divide the head's width (32)"),
        (lambda r: r.update(lilicorr_num_layers=1), "'lilicorr_num_layers' = 1 declares LiLiCorr (lattice correction head) at the top level"),  # noqa: E501
        (lambda r: r["dflash_config"].update(lilicorr_dropout=0.1), "'dflash_config.lilicorr_dropout' (0.1) is unknown"),  # noqa: E501
        (lambda r: r.update(architectures=["DFlashDraftModel"]), "'dflash_config.lilicorr_candidate_topk' = 4 declares LiLiCorr"),  # noqa: E501
        (lambda r: r["dflash_config"].update(projector_type="domino", shift_label=False, pure_draft_prefix_len=1, gru_hidden_dim=4, emb_dim=4), "and Domino's projector"),  # noqa: E501
    ],
    ids=["missing", "not-power-of-two", "too-wide", "disabled", "heads", "top-level", "unknown", "plain-class", "with-domino"],  # noqa: E501
)  # fmt: skip
def test_configs_sglang_refuses_or_ignores_are_refused(edit, message):
    raw = _config()
    edit(raw)
    with pytest.raises(CheckpointError) as e:
        DFlashDraftConfig.from_dict(raw)
    assert message in str(e.value)


def _lilicorr_draft(tmp_path, **fields) -> str:
    path = make_draft(str(tmp_path / "draft"), hidden_size=H, block_size=B, vocab_size=V)
    return add_lilicorr(path, **fields)


def _edit_weights(path: str, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_the_head_loads_and_a_wrong_head_is_named(tmp_path):
    path = _lilicorr_draft(tmp_path, hidden_size=24)
    config = DFlashDraftConfig.from_pretrained(path)
    model = DFlashDraftModel.from_pretrained(path, config, 1)
    assert model.lilicorr.token_proj.weight.shape == (24, H)
    assert isinstance(proposer_for(model, head=None), LiLiCorrProposer)
    DFlashDraftModel.check_checkpoint(path, config, 1)

    _edit_weights(path, lambda t: t.pop("lilicorr.layers.0.mlp.up_proj.bias"))
    with pytest.raises(CheckpointError, match="missing the weight 'lilicorr.layers.0.mlp.up_proj.bias'"):
        DFlashDraftModel.check_checkpoint(path, config, 1)
    _edit_weights(path, lambda t: t.update({"lilicorr.layers.0.mlp.up_proj.bias": torch.zeros(48)}))
    _edit_weights(path, lambda t: t.update({"lilicorr.layers.1.attn_norm.weight": torch.ones(24)}))
    with pytest.raises(
        CheckpointError, match="'lilicorr.layers.1.attn_norm.weight' is not a weight of the LiLiCorr"
    ):
        DFlashDraftModel.check_checkpoint(path, config, 1)


def test_every_tensor_parallel_rank_holds_the_whole_head(tmp_path):
    path = _lilicorr_draft(tmp_path)
    config = DFlashDraftConfig.from_pretrained(path)
    whole = DFlashDraftModel.from_pretrained(path, config, 1)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LiLiCorrDraftModel"]
    for rank in range(2):
        tp = TensorParallel(rank=rank, size=2)
        shard = DFlashDraftModel.from_pretrained(path, config, 1, tp=tp)
        for name, p in whole.lilicorr.named_parameters():
            assert torch.equal(p, shard.lilicorr.get_parameter(name)), name
        assert shard.layers[0].mlp.up_proj.weight.shape[0] == whole.layers[0].mlp.up_proj.weight.shape[0] // 2


def test_sampled_requests_walk_by_sampling_and_hand_their_q_on():
    ours = _our_head(24)
    gen = torch.Generator().manual_seed(4)
    lm_head, embedding = torch.randn(V, H, generator=gen), nn.Embedding(V, H)
    block = torch.randn(2, B, H, generator=gen)
    positions = torch.arange(B).repeat(2, 1) + 5
    info = greedy_and_sampled()  # request 0 greedy, request 1 sampled
    head = _target_head(lm_head, embedding)
    with torch.no_grad():
        greedy = LiLiCorrProposer(ours, head)(block, ProposalInputs(positions[:, 0], positions))
        sampled = LiLiCorrProposer(ours, head)(block, ProposalInputs(positions[:, 0], positions, info))
        off = LiLiCorrProposer(ours, head, sampled_walks=False)
        unsampled = off(block, ProposalInputs(positions[:, 0], positions, info))
    assert greedy.q is None and unsampled.q is None and torch.equal(unsampled.tokens, greedy.tokens)
    assert torch.equal(sampled.tokens[0], greedy.tokens[0])  # the greedy request
    _, candidates = (block[:, 1:] @ lm_head.T).topk(4, dim=-1)
    assert torch.equal(sampled.q.ids, candidates)
    torch.testing.assert_close(sampled.q.probs.sum(-1), torch.ones(2, B - 1))
    assert torch.equal(sampled.q.probs[0], nn.functional.one_hot(sampled.q.probs[0].argmax(-1), 4).float())
    assert "greedy walks" in off.name and "sampled walks" in LiLiCorrProposer(ours, head).name
    # Under a grammar: the walk's rows rank each slot's candidates, the head's logits past them.
    ranked = LiLiCorrProposer(ours, head)(
        block, ProposalInputs(positions[:, 0], positions, None, [True, False])
    )
    assert torch.equal(ranked.logits.argmax(-1), ranked.tokens)
    assert torch.equal(torch.isfinite(ranked.logits).sum(-1), torch.full((2, B - 1), 4))
    torch.testing.assert_close(ranked.fallback, block[:, 1:] @ lm_head.T)


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, True),
        ({"SGLANG_ENABLE_LILICORR_SAMPLING": "1"}, True),
        ({"SGLANG_ENABLE_LILICORR_SAMPLING": "false"}, False),
    ],
)
def test_sglangs_switch_turns_sampled_walks_off(env, want):
    from sglang_dflash.knobs import Knobs

    assert Knobs.from_env(env, simulated=False).lilicorr_sampling is want
    with pytest.raises(ValueError, match="SGLANG_LILICORR_REQUIRE_SAMPLING is set"):
        Knobs.from_env(
            {"SGLANG_ENABLE_LILICORR_SAMPLING": "0", "SGLANG_LILICORR_REQUIRE_SAMPLING": "1"}, simulated=False
        )

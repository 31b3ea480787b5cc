"""DFlash2's candidate selector and the q-aware verify.

* The lattice and the walk (greedy and sampled, with q) equal SGLang 0.5.23's own
  `CandidateSelector.build_lattice` / `sample_path`, run eagerly on CPU with the same weights;
  the unary transform equals `DFlash2DraftModel._transform_unary_logits`.
* The vocab-parallel top-k equals `torch.topk` over the whole vocab.
* `q_sampled_verify` emits the target's law: a two-token decode over a 5-token vocabulary with a
  sampled two-slot walk, against the exact product law (chi-square), with and without a filter;
  with q a point mass it is `sampled_verify`'s rule; greedy rows are `greedy_verify`'s; seeded
  rows are reproducible.
"""

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.draft.tensor_parallel import vocab_parallel_topk
from sglang_dflash.propose.proposers import ProposalInputs, SelectorProposer
from sglang_dflash.propose.selector import CandidateSelector, unary_logits, walk
from tests.support.sampling_info import greedy_and_sampled
from tests.support.thread_group import ThreadGroup

H, V, RANK, K, SLOTS, BS = 32, 50, 4, 4, 5, 6


def _ours_and_sglangs():
    from sglang.srt.models.dflash import CandidateSelector as SGLangSelector

    gen = torch.Generator().manual_seed(0)
    theirs = SGLangSelector(hidden_size=H, vocab_size=V, state_rank=RANK, top_k=K)
    for p in theirs.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen))
    ours = CandidateSelector(H, V, RANK, K)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@pytest.mark.sglang  # imports SGLang's model module
def test_lattice_and_walk_equal_sglangs():
    ours, theirs = _ours_and_sglangs()
    gen = torch.Generator().manual_seed(1)
    candidates = torch.randint(0, V, (BS, SLOTS, K), generator=gen)
    unary = torch.randn(BS, SLOTS, K, generator=gen)
    hidden = torch.randn(BS, SLOTS, H, generator=gen)
    anchor = torch.randint(0, V, (BS,), generator=gen)
    uniforms = torch.rand(BS, SLOTS, generator=gen)
    temperatures = torch.tensor([1.0, 0.7, 1.3, 0.2, 1.0, 2.0])
    greedy = torch.tensor([False, True, False, False, True, False])
    with torch._dynamo.config.patch(disable=True), torch.no_grad():
        want_scores = theirs.build_lattice(
            candidate_ids=candidates, unary_logits=unary, hidden_states=hidden, anchor_token_ids=anchor
        )
        want_tokens, want_q = theirs.sample_path(
            candidate_ids=candidates,
            scores=want_scores,
            uniforms=uniforms,
            temperatures=temperatures,
            greedy_mask=greedy,
        )
        scores = ours.lattice(candidates, unary, hidden, anchor)
    torch.testing.assert_close(scores, want_scores)
    tokens, q = walk(candidates, want_scores, uniforms, temperatures, greedy)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(q, want_q)
    # The control: a walk that ignores its predecessor (always the anchor's row) differs.
    blind, _ = walk(candidates, want_scores[:, :, :1].expand_as(want_scores), uniforms, temperatures, greedy)
    assert not torch.equal(blind, want_tokens)


@pytest.mark.sglang
@pytest.mark.parametrize("multiplier, softcap", [(1.0, None), (0.5, 3.0)])
def test_unary_logits_equal_sglangs(multiplier, softcap):
    from sglang.srt.models.dflash import DFlash2DraftModel

    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(2)) * 5
    model = SimpleNamespace(
        draft_config=SimpleNamespace(output_multiplier=multiplier, final_logit_softcapping=softcap)
    )
    want = DFlash2DraftModel._transform_unary_logits(model, logits.clone())
    torch.testing.assert_close(unary_logits(logits, multiplier, softcap), want)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_vocab_parallel_topk_equals_torch_topk(size):
    gen = torch.Generator().manual_seed(size)
    vocab, k = 37, 5
    width = -(-vocab // size)
    logits = torch.randn(8, vocab, generator=gen)
    padded = torch.nn.functional.pad(logits, (0, size * width - vocab), value=123.0)  # never chosen

    def rank_fn(tp):
        start = tp.rank * width
        return vocab_parallel_topk(
            padded[..., start : start + width], k, start, max(0, min(width, vocab - start)), tp
        )

    want_values, want_ids = logits.topk(k, dim=-1)
    results = ThreadGroup(size).run(rank_fn) if size > 1 else [rank_fn(SimpleNamespace(rank=0, size=1))]
    for values, ids in results:
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(values, want_values)


def test_selector_proposer_walks_the_heads_top_k():
    """Greedy requests get the argmax walk over the head's top-K; sampled ones a draw with q."""
    gen = torch.Generator().manual_seed(3)
    lm_head = torch.randn(V, H, generator=gen)
    head = SimpleNamespace(
        vocab_size=V,
        topk=lambda hidden, k: (hidden @ lm_head.T).topk(k, dim=-1),
        logits=lambda hidden: hidden @ lm_head.T,
    )
    selector = CandidateSelector(H, V, RANK, K)
    for p in selector.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen))
    config = SimpleNamespace(selector_top_k=K, output_multiplier=1.0, final_logit_softcapping=None)
    proposer = SelectorProposer(selector, head, config)
    hidden = torch.randn(2, SLOTS, H, generator=gen)
    anchor = torch.tensor([3, 9])
    positions = torch.arange(SLOTS + 1).repeat(2, 1)
    window = torch.cat([torch.zeros_like(hidden[:, :1]), hidden], dim=1)  # [bs, W, H]: rows 0..W-1
    greedy = proposer(window, ProposalInputs(anchor, positions))
    values, ids = (hidden @ lm_head.T).topk(K, dim=-1)
    scores = selector.lattice(ids, values, hidden, anchor)
    want, _ = walk(ids, scores, torch.zeros(2, SLOTS), torch.ones(2), torch.ones(2, dtype=torch.bool))
    assert torch.equal(greedy.tokens, want) and greedy.q is None
    info = greedy_and_sampled()
    for slots in (SLOTS, 1):  # under a grammar: logits that rank each slot's candidates by the walk's row
        rows = ProposalInputs(anchor, positions, grammar_rows=[True, False])
        ranked = proposer(window[:, : slots + 1], rows)
        assert ranked.logits.shape == (2, slots, V)
        assert torch.equal(torch.isfinite(ranked.logits).sum(-1), torch.full((2, slots), K))
        assert torch.equal(ranked.logits.argmax(-1), ranked.tokens)
        # past the K candidates the grammar falls back on the head's logits over the vocabulary
        assert torch.equal(ranked.fallback, hidden[:, :slots] @ lm_head.T)
    sampled = proposer(window, ProposalInputs(anchor, positions, info))
    assert torch.equal(sampled.tokens[0], want[0])  # the greedy request
    assert sampled.q is not None and torch.allclose(sampled.q.probs.sum(-1), torch.ones(2, SLOTS))
    assert torch.equal(sampled.q.ids, ids)


# ------------------------------------------------------------------ the q-aware verify


def test_a_dflash2_checkpoint_loads_its_selector_and_gets_its_proposer(tmp_path):
    from safetensors.torch import load_file

    from sglang_dflash.checkpoint.config import DFlashDraftConfig
    from sglang_dflash.draft.model import DFlashDraftModel
    from sglang_dflash.propose.proposers import proposer_for
    from tests.support.tiny import add_selector, make_draft

    path = add_selector(make_draft(str(tmp_path / "draft")), architecture="DFlash2BeamDraftModel")
    config = DFlashDraftConfig.from_pretrained(path)
    features = len(config.resolve_target_layer_ids(config.num_target_layers))
    DFlashDraftModel.check_checkpoint(path, config, features)  # the launching process's check
    model = DFlashDraftModel.from_pretrained(path, config, features)
    saved = load_file(f"{path}/model.safetensors")
    for name in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight"):
        assert torch.equal(
            model.get_parameter(f"candidate_selector.{name}"), saved[f"candidate_selector.{name}"]
        )
    assert isinstance(proposer_for(model, head=None), SelectorProposer)

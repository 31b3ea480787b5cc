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
from sglang_dflash.verify.acceptance import greedy_verify
from sglang_dflash.verify.q_sampling import DraftQ, q_sampled_verify
from sglang_dflash.verify.sampling import TOP_K_ALL, SamplingRows
from tests.stats import ALPHA
from tests.test_tensor_parallel import ThreadGroup

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


def greedy_and_sampled() -> SimpleNamespace:
    """SGLang's `SamplingBatchInfo` as a proposer reads it, for two requests at temperature 1:
    request 0 greedy (top_k 1), request 1 sampled."""
    return SimpleNamespace(
        is_all_greedy=False,
        temperatures=torch.tensor([[1.0], [1.0]]),
        top_ks=torch.tensor([1, TOP_K_ALL]),
        top_ps=torch.ones(2),
        min_ps=torch.zeros(2),
        sampling_seed=None,
        need_top_k_sampling=True,
        need_top_p_sampling=False,
        need_min_p_sampling=False,
    )


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

VOCAB = 5


def _tables(seed: int):
    """A target over 5 tokens: p0 [V] after the prompt, p1 [V, V] after one token, p2 [V, V, V];
    a draft: q1 over K=3 candidates, q2 given the first proposal, far from p."""
    gen = torch.Generator().manual_seed(seed)
    logp0 = torch.randn(VOCAB, generator=gen) * 1.5
    logp1 = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    logp2 = torch.randn(VOCAB, VOCAB, VOCAB, generator=gen)
    q1_ids = torch.tensor([0, 2, 4])
    q1 = torch.tensor([0.6, 0.3, 0.1])
    q2_ids = torch.stack([torch.roll(torch.arange(VOCAB), -i)[:3] for i in range(VOCAB)])  # [V, 3]
    q2 = torch.softmax(torch.randn(VOCAB, 3, generator=gen) * 2, dim=-1)
    return logp0, logp1, logp2, q1_ids, q1, q2_ids, q2


def _rows(n: int, top_k: int) -> SamplingRows:
    return SamplingRows(
        temperatures=torch.ones(n),
        top_ks=torch.full((n,), top_k),
        top_ps=torch.ones(n),
        min_ps=torch.zeros(n),
        need_filter=top_k != TOP_K_ALL,
    )


def _filtered(logp: torch.Tensor, top_k: int) -> torch.Tensor:
    p = torch.softmax(logp, dim=-1)
    if top_k != TOP_K_ALL:
        kept = p.topk(top_k, dim=-1).indices
        p = torch.zeros_like(p).scatter_(-1, kept, p.gather(-1, kept))
        p = p / p.sum(-1, keepdim=True)
    return p


def _two_token_decode(n: int, top_k: int, seed: int, wrong_q: bool = False):
    """n independent two-token decodes: one step with a two-slot sampled walk, and for the
    decodes whose first step emitted one token, a second step with a one-slot walk."""
    logp0, logp1, logp2, q1_ids, q1, q2_ids, q2 = _tables(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    d1_index = torch.multinomial(q1, n, replacement=True, generator=gen)
    d1 = q1_ids[d1_index]
    q2_rows = q2[d1]  # [n, 3]
    d2 = q2_ids[d1].gather(1, torch.multinomial(q2_rows, 1, generator=gen))[:, 0]
    candidates = torch.stack([torch.zeros(n, dtype=torch.long), d1, d2], dim=1)
    logits = torch.stack([logp0.expand(n, VOCAB), logp1[d1], logp2[d1, d2]], dim=1)  # [n, 3, V]
    q = DraftQ(
        torch.stack([q1_ids.expand(n, 3), q2_ids[d1]], dim=1), torch.stack([q1.expand(n, 3), q2_rows], dim=1)
    )
    if wrong_q:  # the control: q that is not the distribution the proposals were drawn from
        q = DraftQ(q.ids, torch.full_like(q.probs, 1 / 3))
    accept_len, out, _ = q_sampled_verify(candidates, logits, _rows(n, top_k), q, generator=gen)
    x1, x2 = out[:, 0].clone(), out[:, 1].clone()
    again = accept_len == 0  # one token emitted: the second comes from a fresh step after x1
    m = int(again.sum())
    e1 = q2_ids[x1[again]][:, 0]  # a deterministic one-slot draft this time (a point mass)
    cand2 = torch.stack([x1[again], e1], dim=1)
    logits2 = torch.stack([logp1[x1[again]], logp2[x1[again], e1]], dim=1)
    q_point = DraftQ(e1[:, None, None].repeat(1, 1, 3), torch.tensor([1.0, 0.0, 0.0]).repeat(m, 1, 1))
    _, out2, _ = q_sampled_verify(cand2, logits2, _rows(m, top_k), q_point, generator=gen)
    x2[again] = out2[:, 0]
    want = _filtered(logp0, top_k)[:, None] * _filtered(logp1, top_k)  # [V, V]: p(x1) p(x2 | x1)
    return x1, x2, want, accept_len


@pytest.mark.parametrize("top_k", [TOP_K_ALL, 3], ids=["no-filter", "top-k-3"])
def test_q_verify_emits_the_targets_law(top_k):
    from scipy.stats import chisquare

    n = 40000
    x1, x2, want, accept_len = _two_token_decode(n, top_k, seed=5)
    counts = torch.bincount(x1 * VOCAB + x2, minlength=VOCAB * VOCAB).double()
    expected = want.reshape(-1).double()
    expected = expected / expected.sum() * n
    support = expected > 0
    assert counts[~support].sum() == 0  # nothing outside the target's (filtered) support
    assert chisquare(counts[support], expected[support]).pvalue > ALPHA
    assert 0.2 < (accept_len > 0).double().mean() < 0.95  # both branches ran often


def test_q_verify_with_a_wrong_q_fails_the_law():
    """The control: the same decode, verified with a q other than the one the walk drew from,
    is not the target's law; so the test above can fail."""
    from scipy.stats import chisquare

    n = 40000
    x1, x2, want, _ = _two_token_decode(n, TOP_K_ALL, seed=5, wrong_q=True)
    counts = torch.bincount(x1 * VOCAB + x2, minlength=VOCAB * VOCAB).double()
    expected = want.reshape(-1).double()
    assert chisquare(counts, expected / expected.sum() * n).pvalue < ALPHA


def test_greedy_rows_are_greedy_verify_and_seeded_rows_reproduce():
    logp0, logp1, logp2, q1_ids, q1, q2_ids, q2 = _tables(9)
    n = 64
    gen = torch.Generator().manual_seed(9)
    d1 = q1_ids[torch.multinomial(q1, n, replacement=True, generator=gen)]
    d2 = q2_ids[d1][:, 0]
    candidates = torch.stack([torch.zeros(n, dtype=torch.long), d1, d2], dim=1)
    logits = torch.stack([logp0.expand(n, VOCAB), logp1[d1], logp2[d1, d2]], dim=1)
    q = DraftQ(
        torch.stack([q1_ids.expand(n, 3), q2_ids[d1]], dim=1), torch.stack([q1.expand(n, 3), q2[d1]], dim=1)
    )
    greedy = _rows(n, 1)
    got = q_sampled_verify(candidates, logits, greedy, q, generator=gen)
    want = greedy_verify(candidates, logits.argmax(-1))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    seeded = SamplingRows(
        temperatures=torch.ones(n), top_ks=torch.full((n,), TOP_K_ALL), top_ps=torch.ones(n),
        min_ps=torch.zeros(n), seeds=torch.arange(n) % 4, need_filter=False,
    )  # fmt: skip
    positions = torch.arange(3).repeat(n, 1) + 10
    first = q_sampled_verify(candidates, logits, seeded, q, positions)
    second = q_sampled_verify(candidates, logits, seeded, q, positions)
    assert torch.equal(first[1], second[1])
    other = q_sampled_verify(candidates, logits, seeded, q, positions + 1)
    assert not torch.equal(first[1], other[1])


def test_a_dflash2_checkpoint_loads_its_selector_and_gets_its_proposer(tmp_path):
    from safetensors.torch import load_file

    from sglang_dflash.checkpoint.config import DFlashDraftConfig
    from sglang_dflash.draft.model import DFlashDraftModel
    from sglang_dflash.propose.proposers import proposer_for
    from tests.tiny_models import add_selector, make_draft

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

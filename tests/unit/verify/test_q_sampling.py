"""Exact verification of sampled proposals with their proposal law q (verify/q_sampling.py): the
emitted tokens follow the target's law."""

import pytest
import torch

from sglang_dflash.verify.acceptance import greedy_verify
from sglang_dflash.verify.q_sampling import DraftQ, q_sampled_verify
from sglang_dflash.verify.sampling import TOP_K_ALL, SamplingRows
from tests.support.stats import ALPHA

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

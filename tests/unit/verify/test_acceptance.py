"""Greedy verification and forced/simulated acceptance (verify/acceptance.py), on hand-built tensors."""

import pytest
import torch

from sglang_dflash.verify.acceptance import (
    forced_acceptance,
    geometric_commit_lens,
    geometric_rate,
    greedy_verify,
)
from tests.support.tensors import T


@pytest.mark.parametrize(
    "candidates, predict, accept, out, bonus",
    [
        # perfect match: every proposal accepted, bonus from the last position
        ([5, 8, 2, 4], [8, 2, 4, 9], 3, [8, 2, 4, 9], 9),
        # early mismatch: d1 wrong, nothing accepted, the target's own token is emitted
        ([5, 7, 2, 4], [8, 2, 4, 9], 0, [8, 0, 0, 0], 8),
        # a later proposal matching again does not count after the first miss
        ([5, 8, 3, 4], [8, 2, 4, 9], 1, [8, 2, 0, 0], 2),
        # width 2: one proposal
        ([5, 8], [8, 6], 1, [8, 6], 6),
    ],
    ids=["perfect", "early-miss", "miss-then-match", "width-2"],
)
def test_greedy_verify(candidates, predict, accept, out, bonus):
    accept_len, out_tokens, new_bonus = greedy_verify(T([candidates]), T([predict]))
    assert accept_len.tolist() == [accept]
    assert out_tokens.tolist() == [out]
    assert new_bonus.tolist() == [bonus]


def test_greedy_verify_rows_are_independent():
    candidates = T([[5, 8, 2, 4], [1, 7, 7, 7], [3, 3, 3, 3]])
    predict = T([[8, 2, 0, 0], [7, 7, 7, 7], [3, 3, 3, 3]])
    accept_len, out_tokens, bonus = greedy_verify(candidates, predict)
    assert accept_len.tolist() == [2, 3, 3]
    assert out_tokens.tolist() == [[8, 2, 0, 0], [7, 7, 7, 7], [3, 3, 3, 3]]
    assert bonus.tolist() == [0, 7, 3]


@pytest.mark.parametrize("commit_len", [1, 2, 4])
def test_forced_acceptance(commit_len):
    candidates, predict = T([[5, 8, 2, 4], [1, 2, 3, 4]]), T([[8, 3, 7, 1], [9, 9, 9, 9]])
    accept_len, out, bonus = forced_acceptance(candidates, predict, commit_len, real_draft_tokens=True)
    assert accept_len.tolist() == [commit_len - 1] * 2
    assert out[:, commit_len:].eq(0).all()
    assert out[:, : commit_len - 1].tolist() == candidates[:, 1:commit_len].tolist()
    assert out[:, commit_len - 1].tolist() == bonus.tolist() == predict[:, commit_len - 1].tolist()
    _, fixed, fixed_bonus = forced_acceptance(candidates, predict, commit_len, real_draft_tokens=False)
    assert fixed[:, :commit_len].eq(100).all() and fixed[:, commit_len:].eq(0).all()
    assert fixed_bonus.tolist() == [100, 100]


def test_forced_acceptance_per_request():
    """One commit length per request (the geometric simulation): by hand."""
    candidates, predict = T([[5, 8, 2, 4], [1, 2, 3, 4]]), T([[8, 3, 7, 1], [9, 6, 5, 4]])
    accept_len, out, bonus = forced_acceptance(candidates, predict, T([3, 1]), real_draft_tokens=True)
    assert accept_len.tolist() == [2, 0]
    assert out.tolist() == [[8, 2, 7, 0], [9, 0, 0, 0]]
    assert bonus.tolist() == [7, 9]


def test_geometric_rate_by_hand():
    assert geometric_rate(6.5, 16) == pytest.approx(0.8599, abs=1e-4)
    assert geometric_rate(3.0, 16) == pytest.approx(0.6672, abs=1e-4)
    assert geometric_rate(16, 16) == pytest.approx(1.0, abs=1e-9)
    assert geometric_rate(1, 16) == pytest.approx(0.0, abs=1e-9)
    for mean, width in ((6.5, 16), (3.0, 8)):
        a = geometric_rate(mean, width)
        assert sum(a**k for k in range(width)) == pytest.approx(mean, rel=1e-9)


@pytest.mark.parametrize("width", [16, 4])
def test_geometric_commit_lengths_follow_their_distribution(width):
    """Each request's commit length at rate a and width W: P(L = l) = a^(l-1) (1 - a) for l < W
    and a^(W-1) for l = W; a chi-square test over 20000 draws, and the rows independent (two
    halves of the batch, a 2 x W contingency test)."""
    from scipy import stats

    torch.manual_seed(0)
    rate, n = geometric_rate(6.5, 16), 20000
    lens = geometric_commit_lens(n, width, rate, "cpu")
    counts = torch.bincount(lens, minlength=width + 1)[1:].double().numpy()
    probs = [rate ** (k - 1) * (1 - rate) for k in range(1, width)] + [rate ** (width - 1)]
    assert stats.chisquare(counts, [p * n for p in probs]).pvalue > 1e-3
    halves = [torch.bincount(h, minlength=width + 1)[1:].numpy() for h in (lens[::2], lens[1::2])]
    table = [h for h in zip(*halves) if sum(h) > 0]
    assert stats.chi2_contingency(list(zip(*table))).pvalue > 1e-3
    # Against a control: SGLang's own method, one length for the whole batch, is all or nothing
    # per position (6.5 -> lengths 6 and 7 only).
    assert len(set(lens.tolist())) == width

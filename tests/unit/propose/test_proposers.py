"""The proposers' interface: the argmax proposer with and without logits."""

from types import SimpleNamespace

import torch

from sglang_dflash.propose.proposers import ArgmaxProposer, ProposalInputs, proposer_for


def test_argmax_proposals_with_and_without_logits_agree():
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(50, 16, generator=gen)
    head = SimpleNamespace(
        logits=lambda hidden: hidden @ lm_head.T, argmax=lambda hidden: (hidden @ lm_head.T).argmax(-1)
    )
    proposer = proposer_for(SimpleNamespace(), head)
    assert isinstance(proposer, ArgmaxProposer) and proposer.name == "argmax"
    window = torch.randn(3, 6, 16, generator=gen)  # [bs, W, H]
    hidden = window[:, 1:]  # the proposal rows
    anchor, positions = torch.zeros(3, dtype=torch.long), torch.arange(6).repeat(3, 1)
    plain = proposer(window, ProposalInputs(anchor, positions))
    ranked = proposer(window, ProposalInputs(anchor, positions, grammar_rows=[True, False, True]))
    assert plain.logits is None and plain.q is None
    assert ranked.logits.shape == (3, 5, 50)
    assert torch.equal(plain.tokens, ranked.tokens)
    assert torch.equal(ranked.tokens, (hidden @ lm_head.T).argmax(-1))

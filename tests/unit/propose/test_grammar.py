"""The verify-window grammar walk (`sglang_dflash/propose/grammar.py`) against oracles, for every grammar
backend SGLang has: each mask row equals the mask of a fresh matcher fed the same tokens, the
matcher ends where it started, the masks equal SGLang's own speculative walk
(`spec_utils.build_grammar_vocab_mask`), and grammar-aware proposals are the masked argmax of the
draft's logits, position by position. No engine: SGLang's grammar objects are built directly."""

import numpy as np
import pytest
import torch

from sglang_dflash.propose.grammar import DRAFT_TOP_K, GrammarWindow, allows, describe_choices, walk_window
from tests.support.tiny import EOS_ID

VOCAB = 384
REGEX = "(yes|no)-[0-9]{3}"
TEXT = "no-407"  # a full match of REGEX


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.target("a"))


def _backend(name, tokenizer):
    if name == "xgrammar":
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

        return XGrammarGrammarBackend(tokenizer, VOCAB, [EOS_ID])
    if name == "llguidance":
        from sglang.srt.constrained.llguidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, n_vocab=VOCAB, eos_token_ids=[EOS_ID])
    pytest.importorskip("outlines")
    from sglang.srt.constrained.outlines_backend import OutlinesGrammarBackend

    return OutlinesGrammarBackend(tokenizer, whitespace_pattern=None)


BACKENDS = ["xgrammar", "llguidance", "outlines"]


def _mask_after(backend, tokens, rows=1):
    """Oracle: the mask row of a fresh matcher that accepted `tokens`."""
    grammar = backend.dispatch_regex(REGEX)
    for token in tokens:
        grammar.accept_token(token)
    mask = grammar.allocate_vocab_mask(VOCAB, rows, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    return mask[0].clone()


def _tokens(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_allows_reads_both_mask_layouts():
    packed = np.array([[0b100, 0], [-1, -1]], dtype=np.int32)
    assert allows(packed, 0, 2) and not allows(packed, 0, 1) and not allows(packed, 0, 33)
    assert allows(packed, 1, 63)  # -1: every bit set
    banned = np.array([[False, True]])
    assert allows(banned, 0, 0) and not allows(banned, 0, 1)


@pytest.mark.parametrize("name", BACKENDS)
def test_rows_equal_a_fresh_matcher_and_the_matcher_is_restored(name, tokenizer):
    backend = _backend(name, tokenizer)
    ids = _tokens(tokenizer, TEXT) + [EOS_ID]
    committed, window = ids[:1], ids[:-1]  # window[0] (the bonus) is committed
    grammar = backend.dispatch_regex(REGEX)
    grammar.accept_token(committed[0])
    width = len(window)
    mask = grammar.allocate_vocab_mask(VOCAB, width + 2, "cpu")
    before = _mask_after(backend, committed)

    accepted = walk_window(grammar, mask, 2, width, lambda t, row: window[t])

    assert accepted == window[1:]
    for t in range(width):
        assert torch.equal(mask[2 + t], _mask_after(backend, window[: t + 1])), t
    fresh = grammar.allocate_vocab_mask(VOCAB, 1, "cpu")
    grammar.fill_vocab_mask(fresh, 0)
    assert torch.equal(fresh[0], before)  # nothing the walk did is left in the matcher
    unconstrained = grammar.allocate_vocab_mask(VOCAB, 1, "cpu")[0]
    assert torch.equal(mask[0], unconstrained) and torch.equal(mask[1], unconstrained)


@pytest.mark.parametrize("name", BACKENDS)
def test_an_illegal_proposal_stops_the_walk(name, tokenizer):
    backend = _backend(name, tokenizer)
    ids = _tokens(tokenizer, TEXT)
    grammar = backend.dispatch_regex(REGEX)
    grammar.accept_token(ids[0])
    bad = _tokens(tokenizer, "x")[0]
    window = [ids[0], bad, *ids[1:]]
    mask = grammar.allocate_vocab_mask(VOCAB, len(window), "cpu")

    accepted = walk_window(grammar, mask, 0, len(window), lambda t, row: window[t])

    assert accepted == []
    assert torch.equal(mask[0], _mask_after(backend, ids[:1]))
    unconstrained = grammar.allocate_vocab_mask(VOCAB, 1, "cpu")[0]
    assert all(torch.equal(mask[t], unconstrained) for t in range(1, len(window)))


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])  # outlines has no termination
def test_the_walk_stops_where_the_grammar_terminates(name, tokenizer):
    backend = _backend(name, tokenizer)
    ids = _tokens(tokenizer, TEXT)
    grammar = backend.dispatch_regex(REGEX)
    grammar.accept_token(ids[0])
    window = [*ids, EOS_ID, EOS_ID, EOS_ID]
    mask = grammar.allocate_vocab_mask(VOCAB, len(window), "cpu")

    accepted = walk_window(grammar, mask, 0, len(window), lambda t, row: window[t])

    assert accepted == [*ids[1:], EOS_ID]
    assert not grammar.is_terminated()


class _Req:
    def __init__(self, grammar):
        self.grammar = grammar


def _batch(backend, tokenizer, prefixes):
    reqs = []
    for prefix in prefixes:
        grammar = None
        if prefix is not None:
            grammar = backend.dispatch_regex(REGEX)
            for token in prefix:
                grammar.accept_token(token)
        reqs.append(_Req(grammar))
    return reqs


def test_masks_equal_sglangs_own_speculative_walk(tokenizer):
    """Oracle: SGLang's `build_grammar_vocab_mask` over a chain `GrammarTree`, as its built-in
    DFLASH worker calls it, for a batch with legal, illegal and unconstrained windows."""
    from types import SimpleNamespace

    from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

    backend = _backend("xgrammar", tokenizer)
    ids = _tokens(tokenizer, TEXT)
    bad = _tokens(tokenizer, "x")[0]
    windows = [ids[:4], [ids[0], bad, *ids[1:3]], [5, 6, 7, 8], [ids[0], *ids[1:3], bad]]
    prefixes = [ids[:1], ids[:1], None, ids[:1]]
    candidates = torch.tensor([w[:4] for w in windows])

    ours_reqs = _batch(backend, tokenizer, prefixes)
    _, ours = GrammarWindow(propose=False, vocab_size=VOCAB)(ours_reqs, candidates[:, 1:], None)
    theirs_reqs = _batch(backend, tokenizer, prefixes)
    theirs = build_grammar_vocab_mask(
        reqs=theirs_reqs,
        tree=GrammarTree.from_linear_chain(candidates),
        sampling_info=SimpleNamespace(vocab_size=VOCAB, grammar_mask=None),
        device="cpu",
        barrier=None,
    )
    assert torch.equal(ours.vocab_mask, theirs.vocab_mask)


@pytest.mark.parametrize("name", BACKENDS)
def test_grammar_aware_proposals_are_the_masked_argmax(name, tokenizer):
    """Oracle: position by position, the argmax of the draft logits under a fresh matcher's mask
    after the proposals chosen before it; one position's legal tokens all lie below the top-K."""
    backend = _backend(name, tokenizer)
    ids = _tokens(tokenizer, TEXT)
    width = 5
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, width - 1, VOCAB, generator=gen)
    legal_digits = {t for t in range(VOCAB) if allows(_mask_after(backend, ids[:2])[None].numpy(), 0, t)}
    # Request 0 sits after "no-": its first proposal must be a digit; push all digits out of
    # the draft's top-K so the full-vocabulary path is taken.
    for t in legal_digits:
        logits[0, 0, t] -= 100.0
    reqs = _batch(backend, tokenizer, [ids[:2], None])
    window = GrammarWindow(propose=True, vocab_size=VOCAB)
    proposals, mask = window(reqs, logits.argmax(-1), logits)

    assert window.full_vocab_choices >= 1
    assert window.choices == width - 1  # one choice per proposal slot of the constrained request
    assert describe_choices(window).startswith(f"{window.full_vocab_choices} of {width - 1} grammar-aware")
    assert len(legal_digits) < VOCAB - DRAFT_TOP_K
    history = ids[:2]
    for t in range(width - 1):
        row_mask = _mask_after(backend, history)
        masked = logits[0, t].clone()
        reqs[0].grammar.apply_vocab_mask(logits=masked[None], vocab_mask=row_mask[None])
        want = int(masked.argmax())
        assert int(proposals[0, t]) == want, t
        history = history + [want]
    assert torch.equal(proposals[1], logits[1].argmax(-1))  # unconstrained request: untouched


def test_proposals_ranked_among_a_few_candidates_fall_back_on_the_full_vocabulary(tokenizer):
    """DFlash2 and Domino's pool rank a few candidates per slot (-inf elsewhere). Oracle, slot by
    slot: the best legal candidate, else the argmax of the full logits under the mask. Slot 0 has
    no legal candidate, so the fallback decides it, not one of the -inf tokens in the top-32."""
    backend = _backend("xgrammar", tokenizer)
    ids = _tokens(tokenizer, TEXT)
    width, k = 5, 4
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(1, width - 1, VOCAB, generator=gen)
    digits = _mask_after(backend, ids[:2])[None].numpy()  # after "no-": a digit must follow
    full[0, 0, [t for t in range(VOCAB) if allows(digits, 0, t)]] -= 100.0  # none among the top-K
    top = full.topk(k, dim=-1)
    ranked = torch.full_like(full, float("-inf")).scatter_(2, top.indices, torch.randn(top.values.shape))
    reqs = _batch(backend, tokenizer, [ids[:2]])
    window = GrammarWindow(propose=True, vocab_size=VOCAB)
    proposals, _ = window(reqs, ranked.argmax(-1), ranked, full)

    assert window.full_vocab_choices >= 1
    history = ids[:2]
    for t in range(width - 1):
        row = _mask_after(backend, history)[None].numpy()
        order = ranked[0, t].argsort(descending=True)[:k].tolist()
        legal = [token for token in order if allows(row, 0, token)]
        if legal:
            want = legal[0]
        else:
            masked = full[0, t].clone()
            reqs[0].grammar.apply_vocab_mask(logits=masked[None], vocab_mask=torch.from_numpy(row))
            want = int(masked.argmax())
        assert int(proposals[0, t]) == want, t
        history = history + [want]


def test_the_walk_crosses_the_end_of_thinking(tokenizer):
    """SGLang's reasoning-parser wrapper: rows before the think-end token are unconstrained, the
    rows after it are the grammar's, and rolling back across the boundary reopens thinking.
    Oracle: a fresh wrapper fed the same tokens."""
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

    backend = _backend("xgrammar", tokenizer)
    think_end = _tokens(tokenizer, "x")[0]

    def wrapper(tokens=()):
        grammar = ReasonerGrammarObject(backend.dispatch_regex(REGEX), think_end_ids=[think_end])
        grammar.maybe_init_reasoning(True)
        for token in tokens:
            grammar.accept_token(token)
        return grammar

    def row_after(tokens):
        grammar = wrapper(tokens)
        mask = grammar.allocate_vocab_mask(VOCAB, 1, "cpu")
        grammar.fill_vocab_mask(mask, 0)
        return mask[0].clone()

    thinking = [7, 9, 11]
    answer = _tokens(tokenizer, TEXT)[:3]
    window = [thinking[0], *thinking[1:], think_end, *answer]
    grammar = wrapper(thinking[:1])
    mask = grammar.allocate_vocab_mask(VOCAB, len(window), "cpu")

    accepted = walk_window(grammar, mask, 0, len(window), lambda t, row: window[t])

    assert accepted == window[1:]
    for t in range(len(window)):
        assert torch.equal(mask[t], row_after(window[: t + 1])), t
    unconstrained = grammar.allocate_vocab_mask(VOCAB, 1, "cpu")[0]
    assert torch.equal(mask[0], unconstrained) and not torch.equal(mask[len(thinking)], unconstrained)
    assert grammar.tokens_after_end == -1  # still thinking: the walk left no trace
    assert torch.equal(row_after(thinking[:1]), unconstrained)

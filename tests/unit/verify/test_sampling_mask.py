"""`sampling_mask.sampling_masks` against SGLang's own sampler on the same logits: its pytorch
producer (`top_k_top_p_min_p_sampling_from_probs_torch(return_filtered_probs=True)`) and its
packing (`Sampler._build_sampling_mask_output`), row by row. Engine-level checks are in
test_request_features.py and test_server.py."""

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.verify import sampling_mask
from sglang_dflash.verify.sampling import SamplingRows

pytestmark = pytest.mark.sglang  # imports SGLang's sampler

V, WIDTH = 96, 3


def _sglang_masks(logits, temperature, top_k, top_p, min_p, max_tokens):
    """One request's rows through SGLang's non-speculative sampler: (tokens, SamplingMaskOutput)."""
    from sglang.srt.layers.sampler import (
        Sampler,
        _SamplingMaskCapture,
        top_k_top_p_min_p_sampling_from_probs_torch,
    )

    n = logits.shape[0]
    probs = torch.softmax(logits / temperature, dim=-1)
    full = lambda value, dtype: torch.full((n,), value, dtype=dtype)  # noqa: E731
    tokens, weights, token_ids, selected = top_k_top_p_min_p_sampling_from_probs_torch(
        probs,
        full(top_k, torch.int64),
        full(top_p, torch.float32),
        full(min_p, torch.float32),
        min_p > 0,
        None,
        torch.arange(n),
        return_filtered_probs=True,
    )
    capture = _SamplingMaskCapture(
        weights=weights, token_ids=token_ids, selected_weight=selected, batch_rows=torch.arange(n)
    )
    sampler = SimpleNamespace(sampling_mask_max_tokens=max_tokens, tp_sync_group=None, cp_sync_group=None)
    out = Sampler._build_sampling_mask_output(sampler, tokens, capture, torch.arange(n))
    return tokens, out


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p, max_tokens",
    [(0.8, 8, 0.9, 0.0, 4096), (1.3, 40, 1.0, 0.05, 4096), (1.0, 30, 0.95, 0.0, 5)],
    ids=["top-k-top-p", "top-k-min-p", "overflow"],
)
def test_masks_equal_sglangs_sampler(temperature, top_k, top_p, min_p, max_tokens):
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(2 * WIDTH, V, generator=gen) * 3  # two requests, three window rows each
    tokens, want = _sglang_masks(logits, temperature, top_k, top_p, min_p, max_tokens)
    rows = SamplingRows(
        temperatures=torch.full((2,), temperature),
        top_ks=torch.full((2,), top_k),
        top_ps=torch.full((2,), top_p),
        min_ps=torch.full((2,), min_p),
    )
    got = sampling_mask.sampling_masks(logits, rows, tokens.view(2, WIDTH), max_tokens, torch.tensor([1]))
    packed = min(max_tokens, V)
    assert torch.equal(got["statuses"].view(-1), want.statuses)
    assert torch.equal(got["lengths"].view(-1), want.lengths)
    for row, length in enumerate(want.lengths.tolist()):
        assert torch.equal(got["token_ids"].view(-1, packed)[row, :length], want.token_ids[row, :length])
    torch.testing.assert_close(got["selected_logprobs"].view(-1), want.selected_logprobs)
    # Support logprobs: asked for request 1 only (rows 3..5).
    torch.testing.assert_close(got["support_logprobs"].view(WIDTH, packed), want.support_logprobs[WIDTH:])
    if max_tokens < top_k:
        assert (got["statuses"] == sampling_mask.OVERFLOW).all()


def test_greedy_rows_return_their_token_and_an_invalid_token_is_flagged():
    logits = torch.randn(WIDTH, V, generator=torch.Generator().manual_seed(0))
    greedy = SamplingRows(
        temperatures=torch.ones(1),
        top_ks=torch.ones(1, dtype=torch.int64),
        top_ps=torch.ones(1),
        min_ps=torch.zeros(1),
    )
    tokens = logits.argmax(-1).view(1, WIDTH)
    got = sampling_mask.sampling_masks(logits, greedy, tokens, 4096)
    assert torch.equal(got["token_ids"][0, :, 0], tokens[0].int())
    assert got["lengths"].tolist() == [[1] * WIDTH] and got["selected_logprobs"].tolist() == [[0.0] * WIDTH]
    sampled = SamplingRows(
        temperatures=torch.ones(1), top_ks=torch.full((1,), 4), top_ps=torch.ones(1), min_ps=torch.zeros(1)
    )
    outside = logits.argmin(-1).view(1, WIDTH)  # never in a top-4 support
    assert (
        sampling_mask.sampling_masks(logits, sampled, outside, 4096)["statuses"] == sampling_mask.INVALID
    ).all()


def test_status_codes_are_sglangs():
    from sglang.srt.layers.logits_processor import SamplingMaskStatus

    assert (sampling_mask.OK, sampling_mask.OVERFLOW, sampling_mask.INVALID) == (
        SamplingMaskStatus.OK,
        SamplingMaskStatus.OVERFLOW,
        SamplingMaskStatus.INVALID,
    )

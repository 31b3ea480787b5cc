"""Training's FlexAttention block attention (`sglang_dflash/train/flex_attention.py`) against the
dense path (`mask.block_attention_mask` + `attention.attend_with_context`): its per-element
mask, the tiles it visits, its forward on CPU (FlexAttention has no backward there) with one
compile for batches of any size, and, on a GPU, its gradients. (Against serving:
`test_recipe.py::test_training_forward_matches_serving[flex-*]`.)"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from sglang_dflash.draft.attention import attend_with_context
from sglang_dflash.train import flex_attention, objective
from sglang_dflash.train.flex_attention import TILE, FlexShapes
from sglang_dflash.train.mask import block_attention_mask
from sglang_dflash.train.objective import resolve_block_attention

KINDS = [(False, None), (True, None), (False, 5), (True, 400)]  # (causal, window)


def _anchors(b, s, a, bsz, seed):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.stack([torch.sort(torch.randperm(s - bsz, generator=g)[:a]).values for _ in range(b)])
    anchors[0, 0] = 0  # a block with no context at all
    return anchors


def _padded_dense(anchors, s, bsz, shapes, causal, window):
    """The dense mask [b, Q, S + Q] placed in the padded layout [rows, Qp, Sp + Qp]."""
    b, a = anchors.shape
    nq = a * bsz
    dense = block_attention_mask(anchors, s, bsz, causal=causal, window=window)
    out = torch.zeros(shapes.rows, shapes.queries, shapes.keys, dtype=torch.bool)
    out[:b, :nq, :s] = dense[..., :s]
    out[:b, :nq, shapes.context : shapes.context + nq] = dense[..., s:]
    return out


@pytest.mark.parametrize("causal, window", KINDS)
def test_the_mask_is_the_dense_one(causal, window):
    """`mask_mod` over every (query, key) of the padded layout equals the dense mask on the real
    queries; a padding query sees only its own padding block."""
    s, bsz, a = 150, 8, 12
    anchors = _anchors(2, s, a, bsz, seed=0)
    shapes = FlexShapes.for_run(3, s, 20, bsz)  # 3 rows (1 padding), context 256, queries 256
    assert (shapes.context, shapes.queries) == (256, 256)
    q_anchor = flex_attention.query_anchors(anchors, shapes)
    mod = flex_attention.mask_mod_for(q_anchor, shapes, causal=causal, window=window)
    got = create_mask(mod, shapes.rows, 1, shapes.queries, shapes.keys, device="cpu")[:, 0]
    want = _padded_dense(anchors, s, bsz, shapes, causal, window)
    nq = a * bsz
    assert torch.equal(got[:2, :nq], want[:2, :nq])
    # padding queries (rows 0-1 past Q, and all of row 2): their block's keys, nothing else
    pad = torch.ones_like(got, dtype=torch.bool)
    pad[:2, :nq] = False
    q = torch.arange(shapes.queries)[:, None]
    j = torch.arange(shapes.keys)[None, :] - shapes.context
    own_pad_block = (j >= 0) & (j // bsz == q // bsz)
    assert not (got & pad & ~own_pad_block).any()
    assert (got & pad).any(-1)[pad.any(-1)].all()  # no padding query is left with no key


@pytest.mark.parametrize("causal, window", KINDS)
def test_the_tiles_cover_the_mask(causal, window):
    """`tile_mask` against the tiles of the exact mask: every tile with a visible pair is visited,
    no tile is called full that is not, and on the context keys both are exact."""
    s, bsz, a = 700, 16, 40
    anchors = _anchors(2, s, a, bsz, seed=3)
    shapes = FlexShapes.for_run(2, s, a, bsz)  # context 768, queries 640
    q_anchor = flex_attention.query_anchors(anchors, shapes)
    mod = flex_attention.mask_mod_for(q_anchor, shapes, causal=causal, window=window)
    exact = create_mask(mod, shapes.rows, 1, shapes.queries, shapes.keys, device="cpu")[:, 0]
    tiles = exact.unflatten(1, (-1, TILE)).unflatten(3, (-1, TILE))  # [rows, QT, TILE, KT, TILE]
    exact_any, exact_full = tiles.any(4).any(2), tiles.all(4).all(2)
    some, every = flex_attention.tile_mask(q_anchor, shapes, causal=causal, window=window)
    assert not (exact_any & ~some).any(), "a tile with a visible pair is skipped"
    assert not (every & ~exact_full).any(), "a tile called full is not"
    ct = shapes.context // TILE
    assert torch.equal(some[..., :ct], exact_any[..., :ct])
    assert torch.equal(every[..., :ct], exact_full[..., :ct])
    assert exact_any.float().mean() < 0.5  # the point: tiles are skipped
    if window is None or window > TILE:
        assert exact_full[..., :ct].any()  # and some are full (so the check above can fail)


def _inputs(b, s, a, bsz, heads, kv_heads, d, seed):
    g = torch.Generator().manual_seed(seed)
    q_len = a * bsz
    return _anchors(b, s, a, bsz, seed), (
        torch.randn(b, q_len, heads, d, generator=g),
        *(torch.randn(b, n, kv_heads, d, generator=g) for n in (s, s, q_len, q_len)),
    )


def _flex_and_dense(anchors, tensors, s, bsz, shapes, causal, window):
    d = tensors[0].shape[-1]
    mask = flex_attention.block_mask(anchors, shapes, causal=causal, window=window)
    flex = flex_attention.flex_block_attention(*tensors, mask, shapes, d**-0.5)
    dense_mask = block_attention_mask(anchors, s, bsz, causal=causal, window=window)[:, None]
    return flex, attend_with_context(*tensors, dense_mask, d**-0.5)


@pytest.mark.parametrize("causal, window", [(False, None), (True, 40)])
def test_forward_equals_dense_with_one_compile(causal, window):
    """Batches of different lengths, anchor counts and sizes, padded to the run's shapes: each
    equals the dense path (fp32, GQA, a block anchored at 0), and only the first compiles.
    Without the padding (each batch at its own sizes) the second batch compiles again."""
    bsz, heads, kv_heads, d = 8, 4, 2, 16
    shapes = FlexShapes.for_run(2, 200, 20, bsz)
    batches = [(2, 200, 20), (1, 130, 9), (2, 61, 7)]  # (b, S, A)
    before = flex_attention.compiled_graphs()
    compiles = []
    with torch.no_grad():
        for i, (b, s, a) in enumerate(batches):
            anchors, tensors = _inputs(b, s, a, bsz, heads, kv_heads, d, seed=i)
            flex, dense = _flex_and_dense(anchors, tensors, s, bsz, shapes, causal, window)
            torch.testing.assert_close(flex, dense, rtol=0, atol=2e-6, msg=f"batch {i}")
            compiles.append(flex_attention.compiled_graphs() - before)
        assert compiles[0] <= 1 and compiles[1:] == [compiles[0]] * 2, compiles
        b, s, a = batches[1]
        anchors, tensors = _inputs(b, s, a, bsz, heads, kv_heads, d, seed=1)
        own = FlexShapes.for_run(b, s, a, bsz)
        _flex_and_dense(anchors, tensors, s, bsz, own, causal, window)
    assert flex_attention.compiled_graphs() - before == compiles[0] + 1


def test_the_choice_per_device(monkeypatch):
    """auto: flex on CUDA, dense (saying why) where flex cannot run; flex is refused on CPU."""
    cuda = torch.device("cuda")
    want = "flex" if flex_attention.supported(cuda) is None else "dense"
    assert resolve_block_attention("auto", cuda)[0] == want
    with pytest.raises(ValueError, match="--block-attention flex: FlexAttention has no backward on CPU"):
        resolve_block_attention("flex", torch.device("cpu"))
    monkeypatch.setitem(objective._SUPPORTED, "flex", lambda device: "no Triton")
    assert resolve_block_attention("auto", cuda) == ("dense", "auto on cuda: flex cannot run (no Triton)")


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window", KINDS)
def test_gradients_equal_dense_in_fp32_on_cuda(causal, window):
    """Output and the five gradients to 2e-5 in fp32, and within bf16's precision in bf16;
    training's graph compiles once for two batches."""
    bsz, heads, kv_heads, d = 16, 8, 2, 64
    shapes = FlexShapes.for_run(2, 300, 24, bsz)
    for dtype, atol in ((torch.float32, 2e-5), (torch.bfloat16, 5e-2)):
        before = flex_attention.compiled_graphs()
        for i, (b, s, a) in enumerate([(2, 300, 24), (1, 200, 10)]):
            anchors, tensors = _inputs(b, s, a, bsz, heads, kv_heads, d, seed=i)
            tensors = tuple(x.cuda().to(dtype).requires_grad_() for x in tensors)
            flex, dense = _flex_and_dense(anchors.cuda(), tensors, s, bsz, shapes, causal, window)
            grad = torch.randn_like(dense)
            for name, got, want in zip(
                ("out", "dq", "dk_ctx", "dv_ctx", "dk", "dv"),
                (flex, *torch.autograd.grad(flex, tensors, grad)),
                (dense, *torch.autograd.grad(dense, tensors, grad)),
            ):
                msg = f"{dtype} {name}"
                torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol, msg=msg)
        assert flex_attention.compiled_graphs() - before <= 1

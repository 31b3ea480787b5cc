"""Training's split block attention (`sglang_dflash/train/split_attention.py`) against the dense
path (`attention.attend_with_context` with `mask.block_attention_mask`): output and every
gradient in fp32, rows without context, bf16, and its peak memory on CPU. (Against serving:
`test_recipe.py::test_training_forward_matches_serving[split-*]`.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sglang_dflash.draft.attention import attend_with_context
from sglang_dflash.train import split_attention
from sglang_dflash.train.mask import block_attention_mask
from sglang_dflash.train.objective import resolve_block_attention
from tests.support import paths

REPO = str(paths.REPO)


def _inputs(b, s, a, bsz, heads, kv_heads, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.stack([torch.sort(torch.randperm(s - bsz, generator=g)[:a]).values for _ in range(b)])
    anchors[0, 0] = 0  # a block with no context at all
    q_len = a * bsz

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    tensors = (rand(b, q_len, heads, d), *(rand(b, n, kv_heads, d) for n in (s, s, q_len, q_len)))
    return anchors, tensors


def _both(anchors, tensors, s, bsz, causal, window, dtype):
    """(dense out, split out), each with its gradients for one upstream gradient."""
    d = tensors[0].shape[-1]
    mask = block_attention_mask(anchors, s, bsz, causal=causal, window=window)[:, None]
    dense = attend_with_context(*tensors, mask, d**-0.5)
    bias = split_attention.context_bias(anchors, s, bsz, causal=causal, window=window, dtype=dtype)
    own = split_attention.own_block_mask(bsz, causal=causal, window=window)
    split = split_attention.split_block_attention(*tensors, bias, own, d**-0.5, bsz)
    grad = torch.randn(dense.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    return [(out, torch.autograd.grad(out, tensors, grad)) for out in (dense, split)]


@pytest.mark.parametrize(
    "causal, window, heads, kv_heads",
    [(False, None, 4, 2), (False, None, 4, 4), (True, None, 4, 1), (True, 5, 4, 2), (False, 3, 2, 2)],
)
def test_split_equals_dense_in_fp32(causal, window, heads, kv_heads):
    """Output and the five gradients (q, context K/V, block K/V) to 2e-6, for full, causal and
    sliding layers, GQA, a padded batch of 2 and a block anchored at 0."""
    s, bsz = 37, 4
    anchors, tensors = _inputs(2, s, 6, bsz, heads, kv_heads, 16, torch.float32)
    (dense, dense_grads), (split, split_grads) = _both(
        anchors, tensors, s, bsz, causal, window, torch.float32
    )
    torch.testing.assert_close(split, dense, rtol=0, atol=2e-6)
    for name, want, got in zip(("q", "k_ctx", "v_ctx", "k", "v"), dense_grads, split_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6, msg=f"d{name}")


def test_a_block_with_no_context_sees_only_itself():
    """Anchor 0: the null key adds nothing, the output is the block's own attention."""
    s, bsz, d = 20, 4, 8
    anchors, (q, k_ctx, v_ctx, k, v) = _inputs(1, s, 3, bsz, 2, 2, d, torch.float32)
    bias = split_attention.context_bias(anchors, s, bsz, causal=False, window=None, dtype=torch.float32)
    own = split_attention.own_block_mask(bsz, causal=False, window=None)
    out = split_attention.split_block_attention(q, k_ctx, v_ctx, k, v, bias, own, d**-0.5, bsz)
    alone = torch.nn.functional.scaled_dot_product_attention(
        *(x[:, :bsz].transpose(1, 2) for x in (q, k, v)), scale=d**-0.5
    ).transpose(1, 2)
    torch.testing.assert_close(out[:, :bsz], alone, rtol=0, atol=1e-6)


def test_split_equals_dense_in_bf16():
    s, bsz = 64, 8
    anchors, tensors = _inputs(1, s, 6, bsz, 4, 2, 32, torch.bfloat16)
    (dense, dense_grads), (split, split_grads) = _both(anchors, tensors, s, bsz, False, None, torch.bfloat16)
    torch.testing.assert_close(split.float(), dense.float(), rtol=0, atol=2e-2)
    for want, got in zip(dense_grads, split_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=5e-2)


def test_the_choice_per_device():
    assert resolve_block_attention("auto", torch.device("cpu"))[0] == "split"
    assert resolve_block_attention("dense", torch.device("cpu"))[0] == "dense"
    with pytest.raises(ValueError, match="--block-attention split: no fused attention kernel"):
        resolve_block_attention("split", torch.device("meta"))


_PEAK = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from scripts.bench.block_attention import make_inputs, runner
import argparse
args = argparse.Namespace(seq_len=2048, anchors=512, block_size=16, heads=4, kv_heads=4, head_dim=16)
anchors, q, kv = make_inputs(args, "cpu", torch.float32)
fn = runner(sys.argv[1], args, anchors, "cpu", torch.float32)
def status(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident size
base = status("VmRSS:")
torch.autograd.grad(fn(q, *kv), (q, *kv), torch.ones_like(q))
print((status("VmHWM:") - base) // 1024)
"""


def test_the_split_peaks_lower_on_cpu():
    """One layer call, forward + backward, 512 blocks of 16 over 2048 tokens, in a fresh process
    each: the dense path's [Q, S + Q] mask and scores against the split's."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("no /proc/self/clear_refs to reset the peak resident size")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    peak = {
        mode: int(subprocess.run([sys.executable, "-c", _PEAK, mode, REPO], env=env, capture_output=True,
                                 text=True, check=True).stdout)
        for mode in ("dense", "split")
    }  # fmt: skip
    print(f"peak MiB above the inputs: {peak}")
    assert peak["dense"] > 200 and peak["split"] < peak["dense"] / 3, peak

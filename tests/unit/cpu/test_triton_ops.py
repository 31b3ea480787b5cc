"""MiniMax-M2's q/k RMSNorm stand-ins (cpu/triton_ops.py) against the norm's definition: each row
of q [B, Hq*D] and of k [B, Hk*D] divided by its root mean square over the full width (all heads,
all tensor-parallel ranks), times the weight; as transformers' MiniMax-M2 `q_norm`/`k_norm` and
SGLang's `MiniMaxM2RMSNormTP.forward` compute it."""

import torch

from sglang_dflash.cpu.triton_ops import rms_apply_serial, rms_sumsq_serial

EPS = 1e-6


def _rms_norm(x, w):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * w


def test_the_qk_norm_is_rmsnorm_over_all_heads():
    torch.manual_seed(0)
    q, k = torch.randn(5, 64) * 3, torch.randn(5, 32)
    wq, wk = torch.rand(64) + 0.5, torch.rand(32) + 0.5
    sums = rms_sumsq_serial(q, k)
    assert sums.shape == (10,) and sums.dtype == torch.float32
    got_q, got_k = rms_apply_serial(q, k, wq, wk, sums, 1, EPS)
    torch.testing.assert_close(got_q, _rms_norm(q, wq))
    torch.testing.assert_close(got_k, _rms_norm(k, wk))


def test_two_ranks_with_their_sums_added_give_the_full_norm():
    """Under TP each rank holds half the heads; SGLang all-reduces the sums, then each rank
    normalises its half over the full width (`tp_world` 2)."""
    torch.manual_seed(1)
    q, k = torch.randn(3, 64), torch.randn(3, 32)
    wq, wk = torch.rand(64) + 0.5, torch.rand(32) + 0.5
    halves = [(q[:, :32], k[:, :16], wq[:32], wk[:16]), (q[:, 32:], k[:, 16:], wq[32:], wk[16:])]
    total = sum(rms_sumsq_serial(hq, hk) for hq, hk, _, _ in halves)  # the all-reduce
    out = [rms_apply_serial(hq, hk, a, b, total, 2, EPS) for hq, hk, a, b in halves]
    torch.testing.assert_close(torch.cat([out[0][0], out[1][0]], -1), _rms_norm(q, wq))
    torch.testing.assert_close(torch.cat([out[0][1], out[1][1]], -1), _rms_norm(k, wk))


def test_bf16_rows_are_normalised_in_float32():
    q, k = (torch.randn(2, 16) * 100).bfloat16(), torch.randn(2, 8).bfloat16()
    w = torch.ones(16, dtype=torch.bfloat16)
    got, _ = rms_apply_serial(q, k, w, torch.ones(8, dtype=torch.bfloat16), rms_sumsq_serial(q, k), 1, EPS)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _rms_norm(q.float(), 1.0), atol=0.02, rtol=0.01)

"""FlashInfer's paged prefill in PyTorch, for CPU tests of `draft/flashinfer_attention.py`.

`PagedPrefill` keeps the contract of `flashinfer.BatchPrefillWithPagedKVCacheWrapper` that our
attention relies on (FlashInfer 0.7.2, `prefill.py`): `plan` records the query indptr and the
mask, and points the wrapper at the page indices (eager: the tensor given; graph mode: copied
into the fixed buffer); `run` reads the KV lengths from `_paged_kv_indptr_buf` and the pages
from `_paged_kv_indices_buf`, page size 1, with `flashinfer_mask`. `installed` puts it in
`sys.modules["flashinfer"]` and lets the attention be built on a CPU store.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch


def flashinfer_mask(qo_len: int, kv_len: int, causal: bool, window_left: int) -> torch.Tensor:
    """FlashInfer's fa2 prefill mask for one request, [qo_len, kv_len] (True: may attend).

    From include/flashinfer/attention/{prefill.cuh: logits_mask, variants.cuh: LogitsMask}:
    causal keeps kv_idx + qo_len <= kv_len + q_idx; a window keeps
    kv_idx + qo_len + window_left >= kv_len + q_idx.
    """
    q = torch.arange(qo_len)[:, None]
    k = torch.arange(kv_len)[None, :]
    keep = torch.ones(qo_len, kv_len, dtype=torch.bool)
    if causal:
        keep &= k + qo_len <= kv_len + q
    if window_left >= 0:
        keep &= k + qo_len + window_left >= kv_len + q
    return keep


class PagedPrefill:
    """A stand-in `BatchPrefillWithPagedKVCacheWrapper` (NHD, page size 1)."""

    def __init__(
        self,
        workspace,
        kv_layout="NHD",
        backend="fa2",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
    ):
        self.graph_mode = use_cuda_graph
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self.plans = []  # (args, kwargs) of every plan

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, heads, kv_heads, head_dim, page, **kw):
        self.plans.append(((qo_indptr, kv_indptr, kv_indices), kw))
        self.qo_indptr = qo_indptr.tolist()
        self.causal, self.window_left, self.scale = kw["causal"], kw["window_left"], kw["sm_scale"]
        if self.graph_mode:  # what a captured run reads: the fixed buffers
            self._paged_kv_indptr_buf.copy_(kv_indptr)
            self._paged_kv_indices_buf[: kv_indices.shape[0]].copy_(kv_indices)
        else:
            self._paged_kv_indptr_buf, self._paged_kv_indices_buf = kv_indptr, kv_indices

    def workspace_size(self, *args, **kwargs):
        return 1024, 1024

    def reset_workspace_buffer(self, float_workspace, int_workspace):
        pass

    def run(self, q: torch.Tensor, kv: tuple) -> torch.Tensor:
        # q [rows, heads, d]; kv: ([N, 1, kv_heads, d], [N, 1, kv_heads, d]) -> [rows, heads, d]
        k_cache, v_cache = (t[:, 0].float() for t in kv)
        indptr, indices = self._paged_kv_indptr_buf.tolist(), self._paged_kv_indices_buf.long()
        out = torch.empty_like(q)
        groups = q.shape[1] // k_cache.shape[1]
        for i in range(len(self.qo_indptr) - 1):
            rows = slice(self.qo_indptr[i], self.qo_indptr[i + 1])
            pages = indices[indptr[i] : indptr[i + 1]]
            keys = k_cache[pages].repeat_interleave(groups, dim=1)  # [kv_len, heads, d]
            values = v_cache[pages].repeat_interleave(groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * self.scale
            keep = flashinfer_mask(scores.shape[1], scores.shape[2], self.causal, self.window_left)
            probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
            out[rows] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        return out


@contextlib.contextmanager
def installed(monkeypatch):
    """`flashinfer` as this stand-in, and FlashInfer's draft attention buildable on CPU."""
    from sglang_dflash.draft import flashinfer_attention as fia

    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = PagedPrefill
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fia, "unavailable_reason", lambda *args, **kwargs: None)
    yield

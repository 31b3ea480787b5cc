"""The target's forward over a decode step's verify window, keeping the captured layers the
draft's injection reads (`CaptureHiddenMode.FULL`):

* `verify_forward`: one TARGET_VERIFY forward over `[bonus, d1 .. d_{W-1}]`, a causal chain.
* `decode_forward`: at W = 1 (no draft), the target's ordinary DECODE forward. A speculative
  server's graph runner holds TARGET_VERIFY graphs (SGLang captures the verify, not the
  decode), and SGLang would replay one on this DECODE batch: its width check passes a batch
  without spec_info. So the forward runs eager unless the runner's graphs are DECODE graphs
  (`replays_decode`).

Each returns SGLang's `GenerationBatchResult`; the batch's lengths and mode are restored after.
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.dflash_info import DFlashVerifyInput


def verify_forward(
    target_worker, batch, candidates: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
):
    """One TARGET_VERIFY forward of the target over the window `candidates` [bs, W] at
    `positions` [bs, W], a plain causal chain, written to `slots` [bs, W]."""
    width = candidates.shape[1]
    verify_input = DFlashVerifyInput(
        draft_token=candidates.reshape(-1),
        positions=positions.reshape(-1),
        draft_token_num=width,
        custom_mask=None,
        capture_hidden_mode=CaptureHiddenMode.FULL,
    )
    batch.out_cache_loc = slots.reshape(-1)
    # Attention planning reads host lengths; during verify they cover the window too.
    seq_lens_cpu, seq_lens_sum = batch.seq_lens_cpu, batch.seq_lens_sum
    if seq_lens_cpu is not None:
        batch.seq_lens_cpu = seq_lens_cpu + width
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    # Planning is left to the forward (ModelRunner plans a verify batch that is not marked
    # planned, once, eager or graphed); planning here too would plan every verify twice.
    forward_batch, _ = verify_input.prepare_for_verify(batch, target_worker, defer_metadata_init=True)
    batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum
    return target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True)


def replays_decode(graph_runner) -> bool:
    """Whether SGLang may replay `graph_runner`'s graphs for a DECODE batch: it captured DECODE
    graphs (or says nothing of its mode: none, or SGLang's eager runner, which replays nothing).
    A TARGET_VERIFY runner does not: its graphs read a verify window's inputs, and on FlashInfer
    its metadata update asserts the verify's prefix lengths."""
    mode = getattr(graph_runner, "capture_forward_mode", None)
    return mode is None or mode == ForwardMode.DECODE


def decode_forward(target_worker, batch, bonus: torch.Tensor, slots: torch.Tensor):
    """W = 1: the target's ordinary DECODE forward over each request's bonus token [bs, 1],
    written to `slots` [bs, 1], keeping the captured layers for the draft's injection; eager
    when the model runner's graphs are verify graphs (`replays_decode`)."""
    runner = target_worker.model_runner
    graph_runner = runner.decode_cuda_graph_runner
    seq_lens, seq_lens_cpu, seq_lens_sum = batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum
    forward_mode, spec_info = batch.forward_mode, batch.spec_info
    # A decode forward's lengths include its input token. It is a plain decode: no speculative
    # input (the draft's would reach the attention backend's planning, which on SGLang's Triton
    # backend reads a `kv_indptr` from any spec_info it is given).
    batch.forward_mode, batch.spec_info = ForwardMode.DECODE, None
    batch.input_ids = bonus.view(-1)
    batch.out_cache_loc = slots.view(-1)
    batch.seq_lens = seq_lens + 1
    if seq_lens_cpu is not None:
        batch.seq_lens_cpu = seq_lens_cpu + 1
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    try:
        if not replays_decode(graph_runner):
            runner.decode_cuda_graph_runner = None  # eager; put back below
        return target_worker.forward_batch_generation(
            batch, capture_hidden_mode=CaptureHiddenMode.FULL, is_verify=True
        )
    finally:
        runner.decode_cuda_graph_runner = graph_runner
        batch.forward_mode, batch.seq_lens, batch.spec_info = forward_mode, seq_lens, spec_info
        batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum

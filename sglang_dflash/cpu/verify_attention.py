"""TARGET_VERIFY on SGLang's `torch_native` attention backend.

The backend's extend path reads `extend_prefix_lens`/`extend_seq_lens`, which SGLang leaves
unset for TARGET_VERIFY, and there `seq_lens` is the committed prefix only. A verify window of
width W over a prefix of length P is exactly an extend of W tokens after P, so for the call we
present it as one: prefix P, extend W, total P + W; the stock causal SDPA then computes the
chain verify attention.
"""

from __future__ import annotations

import torch


def forward_extend(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    saved = (forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, forward_batch.seq_lens)
    prefix = forward_batch.seq_lens
    width = forward_batch.spec_info.draft_token_num
    forward_batch.extend_prefix_lens = prefix
    forward_batch.extend_seq_lens = torch.full_like(prefix, width)
    forward_batch.seq_lens = prefix + width
    try:
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, forward_batch.seq_lens = saved

"""The draft network and its step, on CPU and CUDA: the network (`model.py`; on CUDA in fused
kernels, `fused_forward.py`), its attention over the draft KV store (`attention.py`, FlashInfer's
in `flashinfer_attention.py`; the store in `kv_store.py`, and the writes queued by steps without
a draft in `deferred_injection.py`), the block's layout (`block.py`), the
step eager or from CUDA graphs (`step.py`), and what it borrows from the target: captured
features (`target_features.py`) and the embedding and LM head (`target_head.py`), sharded under
tensor parallelism (`tensor_parallel.py`).

Imports `propose/` (each family's head holds draft weights) and `checkpoint/`. No SGLang or
FlashInfer at import time: the GPU kit runs this folder without them.
See docs/architecture.md ("How it works") and docs/gpu.md.
"""

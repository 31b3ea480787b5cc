"""One component at a time, no server: the fused injection op (`ops.py`), the draft step
(`draft_step.py`), sampled verification's memory (`sampling_memory.py`), training's block
attention (`block_attention.py`) and training throughput (`train.py`). See docs/gpu.md and
docs/training.md."""

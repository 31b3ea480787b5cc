"""Tensor-parallel ranks as threads in one process, for the pure functions' tests."""

import threading

import torch

from sglang_dflash.draft.tensor_parallel import TensorParallel


class ThreadGroup:
    """`size` ranks as threads in this process, with lockstep collectives (for the pure
    functions; tests/unit/draft/test_tensor_parallel.py runs the draft itself in a real gloo
    group)."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size

    def _exchange(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = x
        self.barrier.wait()
        out = torch.stack(list(self.slots))
        self.barrier.wait()  # everyone has read before the next exchange writes
        return out

    def run(self, fn):
        results = [None] * self.size

        def body(rank):
            tp = TensorParallel(
                rank=rank,
                size=self.size,
                all_reduce=lambda x: self._exchange(rank, x).sum(0),
                all_gather=lambda x: self._exchange(rank, x),
            )
            results[rank] = fn(tp)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

"""`Ranks`: the training processes of a data-parallel run, and their one reduction per step.

`torchrun --nproc_per_node N -m sglang_dflash.train ...` starts N processes with RANK,
WORLD_SIZE and LOCAL_RANK set; each holds the whole draft and the whole target, and trains on its
strided share of every optimizer step's examples (`data.shard`). After the step's micro-batches,
one all-reduce sums every gradient across ranks (gloo on CPU, NCCL on CUDA) and one more the
step's metrics and counts; every rank then takes the same optimizer step. A rank whose share
of a micro-batch is empty just adds nothing, so every rank makes exactly the same collective
calls and none waits for a collective another will not make.

This is what DDP computes (DDP averages where this sums; the loss here is normalised after the
sum, over the whole step's labels). DDP's wrapper is not used because the objective calls the
draft's parts (feature fusion, context K/V, layers), not one `forward`; the cost is that the
gradient reduction does not overlap the backward. A single process is world 1, with no
process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, device_type: str) -> "Ranks":
        """The process group torchrun describes in the environment (none: one process)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        return cls(rank=dist.get_rank(), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the logs, checkpoints and the export."""
        return self.rank == 0

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place."""
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Every parameter's gradient summed over the ranks, through one flat buffer (a rank with
        no labels this step contributes zeros)."""
        params = list(params)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def close(self) -> None:
        """At the end of the run: every rank waits for rank 0's export, then leaves the group."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

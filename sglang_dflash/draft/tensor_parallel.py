"""The draft's tensor-parallel shard: which slice of each weight this rank holds, and the
collectives that put the pieces back together.

The draft is sharded like SGLang shards the target (Megatron style): `q/k/v_proj` and
`gate/up_proj` are split by output rows (attention heads, KV heads, MLP columns), `o_proj` and
`down_proj` by input columns, and their outputs are summed across ranks (`all_reduce`). `fc`,
the norms and RoPE are replicated. So each rank attends over its own heads and keeps only its
KV heads in the draft KV store, which is what SGLang budgets per rank.

The target's LM head is vocab-parallel: each rank's logits cover a contiguous slice of the
(padded) vocab, rank r the ids `[r*P, (r+1)*P)`. Proposals come from `vocab_parallel_argmax`,
which gathers one (max, id) pair per row and rank instead of the logits.

`TensorParallel()` (size 1) is the unsharded draft: every collective is the identity.

See docs/serving.md ("Tensor parallelism").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


def _stack_one(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # x -> the sum of x over ranks (may reuse x's storage)
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda x: x, repr=False)
    # x [...] -> [size, ...]: every rank's x, in rank order
    all_gather: Callable[[torch.Tensor], torch.Tensor] = field(default=_stack_one, repr=False)

    @classmethod
    def from_sglang(cls) -> "TensorParallel":
        """This rank of SGLang's TP group (the group the target's parallel layers use)."""
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return cls()
        return cls(
            rank=group.rank_in_group,
            size=group.world_size,
            all_reduce=group.all_reduce,
            all_gather=lambda x: group.all_gather(x.unsqueeze(0), dim=0),
        )

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, KV heads, MLP columns); an error naming both
        numbers when it does not divide."""
        if total % self.size:
            raise ValueError(
                f"the draft's {what} ({total}) do not divide by the tensor-parallel size ({self.size})"
            )
        return total // self.size

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of `tensor` along `dim`. E.g., rank 1 of 2, [4, 6] on
        dim 0 -> rows 2..3."""
        if self.size == 1:
            return tensor
        part = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * part, part)


def vocab_parallel_argmax(
    local_logits: torch.Tensor, vocab_start: int, num_valid: int, tp: TensorParallel
) -> torch.Tensor:
    """The argmax over the whole vocab of logits sharded by vocab, ties to the lowest id (the
    rule of `torch.argmax`), with one gather of a (max, id) pair per row and rank.

    local_logits [..., P]: this rank's slice, column j is token `vocab_start + j`; columns from
    `num_valid` on are vocab padding. -> [...] int64 token ids, the same on every rank.

    E.g., two ranks, P = 3: rank 0 holds [1, 5, 5] (ids 0-2), rank 1 holds [5, 2, 0] (ids 3-5):
    local (max, id) pairs (5, 1) and (5, 3); the first rank with the max wins -> 1.
    """
    valid = local_logits[..., :num_valid].float()
    if num_valid > 0:
        values, index = valid.max(dim=-1)  # the first maximum: the lowest id in this shard
    else:  # a rank whose slice is all padding
        values = torch.full(local_logits.shape[:-1], float("-inf"), device=local_logits.device)
        index = torch.zeros(local_logits.shape[:-1], dtype=torch.int64, device=local_logits.device)
    ids = index.to(torch.int64) + vocab_start
    all_values = tp.all_gather(values)  # [size, ...]
    all_ids = tp.all_gather(ids)  # [size, ...]
    # Ranks hold increasing id ranges, so the first rank with the max holds the lowest id.
    best = all_values.argmax(dim=0, keepdim=True)
    return all_ids.gather(0, best).squeeze(0)


def vocab_parallel_topk(
    local_logits: torch.Tensor, k: int, vocab_start: int, num_valid: int, tp: TensorParallel
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k over the whole vocab of logits sharded by vocab, gathering k (value, id) pairs
    per row and rank instead of the vocab (SGLang's `candidate_topk` does the same).

    local_logits [..., P] (as `vocab_parallel_argmax`) -> values [..., k] float32 and ids
    [..., k] int64, sorted by value, the same on every rank.
    E.g., two ranks, k 2: rank 0 holds [1, 5, 4] (ids 0-2), rank 1 [6, 2, 0] (ids 3-5): local
    pairs (5, 1), (4, 2) and (6, 3), (2, 4) -> values [6, 5], ids [3, 1].
    """
    valid = local_logits[..., :num_valid].float()
    if num_valid < k:  # a rank holding fewer than k real tokens (or only padding)
        pad = valid.new_full((*valid.shape[:-1], k - num_valid), float("-inf"))
        valid = torch.cat([valid, pad], dim=-1)
    values, index = valid.topk(k, dim=-1)
    ids = index.to(torch.int64) + vocab_start
    if tp.size == 1:
        return values, ids
    all_values = tp.all_gather(values).movedim(0, -2).flatten(-2)  # [..., size*k]
    all_ids = tp.all_gather(ids).movedim(0, -2).flatten(-2)
    values, best = all_values.topk(k, dim=-1)
    return values, all_ids.gather(-1, best)


def vocab_parallel_logsumexp(local_logits: torch.Tensor, num_valid: int, tp: TensorParallel) -> torch.Tensor:
    """log(sum(exp(logits))) over the whole vocab of logits sharded by vocab, in float32, with one
    gather of a value per row and rank: each rank's over its real tokens, then theirs.

    local_logits [..., P] (as `vocab_parallel_argmax`) -> [...], the same on every rank.
    """
    local = torch.logsumexp(local_logits[..., :num_valid].float(), dim=-1)  # -inf on an all-padding rank
    if tp.size == 1:
        return local
    return torch.logsumexp(tp.all_gather(local), dim=0)


def check_ranks_agree(tp: TensorParallel, **tensors: torch.Tensor) -> None:
    """Raise unless every rank holds the same values of each tensor (a debugging check: it
    gathers and syncs the host, so it runs only under SGLANG_DFLASH_CHECK_RANKS=1)."""
    for name, tensor in tensors.items():
        gathered = tp.all_gather(tensor)  # [size, ...]
        mismatch = gathered != gathered[:1]  # [size, ...]
        if mismatch.any():
            rank, *index = mismatch.nonzero()[0].tolist()
            raise RuntimeError(
                f"DFLASH tensor-parallel ranks disagree on {name}: rank {rank} holds "
                f"{gathered[rank][tuple(index)].item()} at {tuple(index)}, rank 0 "
                f"{gathered[0][tuple(index)].item()} (rank {tp.rank} of {tp.size}: {tensor.tolist()})"
            )

"""Domino's projector: proposals rolled out greedily, each slot's base logits corrected by a GRU
over the tokens proposed before it (SGLang: models/dflash.py builds the weights,
speculative/domino_utils.py `domino_greedy_rollout` computes the rollout).

For a request with bonus token t0 and the draft's final hidden states z_1 .. z_n at its n proposal
slots (window rows 1..n, or 0..n-1 with `shift_label`), with the target's LM head W and
embedding E:

    base_i = z_i W^T                                    [V]: what a plain draft takes the argmax of
    d_1    = argmax base_1
    h      = GRU(E[t0], E[d_1])                         the prefix GRU from a zero state
    d_i    = argmax(base_i + embed_proj([z_i, h]))      i = 2 .. n, then h = GRUCell(E[d_i], h)

`embed_proj` is Linear(H + g -> e), SiLU, Linear(e -> V). With a candidate pool of P tokens
(0 < P < V, `--speculative-domino-candidate-pool-size`, SGLang's default 2048) the argmax of
slots 2..n runs over one pool per request: the P tokens with the highest base logit over the
trained block's slots 2..B-1, also when the step verifies a narrower window (n < B-1), so that
the window's proposals are the first n of SGLang's rollout over the block. Every proposal is a
deterministic function of the step's state (a point mass), so the plain verify stays exact.

The rollout is sequential in the slot: one batched iteration per slot (n = W - 1, at most 15
for the usual block of 16), as in SGLang; no host sync.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

DEFAULT_POOL_SIZE = 2048  # SGLang's --speculative-domino-candidate-pool-size default


class PrefixGRU(nn.Module):
    """A one-layer GRU without biases, under the names of the checkpoint's `nn.GRU`
    (`prefix_gru.weight_ih_l0` [3g, H], `prefix_gru.weight_hh_l0` [3g, g])."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.weight_ih_l0 = nn.Parameter(torch.empty(3 * hidden_size, input_size))
        self.weight_hh_l0 = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))

    def step(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x [bs, H], h [bs, g] -> the next state [bs, g] (PyTorch's GRU cell)."""
        return torch.gru_cell(x, h, self.weight_ih_l0, self.weight_hh_l0, None, None)


def embed_projector(hidden_size: int, gru_hidden_dim: int, emb_dim: int, vocab_size: int) -> nn.Sequential:
    """`embed_proj`: Linear(H + g -> e), SiLU, Linear(e -> V), all without bias (names .0, .2)."""
    return nn.Sequential(
        nn.Linear(hidden_size + gru_hidden_dim, emb_dim, bias=False),
        nn.SiLU(),
        nn.Linear(emb_dim, vocab_size, bias=False),
    )


def rollout(
    base: torch.Tensor,
    z: torch.Tensor,
    bonus: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    gru: PrefixGRU,
    embed_proj: nn.Sequential,
    pool_size: int,
    with_scores: bool = False,
    pool_logits: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """base [bs, n, V] (the LM head over z), z [bs, n, H], bonus [bs] -> proposals [bs, n] int64,
    and with `with_scores` each slot's corrected logits [bs, n, V] (-inf outside the pool), which a
    grammar ranks its candidates by. pool_logits [bs, m, V], m >= n: the base logits the pool is
    chosen over, slots 2..m (default `base`); a window narrower than the trained block passes the
    whole block's, so its pool is the one SGLang's rollout over the block uses."""
    bs, n, vocab = base.shape
    first = torch.argmax(base[:, 0], dim=-1)  # [bs]
    proposals = [first]
    scores = [base[:, 0]] if with_scores else None
    if n == 1:
        return first[:, None], _stacked(scores)
    pool = None
    if 0 < pool_size < vocab:
        # [bs, P]: the tokens with the best base logit over slots 2..m, shared by those slots.
        over = base if pool_logits is None else pool_logits  # [bs, m, V]
        pool = torch.topk(over[:, 1:].amax(dim=1), k=pool_size, dim=-1, sorted=False).indices
        pool_base = base.gather(2, pool[:, None, :].expand(bs, n, pool_size))  # [bs, n, P]
        pool_weight = embed_proj[2].weight[pool]  # [bs, P, e]: the pool's rows of the last Linear
    h = gru.weight_ih_l0.new_zeros(bs, gru.hidden_size)
    for token in (bonus, first):  # the prefix GRU over [t0, d_1]
        h = gru.step(embed(token), h)
    for i in range(1, n):
        e = embed_proj[1](embed_proj[0](torch.cat([z[:, i], h.to(z.dtype)], dim=-1)))  # [bs, e]
        if pool is None:
            corrected = base[:, i] + embed_proj[2](e)  # [bs, V]
            token = torch.argmax(corrected, dim=-1)
        else:
            corrected = pool_base[:, i] + torch.bmm(pool_weight, e[:, :, None])[:, :, 0]  # [bs, P]
            token = pool.gather(1, torch.argmax(corrected, dim=-1, keepdim=True))[:, 0]
            if with_scores:
                corrected = torch.full_like(base[:, i], float("-inf")).scatter_(1, pool, corrected)
        proposals.append(token)
        if with_scores:
            scores.append(corrected)
        if i + 1 < n:
            h = gru.step(embed(token), h)
    return torch.stack(proposals, dim=1), _stacked(scores)


def _stacked(scores: Optional[list[torch.Tensor]]) -> Optional[torch.Tensor]:
    return None if scores is None else torch.stack(scores, dim=1)

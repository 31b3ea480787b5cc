"""Exact verification of proposals the draft sampled: speculative sampling with the draft's q.

Terms are those of `acceptance.py` and `sampling.py`. A sampled walk (DFlash2's selector,
`propose/selector.py`) draws proposal d_{t+1} from q_t, a distribution over K candidates, given the
window so far. Row t of the verify, with p_t the target's filtered distribution at that row
(`sampling.filtered_probs`: temperature, top-k, top-p, min_p, after every logit adjustment):

  * accept d_{t+1} with probability min(1, p_t(d) / q_t(d))  (u q_t(d) < p_t(d), u ~ U[0, 1));
  * at the first rejection emit r_t ~ (p_t - q_t)+ renormalised, and stop;
  * after W-1 acceptances emit the bonus from p_{W-1}.

Why this is exact: P(emit x at row t | history) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y),
q(y))) (p(x) - q(x))+ / sum_y (p(y) - q(y))+ = min(p(x), q(x)) + (p(x) - q(x))+ = p(x), because
sum_y (p - q)+ = 1 - sum_y min(p, q). The row is reached only with the history it conditions on,
and its randomness (the walk's draw, u, the residual draw) is fresh, so by induction over emitted
tokens the output has the target's law, as for `sampling.sampled_verify` (whose rule is this one
with q a point mass). Greedy rows take the target's argmax (their walk was greedy too).

A rejected d has p(d) < q(d), so the residual gives it no mass and r_t != d: the draws below can
be checked against the proposals by `greedy_verify`, like `sampled_verify`'s.

Randomness: unseeded rows draw from the given generator; seeded rows (`sampling_seed`) hash
(seed, position, column) as `sampling.seeded_gumbel` does, the acceptance uniform on its own
column (`ACCEPT_COLUMN`), so a seeded request's tokens depend only on its seed and history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang_dflash.verify.acceptance import greedy_verify
from sglang_dflash.verify.sampling import (
    SamplingRows,
    _temperature_softmax,
    filtered_probs,
    rows_per_draw,
    seeded_gumbel,
    seeded_uniforms,
)

ACCEPT_COLUMN = 0xFFFFFFFF  # the acceptance uniform's hash column (no token id is this large)


@dataclass
class DraftQ:
    """The draft distribution each proposal was drawn from: q_t over K candidate ids."""

    ids: torch.Tensor  # [bs, W-1, K] int64
    probs: torch.Tensor  # [bs, W-1, K] float32, rows sum to 1

    def pinned(self, tokens: torch.Tensor) -> "DraftQ":
        """Where `tokens` [bs, W-1] differ from what was drawn (a grammar re-picked them), the
        point mass on the new token: a deterministic proposal."""
        drawn = (self.ids == tokens[..., None]) & (self.probs > 0)
        changed = ~drawn.any(dim=-1)  # [bs, W-1]
        point_ids = self.ids.clone()
        point_ids[..., 0] = tokens
        point_probs = torch.zeros_like(self.probs)
        point_probs[..., 0] = 1.0
        return DraftQ(
            torch.where(changed[..., None], point_ids, self.ids),
            torch.where(changed[..., None], point_probs, self.probs),
        )


def q_sampled_verify(
    candidates: torch.Tensor,
    logits: torch.Tensor,
    rows: SamplingRows,
    q: DraftQ,
    positions: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    max_rows: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """candidates [bs, W] = [bonus, d1..d_{W-1}]; logits [bs, W, V] adjusted; rows: bs requests;
    q: the proposals' draft distributions; positions [bs, W] (seeded rows); generator: unseeded
    noise; max_rows: window rows drawn at once (default `sampling.rows_per_draw`).
    Returns accept_len [bs], out_tokens [bs, W], new_bonus [bs], `greedy_verify`'s contract."""
    if rows.seeds is not None and positions is None:
        raise ValueError("q_sampled_verify: rows.seeds is set, so positions are required")
    bs, width = candidates.shape
    k = q.ids.shape[-1]
    # The last row proposes nothing: its q is empty and its draw is the bonus, from p.
    pad = torch.zeros(bs, 1, k, device=candidates.device)
    q_ids = torch.cat([q.ids, pad.long()], dim=1).reshape(bs * width, k)
    q_probs = torch.cat([q.probs.float(), pad], dim=1).reshape(bs * width, k)
    proposed = torch.cat([candidates[:, 1:], candidates[:, :1]], dim=1).reshape(-1)  # last: unused
    has_proposal = (torch.arange(width, device=candidates.device) < width - 1).repeat(bs)
    flat_rows = rows.repeat_rows(width)
    flat_logits = logits.reshape(bs * width, -1)
    flat_positions = None if positions is None else positions.reshape(-1)
    max_rows = max_rows or rows_per_draw(flat_logits.shape[-1])
    draws = []
    for start in range(0, bs * width, max_rows):  # chunks bound the transient memory
        end = start + max_rows
        draws.append(
            _draw(
                flat_logits[start:end],
                flat_rows.rows(start, end),
                proposed[start:end],
                has_proposal[start:end],
                q_ids[start:end],
                q_probs[start:end],
                None if flat_positions is None else flat_positions[start:end],
                generator,
            )
        )
    return greedy_verify(candidates, torch.cat(draws).view(bs, width).to(candidates.dtype))


def _draw(logits, rows, proposed, has_proposal, q_ids, q_probs, positions, generator) -> torch.Tensor:
    """Rows drawn at once: each emits its proposal if accepted, else a residual draw. [n] int64."""
    if rows.need_filter:
        p = filtered_probs(logits, rows.temperatures, rows.top_ks, rows.top_ps, rows.min_ps)  # [n, V]
    else:
        p = _temperature_softmax(logits, rows.temperatures)
    q = torch.zeros_like(p).scatter_add_(1, q_ids, q_probs)  # [n, V]
    p_d = p.gather(1, proposed[:, None])[:, 0]
    q_d = q.gather(1, proposed[:, None])[:, 0]
    if rows.seeds is None:
        u = torch.rand(p_d.shape, generator=generator, device=p.device)
    else:
        u = seeded_uniforms(rows.seeds, positions, ACCEPT_COLUMN)
    accepted = has_proposal & (u * q_d < p_d)
    residual = (p - q).clamp_min_(0.0)
    # No residual mass means p <= q everywhere, i.e. p == q: such a row never rejects.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    if rows.seeds is None:
        noise = torch.empty_like(residual).exponential_(generator=generator)
        scores = residual / noise.clamp_min_(torch.finfo(torch.float32).tiny)
    else:
        columns = torch.arange(p.shape[-1], device=p.device)
        scores = residual.double().log() + seeded_gumbel(rows.seeds, positions, columns)
    drawn = torch.where(accepted, proposed, scores.argmax(dim=-1))
    return torch.where(rows.is_greedy, torch.argmax(logits, dim=-1), drawn)

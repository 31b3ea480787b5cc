"""Pure functions for block verification: which proposals the target accepts.

Terms: the verify window of a request is `[bonus, d1 .. d_{B-1}]`, where `bonus` is the token
the previous step emitted (its KV is not written yet) and `d_i` are the draft's proposals.
The target's forward over the window yields one prediction per position. `accept_len` counts
the leading proposals equal to the target's own predictions; the token after them is the new
bonus. The step commits `accept_len + 1` tokens (bonus, d1 .. d_accept), and emits
`d1 .. d_accept, new bonus`.

See docs/architecture.md ("How it works").
"""

from __future__ import annotations

import torch


def greedy_verify(
    candidates: torch.Tensor, target_predict: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Longest prefix of proposals equal to the target's argmax, plus the target's next token.

    candidates [bs, B] = [bonus, d1..d_{B-1}]; target_predict [bs, B] = target argmax at each
    position. Returns accept_len [bs], out_tokens [bs, B] (row: d1..d_acc, new bonus, 0...),
    new_bonus [bs].
    E.g., candidates [5, 8, 2, 4], predict [8, 2, 7, 1] -> accept_len 2, out [8, 2, 7, 0], bonus 7.
    """
    matches = candidates[:, 1:] == target_predict[:, :-1]  # [bs, B-1]
    accept_len = matches.to(torch.int32).cumprod(dim=1).sum(dim=1)  # [bs]
    new_bonus = target_predict.gather(1, accept_len[:, None].to(torch.int64)).squeeze(1)
    # Accepted proposals equal the target's predictions, so the emitted row is the target's
    # predictions up to and including the bonus position.
    cols = torch.arange(candidates.shape[1], device=candidates.device)
    out_tokens = torch.where(cols[None, :] <= accept_len[:, None], target_predict, 0)
    return accept_len, out_tokens, new_bonus


def forced_acceptance(
    candidates: torch.Tensor,
    target_predict: torch.Tensor,
    commit_len: int,
    *,
    real_draft_tokens: bool,
    fixed_token_id: int = 100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Benchmark-only acceptance (SGLANG_SIMULATE_ACC_LEN): every request commits `commit_len`.

    Same outputs as `greedy_verify`. With `real_draft_tokens`, the emitted row is the first
    commit_len-1 proposals plus the target's prediction after them; otherwise every emitted
    token is `fixed_token_id`, as in SGLang's built-in "fixed" token mode.
    E.g., candidates [5, 8, 2, 4], predict [8, 3, 7, 1], commit_len 3 -> out [8, 2, 7, 0].
    """
    bs, width = candidates.shape
    accept = commit_len - 1
    accept_len = torch.full((bs,), accept, dtype=torch.int32, device=candidates.device)
    cols = torch.arange(width, device=candidates.device)[None, :]
    if real_draft_tokens:
        bonus = target_predict[:, accept]
        shifted = torch.cat([candidates[:, 1:], bonus[:, None]], dim=1)  # [d1..d_{B-1}, bonus]
        emitted = torch.where(cols < accept, shifted, bonus[:, None])
    else:
        bonus = torch.full((bs,), fixed_token_id, dtype=candidates.dtype, device=candidates.device)
        emitted = torch.full_like(candidates, fixed_token_id)
    out_tokens = torch.where(cols <= accept, emitted, 0)
    return accept_len, out_tokens, bonus


def simulated_acceptance(candidates: torch.Tensor, logits: torch.Tensor, setting) -> tuple:
    """SGLang's benchmark knob (`knobs.SimulatedAcceptance`), as its built-in DFLASH applies it:
    a commit length drawn by SGLang, then `forced_acceptance`. logits [bs*W, V]."""
    from sglang.srt.speculative.spec_utils import sample_simulated_acc_len

    commit_len = sample_simulated_acc_len(setting.mean, setting.method, candidates.shape[1])
    target_predict = torch.argmax(logits, dim=-1).view(candidates.shape)
    return forced_acceptance(
        candidates, target_predict, commit_len, real_draft_tokens=setting.token_mode == "real-draft-token"
    )

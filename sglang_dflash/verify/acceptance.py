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

import functools

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
    commit_len,
    *,
    real_draft_tokens: bool,
    fixed_token_id: int = 100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Benchmark-only acceptance (SGLANG_SIMULATE_ACC_LEN): every request commits `commit_len`
    (an int, or one per request: [bs] on the device).

    Same outputs as `greedy_verify`. With `real_draft_tokens`, the emitted row is the first
    commit_len-1 proposals plus the target's prediction after them; otherwise every emitted
    token is `fixed_token_id`, as in SGLang's built-in "fixed" token mode.
    E.g., candidates [5, 8, 2, 4], predict [8, 3, 7, 1], commit_len 3 -> out [8, 2, 7, 0].
    """
    bs, width = candidates.shape
    device = candidates.device
    accept = (torch.as_tensor(commit_len, device=device) - 1).to(torch.int64).expand(bs)  # [bs]
    accept_len = accept.to(torch.int32)
    cols = torch.arange(width, device=device)[None, :]
    if real_draft_tokens:
        bonus = target_predict.gather(1, accept[:, None]).squeeze(1)
        shifted = torch.cat([candidates[:, 1:], bonus[:, None]], dim=1)  # [d1..d_{B-1}, bonus]
        emitted = torch.where(cols < accept[:, None], shifted, bonus[:, None])
    else:
        bonus = torch.full((bs,), fixed_token_id, dtype=candidates.dtype, device=device)
        emitted = torch.full_like(candidates, fixed_token_id)
    out_tokens = torch.where(cols <= accept[:, None], emitted, 0)
    return accept_len, out_tokens, bonus


@functools.lru_cache(maxsize=None)
def geometric_rate(mean: float, full_width: int) -> float:
    """The per-position acceptance rate a at which E[commit | B] = 1 + a + ... + a^(B-1) = mean
    (bisection; mean clamped to [1, B]). E.g., (6.5, 16) -> 0.860; (3, 16) -> 0.667."""
    mean = min(max(mean, 1.0), float(full_width))
    low, high = 0.0, 1.0
    for _ in range(60):
        rate = (low + high) / 2
        expected = sum(rate**k for k in range(full_width))
        low, high = (rate, high) if expected < mean else (low, rate)
    return (low + high) / 2


def geometric_commit_lens(bs: int, width: int, rate: float, device) -> torch.Tensor:
    """[bs] commit lengths with each draft position accepted with probability `rate`,
    independently per request and position, until the first rejection (drawn on the device).
    E.g., draws [[T, T, F], [F, T, T]] -> [3, 1]."""
    accepted = torch.rand(bs, width - 1, device=device) < rate  # [bs, W-1]
    return 1 + accepted.to(torch.int32).cumprod(dim=1).sum(dim=1)


def simulated_warning(setting) -> str:
    """The start-up warning when acceptance is simulated (`knobs.SimulatedAcceptance`)."""
    return (
        f"DFLASH acceptance is SIMULATED (SGLANG_SIMULATE_ACC_LEN={setting.mean}, method={setting.method}, "
        f"tokens={setting.token_mode}): outputs are not the model's; benchmark use only"
    )


def simulated_acceptance(candidates: torch.Tensor, logits: torch.Tensor, setting, full_width: int) -> tuple:
    """SGLang's benchmark knob (`knobs.SimulatedAcceptance`), as its built-in DFLASH applies it:
    a commit length drawn by SGLang, then `forced_acceptance`. logits [bs*W, V].

    SGLang draws one length for the whole batch, the floor or ceiling of the mean: acceptance is
    all or nothing by position (at 6.5, positions 1..5 always accepted, 6 half the time, none
    after), which flatters a narrower width. With the method "geometric" (ours only,
    `SGLANG_DFLASH_SIMULATE_ACC_METHOD`), every request and position is drawn independently at
    the rate that gives the mean at the full width B (`full_width`), whatever this step's W."""
    bs, width = candidates.shape
    if setting.method == "geometric":
        commit_len = geometric_commit_lens(
            bs, width, geometric_rate(setting.mean, full_width), candidates.device
        )
    else:
        from sglang.srt.speculative.spec_utils import sample_simulated_acc_len

        commit_len = sample_simulated_acc_len(setting.mean, setting.method, width)
    target_predict = torch.argmax(logits, dim=-1).view(candidates.shape)
    return forced_acceptance(
        candidates, target_predict, commit_len, real_draft_tokens=setting.token_mode == "real-draft-token"
    )


def acceptance_for(setting, full_width: int):
    """What a step's accepted run is, chosen once at start-up: as verified, or, under SGLang's
    benchmark knob (`setting`, a `knobs.SimulatedAcceptance`), drawn by `simulated_acceptance`.
    The result maps (candidates [bs, W], logits [bs*W, V], verified (accept_len, out_tokens,
    new_bonus)) to the (accept_len, out_tokens, new_bonus) the step commits."""
    if setting is None:
        return lambda candidates, logits, verified: verified
    return lambda candidates, logits, verified: simulated_acceptance(candidates, logits, setting, full_width)

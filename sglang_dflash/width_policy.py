"""`WidthPolicy`: the verify width of each decode step, chosen for committed tokens per second.

For a step with `bs` requests it picks, among W = 1 .. B (`--speculative-num-draft-tokens`),

    W* = argmax_W  E[commit | W] / T(bs, W)

* `E[commit | W] = 1 + sum_{k=1}^{W-1} prod_{j<=k} a_j` tokens per request, where `a_k` is the
  probability that draft position k is accepted given that positions 1..k-1 were
  (`AcceptanceEstimate`, from the accepted-draft counts the scheduler brings to the host anyway).
* `T(bs, W)` is the step interval (`StepCostModel`), a linear model fitted online to the host
  time between consecutive decode steps:

      T(bs, W) = c0 + c1*bs + [W > 1] * (c2 + c3*bs) + c4 * bs*W
                 \\_ rest _/   \\______ draft ______/   \\ verify /

  `W = 1` runs no draft (the target's plain decode forward); `W > 1` runs the draft's whole block
  whatever W is, and verifies `bs*W` tokens.

Both estimates forget the past exponentially, so they follow a changing load. Widths the policy
stops choosing would never be measured again, so every `probe_every` steps it verifies a width
from `probe_widths` instead (in turn: no draft, the narrowest draft, the full width, which
refreshes every position's acceptance). Until the cost model has seen both kinds of step (with
and without the draft, and two draft widths, each twice), every step is a probe: the first six
decode steps of a server.

All of it is host arithmetic on a handful of floats: no device work and no sync.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)


def expected_commit(rates: Sequence[float]) -> np.ndarray:
    """Expected committed tokens per request at each width, from conditional acceptance rates.

    rates [B-1]: a_k for draft positions k = 1..B-1 -> [B]: E[commit | W] for W = 1..B.
    E.g., rates [0.5, 0.5] -> [1, 1.5, 1.75].
    """
    reach = np.cumprod(np.asarray(rates, dtype=np.float64))  # P(first k drafts all accepted)
    return 1.0 + np.concatenate([[0.0], np.cumsum(reach)])


def step_features(bs: int, widths: np.ndarray) -> np.ndarray:
    """The cost model's regressors for `bs` requests at each width -> [len(widths), 5].

    E.g., bs 4, widths [1, 3] -> [[1, 4, 0, 0, 4], [1, 4, 1, 4, 12]].
    """
    widths = np.asarray(widths, dtype=np.float64)
    drafted = (widths > 1).astype(np.float64)
    ones = np.ones_like(widths)
    return np.stack([ones, bs * ones, drafted, drafted * bs, bs * widths], axis=1)


class AcceptanceEstimate:
    """Exponentially weighted counts of how often each draft position was reached and accepted.

    A request-step that verified width W and accepted n drafts reached positions 1..min(n+1, W-1)
    and accepted positions 1..n. Positions a step did not verify get no evidence; as their counts
    decay, their rate returns to `prior`.
    """

    def __init__(
        self, num_draft_tokens: int, decay: float = 0.98, prior: float = 0.6, prior_weight: float = 2.0
    ):
        self.num_positions = num_draft_tokens - 1
        self.decay = decay
        self.prior = prior
        self.prior_weight = prior_weight
        self.reached = np.zeros(self.num_positions)
        self.accepted = np.zeros(self.num_positions)

    def observe(self, num_accepted: Sequence[int], width: int) -> None:
        """One verify step: accepted drafts per request (host ints) at verify width `width`."""
        self.reached *= self.decay
        self.accepted *= self.decay
        verified = min(width, self.num_positions + 1) - 1  # positions 1..verified were proposed
        if verified <= 0 or len(num_accepted) == 0:
            return
        counts = np.bincount(
            np.minimum(np.asarray(num_accepted, dtype=np.int64), verified), minlength=verified + 1
        )
        at_least = np.cumsum(counts[::-1])[::-1]  # at_least[n] = requests that accepted >= n drafts
        # Position k (1-based) is reached by requests with >= k-1 accepted, accepted by >= k.
        self.reached[:verified] += at_least[:verified]
        self.accepted[:verified] += at_least[1 : verified + 1]

    def rates(self) -> np.ndarray:
        """[B-1] conditional acceptance rate of each draft position."""
        w = self.prior_weight
        return (self.accepted + self.prior * w) / (self.reached + w)


class StepCostModel:
    """Least squares of the step interval on `step_features`, with exponential forgetting.

    Keeps the normal equations (5x5 and 5) and solves them on demand; a small ridge, relative to
    each feature's scale, keeps them solvable when the batch size never varies (predictions at
    the seen sizes are unaffected).
    """

    NUM_FEATURES = 5

    def __init__(self, draft_widths_needed: int = 2, forget: float = 0.995, ridge: float = 1e-9):
        self.draft_widths_needed = draft_widths_needed
        self.forget = forget
        self.ridge = ridge
        self.xtx = np.zeros((self.NUM_FEATURES, self.NUM_FEATURES))
        self.xty = np.zeros(self.NUM_FEATURES)
        self.coef: Optional[np.ndarray] = None
        self.seen_widths: dict[int, float] = {}  # width -> decayed sample count

    def observe(self, bs: int, width: int, seconds: float) -> None:
        x = step_features(bs, np.array([width]))[0]
        self.xtx = self.forget * self.xtx + np.outer(x, x)
        self.xty = self.forget * self.xty + seconds * x
        for w in self.seen_widths:
            self.seen_widths[w] *= self.forget
        self.seen_widths[width] = self.seen_widths.get(width, 0.0) + 1.0
        self.coef = None

    @property
    def ready(self) -> bool:
        """Enough evidence to tell the draft's cost from the verify's: steps without the draft,
        and steps at two different draft widths (each width seen at least twice, recently)."""
        seen = [w for w, n in self.seen_widths.items() if n >= 2.0]
        return 1 in seen and len([w for w in seen if w > 1]) >= self.draft_widths_needed

    def predict(self, bs: int, widths: np.ndarray) -> np.ndarray:
        """Predicted step seconds for `bs` requests at each width."""
        if self.coef is None:
            # Ridge relative to each feature's own scale (features 2 and 3 can be all zero).
            damping = self.ridge * np.maximum(np.diag(self.xtx), 1e-12)
            self.coef = np.linalg.solve(self.xtx + np.diag(damping), self.xty)
        return step_features(bs, widths) @ self.coef


class WidthPolicy:
    """Chooses each decode step's verify width; fed by the worker (step intervals) and by the
    scheduler's result processing (accepted-draft counts)."""

    def __init__(
        self,
        num_draft_tokens: int,
        *,
        probe_every: int = 32,
        acceptance: Optional[AcceptanceEstimate] = None,
        cost: Optional[StepCostModel] = None,
    ):
        self.max_width = int(num_draft_tokens)
        self.widths = np.arange(1, self.max_width + 1)
        self.acceptance = acceptance or AcceptanceEstimate(self.max_width)
        self.cost = cost or StepCostModel(draft_widths_needed=min(2, self.max_width - 1))
        self.probe_every = probe_every
        # Probes: the full width (refreshes every position's rate), no draft, the narrowest draft.
        self.probe_widths = list(dict.fromkeys([self.max_width, 1, min(2, self.max_width)]))
        self.steps = 0
        self._probes = 0

    def choose(self, bs: int) -> int:
        """The verify width for the next decode step of `bs` requests."""
        self.steps += 1
        if self.max_width == 1:
            return 1
        if not self.cost.ready or self.steps % self.probe_every == 0:
            self._probes += 1
            return self.probe_widths[self._probes % len(self.probe_widths)]
        return self.best_width(bs)

    def best_width(self, bs: int) -> int:
        commit = expected_commit(self.acceptance.rates())
        seconds = np.maximum(self.cost.predict(bs, self.widths), 1e-6)
        return int(self.widths[int(np.argmax(commit / seconds))])

    def observe_step(self, bs: int, width: int, seconds: float) -> None:
        """The host interval from the start of a decode step to the start of the next decode
        step (the worker drops intervals with a prefill or an idle batch in between). Every
        interval is kept: rejecting those far from the prediction would let a wrong model
        reject the evidence that corrects it."""
        self.cost.observe(bs, width, seconds)

    def observe_acceptance(self, num_accepted: Sequence[int], width: int) -> None:
        self.acceptance.observe(num_accepted, width)


ENV_VAR = "SGLANG_DFLASH_ADAPTIVE_WIDTH"


def policy_for(
    num_draft_tokens: int, device_type: str, env: Optional[str]
) -> tuple[Optional[WidthPolicy], str]:
    """The policy for this server, or None for the fixed width; with the reason, for the log.

    `SGLANG_DFLASH_ADAPTIVE_WIDTH=0` forces the fixed width and `=1` adapts on any device. Unset,
    it adapts on CPU only: on CUDA, SGLang captures the target's verify graphs for the full width
    alone and the decode forward of W = 1 has no graph beside them (docs/adaptive-verify-width.md).
    """
    if env not in (None, "", "0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 or 1, got {env!r}")
    if num_draft_tokens < 2:
        return None, "fixed: --speculative-num-draft-tokens is 1"
    if env == "0":
        return None, f"fixed: {ENV_VAR}=0"
    if env == "1":
        return WidthPolicy(num_draft_tokens), f"adaptive ({ENV_VAR}=1)"
    if device_type != "cpu":
        return None, (
            f"fixed on {device_type}: verify graphs exist for the full width only "
            f"(set {ENV_VAR}=1 to adapt with eager narrow steps)"
        )
    return WidthPolicy(num_draft_tokens), "adaptive (CPU default)"

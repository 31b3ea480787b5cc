"""`WidthPolicy`: the verify width of each decode step, chosen for committed tokens per second.

For a step with `bs` requests it picks, among W = 1 .. B (`--speculative-num-draft-tokens`),

    W* = argmax_W  E[commit | W] / T(bs, W)

* `E[commit | W] = 1 + sum_{k=1}^{W-1} prod_{j<=k} a_j` tokens per request, where `a_k` is the
  probability that draft position k is accepted given that positions 1..k-1 were
  (`AcceptanceEstimate`, from the accepted-draft counts the scheduler brings to the host anyway).
* `T(bs, W, C)` is the step interval (`StepCostModel`), a linear model fitted online to the
  host time between consecutive decode steps, with C the batch's committed tokens (thousands):

      T = c0 + c1*bs + [W > 1] * (c2 + c3*bs) + c4*bs*W + c5*W*C + c6*N
          \\_ rest _/   \\______ draft ______/   \\___ verify ___/  \\ results /

  `W = 1` runs no draft (the target forward over one token per request); `W > 1` runs the
  draft's whole block whatever W is, and verifies `bs*W` tokens, each attending its request's
  context. Without C the costs drift as the contexts grow, and a width measured at short
  contexts looks cheaper than one measured now. (The draft's own attention over the context
  would be one more term, but it moves with the verify's, and the two cannot be told apart
  from the few draft widths the policy measures; the corrections below absorb it.)
  N is the number of tokens whose results the scheduler handles in the interval: those the
  previous step committed under overlap scheduling, where a step's results are processed
  while the next step runs (20 to 50 us a token on the CPU engine). Charged to the interval
  they land in, a wide step would look cheaper and the narrow step after it dearer; the model
  charges them to the step that committed them, `bs * E[commit | W]` tokens. (A step timed on
  the device, `device_clock.py`, does not include that host work: there N is 0,
  `device_timed`.) Recent measurements correct the model: the one at the nearest batch size
  scales it by measured / predicted there (`WidthPolicy.step_seconds`).
* Margins against the noise of both estimates: a narrower draft width must beat the full
  width by 3%, and a draft width must beat no draft by 5%.
* No request pays for its neighbours' drafts. One width serves the whole batch, and a request
  whose drafts are rarely accepted commits about one token a step whatever the width, so a
  wide step that pays for the batch makes that request slower than no draft at all (on the
  CPU at bs 16: a 38 ms step instead of a 13 ms one, for 1.1 tokens). Each request's own
  acceptance rate is followed (`RequestAcceptance`), and a draft width is ruled out when it
  would make the batch's least-accepted request commit its tokens more than `fair_slack` (5%)
  slower than without the draft: `E_worst[commit | W] / T(bs, W) >= 1 / (T(bs, 1) (1 + slack))`.
  In fixed-length waves the slowest request sets the makespan, and without this rule it was
  the request a wide window slowed (`SGLANG_DFLASH_FAIR_SLACK=off` switches it off).

Both estimates forget the past exponentially, so they follow a changing load. Widths the policy
stops choosing would never be measured again, so every `probe_every` steps (every 4th step in
the first `early_steps`, while start-up costs settle) it verifies a probe width instead, in
turn: no draft, the full width (which refreshes every position's acceptance), no draft, the
narrowest draft. Until the cost model has seen steps with and without the draft, and two draft
widths, every step is a probe. And when the load reaches a batch size with no recent
measurement of no draft, or of the full width, within a factor 1.5, the next step measures it.
When every draft width is far from paying (below 80% of no draft's rate, or ruled out for a
request's sake), probes are 4 times rarer: a probe at the full width costs several steps
without the draft, and the poorly drafted requests pay for it.

All of it is host arithmetic on a handful of floats: no device work and no sync.

See docs/verify-width.md.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np

from sglang_dflash.knobs import FAIR_SLACK  # a draft width may make a request's tokens this much slower

ENV_VAR = "SGLANG_DFLASH_ADAPTIVE_WIDTH"
FAIR_SLACK_ENV = "SGLANG_DFLASH_FAIR_SLACK"

logger = logging.getLogger(__name__)

RECENT_STEPS = 256  # a measured (batch size, width) cost is trusted this many steps
FRESH_STEPS = 32  # a new interval is averaged with one this recent, and replaces an older one
RECENT_WEIGHT = 0.25  # weight of a new interval in its (batch size, width) moving average
SPIKE_FACTOR = 1.25  # a new interval counts as at most this many times its current estimate
EARLY_PROBE_EVERY = 4  # probe spacing in the policy's first `early_steps` steps
NEAR = 1.5  # batch sizes within this factor of each other count as near
DRAFT_MARGIN = 1.05  # a draft width is chosen only if it promises this much more than none
FAR_BELOW = 0.8  # when every draft width promises less than this share of no draft's rate ...
FAR_PROBE_FACTOR = 4  # ... probes are this many times rarer
NARROW_MARGIN = 1.03  # a narrower draft width only if it promises this much more than the full


def expected_commit(rates: Sequence[float]) -> np.ndarray:
    """Expected committed tokens per request at each width, from conditional acceptance rates.

    rates [B-1]: a_k for draft positions k = 1..B-1 -> [B]: E[commit | W] for W = 1..B.
    E.g., rates [0.5, 0.5] -> [1, 1.5, 1.75].
    """
    reach = np.cumprod(np.asarray(rates, dtype=np.float64))  # P(first k drafts all accepted)
    return 1.0 + np.concatenate([[0.0], np.cumsum(reach)])


def step_features(bs: int, widths: np.ndarray, context: float = 0.0, processed=0.0) -> np.ndarray:
    """The cost model's regressors for `bs` requests holding `context` committed tokens in all,
    at each width, with `processed` result tokens (a number, or one per width) -> [len(widths), 7].
    The context counts in thousands of tokens, the results in hundreds.

    E.g., bs 4, widths [1, 3], context 2000, processed [4, 10]
    -> [[1, 4, 0, 0, 4, 2, 0.04], [1, 4, 1, 4, 12, 6, 0.1]].
    """
    widths = np.asarray(widths, dtype=np.float64)
    drafted = (widths > 1).astype(np.float64)
    ones = np.ones_like(widths)
    c = context / 1000.0
    n = np.asarray(processed, dtype=np.float64) * ones / 100.0
    return np.stack([ones, bs * ones, drafted, drafted * bs, bs * widths, widths * c, n], axis=1)


class AcceptanceEstimate:
    """Exponentially weighted counts of how often each draft position was reached and accepted.

    A request-step that verified width W and accepted n drafts reached positions 1..min(n+1, W-1)
    and accepted positions 1..n. The counts of the positions a step verified decay by `decay`
    per request in the step, so the estimate remembers about 1 / (1 - decay) request-steps
    whatever the batch size (a memory counted in steps would rest on a handful of requests at
    batch 1, and noisy late positions would mislead the policy); those of positions it did
    not verify get no evidence and decay only by `idle_decay` per step, slowly returning their
    rate to `prior` (a step without the draft must not make the draft look better).
    """

    def __init__(
        self,
        num_draft_tokens: int,
        decay: float = 0.998,
        idle_decay: float = 0.999,
        prior: float = 0.6,
        prior_weight: float = 1.0,
    ):
        self.num_positions = num_draft_tokens - 1
        self.decay = decay
        self.idle_decay = idle_decay
        self.prior = prior
        self.prior_weight = prior_weight
        self.reached = np.zeros(self.num_positions)
        self.accepted = np.zeros(self.num_positions)

    def observe(self, num_accepted: Sequence[int], width: int) -> None:
        """One verify step: accepted drafts per request (host ints) at verify width `width`."""
        verified = min(width, self.num_positions + 1) - 1  # positions 1..verified were proposed
        if len(num_accepted) == 0:
            return
        verified = max(verified, 0)
        decay = self.decay ** len(num_accepted)
        factors = np.where(np.arange(self.num_positions) < verified, decay, self.idle_decay)
        self.reached *= factors
        self.accepted *= factors
        if verified == 0:
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

    def pooled_rate(self) -> float:
        """The share of all proposals accepted, every position alike."""
        w = self.prior_weight
        return float((self.accepted.sum() + self.prior * w) / (self.reached.sum() + w))


class RequestAcceptance:
    """Each running request's own acceptance rate: the share of its proposals that were
    accepted, every position alike.

    A request-step that verified width W and accepted n drafts tried positions 1..min(n+1, W-1)
    and accepted n of them. A request's rate is (accepted + m * prior) / (tried + m): the prior,
    the batch's rate, holds a new request at the average until m proposals of its own say
    otherwise. Counts decay by `decay` per step of the request, so a request whose text turns
    predictable (or not) is followed; requests unseen for `idle_steps` steps are dropped.

    A newcomer is taken for an average request, not a pessimistic one: its rate is learnt only
    from steps with the draft, so a prior that ruled drafting out would keep it unknown until
    the next probe (tried: the 1/(bs+1) quantile of recent requests' rates as the prior left
    28% of the steps at concurrency 4 without the draft, against 4% with this one). A wave of
    new requests thus runs its first step or two as if all were average.

    E.g., width 4, accepted [0, 3] -> tried [1, 3], accepted [0, 3]; at prior 0.5 and m 1,
    rates 0.25 and 0.875.
    """

    def __init__(
        self,
        prior_weight: float = 4.0,
        decay: float = 0.97,
        idle_steps: int = RECENT_STEPS,
    ):
        self.prior_weight = prior_weight
        self.decay = decay
        self.idle_steps = idle_steps
        self.counts: dict[str, tuple[float, float, int]] = {}  # rid -> (accepted, tried, step)

    def observe(self, rids: Sequence[str], num_accepted: Sequence[int], width: int, step: int) -> None:
        """One verify step of the requests `rids` at width `width`."""
        if width <= 1 or len(rids) == 0:
            return
        accepted = np.minimum(np.asarray(num_accepted, dtype=np.int64), width - 1)
        tried = np.minimum(accepted + 1, width - 1)
        for rid, n, k in zip(rids, accepted.tolist(), tried.tolist()):
            old_accepted, old_tried, _ = self.counts.get(rid, (0.0, 0.0, step))
            self.counts[rid] = (self.decay * old_accepted + n, self.decay * old_tried + k, step)
        if step % self.idle_steps == 0:
            self.counts = {r: c for r, c in self.counts.items() if step - c[2] < self.idle_steps}

    def rate(self, rid: str, prior: float) -> float:
        accepted, tried, _ = self.counts.get(rid, (0.0, 0.0, 0))
        return (accepted + self.prior_weight * prior) / (tried + self.prior_weight)

    def worst(self, rids: Sequence[str], prior: float) -> float:
        """The lowest rate among `rids` (`prior` for none)."""
        return min((self.rate(rid, prior) for rid in rids), default=prior)


class StepCostModel:
    """Least squares of the step interval on `step_features`, with exponential forgetting.

    Keeps the normal equations (7x7 and 7) and solves them on demand; a small ridge, relative to
    each feature's scale, keeps them solvable when the batch size never varies (predictions at
    the seen sizes are unaffected).
    """

    NUM_FEATURES = 7

    def __init__(self, draft_widths_needed: int = 2, forget: float = 0.995, ridge: float = 1e-9):
        self.draft_widths_needed = draft_widths_needed
        self.forget = forget
        self.ridge = ridge
        self.xtx = np.zeros((self.NUM_FEATURES, self.NUM_FEATURES))
        self.xty = np.zeros(self.NUM_FEATURES)
        self.coef: Optional[np.ndarray] = None
        self.seen_widths: dict[int, float] = {}  # width -> decayed sample count
        self._was_ready = False

    def observe(self, bs: int, width: int, seconds: float, context: float = 0.0, processed: float = 0.0):
        x = step_features(bs, np.array([width]), context, processed)[0]
        self.xtx = self.forget * self.xtx + np.outer(x, x)
        self.xty = self.forget * self.xty + seconds * x
        for w in self.seen_widths:
            self.seen_widths[w] *= self.forget
        self.seen_widths[width] = self.seen_widths.get(width, 0.0) + 1.0
        self.coef = None

    @property
    def ready(self) -> bool:
        """Enough evidence to tell the draft's cost from the verify's: steps without the draft,
        and steps at two different draft widths (each width seen at least twice, recently; once
        ready, a width stays counted while seen once in about the last 280 steps, so that the
        rare probes of a load where drafting does not pay keep the model ready)."""
        need = 0.25 if self._was_ready else 2.0
        seen = [w for w, n in self.seen_widths.items() if n >= need]
        ready = 1 in seen and len([w for w in seen if w > 1]) >= self.draft_widths_needed
        self._was_ready |= ready
        return ready

    def predict(self, bs: int, widths: np.ndarray, context: float = 0.0, processed=0.0) -> np.ndarray:
        """Predicted step seconds for `bs` requests holding `context` tokens, at each width,
        handling `processed` result tokens (a number, or one per width)."""
        if self.coef is None:
            # Ridge relative to each feature's own scale (features 2, 3, 5, 6 can be all zero).
            damping = self.ridge * np.maximum(np.diag(self.xtx), 1e-12)
            self.coef = np.linalg.solve(self.xtx + np.diag(damping), self.xty)
        return step_features(bs, widths, context, processed) @ self.coef


class WidthPolicy:
    """Chooses each decode step's verify width; fed by the worker (step intervals) and by the
    scheduler's result processing (accepted-draft counts)."""

    def __init__(
        self,
        num_draft_tokens: int,
        *,
        probe_every: int = 32,
        early_steps: int = 128,
        acceptance: Optional[AcceptanceEstimate] = None,
        cost: Optional[StepCostModel] = None,
        fair_slack: Optional[float] = FAIR_SLACK,
        far_probe_factor: int = FAR_PROBE_FACTOR,
        allowed: Optional[Sequence[int]] = None,
    ):
        self.max_width = int(num_draft_tokens)
        self.widths = np.arange(1, self.max_width + 1)
        # The widths a step may take (all of 1..B unless given; 1 and B always): on CUDA, those
        # with a verify graph (`verify_widths.py`).
        allowed = set(self.widths.tolist() if allowed is None else allowed) | {1, self.max_width}
        if not allowed <= set(self.widths.tolist()):
            raise ValueError(f"allowed widths {sorted(allowed)} must lie in 1..{self.max_width}")
        self.allowed = np.isin(self.widths, sorted(allowed))  # [B] bool
        self.neighbour_probes = False  # probe the allowed neighbours of the best width (`seed`)
        self._best = self.max_width  # the last width chosen as the best
        self.acceptance = acceptance or AcceptanceEstimate(self.max_width)
        self.requests = RequestAcceptance()
        self.fair_slack = fair_slack  # None: the batch's throughput alone decides
        self.far_probe_factor = far_probe_factor
        self.cost = cost or StepCostModel(draft_widths_needed=min(2, self.max_width - 1))
        self.probe_every = probe_every
        self.early_steps = early_steps
        # Probes: the full width (refreshes every position's rate), no draft, the narrowest draft.
        narrowest = int(self.widths[1:][self.allowed[1:]].min()) if self.max_width > 1 else 1
        self.probe_widths = [1, self.max_width, 1, narrowest]
        self.steps = 0
        self.probing = False  # whether the last choice was a probe
        self._probes = 0
        self._far = False  # whether the last choice found every draft width far from paying
        # Result tokens of the last step the scheduler handled (`observe_processed`).
        self.processed = 0
        # Whether a step's measured cost includes the results the scheduler handled in it: on
        # host clocks it does (the interval between two step starts), on the device clock it
        # does not (`device_timed`).
        self.charges_processed = True
        # (bs, width) -> (moving averages of its recent step intervals, of their contexts and
        # of their result tokens, step of the last one)
        self.recent: dict[tuple[int, int], tuple[float, float, float, int]] = {}

    def choose(self, bs: int, context: float = 0.0, rids: Sequence[str] = ()) -> int:
        """The verify width for the next decode step of `bs` requests (`rids`, when known)
        holding `context` committed tokens in all."""
        self.steps += 1
        if self.max_width == 1:
            return 1
        every = EARLY_PROBE_EVERY if self.steps <= self.early_steps else self.probe_every
        if self._far and self.steps > self.early_steps:
            # A probe at a draft width costs several steps without one, and the requests that
            # accept little pay for it: when drafting is far from paying, probe rarely (the two
            # ends stay measured, below, within RECENT_STEPS).
            every *= self.far_probe_factor
        self.probing = not self.cost.ready or self.steps % every == 0
        if self.probing:
            self._probes += 1
            if self.neighbour_probes and self.cost.ready:
                return self._neighbour(self._probes)
            return self.probe_widths[self._probes % len(self.probe_widths)]
        # The two ends, no draft and the full width, are measured near every batch size the
        # load reaches before the model's extrapolation is trusted: a width it overestimates
        # would otherwise never be chosen, so never measured. (With a start-up table of every
        # batch size's costs, `seed`, the model has seen them all.)
        for width in () if self.neighbour_probes else (1, self.max_width):
            if not self._measured_near(bs, width):
                self.probing = True
                return width
        self._best = self.best_width(bs, context, self.requests.worst(rids, self.acceptance.pooled_rate()))
        return self._best

    def _neighbour(self, probe: int) -> int:
        """The allowed width next below the best one (odd probes) or next above it (even), or
        the other one at an end. A probe costs a step at that width, and at high load the
        full width costs several narrow steps: only the widths a load change would move to
        are measured.

        E.g., allowed {1, 2, 4, 8, 16}, best 4: probes alternate 2 and 8; best 16: always 8."""
        allowed = self.widths[self.allowed].tolist()
        i = allowed.index(self._best)
        below, above = allowed[max(i - 1, 0)], allowed[min(i + 1, len(allowed) - 1)]
        if below == self._best:
            return above
        if above == self._best:
            return below
        return below if probe % 2 else above

    def device_timed(self) -> None:
        """Steps are timed on the device from here on (`device_clock.py`): a step's time is its
        own work, without the scheduler's handling of the previous step's results (host work
        between the step's events, not device work inside them), so the cost model's results
        term is neither fitted nor charged."""
        self.charges_processed = False

    def seed(self, table: dict[tuple[int, int], float]) -> None:
        """Start-up costs: (batch size, width) -> seconds of a step, from timed replays of the
        captured graphs. The cost model starts from them (they fade as steps are measured), and
        probes go to neighbouring widths only (`_neighbour`)."""
        for (bs, width), seconds in sorted(table.items()):
            self.cost.observe(bs, width, seconds)
        self.neighbour_probes = True

    def _measured_near(self, bs: int, width: int) -> bool:
        """Was `width` measured recently at a batch size within a factor NEAR of `bs`?"""
        for (measured_bs, measured_width), (*_, step) in self.recent.items():
            if (
                measured_width == width
                and self.steps - step <= RECENT_STEPS
                and bs / NEAR <= measured_bs <= bs * NEAR
            ):
                return True
        return False

    def best_width(self, bs: int, context: float = 0.0, worst: Optional[float] = None) -> int:
        """The width of highest expected tokens per second, with margins against the noise of
        the estimates (picking whichever width had the luckiest measurement): a narrower draft
        width must beat the full width by `NARROW_MARGIN`, and the chosen draft width must beat
        no draft by `DRAFT_MARGIN`, so near-ties neither waste verified tokens nor run the
        draft for nothing.

        No request pays for its neighbours' drafts: a draft width is ruled out when it would
        make the batch's least-accepted request (`worst`, its `RequestAcceptance` rate) commit
        its tokens more than `fair_slack` slower than without the draft. E.g., at one step per
        10 ms without the draft and 20 ms at width 4, a request must expect 2 / (1 + slack)
        tokens a step at width 4 for it to be chosen."""
        seconds = np.maximum(self.step_seconds(bs, context), 1e-6)
        # A draft width's step runs the draft and verifies more tokens than the step without
        # one, so it is never cheaper: estimates that say otherwise are noise (a slow interval
        # without the draft), which at an acceptance near zero would choose a draft that
        # cannot pay (seen: 80 steps at the full width, accepting nothing, on a tiny CPU model).
        seconds[1:] = np.maximum(seconds[1:], seconds[0])
        rate = expected_commit(self.acceptance.rates()) / seconds
        if self.fair_slack is not None and worst is not None:
            worst_rate = expected_commit(np.full(self.max_width - 1, worst)) / seconds
            rate[worst_rate * (1.0 + self.fair_slack) < worst_rate[0]] = 0.0
        rate[~self.allowed] = 0.0
        self._far = bool(rate[1:].max() < FAR_BELOW * rate[0])
        full = self.max_width - 1
        best = int(np.argmax(rate[1:])) + 1
        if rate[best] <= NARROW_MARGIN * rate[full]:
            best = full
        return int(self.widths[best]) if rate[best] > DRAFT_MARGIN * rate[0] else 1

    def step_seconds(self, bs: int, context: float = 0.0) -> np.ndarray:
        """[B] step cost at each width for `bs` requests holding `context` tokens: the model,
        corrected by recent measurements. Costs are not linear over a wide range of batch
        sizes (attention over padded contexts), so the model's extrapolation can be far off.
        For each width, the recent measurement at the nearest batch size (exactly `bs` when
        there is one) scales the model by measured / predicted there, the prediction taken at
        the measurement's own context; a width the model wrongly favours is measured the first
        time it is chosen, and from then on the measurement decides, carried to today's
        context by the model.
        E.g., model 10 ms at (bs 32, W 4); measured 30 ms vs model 20 ms at (16, 4) -> 15 ms.
        Each width is charged the results of its own commits, `bs * E[commit | W]` tokens."""
        processed = bs * expected_commit(self.acceptance.rates()) * self.charges_processed  # [B]
        seconds = self.cost.predict(bs, self.widths, context, processed)
        # width -> (distance, bs, (seconds, context, processed) averages)
        nearest: dict[int, tuple[float, int, tuple[float, float, float]]] = {}
        for (measured_bs, width), (*averages, step) in self.recent.items():
            if self.steps - step > RECENT_STEPS:
                continue
            distance = abs(np.log(measured_bs / bs))
            if width not in nearest or distance < nearest[width][0]:
                nearest[width] = (distance, measured_bs, tuple(averages))
        for width, (_, measured_bs, (measured, measured_context, measured_processed)) in nearest.items():
            i = width - 1
            predicted = float(
                self.cost.predict(measured_bs, self.widths[i : i + 1], measured_context, measured_processed)[
                    0
                ]
            )
            if predicted > 0 and seconds[i] > 0:
                seconds[i] *= measured / predicted
            elif measured_bs == bs:  # a model not yet fitted: the measurement as it is
                seconds[i] = measured
        return seconds

    def observe_step(self, bs: int, width: int, seconds: float, context: float = 0.0) -> None:
        """The host interval from the start of a decode step of `bs` requests holding `context`
        tokens to the start of the next decode step, which handled the results of the last step
        `observe_processed` saw (the worker drops intervals with a prefill or an idle batch in
        between). Every interval is kept: rejecting those far from the prediction would let a
        wrong model reject the evidence that corrects it. Spikes (a pause of the whole process) are
        clipped instead: each interval counts as at most SPIKE_FACTOR times the current
        estimate, so a real change of cost still comes through, a bounded step at a time."""
        raw, processed = seconds, self.processed if self.charges_processed else 0
        if self.cost.ready:
            predicted = float(self.cost.predict(bs, np.array([width]), context, processed)[0])
            if predicted > 0:
                seconds = min(seconds, SPIKE_FACTOR * predicted)
        self.cost.observe(bs, width, seconds, context, processed)
        seconds = raw
        previous = self.recent.get((bs, width))
        if previous is not None and self.steps - previous[-1] <= FRESH_STEPS:
            seconds = min(seconds, SPIKE_FACTOR * previous[0])  # a spike, clipped
            # The context and results averaged alike, so that the model's prediction at them
            # compares with the average interval.
            seconds, context, processed = (
                (1 - RECENT_WEIGHT) * old + RECENT_WEIGHT * new
                for old, new in zip(previous[:3], (seconds, context, processed))
            )
        self.recent[(bs, width)] = (seconds, context, processed, self.steps)  # an older one is replaced

    def observe_acceptance(self, num_accepted: Sequence[int], width: int, rids: Sequence[str] = ()) -> None:
        """A verify step's accepted drafts per request (of `rids`, when known) at width `width`."""
        self.requests.observe(rids, num_accepted, width, self.steps)
        self.acceptance.observe(num_accepted, width)

    def observe_processed(self, tokens: int) -> None:
        """The scheduler handled the results of a decode step that committed `tokens` tokens."""
        self.processed = tokens


def policy_for(
    num_draft_tokens: int,
    device_type: str,
    adaptive: Optional[bool] = None,
    tp_size: int = 1,
    fair_slack: Optional[float] = FAIR_SLACK,
    graph_widths: Optional[Sequence[int]] = None,
) -> tuple[Optional[WidthPolicy], str]:
    """The policy for this server, or None for the fixed width; with the reason, for the log.

    `adaptive` is SGLANG_DFLASH_ADAPTIVE_WIDTH (`knobs.Knobs.adaptive_width`): False (=0) forces
    the fixed width and True (=1) adapts on any device. None (unset) adapts on CPU, and on CUDA
    when the target has verify graphs at several widths
    (`graph_widths`, `verify_widths.py`): the policy then chooses among those. Without them a
    narrower step would run eager (SGLang captures the full width only; docs/verify-width.md).
    Under tensor parallelism the width is fixed: each rank's policy times its own steps, and
    ranks that chose different widths would run collectives of different shapes.
    `fair_slack` is SGLANG_DFLASH_FAIR_SLACK (`Knobs.fair_slack`; None: off).
    """
    if num_draft_tokens < 2:
        return None, "fixed: --speculative-num-draft-tokens is 1"
    if tp_size > 1:
        return None, f"fixed at tp_size {tp_size}: each rank would time its steps, and choose, apart"
    if adaptive is False:
        return None, f"fixed: {ENV_VAR}=0"
    if fair_slack is None:
        fairness = f"the batch's throughput alone ({FAIR_SLACK_ENV}=off)"
    else:
        fairness = f"no request slowed by more than {fair_slack:.0%}"
    policy = WidthPolicy(num_draft_tokens, fair_slack=fair_slack, allowed=graph_widths)
    among = "" if graph_widths is None else f" among {policy.widths[policy.allowed].tolist()}"
    if adaptive:
        return policy, f"adaptive{among} ({ENV_VAR}=1; {fairness})"
    if device_type == "cpu":
        return policy, f"adaptive{among} (CPU default; {fairness})"
    if graph_widths is not None:
        return policy, f"adaptive{among} (verify graphs at each; {fairness})"
    return None, (
        f"fixed on {device_type}: verify graphs exist for the full width only "
        f"(set {ENV_VAR}=1 to adapt with eager narrow steps)"
    )

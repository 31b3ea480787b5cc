"""`StepWidth`: the verify width W of each decode step (1 <= W <= B), and how a step at W = 1
runs the target.

The width is adaptive (`policy.py`) or always B, chosen once at start-up
(`policy.py`, `policy_for`), and again when the target gets a verify backend (and on CUDA a
graph) at each of several widths (`use_verify_widths`, `verify_widths.py`): the policy then
chooses among those widths. The adaptive policy learns each (batch size, width)'s cost from
the interval between successive decode steps' starts, measured here on host clocks; intervals
that are not a step's steady cost are left out: the server's first decode steps (one-time
start-up costs) and the first decode step after an extend or idle step (the scheduler also
settles the extend's results in it). With verify graphs on CUDA each step is timed on the
device instead (`device_clock.py`), and charged to the step that ran it. Acceptance reaches
the policy from the scheduler's side (`metrics.resolve_spec_tokens_hook`).

At W = 1 there is no draft: the target runs one token per request, through its plain DECODE
forward, or through a verify forward over a window of one: on the CPU engine with the batched
verify attention (exactly decode attention, in one SDPA per layer for the batch instead of
SGLang's per-request decode loop: 12.5 vs 13.4 ms a step at batch 25, docs/verify-width.md),
and wherever each width has its own verify backend (on CUDA a one-token verify graph).
"""

from __future__ import annotations

import itertools
import time
from typing import Iterator, Optional, Sequence

import torch

from sglang_dflash.knobs import Knobs, Width1Forward
from sglang_dflash.width.device_clock import DeviceStepClock
from sglang_dflash.width.policy import policy_for

COLD_DECODE_STEPS = 8  # a server's first decode steps, whose intervals the policy ignores
WIDTH1_FORWARD_ENV = "SGLANG_DFLASH_WIDTH1_FORWARD"


def decode_when_off(
    device_type: str, override: Optional[Width1Forward], verify_attention_mode: str
) -> tuple[bool, str]:
    """Whether a step at W = 1 runs the target's DECODE forward (else a verify over one token),
    with the reason. `override`: SGLANG_DFLASH_WIDTH1_FORWARD (`Knobs.width1_forward`)."""
    if override is not None:
        return override == "decode", f"{override} forward ({WIDTH1_FORWARD_ENV}={override})"
    if device_type == "cpu" and verify_attention_mode == "batched":
        return False, "a verify forward over one token (batched CPU verify attention)"
    return True, "the target's decode forward"


def forced_widths(width1_steps: int, widths: Sequence[int]) -> Optional[Iterator[int]]:
    """The test aids' widths, one per decode step: 1 for the first `width1_steps` steps, and
    `widths` in turn from then on (decode step k takes widths[k % len(widths)]); None when neither
    is set. Without `widths` the iterator ends after the width-1 steps: the policy's then.
    E.g., 1 step and (1, 2, 8) -> 1, 2, 8, 1, 2, 8, ..."""
    if not width1_steps and not widths:
        return None
    then = itertools.islice(itertools.cycle(widths), width1_steps, None)  # empty without widths
    return itertools.chain(itertools.repeat(1, width1_steps), then)


class StepWidth:
    def __init__(
        self, num_draft_tokens: int, device: torch.device | str, tp_size: int, knobs: Knobs, metrics=None
    ):
        from sglang_dflash.cpu import verify_attention

        self.device_type = torch.device(device).type
        self.num_draft_tokens = num_draft_tokens  # B
        self._tp_size, self._knobs = tp_size, knobs
        self.policy, self._policy_reason = self._policy_for()
        self.decode_when_off, self._off_reason = decode_when_off(
            self.device_type, knobs.width1_forward, verify_attention.mode()
        )
        self.clock: Optional[DeviceStepClock] = None  # None: host clocks (`use_verify_widths`)
        self.metrics = metrics  # DFlashMetrics or None: the chosen widths' histogram
        if any(not 1 <= w <= num_draft_tokens for w in knobs.widths):
            raise ValueError(f"SGLANG_DFLASH_TEST_WIDTHS: each width must be in 1..{num_draft_tokens}")
        self._widths = knobs.widths  # test aid: these widths in turn, whatever the policy
        # The test aids (no draft for the first N decode steps; forced widths), chosen here once:
        # a server without them asks its policy every step, without a test.
        forced = forced_widths(knobs.width1_steps, knobs.widths)
        self._width_for = self._policy_width if forced is None else self._forced_width(forced)
        # (start, bs, width, context, measured) of the last decode step; None after an extend or
        # idle step.
        self._last: Optional[tuple[float, int, int, int, bool]] = None
        self._excluded = 0.0  # seconds of the last decode step that are not its own cost
        self._decode_steps = 0

    def _policy_for(self, graph_widths: Optional[Sequence[int]] = None):
        """This server's policy and why (`policy.policy_for`), among `graph_widths` if given."""
        knobs = self._knobs
        return policy_for(
            self.num_draft_tokens,
            self.device_type,
            knobs.adaptive_width,
            tp_size=self._tp_size,
            fair_slack=knobs.fair_slack,
            graph_widths=graph_widths,
        )

    def use_verify_widths(self, widths: Sequence[int], graphed: bool) -> None:
        """The target verifies at `widths` only, each with its own attention backend, and from
        CUDA graphs when `graphed` (`verify_widths.py`): the policy chooses among them (on CUDA
        it adapts by default now), W = 1 runs a verify over one token on its own backend (unless
        SGLANG_DFLASH_WIDTH1_FORWARD says otherwise, or width 1 has none: then the decode
        forward), and on CUDA the steps are timed on the device (`device_clock.py`)."""
        missing = sorted(set(self._widths) - set(widths))
        if missing:
            raise ValueError(
                f"SGLANG_DFLASH_TEST_WIDTHS: widths {missing} have no verify backend ({list(widths)})"
            )
        self.policy, self._policy_reason = self._policy_for(widths)
        if self._knobs.width1_forward is None and 1 in widths:
            self.decode_when_off, self._off_reason = (
                False,
                "a verify forward over one token, on its own backend",
            )
        if graphed and self.device_type == "cuda" and self.policy is not None:
            self.clock = DeviceStepClock()
            self.policy.device_timed()

    def decode_runs_eager(self, why: str) -> None:
        """A step at W = 1 that takes the decode forward runs it eager, because of `why` (for
        the start-up line; `target_forward.replays_decode`)."""
        if self.decode_when_off:
            self._off_reason += f", eager ({why})"

    @property
    def wants_costs(self) -> bool:
        """Whether a start-up cost table would be read: only an adaptive policy reads one."""
        return self.policy is not None

    def seed(self, table) -> None:
        """`table`: (batch size, width) -> seconds from timed replays, the policy's starting
        costs (`verify_runners.cost_table`)."""
        if self.policy is not None and table:
            self.policy.seed(table)

    def describe(self) -> str:
        """For the start-up line: `verify_width=<this>`."""
        return f"{self.num_draft_tokens} ({self._policy_reason}; width 1 runs {self._off_reason})"

    @property
    def probing(self) -> bool:
        """The width chosen last was a probe, chosen to measure it rather than as the best."""
        return self.policy is not None and self.policy.probing

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` of the current decode step out of its measured cost: the bulk
        injection of tokens queued by earlier steps at W = 1 (`draft/deferred_injection.py`),
        which is theirs, not this step's width's. (Host clocks only: on the device clock the
        flush stays in the step that ran it.)"""
        self._excluded += seconds

    def not_decoding(self) -> None:
        """An extend or idle step ran: the interval across it is not a decode step's cost."""
        self._last = None

    def choose(self, bs: int, context: int, rids: Sequence[str]) -> int:
        """This step's width for `bs` requests `rids` holding `context` committed tokens (a host
        count); feeds the interval since the last decode step's start to the policy (host
        clocks only)."""
        now = time.perf_counter()
        width = self._width_for(bs, context, rids, now)
        self._decode_steps += 1
        warm = self._decode_steps > COLD_DECODE_STEPS
        measured = self._last is not None and warm
        self._last = (now, bs, width, context, measured)
        self._excluded = 0.0
        if self.clock is not None and self.policy is not None:
            # On the device a step's time is its own: no extend or idle step falls inside it.
            self.clock.begin((bs, width, context) if warm else None)
        if self.metrics is not None:
            self.metrics.observe_width(width)
        return width

    def _policy_width(self, bs: int, context: int, rids: Sequence[str], now: float) -> int:
        """B when fixed; else the policy's choice, after it is fed the last step's cost."""
        if self.policy is None:
            return self.num_draft_tokens
        if self.clock is not None:
            for (last_bs, last_width, last_context), seconds in self.clock.poll():
                self.policy.observe_step(last_bs, last_width, seconds, last_context)
        elif self._last is not None and self._last[4]:
            start, last_bs, last_width, last_context, _ = self._last
            self.policy.observe_step(last_bs, last_width, now - start - self._excluded, last_context)
        return self.policy.choose(bs, context, rids)

    def _forced_width(self, forced: Iterator[int]):
        """`_policy_width` under the test aids: their next width while they have one."""

        def width_for(bs: int, context: int, rids: Sequence[str], now: float) -> int:
            width = next(forced, None)
            return self._policy_width(bs, context, rids, now) if width is None else width

        return width_for

    def end_step(self) -> None:
        """The decode step has launched all its work (the device clock's end event)."""
        if self.clock is not None:
            self.clock.end()

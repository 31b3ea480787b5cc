"""`Knobs`: every environment variable the DFLASH worker reads, read once at start-up.

Serving choices (documented for users in docs/):

  SGLANG_DFLASH_GRAMMAR_PROPOSALS=0       grammar requests get the draft's plain argmax, not the
                                          grammar-aware proposals (docs/requests.md)
  SGLANG_DFLASH_ADAPTIVE_WIDTH=0|1        fix the verify width at B, or adapt it on any device
                                          (unset: adapt on CPU only; docs/verify-width.md)
  SGLANG_DFLASH_FAIR_SLACK=x|off          how much slower a draft width may make one request's
                                          tokens (`width/policy.py`, `FAIR_SLACK`); off: batch
                                          rate only
  SGLANG_DFLASH_WIDTH1_FORWARD=decode|verify
                                          how a step without draft runs the target
                                          (`width/step.py`)
  SGLANG_DFLASH_DEFERRED_INJECTION=0      steps without a draft inject their tokens' draft K/V
                                          at once, not queued for one bulk injection before the
                                          next draft (`draft/deferred_injection.py`)
  SGLANG_DFLASH_DRAFT_CUDA_GRAPH=0        the draft step never replays CUDA graphs
  SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN=n the draft's plan-free graphs replay up to n tokens of
                                          visible context (default 2048; 0: none; `draft/step.py`)
  SGLANG_DFLASH_VERIFY_GRAPHS=0           no verify graphs below the full width on CUDA (narrow
                                          steps eager; the width then fixed unless
                                          SGLANG_DFLASH_ADAPTIVE_WIDTH=1; `width/verify_widths.py`)
  SGLANG_DFLASH_STEP_TIMING=path          per-phase step records, appended as JSON lines
                                          (`step_timer.py`, scripts/serving/step_phases.py)
  SGLANG_ENABLE_LILICORR_SAMPLING=0|1     SGLang's switch: 0 walks LiLiCorr's lattice greedily
                                          for every request (unset: sampled requests sample their
                                          walk, verified exactly with its q; `propose/proposers.py`);
                                          with SGLANG_LILICORR_REQUIRE_SAMPLING=1, 0 is refused

Benchmark aid, SGLang's own and honoured as its built-in DFLASH does:

  SGLANG_SIMULATE_ACC_LEN (+ _METHOD, _TOKEN_MODE)
                                          acceptance is forced to a drawn length: outputs are
                                          not the model's
  SGLANG_DFLASH_SIMULATE_ACC_METHOD=geometric
                                          ours only: each request's draft positions accepted
                                          independently, at the rate whose mean at the full
                                          width is SGLANG_SIMULATE_ACC_LEN
                                          (`verify/acceptance.py`)

Test aids; each switches a feature off so that a test can show it notices:

  SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION=1   decode steps inject no context K/V into the draft
  SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER=1      PD transfer leaves the draft's K/V out
  SGLANG_DFLASH_TEST_SKIP_DRAFT_HICACHE=1       HiCache leaves the draft's K/V out of its backups
  SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT=1        hybrid targets keep the linear-attention state of
                                                the whole verify window (`integration/linear_state.py`)
  SGLANG_DFLASH_TEST_WIDTH1_STEPS=N             the first N decode steps run without draft
  SGLANG_DFLASH_TEST_WIDTHS=w1,w2,...           decode steps take these verify widths in turn
                                                (each at most B), whatever the policy
  SGLANG_DFLASH_VERIFY_GRAPHS=eager             each verify width's own attention backend,
                                                without graphs, on any device (the CPU
                                                rehearsal of the per-width swap)

Debugging aids:

  SGLANG_DFLASH_CHECK_RANKS=1             tensor-parallel ranks compare their proposals and
                                          committed tokens every step (gathers, host sync)
  SGLANG_DFLASH_TRACE_PROPOSALS=path      every request's verified proposals per step, appended
                                          as JSON lines (host sync)

Read by their own modules, outside the worker: SGLANG_DFLASH_IMPL (`plugin.py`),
SGLANG_DFLASH_SAMPLING_MEMORY_MB (`verify/sampling.py`), SGLANG_DFLASH_OPS (`ops/`),
SGLANG_DFLASH_CPU_VERIFY_ATTENTION (`cpu/verify_attention.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

GRAMMAR_PROPOSALS_ENV = "SGLANG_DFLASH_GRAMMAR_PROPOSALS"
ADAPTIVE_WIDTH_ENV = "SGLANG_DFLASH_ADAPTIVE_WIDTH"
FAIR_SLACK_ENV = "SGLANG_DFLASH_FAIR_SLACK"
WIDTH1_FORWARD_ENV = "SGLANG_DFLASH_WIDTH1_FORWARD"
DRAFT_GRAPHS_ENV = "SGLANG_DFLASH_DRAFT_CUDA_GRAPH"
DRAFT_PLAN_FREE_ENV = "SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN"
VERIFY_GRAPHS_ENV = "SGLANG_DFLASH_VERIFY_GRAPHS"
DEFERRED_INJECTION_ENV = "SGLANG_DFLASH_DEFERRED_INJECTION"
STEP_TIMING_ENV = "SGLANG_DFLASH_STEP_TIMING"
SKIP_DECODE_INJECTION_ENV = "SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION"
SKIP_DRAFT_TRANSFER_ENV = "SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER"
SKIP_DRAFT_HICACHE_ENV = "SGLANG_DFLASH_TEST_SKIP_DRAFT_HICACHE"
SKIP_STATE_COMMIT_ENV = "SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT"
WIDTH1_STEPS_ENV = "SGLANG_DFLASH_TEST_WIDTH1_STEPS"
WIDTHS_ENV = "SGLANG_DFLASH_TEST_WIDTHS"
CHECK_RANKS_ENV = "SGLANG_DFLASH_CHECK_RANKS"
TRACE_PROPOSALS_ENV = "SGLANG_DFLASH_TRACE_PROPOSALS"
LILICORR_SAMPLING_ENV = "SGLANG_ENABLE_LILICORR_SAMPLING"
LILICORR_REQUIRE_SAMPLING_ENV = "SGLANG_LILICORR_REQUIRE_SAMPLING"
SIMULATE_METHOD_ENV = "SGLANG_DFLASH_SIMULATE_ACC_METHOD"


@dataclass(frozen=True)
class SimulatedAcceptance:
    """SGLang's benchmark knob: acceptance lengths drawn around `mean` by `method`."""

    mean: float
    method: str
    token_mode: str


@dataclass(frozen=True)
class Knobs:
    # Serving choices; None where unset (the module that uses each validates it).
    grammar_proposals: bool = True
    adaptive_width: Optional[str] = None
    fair_slack: Optional[str] = None
    width1_forward: Optional[str] = None
    draft_graphs: Optional[str] = None
    draft_plan_free: Optional[str] = None
    verify_graphs: Optional[str] = None
    deferred_injection: bool = True
    step_timing: Optional[str] = None
    lilicorr_sampling: bool = True
    # Benchmark aid.
    simulated_acceptance: Optional[SimulatedAcceptance] = None
    # Test aids.
    skip_decode_injection: bool = False
    skip_draft_transfer: bool = False
    skip_draft_hicache: bool = False
    skip_state_commit: bool = False
    width1_steps: int = 0
    widths: tuple[int, ...] = ()
    # Debugging aids.
    check_ranks: bool = False
    trace_proposals: Optional[str] = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, *, simulated: bool = True) -> "Knobs":
        """The knobs of this process. `simulated=False` skips SGLang's simulated-acceptance
        settings (read through `sglang.srt.environ`, so SGLang must be importable)."""

        def on(name: str) -> bool:
            return environ.get(name) == "1"

        return cls(
            grammar_proposals=environ.get(GRAMMAR_PROPOSALS_ENV, "1") != "0",
            adaptive_width=environ.get(ADAPTIVE_WIDTH_ENV),
            fair_slack=environ.get(FAIR_SLACK_ENV),
            width1_forward=environ.get(WIDTH1_FORWARD_ENV),
            draft_graphs=environ.get(DRAFT_GRAPHS_ENV),
            draft_plan_free=environ.get(DRAFT_PLAN_FREE_ENV),
            verify_graphs=environ.get(VERIFY_GRAPHS_ENV),
            deferred_injection=environ.get(DEFERRED_INJECTION_ENV, "1") != "0",
            step_timing=environ.get(STEP_TIMING_ENV) or None,
            lilicorr_sampling=_lilicorr_sampling(environ),
            simulated_acceptance=_simulated_acceptance(environ.get(SIMULATE_METHOD_ENV))
            if simulated
            else None,
            skip_decode_injection=on(SKIP_DECODE_INJECTION_ENV),
            skip_draft_transfer=on(SKIP_DRAFT_TRANSFER_ENV),
            skip_draft_hicache=on(SKIP_DRAFT_HICACHE_ENV),
            skip_state_commit=on(SKIP_STATE_COMMIT_ENV),
            width1_steps=int(environ.get(WIDTH1_STEPS_ENV, "0")),
            widths=tuple(int(w) for w in environ.get(WIDTHS_ENV, "").split(",") if w.strip()),
            check_ranks=on(CHECK_RANKS_ENV),
            trace_proposals=environ.get(TRACE_PROPOSALS_ENV) or None,
        )

    def aids_on(self) -> list[str]:
        """The test and debugging aids that are on, for the start-up line."""
        aids = [
            (self.skip_decode_injection, "test: decode-time injection OFF"),
            (self.skip_draft_transfer, "test: draft K/V left out of the PD transfer"),
            (self.skip_draft_hicache, "test: draft K/V left out of HiCache"),
            (self.skip_state_commit, "test: linear-attention state commit OFF"),
            (self.width1_steps > 0, f"test: no draft for the first {self.width1_steps} decode steps"),
            (bool(self.widths), f"test: verify widths {list(self.widths)} in turn"),
            (self.verify_graphs == "eager", "test: per-width verify backends without graphs"),
            (self.check_ranks, "checking that tensor-parallel ranks agree each step"),
            (self.trace_proposals is not None, f"tracing proposals to {self.trace_proposals}"),
        ]
        return [text for is_on, text in aids if is_on]


def _switch(environ: Mapping[str, str], name: str) -> Optional[bool]:
    """An SGLang boolean environment variable as SGLang's `envs` reads it; None where unset."""
    value = environ.get(name)
    if value is None or value == "":
        return None
    if value.lower() in ("1", "true", "yes", "y"):
        return True
    if value.lower() in ("0", "false", "no", "n"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean (1/0, true/false)")


def _lilicorr_sampling(environ: Mapping[str, str]) -> bool:
    sampling = _switch(environ, LILICORR_SAMPLING_ENV)
    if sampling is False and _switch(environ, LILICORR_REQUIRE_SAMPLING_ENV):
        raise ValueError(
            f"{LILICORR_REQUIRE_SAMPLING_ENV} is set but {LILICORR_SAMPLING_ENV}=0 walks LiLiCorr's "
            "lattice greedily for every request"
        )
    return sampling is not False


def _simulated_acceptance(method: Optional[str]) -> Optional[SimulatedAcceptance]:
    """SGLang's setting; `method`: SGLANG_DFLASH_SIMULATE_ACC_METHOD, "geometric" or unset."""
    from sglang.srt.environ import envs
    from sglang.srt.speculative.spec_utils import check_simulate_acc_token_mode

    if method not in (None, "", "geometric"):
        raise ValueError(f"{SIMULATE_METHOD_ENV} must be geometric, got {method!r}")
    mean = envs.SGLANG_SIMULATE_ACC_LEN.get()
    if mean <= 0:
        if method:
            raise ValueError(f"{SIMULATE_METHOD_ENV}={method} needs SGLANG_SIMULATE_ACC_LEN (the mean)")
        return None
    check_simulate_acc_token_mode()
    return SimulatedAcceptance(
        mean, method or envs.SGLANG_SIMULATE_ACC_METHOD.get(), envs.SGLANG_SIMULATE_ACC_TOKEN_MODE.get()
    )

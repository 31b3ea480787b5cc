"""Every environment variable sglang-dflash reads: one registry (`REGISTRY`), parsed and checked
at start-up.

A `Knob` is a variable's name, its kind (a serving choice, a benchmark, test or debugging aid, a
build setting, the GPU kit's, or SGLang's own), what may be set (`Parser`: the typed value it
gives, and what is allowed, in words), its default, one line of meaning, and where it acts.
`parse(environ)` reads them all at once and refuses the environment with one `KnobError` that
names each bad variable, its value and what it takes, and each `SGLANG_DFLASH_` name the registry
does not know. It runs in the launching process (`integration/server_args.py`), so a bad value
fails the launch itself, and in each scheduler (`Knobs.from_env`, the worker). Unset or empty: the
default.

Consumers get typed values, never the text: the worker's `Knobs` (one field per knob that says
which), and `value(name)` for the modules that read their own variable: SGLANG_DFLASH_IMPL
(`use_builtin`), SGLANG_DFLASH_OPS (`ops/`), SGLANG_DFLASH_CPU_VERIFY_ATTENTION
(`cpu/verify_attention.py`), SGLANG_DFLASH_SAMPLING_MEMORY_MB (`verify/sampling.py`),
SGLANG_DFLASH_STEP_TIMING (`StepTimer.from_env`), SGLANG_DFLASH_ALLOW_OTHER_TARGET
(`integration/server_args.py`), and the build's two (`setup.py`, which loads this file by path:
at module level it imports the standard library only). Nothing else in the
package, scripts/ or setup.py reads an SGLANG_DFLASH_ variable (tests/unit/test_knobs.py checks);
the GPU kit's two are read by the kit itself (tests/gpu_kit/serve/standin, outside the package).

docs/knobs.md is generated from the registry: `python -m sglang_dflash.knobs > docs/knobs.md`.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional

PREFIX = "SGLANG_DFLASH_"
BUILTIN = "builtin"  # SGLANG_DFLASH_IMPL=builtin: SGLang's built-in worker serves DFLASH
FAIR_SLACK = 0.05  # a draft width may make a request's tokens at most this much slower than none
PLAN_FREE_MAX_LEN = 2048  # tokens of visible context up to which the draft's plan-free graphs replay

# The typed values of the knobs that choose among names.
Width1Forward = Literal["decode", "verify"]
VerifyGraphs = Literal["on", "off", "eager"]  # on: per-width graphs on CUDA; eager: without graphs
OpsMode = Literal["auto", "reference", "cuda"]
CpuVerifyAttention = Literal["batched", "per-request"]

# Kinds, in docs/knobs.md's order, with the line under each heading.
SERVING, BENCHMARK, TEST, DEBUGGING, BUILD, KIT, SGLANG = (
    "Serving choices",
    "Benchmark aids",
    "Test aids",
    "Debugging aids",
    "Build",
    "GPU kit",
    "SGLang's",
)
KINDS = {
    SERVING: "How DFLASH is served.",
    BENCHMARK: "For measurements: not for serving users.",
    TEST: "Each switches a feature off or forces a choice, so that a test can show it notices; "
    "outputs may be wrong.",
    DEBUGGING: "Extra checks and records, at a cost every step.",
    BUILD: "Read by `setup.py` when the package is built (and checked at launch like the rest).",
    KIT: "Set and read by the maintainers' GPU kit (`tests/gpu_kit`), outside the package.",
    SGLANG: "SGLang's own, which this worker honours as SGLang's built-in DFLASH does.",
}


class KnobError(ValueError):
    """An environment variable set to a value it does not take, or an unknown SGLANG_DFLASH_ one."""


@dataclass(frozen=True)
class Parser:
    allowed: str  # what may be set, in words: "0 or 1", "a non-negative integer"
    parse: Callable[[str], Any]  # the set text -> its typed value; ValueError where not allowed
    show: Callable[[Any], Optional[str]] = str  # a typed value as it is set (None: only by unsetting)


def choice(values: Mapping[str, Any], fold: Callable[[str], str] = str, allowed: str = "") -> Parser:
    """One of `values`' keys (after `fold`) -> its value."""

    def parse(text: str) -> Any:
        if fold(text) not in values:
            raise ValueError
        return values[fold(text)]

    names = list(values)
    allowed = allowed or (" or ".join(names) if len(names) <= 2 else "one of " + ", ".join(names))
    return Parser(allowed, parse, lambda value: next((k for k, v in values.items() if v == value), None))


def _integer(text: str, low: int) -> int:
    if not re.fullmatch(r"[0-9]+", text) or int(text) < low:
        raise ValueError
    return int(text)


def _slack(text: str) -> Optional[float]:
    if text == "off":
        return None
    try:
        slack = float(text)
    except ValueError:
        raise ValueError from None
    if not slack >= 0:  # nan too
        raise ValueError
    return slack


def _widths(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError
    return tuple(_integer(part, 1) for part in parts)


def _appendable(path: str) -> str:
    """`path` if this process can open it for appending (created empty where it does not exist)."""
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        raise ValueError(error.strerror or str(error)) from None
    return path


def _archs(text: str) -> tuple[str, ...]:
    archs = tuple(a.strip() for a in text.split(";") if a.strip())
    if not archs or not all(re.fullmatch(r"[0-9]+[a-z]?", a) for a in archs):
        raise ValueError
    return archs


SWITCH = choice({"0": False, "1": True})
NON_NEGATIVE = Parser("a non-negative integer", lambda text: _integer(text, 0))
POSITIVE = Parser("a positive integer", lambda text: _integer(text, 1))
PLAN_FREE = Parser(  # 0: none
    "a non-negative integer", lambda text: _integer(text, 0) or None, lambda v: "0" if v is None else str(v)
)
SLACK = Parser("a number >= 0 or off", _slack, lambda v: "off" if v is None else f"{v:g}")
WIDTHS = Parser("a list of positive integers separated by commas", _widths, lambda v: ",".join(map(str, v)))
APPENDABLE = Parser("a file that can be opened for appending, in a directory that exists", _appendable)
ARCHS = Parser("a list of SM versions separated by ';' (e.g. 90;100a)", _archs, ";".join)
IMPL = choice({"sglang-dflash": "sglang-dflash", BUILTIN: BUILTIN}, fold=lambda text: text.strip().lower())
WIDTH1_FORWARD = choice({"decode": "decode", "verify": "verify"})
VERIFY_GRAPHS = choice({"0": "off", "eager": "eager"})
WINDOW_POOL = choice({"auto": "auto", "0": "off", "1": "on"})
OPS = choice({"auto": "auto", "reference": "reference", "cuda": "cuda"})
CPU_VERIFY_ATTENTION = choice({"batched": "batched", "per-request": "per-request"})
GEOMETRIC = choice({"geometric": "geometric"})
SGLANG_BOOL = choice(  # as SGLang's EnvBool reads it
    {"1": True, "true": True, "yes": True, "y": True, "0": False, "false": False, "no": False, "n": False},
    fold=str.lower,
    allowed="a boolean (1/true/yes/y or 0/false/no/n)",
)


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str
    parser: Optional[Parser]  # None: SGLang's, read and checked by SGLang (`sglang.srt.environ.envs`)
    default: Any  # where unset or empty
    where: str  # the module it acts in
    field: Optional[str]  # the `Knobs` field that carries it to the worker, if one does
    meaning: str  # one line, for docs/knobs.md

    def read(self, environ: Mapping[str, str] = os.environ) -> Any:
        """This variable's typed value in `environ` (its default where unset or empty)."""
        text = environ.get(self.name, "")
        if text == "":
            return self.default
        try:
            return self.parser.parse(text)
        except ValueError as error:
            detail = f" ({error})" if str(error) else ""
            raise KnobError(f"{self.name}={text!r} is not {self.parser.allowed}{detail}") from None


# fmt: off
REGISTRY: tuple[Knob, ...] = (
    # Knob(name, kind, parser, default, where it acts, the `Knobs` field carrying it or None,
    #      meaning)
    # ---- serving choices
    Knob("SGLANG_DFLASH_IMPL", SERVING, IMPL, "sglang-dflash", "plugin.py", None,
         "who serves DFLASH: this plugin's worker, or SGLang's built-in one (builtin)"),
    Knob("SGLANG_DFLASH_GRAMMAR_PROPOSALS", SERVING, SWITCH, True, "propose/grammar.py", "grammar_proposals",
         "grammar requests get grammar-aware proposals (0: the draft's plain argmax; docs/requests.md)"),
    Knob("SGLANG_DFLASH_ADAPTIVE_WIDTH", SERVING, SWITCH, None, "width/policy.py", "adaptive_width",
         "0: the verify width fixed at B; 1: adapted on any device; unset: adapted on CPU, and on CUDA "
         "where the target has verify graphs at several widths (docs/verify-width.md)"),
    Knob("SGLANG_DFLASH_FAIR_SLACK", SERVING, SLACK, FAIR_SLACK, "width/policy.py", "fair_slack",
         "how much slower a draft width may make one request's tokens than none (0.05: 5%); off: the "
         "batch's throughput alone decides"),
    Knob("SGLANG_DFLASH_WIDTH1_FORWARD", SERVING, WIDTH1_FORWARD, None, "width/step.py", "width1_forward",
         "how a step without draft runs the target; unset: a verify over one token where that is cheaper "
         "(CPU's batched verify attention, a width-1 verify backend), else the decode forward"),
    Knob("SGLANG_DFLASH_DEFERRED_INJECTION", SERVING, SWITCH, True, "draft/deferred_injection.py",
         "deferred_injection",
         "steps without draft queue their tokens' draft K/V for one bulk injection before the next draft "
         "(0: inject at once)"),
    Knob("SGLANG_DFLASH_DRAFT_WINDOW_POOL", SERVING, WINDOW_POOL, "auto", "draft/window_ring.py",
         "window_pool",
         "auto: the draft's windowed layers keep each request's last window + block only where that gives "
         "the target's pool more tokens and the server serves it (CPU; docs/serving.md), the choice logged; "
         "1: always, on CUDA too (FlashInfer over the ring, not yet run on a GPU), refused by name where "
         "it cannot; 0: K/V for every token"),
    Knob("SGLANG_DFLASH_DRAFT_CUDA_GRAPH", SERVING, SWITCH, True, "draft/step.py", "draft_graphs",
         "the draft step replays CUDA graphs where it can (0: always eager)"),
    Knob("SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN", SERVING, PLAN_FREE, PLAN_FREE_MAX_LEN, "draft/step.py",
         "draft_plan_free",
         "the draft's plan-free CUDA graphs replay up to this many tokens of visible context (0: none)"),
    Knob("SGLANG_DFLASH_VERIFY_GRAPHS", SERVING, VERIFY_GRAPHS, "on", "width/verify_widths.py",
         "verify_graphs",
         "unset: verify graphs at the narrower widths on CUDA; 0: none (narrow steps eager, the width then "
         "fixed unless SGLANG_DFLASH_ADAPTIVE_WIDTH=1); eager, a test aid: each width's own attention "
         "backend without graphs, on any device"),
    Knob("SGLANG_DFLASH_OPS", SERVING, OPS, "auto", "ops/__init__.py", None,
         "the context-KV injection: auto (the CUDA op where it applies, else its maths in PyTorch, else "
         "the module reference), reference, or cuda (an error where it cannot run)"),
    Knob("SGLANG_DFLASH_CPU_VERIFY_ATTENTION", SERVING, CPU_VERIFY_ATTENTION, "batched",
         "cpu/verify_attention.py", None,
         "the verify attention on torch_native: one masked SDPA per layer for the batch, or SGLang's "
         "per-request loop (for comparisons)"),
    Knob("SGLANG_DFLASH_SAMPLING_MEMORY_MB", SERVING, POSITIVE, 1024, "verify/sampling.py", None,
         "the transient memory one sampled draw may take, in MB: rows are drawn in chunks that fit"),
    Knob("SGLANG_DFLASH_ALLOW_OTHER_TARGET", SERVING, SWITCH, False, "integration/server_args.py", None,
         "1: serve, with a warning, a draft whose config names another target (a num_target_layers, or "
         "a plain draft's vocab_size, other than the target's); unset: such a draft is refused at launch"),
    # ---- benchmark aids
    Knob("SGLANG_DFLASH_STEP_TIMING", BENCHMARK, APPENDABLE, None, "step_timer.py", "step_timing",
         "per-phase step records appended to this file as JSON lines (the device is synchronized around "
         "every phase; scripts/serving/step_phases.py)"),
    Knob("SGLANG_DFLASH_SIMULATE_ACC_METHOD", BENCHMARK, GEOMETRIC, None, "verify/acceptance.py", None,
         "with SGLANG_SIMULATE_ACC_LEN, ours only: each request's draft positions accepted "
         "independently, at the rate whose mean at the full width is that length"),
    # ---- test aids
    Knob("SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION", TEST, SWITCH, False, "worker.py",
         "skip_decode_injection",
         "decode steps inject no context K/V into the draft"),
    Knob("SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER", TEST, SWITCH, False, "worker.py", "skip_draft_transfer",
         "prefill/decode disaggregation leaves the draft's K/V out of its transfer"),
    Knob("SGLANG_DFLASH_TEST_SKIP_DRAFT_HICACHE", TEST, SWITCH, False, "worker.py", "skip_draft_hicache",
         "HiCache leaves the draft's K/V out of its backups"),
    Knob("SGLANG_DFLASH_TEST_SKIP_WINDOW_REPREFILL", TEST, SWITCH, False, "integration/draft_budget.py",
         "skip_window_reprefill",
         "with the window ring, a radix-cache hit reuses its whole prefix: its first drafts read no window"),
    Knob("SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT", TEST, SWITCH, False, "integration/linear_state.py",
         "skip_state_commit",
         "hybrid targets keep the linear-attention state of the whole verify window"),
    Knob("SGLANG_DFLASH_TEST_WIDTH1_STEPS", TEST, NON_NEGATIVE, 0, "width/step.py", "width1_steps",
         "the first N decode steps run without draft"),
    Knob("SGLANG_DFLASH_TEST_WIDTHS", TEST, WIDTHS, (), "width/step.py", "widths",
         "decode steps take these verify widths in turn (each at most B), whatever the policy"),
    # ---- debugging aids
    Knob("SGLANG_DFLASH_CHECK_RANKS", DEBUGGING, SWITCH, False, "draft/tensor_parallel.py", "check_ranks",
         "tensor-parallel ranks compare their proposals and committed tokens every step (gathers, host "
         "sync)"),
    Knob("SGLANG_DFLASH_TRACE_PROPOSALS", DEBUGGING, APPENDABLE, None, "worker.py", "trace_proposals",
         "every request's verified proposals per step appended to this file as JSON lines (host sync)"),
    Knob("SGLANG_DFLASH_TRACE_FEATURES", DEBUGGING, APPENDABLE, None, "runtime.py", "trace_features",
         "the target features the draft reads (its fc input), appended to this file as a JSON line per "
         "injection with their positions (host sync)"),
    # ---- build
    Knob("SGLANG_DFLASH_BUILD_CUDA", BUILD, SWITCH, None, "setup.py", None,
         "unset: build the CUDA extension if nvcc is found (a failed build only warns); 1: build it, or "
         "fail the install; 0: never build it"),
    Knob("SGLANG_DFLASH_CUDA_ARCHS", BUILD, ARCHS, ("80", "90", "100", "120"), "setup.py", None,
         "the SM versions the CUDA extension is compiled for (the last also as PTX); "
         "TORCH_CUDA_ARCH_LIST, if set, takes precedence"),
    # ---- the GPU kit's
    Knob("SGLANG_DFLASH_SGL_KERNEL_STANDIN", KIT, SWITCH, False, "tests/gpu_kit/serve/standin/sgl_kernel",
         None,
         "the kit's sgl_kernel stand-in serves the kernels the GPU machine's sgl-kernel lacks"),
    Knob("SGLANG_DFLASH_GPU_KIT", KIT, SWITCH, False, "tests/gpu_kit/serve/standin/sitecustomize.py", None,
         "the kit's sitecustomize applies its patches (on the GPU machine)"),
    # ---- SGLang's (the first two read here as SGLang reads them, the others through its `envs`)
    Knob("SGLANG_ENABLE_LILICORR_SAMPLING", SGLANG, SGLANG_BOOL, True, "propose/proposers.py",
         "lilicorr_sampling",
         "0: LiLiCorr's lattice walked greedily for every request; unset (unlike SGLang's default): "
         "sampled requests sample their walk, verified exactly with its q"),
    Knob("SGLANG_LILICORR_REQUIRE_SAMPLING", SGLANG, SGLANG_BOOL, False, "knobs.py", None,
         "refuses SGLANG_ENABLE_LILICORR_SAMPLING=0"),
    Knob("SGLANG_SIMULATE_ACC_LEN", SGLANG, None, None, "verify/acceptance.py", None,
         "a benchmark aid: acceptance forced to lengths drawn around this mean (outputs are not the "
         "model's)"),
    Knob("SGLANG_SIMULATE_ACC_METHOD", SGLANG, None, None, "verify/acceptance.py", None,
         "how SGLang draws those lengths (one per batch)"),
    Knob("SGLANG_SIMULATE_ACC_TOKEN_MODE", SGLANG, None, None, "verify/acceptance.py", None,
         "which tokens a forced acceptance commits (fixed or real-draft-token)"),
    Knob("SGLANG_DFLASH_EAGER_DRAFT_SAMPLER", SGLANG, None, None, "SGLang's dflash_worker_v2.py", None,
         "SGLang's built-in DFLASH worker's (SGLANG_DFLASH_IMPL=builtin); this worker has no such "
         "sampler and does not read it"),
)
# fmt: on
BY_NAME = {knob.name: knob for knob in REGISTRY}


def parse(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Name -> typed value of every knob with a parser (SGLang's own are left to SGLang). Raises
    one KnobError naming every bad variable, its value and what it takes, and every SGLANG_DFLASH_
    name the registry does not know."""
    values, problems = {}, []
    for knob in REGISTRY:
        if knob.parser is not None:
            try:
                values[knob.name] = knob.read(environ)
            except KnobError as error:
                problems.append(str(error))
    ours = [n.removeprefix(PREFIX) for n in BY_NAME if n.startswith(PREFIX)]
    for name in sorted(n for n in environ if n.startswith(PREFIX) and n not in BY_NAME):
        close = difflib.get_close_matches(name.removeprefix(PREFIX), ours, n=1, cutoff=0.75)
        hint = f" (did you mean {PREFIX}{close[0]}?)" if close else " (docs/knobs.md lists them)"
        problems.append(f"{name} is not a variable sglang-dflash reads{hint}")
    if problems:
        raise KnobError("; ".join(problems))
    return values


def value(name: str, environ: Mapping[str, str] = os.environ) -> Any:
    """One knob's typed value (for the modules that read their own); KnobError if it is bad."""
    return BY_NAME[name].read(environ)


def use_builtin(environ: Mapping[str, str] = os.environ) -> bool:
    """SGLANG_DFLASH_IMPL=builtin hands DFLASH back to SGLang's built-in worker."""
    return value("SGLANG_DFLASH_IMPL", environ) == BUILTIN


@dataclass(frozen=True)
class SimulatedAcceptance:
    """SGLang's benchmark knob: acceptance lengths drawn around `mean` by `method`."""

    mean: float
    method: str
    token_mode: str


@dataclass(frozen=True)
class Knobs:
    """The worker's knobs, typed (each from the registry's knob whose `field` names it)."""

    # Serving choices.
    grammar_proposals: bool = True
    adaptive_width: Optional[bool] = None  # None: the device's default
    fair_slack: Optional[float] = FAIR_SLACK  # None: off
    width1_forward: Optional[Width1Forward] = None  # None: the cheaper where known
    deferred_injection: bool = True
    window_pool: str = "auto"  # "auto", "on" or "off"
    draft_graphs: bool = True
    draft_plan_free: Optional[int] = PLAN_FREE_MAX_LEN  # None: no plan-free graphs
    verify_graphs: VerifyGraphs = "on"
    lilicorr_sampling: bool = True
    # Benchmark aids.
    step_timing: Optional[str] = None  # a file, checked appendable
    simulated_acceptance: Optional[SimulatedAcceptance] = None
    # Test aids.
    skip_decode_injection: bool = False
    skip_draft_transfer: bool = False
    skip_draft_hicache: bool = False
    skip_state_commit: bool = False
    skip_window_reprefill: bool = False
    width1_steps: int = 0
    widths: tuple[int, ...] = ()
    # Debugging aids.
    check_ranks: bool = False
    trace_proposals: Optional[str] = None  # a file, checked appendable
    trace_features: Optional[str] = None  # a file, checked appendable

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, *, simulated: bool = True) -> "Knobs":
        """The knobs of this process, every variable checked (`parse`). `simulated=False` skips
        SGLang's simulated-acceptance settings (read through `sglang.srt.environ`, so SGLang
        must be importable)."""
        values = parse(environ)
        if values["SGLANG_LILICORR_REQUIRE_SAMPLING"] and not values["SGLANG_ENABLE_LILICORR_SAMPLING"]:
            raise KnobError(
                "SGLANG_LILICORR_REQUIRE_SAMPLING is set but SGLANG_ENABLE_LILICORR_SAMPLING=0 walks "
                "LiLiCorr's lattice greedily for every request"
            )
        method = values["SGLANG_DFLASH_SIMULATE_ACC_METHOD"]
        return cls(
            **{knob.field: values[knob.name] for knob in REGISTRY if knob.field},
            simulated_acceptance=_simulated_acceptance(method) if simulated else None,
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
            (self.trace_features is not None, f"tracing target features to {self.trace_features}"),
        ]
        return [text for is_on, text in aids if is_on]


def _simulated_acceptance(method: Optional[str]) -> Optional[SimulatedAcceptance]:
    """SGLang's setting; `method`: SGLANG_DFLASH_SIMULATE_ACC_METHOD ("geometric" or None)."""
    from sglang.srt.environ import envs
    from sglang.srt.speculative.spec_utils import check_simulate_acc_token_mode

    mean = envs.SGLANG_SIMULATE_ACC_LEN.get()
    if mean <= 0:
        if method:
            raise KnobError(
                f"SGLANG_DFLASH_SIMULATE_ACC_METHOD={method} needs SGLANG_SIMULATE_ACC_LEN (the mean)"
            )
        return None
    check_simulate_acc_token_mode()
    return SimulatedAcceptance(
        mean, method or envs.SGLANG_SIMULATE_ACC_METHOD.get(), envs.SGLANG_SIMULATE_ACC_TOKEN_MODE.get()
    )


# ---------------------------------------------------------------------------- docs/knobs.md


def markdown() -> str:
    """docs/knobs.md: the registry, one table per kind."""
    lines = [
        "# Environment variables",
        "",
        "Every environment variable sglang-dflash reads. Generated from the registry in",
        "`sglang_dflash/knobs.py` (`python -m sglang_dflash.knobs > docs/knobs.md`; a test checks",
        "that this file is current). Each value is parsed and checked when a server launches, on",
        "every device: a value a variable does not take, or an `SGLANG_DFLASH_` name not listed",
        "here, fails the launch with an error naming the variable, its value and what it takes.",
        "Unset or empty: the default.",
    ]
    for kind, line in KINDS.items():
        lines += ["", f"## {kind}", "", line, "", "| Variable | Values | Default | Meaning | Where |"]
        lines.append("| --- | --- | --- | --- | --- |")
        for knob in (k for k in REGISTRY if k.kind == kind):
            if knob.parser is None:
                allowed, default = "read by SGLang (`sglang.srt.environ.envs`)", "SGLang's"
            else:
                allowed = knob.parser.allowed
                shown = None if knob.default is None else knob.parser.show(knob.default)
                default = f"`{shown}`" if shown else "unset"
            lines.append(f"| `{knob.name}` | {allowed} | {default} | {knob.meaning} | `{knob.where}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")

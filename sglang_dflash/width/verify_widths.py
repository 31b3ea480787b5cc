"""`VerifyWidths`: the target's verify forward at several widths, each width with its own
attention backend and (on CUDA) its own graph runner, swapped in around the step's verify.

SGLang captures the target's TARGET_VERIFY graphs at the full width B only, so a narrower
verify would run eager. Following SGLang's own adaptive EAGLE, this keeps one
(attention backend, graph runner) pair per width of `graph_widths(B)`, built once at start-up,
and puts the step's pair in the model runner's two slots for the length of its verify:

    with widths.active(W):   # runner.attn_backend, runner.decode_cuda_graph_runner = W's pair
        verify_forward(...)  # the width-W graph replays (or the forward runs eager on W's backend)

Each width needs a backend of its own: backends keep their graph metadata per batch size only,
and every runner re-initialises its backend's graph buffers, so two widths sharing a backend
would corrupt each other's graphs. Width B is SGLang's own pair, read fresh from the runner at
every step (a recapture replaces it), and W = 1 is a one-token verify graph: a step without
draft runs a verify over its bonus token, never the DECODE forward (whose batch would replay a
width-1 verify graph with the wrong inputs, were that graph installed).

Pairs are built widest first, into SGLang's shared graph pool, each after a check that the
free device memory holds it: a width that does not fit is dropped and named in the start-up
line, and the narrower ones are still tried. Building, timing and memory readings come from
the caller (`verify_runners.py` builds SGLang's pairs), so all of this runs on CPU with
stand-ins.

See docs/verify-width.md ("On CUDA").
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from sglang_dflash.knobs import VerifyGraphs

logger = logging.getLogger(__name__)

HEADROOM_GB = 1.0  # device memory left free after the last width's graphs, for the forward itself
# How SGLang's graph runner reports a failed capture (`decode_cuda_graph_runner.py`).
CAPTURE_FAILED = "Capture cuda graph failed"


def graph_widths(num_draft_tokens: int) -> tuple[int, ...]:
    """The verify widths that get a pair, widest first: B, the powers of two below it, and 1.
    A verify costs about the same up to the GEMM ridge and linearly beyond, so the best width
    keeps bs * W near a few hundred tokens, which powers of two track within 2x.

    E.g., 16 -> (16, 8, 4, 2, 1); 6 -> (6, 4, 2, 1); 1 -> (1,).
    """
    widths = {1, num_draft_tokens}
    power = 2
    while power < num_draft_tokens:
        widths.add(power)
        power *= 2
    return tuple(sorted(widths, reverse=True))


def why_not_per_width(
    *,
    device_type: str,
    mode: VerifyGraphs,
    num_draft_tokens: int,
    tp_size: int,
    hybrid: bool,
    lora: bool,
    two_batch_overlap: bool,
    disaggregation: str,
    graphs_disabled: bool,
    torch_compile: bool = False,
    pdmux: bool = False,
) -> Optional[str]:
    """None when each width gets its own pair, else why not (for the start-up line).
    `mode`: SGLANG_DFLASH_VERIFY_GRAPHS (`knobs.Knobs.verify_graphs`): "on" (unset: per-width
    graphs on CUDA), "off" (=0: none) or "eager" (a test aid: per-width attention backends without
    graphs, on any device).
    The refusals are what SGLang's adaptive EAGLE refuses too, and what has not run yet (DP
    attention is refused for the whole server, `server_args.py`)."""
    if mode == "off":
        return "SGLANG_DFLASH_VERIFY_GRAPHS=0"
    if num_draft_tokens < 2:
        return "--speculative-num-draft-tokens is 1"
    if mode != "eager":
        if device_type != "cuda":
            return f"no CUDA graphs on {device_type}"
        if graphs_disabled:
            return "CUDA graphs are disabled"
    refusals = [
        (tp_size > 1, f"tp_size {tp_size}: ranks would have to agree on every step's width"),
        (hybrid, "a hybrid linear-attention target (its state backend is B's)"),
        (lora, "LoRA adapters"),
        (two_batch_overlap, "two-batch overlap"),
        (torch_compile, "--enable-torch-compile (each width's capture would compile again)"),
        (pdmux, "PD multiplexing (its graphs plan on its own backend group)"),
        (disaggregation != "null", f"disaggregation mode {disaggregation} (recaptures B's graphs only)"),
    ]
    return next((reason for refused, reason in refusals if refused), None)


def widths_to_build(
    num_draft_tokens: int, adaptive: Optional[bool], width1_steps: int, forced: Sequence[int]
) -> tuple[int, ...]:
    """The narrower widths (below B) that get a pair, widest first. `adaptive`:
    SGLANG_DFLASH_ADAPTIVE_WIDTH (`Knobs.adaptive_width`); False fixes every step at B, so only
    the widths the test aids force are built (`forced`: SGLANG_DFLASH_TEST_WIDTHS; width 1 when
    SGLANG_DFLASH_TEST_WIDTH1_STEPS is set): a fixed-width server runs none of the per-width
    machinery it never verifies at.

    E.g., B 8: adaptive -> (4, 2, 1); fixed -> (); fixed with forced widths (1, 8) -> (1,)."""
    if adaptive is not False:
        return graph_widths(num_draft_tokens)[1:]
    wanted = set(forced) | ({1} if width1_steps else set())
    return tuple(sorted((w for w in wanted if w < num_draft_tokens), reverse=True))


def build_failure(error: BaseException) -> Optional[str]:
    """Why a width's pair could not be built, when `error` is one its capture may meet and the
    server can do without the width: the device ran out of memory, or SGLang's graph runner
    failed to capture (it re-raises what the capture raised as a plain Exception, "Capture cuda
    graph failed: ...", `decode_cuda_graph_runner.py`). None for anything else: a defect, raised
    as it is."""
    text = str(error)
    out_of_memory = type(error).__name__ == "OutOfMemoryError" or "out of memory" in text.lower()
    if out_of_memory:
        return f"out of memory while building it: {_first_line(text)}"
    if text.startswith(CAPTURE_FAILED):
        return f"its graph capture failed: {_first_line(text[len(CAPTURE_FAILED) :].lstrip(': '))}"
    return None


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "(no message)"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def step_cost_table(
    verify: dict[int, dict[int, float]], draft: dict[int, float]
) -> dict[tuple[int, int], float]:
    """A decode step's cost at each captured (batch size, width), from timed graph replays:
    `verify` width -> batch size -> seconds of its verify graph, `draft` batch size -> seconds
    of the draft step's graph. A step at W > 1 runs the draft too, padded to its smallest
    bucket that holds the batch; a batch size above every draft bucket has no W > 1 entry.

    E.g., verify {1: {8: 1.0}, 4: {8: 1.5}}, draft {16: 0.5} -> {(8, 1): 1.0, (8, 4): 2.0}.
    """
    table = {}
    buckets = sorted(draft)
    for width, by_size in verify.items():
        for bs, seconds in by_size.items():
            if width == 1:
                table[(bs, 1)] = seconds
                continue
            bucket = next((b for b in buckets if b >= bs), None)
            if bucket is not None:
                table[(bs, width)] = seconds + draft[bucket]
    return table


@dataclass(frozen=True)
class WidthPair:
    """One width's attention backend and graph runner (None: the verify runs eager on the
    backend), with what building it cost."""

    width: int
    attn_backend: Any
    graph_runner: Any
    seconds: float = 0.0
    gigabytes: float = 0.0


class VerifyWidths:
    """The pairs of every width but B (SGLang's, read from `runner`), and the swap."""

    def __init__(self, runner, num_draft_tokens: int, pairs: dict[int, WidthPair], dropped: dict[int, str]):
        self.runner = runner
        self.num_draft_tokens = num_draft_tokens
        self.pairs = pairs  # width -> its pair, every width but B
        self.dropped = dropped  # width -> why it has no pair

    @classmethod
    def build(
        cls,
        runner,
        num_draft_tokens: int,
        make_pair: Callable[[int], WidthPair],
        free_gb: Optional[Callable[[], float]] = None,
        full_width_gb: float = 0.0,
        headroom_gb: float = HEADROOM_GB,
        widths: Optional[Sequence[int]] = None,
    ) -> "VerifyWidths":
        """Build the pairs of `widths` (default: every width of `graph_widths` but B), widest
        first. `make_pair(W)` builds one; `free_gb()` reads the free device memory (None:
        nothing to check, as on CPU).
        A narrower width never needs more than a wider one (its buffers scale with W), so each
        width is expected to take what the last one built took, the first what B's graphs
        took (`full_width_gb`); a width is built only if that leaves `headroom_gb` free. A width
        whose build runs out of memory or whose capture fails (`build_failure`) is dropped and
        named too, and the narrower ones are still tried.

        E.g., B's graphs 3 GB, 4.5 GB free, headroom 1: width 8 is built (3 + 1 <= 4.5) and
        takes 1.5 GB; 3 GB are left, so width 4 (1.5 + 1) is built too."""
        pairs: dict[int, WidthPair] = {}
        dropped: dict[int, str] = {}
        expected = full_width_gb
        todo = graph_widths(num_draft_tokens)[1:] if widths is None else sorted(set(widths), reverse=True)
        for width in todo:
            if free_gb is not None:
                free = free_gb()
                if expected + headroom_gb > free:
                    dropped[width] = (
                        f"{free:.2f} GB free, about {expected:.2f} GB needed + {headroom_gb:.2f} GB headroom"
                    )
                    continue
            try:
                pair = make_pair(width)
            except Exception as error:  # start-up only; anything but `build_failure`'s is raised
                why = build_failure(error)
                if why is None:
                    raise
                logger.warning("DFLASH verify width %d dropped: %s", width, why)
                dropped[width] = why
                continue
            pairs[width] = pair
            expected = pair.gigabytes
        return cls(runner, num_draft_tokens, pairs, dropped)

    @property
    def widths(self) -> tuple[int, ...]:
        """The widths a step may verify at, narrowest first (B always)."""
        return tuple(sorted([*self.pairs, self.num_draft_tokens]))

    @property
    def graphed(self) -> bool:
        """Whether the narrower widths replay graphs (else they run eager on their backends)."""
        return any(pair.graph_runner is not None for pair in self.pairs.values())

    @contextlib.contextmanager
    def active(self, width: int):
        """The model runner verifies at `width` inside this block: its attention backend and
        graph runner are `width`'s; B's own are put back after. B itself swaps nothing, nor
        does width 1 where it was dropped at start-up (the policy chooses among the other
        widths with a pair; a step without draft always exists): it runs on B's, eager."""
        if width == self.num_draft_tokens or (width == 1 and 1 in self.dropped):
            yield
            return
        pair = self.pairs.get(width)
        if pair is None:
            raise ValueError(f"verify width {width} has no attention backend (widths: {list(self.widths)})")
        runner = self.runner
        saved = runner.attn_backend, runner.decode_cuda_graph_runner
        runner.attn_backend, runner.decode_cuda_graph_runner = pair.attn_backend, pair.graph_runner
        try:
            yield
        finally:
            runner.attn_backend, runner.decode_cuda_graph_runner = saved

    def describe(self) -> str:
        """For the start-up line, e.g. `1 (0.4 s, 0.12 GB), 2 (0.5 s, 0.15 GB); 4 dropped (...)`."""
        kind = "graphs" if self.graphed else "eager backends"
        built = ", ".join(
            f"{w} ({self.pairs[w].seconds:.1f} s, {self.pairs[w].gigabytes:.2f} GB)"
            for w in sorted(self.pairs)
        )
        text = f"{kind} at {built}" if built else "none built"
        for width, why in sorted(self.dropped.items()):
            text += f"; {width} dropped ({why})"
        return text

"""The draft step: one draft forward over each request's block, eager or replayed from a CUDA
graph. The worker asks `DraftStep` for a step and gets the block, its positions and the draft's
final hidden states; which way it ran is this module's business.

Graphs. One per batch-size bucket (SGLang's capture sizes, `--cuda-graph-bs` /
`--cuda-graph-max-bs`), captured at start-up after the target's graphs and the draft's warm-up,
in SGLang's graph memory pool. Each graph runs, for its b rows:

    block = [bonus, MASK x (Bd-1)] at positions seq_lens + [0, Bd)   (`block.prepare_draft_block`)
    hidden = norm(draft layers(embed(block)))                          [b, Bd, H]

over static inputs `bonus [b]`, `seq_lens [b]` and static outputs `block_ids`, `positions`
[b, Bd] and `hidden` [b, Bd, H]. `hidden` is a view of one buffer that every bucket shares
([max b, Bd, H]; one bucket replays per step, and its output is read before the next replay):
per-bucket outputs would keep Σb·Bd·H of them alive, about 0.55 GB for SGLang's default sizes
up to 256 at H = 4096. The draft attention is FlashInfer's in CUDA-graph mode: its
plan runs on the host before each replay, with the exact host lengths, into fixed buffers the
graph reads (`flashinfer_attention.py`). The LM head stays outside, so the proposals cost the
step's verify width, and a grammar batch can read full logits off the same hidden states.

Plan-free graphs. A graph-mode plan costs host time every step (the page layout's small
kernels, the plan's host loop and copies): about 0.9 ms at batch 1 on an H100, more than the
draft's own forward there. So each bucket has a second graph whose attention is planned once,
at capture, without split-KV, and builds its layout on the device inside the graph
(`flashinfer_attention.py`, `plan_free_max_len`): its replay costs three small copies on the
host. Without split-KV a long context runs on few CTAs, so it replays only while every
request's visible context is at most a bound (`SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN`, default
2048 tokens; 0: none), read from the host lengths, which for this need not be exact; above
it the split-KV graph and its per-step plan run.

Padding. A batch of bs requests replays the smallest bucket b >= bs, as SGLang pads its own
graphs: rows bs..b-1 are a request with no context (`seq_lens` 0, request-pool row 0) whose
block attends only to itself, in its own scratch slots; their outputs are never read.

Eager. Everything else runs the same forward eagerly, chosen per step from host values only
(no device sync): a batch larger than every bucket, or one whose host lengths are only upper
bounds (the graph-mode plan needs exact ones), or a step whose page indices would not fit the
graphs' buffer. Where no graph can run at all (CPU, SDPA attention, `--disable-cuda-graph`,
`SGLANG_DFLASH_DRAFT_CUDA_GRAPH=0`), the reason is logged once at start-up.

See docs/gpu.md and docs/draft-cuda-graphs.md.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from sglang_dflash.draft.block import prepare_draft_block
from sglang_dflash.knobs import PLAN_FREE_MAX_LEN

GRAPHS_ENV = "SGLANG_DFLASH_DRAFT_CUDA_GRAPH"  # 0: the draft step always runs eagerly
PLAN_FREE_ENV = "SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN"  # 0: no plan-free graphs

logger = logging.getLogger(__name__)


# (block_ids [bs, Bd], positions [bs, Bd], hidden [bs, Bd, H])
StepOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------ pure decisions


def capture_sizes(sglang_sizes: Optional[Sequence[int]], max_batch_size: int) -> tuple[int, ...]:
    """The buckets to capture: SGLang's capture sizes, clamped as SGLang clamps its own to the
    largest batch there can be (`max_batch_size`, the request pool's rows), ascending, unique.
    E.g., [1, 2, 4, 8, 16, 24, 32], max 20 -> (1, 2, 4, 8, 16, 20); max 64 -> all of them."""
    sizes = {int(s) for s in sglang_sizes or ()}
    kept = {s for s in sizes if 1 <= s <= max_batch_size}
    if any(s > max_batch_size for s in sizes):
        kept.add(max_batch_size)
    return tuple(sorted(kept))


def bucket_for(bs: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest bucket holding bs requests, or None above the largest (bisect, as SGLang
    pads). E.g., bs 5 in (1, 2, 4, 8) -> 8; bs 9 -> None."""
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None


def graphs_unavailable_reason(
    *, device: torch.device, attention_name: str, disable_cuda_graph: bool, enabled: bool = True
) -> Optional[str]:
    """Why the draft step can never run from CUDA graphs in this server (None if it can).
    `enabled`: SGLANG_DFLASH_DRAFT_CUDA_GRAPH (`knobs.Knobs.draft_graphs`)."""
    if device.type != "cuda":
        return f"the draft runs on {device.type}"
    if not enabled:
        return f"{GRAPHS_ENV}=0"
    if disable_cuda_graph:
        return "--disable-cuda-graph"
    if attention_name != "flashinfer":
        return f"the draft attention is {attention_name}, which sizes its work from host lengths every step"
    return None


def eager_reason(
    bs: int, sizes: Sequence[int], host_lens_exact: bool, num_indices: int, capacity: int
) -> Optional[str]:
    """Why this step runs eagerly although graphs were captured (None: replay), from host
    values only. `num_indices`: the page indices its plan lists (host lengths + blocks)."""
    if bucket_for(bs, sizes) is None:
        return f"batch size above the largest graph ({sizes[-1] if sizes else 0})"
    if not host_lens_exact:
        return "only upper-bound host lengths"
    if num_indices > capacity:
        return "more page indices than the graphs' buffer holds"
    return None


def padded_host_lens(host_lens: torch.Tensor, size: int) -> torch.Tensor:
    """Host lengths of a batch padded to `size` rows with empty requests.
    E.g., [5, 9] to 4 rows -> [5, 9, 0, 0]."""
    pad = size - host_lens.shape[0]
    return host_lens if pad == 0 else torch.cat([host_lens, host_lens.new_zeros(pad)])


# ------------------------------------------------------------------ the step


@dataclass
class BucketGraph:
    """One bucket's graph, its attention and its static tensors (b rows)."""

    size: int
    attention: object  # a graph-mode draft attention for `size` requests
    bonus: torch.Tensor  # [b] int64, input
    seq_lens: torch.Tensor  # [b] int64, input
    pool_rows: torch.Tensor  # [b] int64, input to the plan (outside the graph, or inside: plan-free)
    graph: Optional[object] = None  # torch.cuda.CUDAGraph, or a test's stand-in
    outputs: Optional[StepOutput] = None  # static: [b, Bd] x2, [b, Bd, H]

    def load(self, bonus: torch.Tensor, seq_lens: torch.Tensor, pool_rows: torch.Tensor) -> None:
        """Copy a batch of bs <= b rows in; rows bs..b-1 become empty requests (row 0)."""
        bs = seq_lens.shape[0]
        for static, value in ((self.bonus, bonus), (self.seq_lens, seq_lens), (self.pool_rows, pool_rows)):
            static[:bs].copy_(value)
            if bs < self.size:
                static[bs:].zero_()


class PlannedReplay:
    """A captured graph whose `replay()` first runs `plan` (once: the plan holds for every
    replay on the same inputs)."""

    def __init__(self, graph, plan: Optional[Callable[[], None]] = None):
        self.graph, self._plan = graph, plan

    def replay(self) -> None:
        if self._plan is not None:
            self._plan()
            self._plan = None
        self.graph.replay()


class DraftStep:
    """`step(req_to_token, req_pool_indices, bonus [bs], seq_lens [bs], host_lens [bs], exact)
    -> (block_ids [bs, Bd], positions [bs, Bd], hidden [bs, Bd, H])`.

    `forward(embeds [N, H], positions [N], attend) -> [N, H]`: the draft network (the module,
    or `fused_forward.FusedDraftForward`); `embed(ids [N]) -> [N, H]`: the target's embedding;
    `attention`: the eager draft attention.

    From a replay, `hidden` is the graph's static output: valid only until the next replay of
    any graph in the same memory pool. SGLang's pool is shared, and the target's graphs, captured
    first, may use that memory for their intermediates, so the target's verify overwrites it:
    read `hidden` before the verify. The block and positions, which the step needs after the
    verify, are returned as copies.
    """

    def __init__(
        self,
        forward: Callable,
        embed: Callable[[torch.Tensor], torch.Tensor],
        attention,
        *,
        block_size: int,
        mask_token_id: int,
        context_window: Optional[int] = None,
    ):
        self.forward = forward
        self.embed = embed
        self.attention = attention
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        # The most context rows the attention lists per request (None: all): the draft window
        # (--speculative-draft-window-size), or a window ring's reach where every layer is in it.
        self.context_window = context_window
        self.graphs: dict[int, BucketGraph] = {}
        self.plan_free: dict[int, BucketGraph] = {}  # bucket -> its plan-free graph
        self.plan_free_max_len: Optional[int] = None
        self.req_to_token: Optional[torch.Tensor] = None  # what the plan-free graphs read
        self._shared_hidden: Optional[torch.Tensor] = None  # [max b, Bd, H], set at capture
        self.sizes: tuple[int, ...] = ()
        self.kv_indices_capacity = 0
        self.replay_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.eager_steps: dict[str, int] = {}  # reason -> steps run eagerly although graphs exist

    # ------------------------------------------------------------ per step

    def __call__(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        bonus: torch.Tensor,
        seq_lens: torch.Tensor,
        host_lens: torch.Tensor,
        host_lens_exact: bool,
    ) -> StepOutput:
        bs = seq_lens.shape[0]
        if self.graphs:
            visible = host_lens if self.context_window is None else host_lens.clamp(max=self.context_window)
            size = bucket_for(bs, self.sizes)
            # Host values (no sync), exact or upper bounds: both bound the device lengths.
            if bs and size in self.plan_free and int(visible.max()) <= self.plan_free_max_len:
                if req_to_token.data_ptr() != self.req_to_token.data_ptr():
                    raise ValueError("the plan-free draft graphs were captured over another req_to_token")
                return self._replay(self.plan_free[size], None, bonus, seq_lens, req_pool_indices, host_lens)
            # The padded plan lists every bucket row's block.
            num_indices = int(visible.sum()) + (size or bs) * self.block_size
            why = eager_reason(bs, self.sizes, host_lens_exact, num_indices, self.kv_indices_capacity)
            if why is None:
                return self._replay(
                    self.graphs[size],
                    req_to_token,
                    bonus,
                    seq_lens,
                    req_pool_indices,
                    host_lens,
                )
            self._count_eager(why)
        attend = self.attention.bind(
            req_to_token,
            req_pool_indices,
            seq_lens,
            host_lens,
            self.block_size,
            host_lens_exact=host_lens_exact,
        )
        return self._forward(bonus, seq_lens, attend)

    def _forward(self, bonus: torch.Tensor, seq_lens: torch.Tensor, attend) -> StepOutput:
        bs = seq_lens.shape[0]
        block_ids, positions = prepare_draft_block(
            bonus, seq_lens, mask_token_id=self.mask_token_id, block_size=self.block_size
        )  # [bs, Bd] x2
        hidden = self.forward(self.embed(block_ids.view(-1)), positions.view(-1), attend)
        return block_ids, positions, hidden.view(bs, self.block_size, -1)

    def _replay(
        self, g: BucketGraph, req_to_token, bonus, seq_lens, req_pool_indices, host_lens
    ) -> StepOutput:
        """`req_to_token` None: a plan-free graph, which binds its attention itself."""
        bs = seq_lens.shape[0]
        g.load(bonus, seq_lens, req_pool_indices)
        if req_to_token is not None:
            g.attention.bind(
                req_to_token, g.pool_rows, g.seq_lens, padded_host_lens(host_lens, g.size), self.block_size
            )
        with self.replay_scope():
            g.graph.replay()
        block_ids, positions, hidden = g.outputs
        return block_ids[:bs].clone(), positions[:bs].clone(), hidden[:bs]

    def timing_graphs(self) -> dict[int, "PlannedReplay"]:
        """Bucket -> a graph to time at start-up (`verify_runners.cost_table`), on its
        capture-time inputs (empty requests): the plan-free graphs where there are (they serve
        the short contexts), else the split-KV ones, each planned again for its own bucket
        before its first replay. The split-KV buckets share their attention's int workspace,
        where the last plan (the smallest bucket's, at capture) left its offsets, which depend
        on the padded batch: replayed as it is, a larger bucket would read another bucket's
        plan (wrong timings, or an illegal memory access)."""
        if self.plan_free:
            return {size: PlannedReplay(g.graph) for size, g in self.plan_free.items()}
        return {
            size: PlannedReplay(g.graph, lambda g=g: self._plan_empty(g)) for size, g in self.graphs.items()
        }

    def _plan_empty(self, g: "BucketGraph") -> None:
        """Plan bucket `g`'s split-KV attention for empty requests, as at its capture."""
        for static in (g.bonus, g.seq_lens, g.pool_rows):
            static.zero_()
        zeros = torch.zeros(g.size, dtype=torch.int64)
        g.attention.bind(self.req_to_token, g.pool_rows, g.seq_lens, zeros, self.block_size)

    def _count_eager(self, why: str) -> None:
        if why not in self.eager_steps:
            logger.info("DFLASH draft step runs eagerly for the first time because of: %s", why)
        self.eager_steps[why] = self.eager_steps.get(why, 0) + 1

    # ------------------------------------------------------------ start-up

    @torch.no_grad()
    def capture(
        self,
        sizes: Sequence[int],
        make_attention: Callable[[int], object],
        req_to_token: torch.Tensor,
        *,
        kv_indices_capacity: int,
        pool=None,
        capture_context: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
        capture_graph: Optional[Callable] = None,
        replay_scope: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
        make_plan_free: Optional[Callable[[int], object]] = None,
        plan_free_max_len: Optional[int] = None,
    ) -> float:
        """Capture one graph per size, the largest first (smaller graphs then reuse its pool
        memory, as SGLang orders its own). `make_attention(b)`: a graph-mode attention for b
        requests. `make_plan_free(b)`: a plan-free one (`plan_once`, `bind_on_device`), for a
        second graph per size that replays while every visible context is at most
        `plan_free_max_len` tokens. `pool`: the graph memory pool to capture in (SGLang's).
        `capture_context()`: yields the stream to capture on (SGLang's `graph_capture()` under
        tensor parallelism). `capture_graph(run, pool, stream) -> (graph, outputs)`:
        `torch_capture`, unless a test replaces it. `replay_scope()`: entered around every replay
        (SGLang's check that nothing borrowed from the graph pool is live). Returns the seconds it took."""
        start = time.perf_counter()
        capture_graph = capture_graph or torch_capture
        capture_context = capture_context or _side_stream
        self.kv_indices_capacity = kv_indices_capacity
        self.replay_scope = replay_scope or contextlib.nullcontext
        if (make_plan_free is None) != (plan_free_max_len is None):
            raise ValueError("make_plan_free and plan_free_max_len go together")
        self.plan_free_max_len = plan_free_max_len
        self.req_to_token = req_to_token
        self._shared_hidden = None  # [max b, Bd, H]: every bucket's `hidden` output (module docstring)
        with capture_context() as stream:
            for size in sorted(set(sizes), reverse=True):
                self.graphs[size] = self._capture_bucket(
                    size, make_attention(size), False, req_to_token, capture_graph, pool, stream
                )
                if pool is None and hasattr(self.graphs[size].graph, "pool"):
                    pool = self.graphs[size].graph.pool()  # the later graphs share the first one's pool
                if make_plan_free is not None:
                    self.plan_free[size] = self._capture_bucket(
                        size, make_plan_free(size), True, req_to_token, capture_graph, pool, stream
                    )
        self.sizes = tuple(sorted(self.graphs))
        return time.perf_counter() - start

    def _capture_bucket(
        self, size, attention, plan_free, req_to_token, capture_graph, pool, stream
    ) -> BucketGraph:
        """One bucket's graph. Split-KV (`plan_free` False): planned for empty requests here
        (every replay plans again, with the batch's lengths). Plan-free: planned once, here,
        and the layout built inside the graph from its static inputs."""
        device = req_to_token.device
        g = BucketGraph(
            size=size,
            attention=attention,
            bonus=torch.zeros(size, dtype=torch.int64, device=device),
            seq_lens=torch.zeros(size, dtype=torch.int64, device=device),
            pool_rows=torch.zeros(size, dtype=torch.int64, device=device),
        )
        # On the capture stream: the plan's copies must land before the warm-up reads them.
        with _on(stream):
            if plan_free:
                attention.plan_once(self.block_size)
            else:
                zeros = torch.zeros(size, dtype=torch.int64)
                attend = attention.bind(req_to_token, g.pool_rows, g.seq_lens, zeros, self.block_size)

        def forward() -> StepOutput:
            if plan_free:
                # First in the graph: FlashInfer's kernels read the indptr before their PDL wait,
                # so its writes must be well upstream of the first attention kernel.
                bound = attention.bind_on_device(req_to_token, g.pool_rows, g.seq_lens, self.block_size)
                return self._forward(g.bonus, g.seq_lens, bound)
            return self._forward(g.bonus, g.seq_lens, attend)

        with _on(stream):
            for _ in range(2):  # warm up on the capture stream: lazy kernel builds, cuBLAS
                warm = forward()
            if self._shared_hidden is None:  # the largest bucket comes first; outside the pool
                self._shared_hidden = torch.empty_like(warm[2])
        out = self._shared_hidden[:size]

        def run() -> StepOutput:
            # The forward's own output becomes a graph intermediate, whose pool memory the next
            # (smaller) bucket reuses.
            block_ids, positions, hidden = forward()
            out.copy_(hidden)
            return block_ids, positions, out

        g.graph, g.outputs = capture_graph(run, pool, stream)
        return g


def torch_capture(run: Callable[[], StepOutput], pool, stream) -> tuple[object, StepOutput]:
    """One CUDA graph of `run()`, in `pool`, on `stream`; its outputs are the static tensors."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = run()
    return graph, outputs


@contextlib.contextmanager
def _side_stream():
    """A capture stream of our own, made current (as SGLang's `graph_capture()` does), where
    SGLang's is not in use."""
    stream = torch.cuda.Stream()
    outer = torch.cuda.current_stream()
    stream.wait_stream(outer)
    with torch.cuda.stream(stream):
        yield stream
    outer.wait_stream(stream)


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


# ------------------------------------------------------------------ SGLang's side


def capture_in_sglang(
    step: DraftStep,
    runner,
    req_to_token: torch.Tensor,
    *,
    attention_name: str,
    graph_attention: Callable,
    enabled: bool = True,
    plan_free_max_len: Optional[int] = PLAN_FREE_MAX_LEN,
) -> Optional[tuple[float, float]]:
    """The draft step's CUDA graphs, one per SGLang capture size, in SGLang's graph memory pool;
    or why there are none (logged once). `runner`: the target's ModelRunner.
    `graph_attention(max b, plan-free bound) -> (page-index capacity, make_attention(b),
    make_plan_free(b))`: the graph-mode attentions and the buffers they share (make_plan_free
    None without a bound). `enabled`: SGLANG_DFLASH_DRAFT_CUDA_GRAPH; `plan_free_max_len`:
    SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN, None for no plan-free graphs (`knobs.Knobs`).
    Returns (GB, seconds) for SGLang's start-up accounting, or None when nothing was captured."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
    from sglang.srt.model_executor.runner_utils.pool import (
        get_or_create_global_graph_memory_pool,
        graph_pool_replay_scope,
    )
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.utils.common import get_available_gpu_memory

    reason = graphs_unavailable_reason(
        device=torch.device(runner.device),
        attention_name=attention_name,
        disable_cuda_graph=check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED),
        enabled=enabled,
    )
    if reason is None:
        # The target's captured sizes (its verify graphs), else the configured ones.
        sglang_sizes = runner.decode_cuda_graph_capture_bs or get_exec().graph.cuda_graph_config.decode.bs
        sizes = capture_sizes(sglang_sizes, req_to_token.shape[0])
        if not sizes:
            reason = f"no capture batch sizes (SGLang's: {sglang_sizes})"
    if reason is not None:
        logger.info("DFLASH draft step: eager, no CUDA graphs (%s)", reason)
        return None
    # SGLang's own measure of its graphs' memory: free GB after returning the cache.
    free_before = get_available_gpu_memory(runner.device, runner.gpu_id)
    bound = plan_free_max_len
    if bound is not None:  # no visible context is longer than a request-pool row or the window
        bound = min(bound, req_to_token.shape[1], step.context_window or bound)
    capacity, make_attention, make_plan_free = graph_attention(max(sizes), bound)
    seconds = step.capture(
        sizes,
        make_attention,
        req_to_token,
        kv_indices_capacity=capacity,
        pool=get_or_create_global_graph_memory_pool(torch.cuda),
        capture_context=_sglang_graph_capture,
        replay_scope=graph_pool_replay_scope,
        make_plan_free=make_plan_free,
        plan_free_max_len=bound,
    )
    used_gb = free_before - get_available_gpu_memory(runner.device, runner.gpu_id)
    plan_free = (
        f"plan-free graphs (split-KV off, planned once) up to {bound} tokens of visible context, "
        "split-KV graphs planned per step above (eager there for steps without exact host lengths)"
        if bound is not None
        else f"split-KV graphs planned per step ({PLAN_FREE_ENV}=0; eager for steps without exact "
        "host lengths)"
    )
    logger.info(
        "DFLASH draft step: CUDA graphs for batch sizes %s (%.2f GB, %.1f s; page-index buffer %d): %s; "
        "eager above %d requests",
        list(sizes),
        used_gb,
        seconds,
        capacity,
        plan_free,
        sizes[-1],
    )
    return used_gb, seconds


@contextlib.contextmanager
def _sglang_graph_capture():
    """SGLang's capture context on its shared capture stream: under tensor parallelism it makes
    the draft's all-reduces capturable (custom all-reduce, pynccl); with graph-pool borrowing on
    (SGLANG_ENABLE_GRAPH_POOL_BORROW) it retires the borrow pool first. Yields the stream."""
    from sglang.srt.distributed.parallel_state import graph_capture
    from sglang.srt.model_executor.runner_utils.pool import (
        get_or_create_global_graph_capture_stream,
        graph_pool_capture_scope,
    )

    stream = get_or_create_global_graph_capture_stream()
    with graph_pool_capture_scope(), graph_capture(stream=stream) as context:
        yield context.stream

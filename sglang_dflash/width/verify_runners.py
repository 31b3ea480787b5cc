"""SGLang's attention backends and TARGET_VERIFY graph runners at verify widths below B, for
`verify_widths.py`: built as SGLang's adaptive EAGLE builds its per-step-count states
(`speculative/eagle_worker_v2.py`, `build_adaptive_runtime_state`), and timed. SGLang is
imported inside the functions, which run at start-up only.

* `verify_widths_for`: start-up. Decides (once, with the reason) whether the target gets
  per-width pairs, and builds them after SGLang's own width-B graphs.
* `make_pair`: one width. SGLang's FA3 and Triton backends read the verify width from the
  server's speculative config when constructed, and a graph runner reads it for its capture
  width, so both are built under `speculative_num_draft_tokens = W`, restored to B after
  (SGLang reads B elsewhere, e.g. for the KV slots a decode step reserves).
* `cost_table`: the start-up cost table, each captured graph (the verify's at every width, the
  draft step's) replayed and timed with CUDA events (3 replays after one warm-up), on the
  inputs it was captured with.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional, Sequence

import torch

from sglang_dflash.knobs import VerifyGraphs
from sglang_dflash.width.verify_widths import VerifyWidths, WidthPair, step_cost_table, why_not_per_width

logger = logging.getLogger(__name__)

REPLAYS = 3  # timed replays per captured graph


@contextlib.contextmanager
def speculative_width(width: int):
    """SGLang's resolved `speculative_num_draft_tokens` is `width` inside this block."""
    from sglang.srt.runtime_context import get_context, get_spec

    full = get_spec().speculative_num_draft_tokens
    get_context().override("dflash.verify_width", speculative_num_draft_tokens=width)
    try:
        yield
    finally:
        get_context().override("dflash.verify_width", speculative_num_draft_tokens=full)


def _free_gb(runner) -> float:
    from sglang.srt.utils.common import get_available_gpu_memory

    return get_available_gpu_memory(runner.device, runner.gpu_id)


def make_pair(runner, width: int, graphed: bool) -> WidthPair:
    """Width `width`'s attention backend (sharing SGLang's workspace: replays are serial) and,
    when `graphed`, its TARGET_VERIFY graph runner at SGLang's capture sizes."""
    start = time.perf_counter()
    free_before = _free_gb(runner) if graphed else 0.0
    with speculative_width(width):
        backend = runner._get_attention_backend(init_new_workspace=False)
        graph_runner = None
        if graphed:
            graph_runner = runner._decode_cuda_graph_runner_cls()(
                runner, attn_backend=backend, speculative_num_draft_tokens=width
            )
    used = free_before - _free_gb(runner) if graphed else 0.0
    return WidthPair(width, backend, graph_runner, time.perf_counter() - start, used)


def runner_graphs(graph_runner) -> Optional[dict[int, object]]:
    """Batch size -> CUDA graph of an SGLang graph runner, or None when the runner keeps them
    where this cannot find them (SGLang's `full` graph backend's `_graphs`, keyed by a shape
    with the batch size; other graph backends are not read)."""
    graphs = getattr(getattr(graph_runner, "backend", None), "_graphs", None)
    if not isinstance(graphs, dict) or not graphs:
        return None
    sizes = [getattr(key, "size", None) for key in graphs]
    if None in sizes:
        return None
    return {int(size): graph for size, graph in zip(sizes, graphs.values())}


def replay_seconds(graphs: dict[int, object]) -> dict[int, float]:
    """Batch size -> seconds of one replay of each graph, on the inputs it was captured with
    (its KV writes go to the capture's dummy slots). Start-up only: it synchronizes."""
    from sglang.srt.model_executor.runner_utils.pool import graph_pool_replay_scope

    seconds: dict[int, float] = {}
    for size, graph in graphs.items():
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with graph_pool_replay_scope():
            graph.replay()  # warm-up
            begin.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()
        end.synchronize()
        seconds[size] = begin.elapsed_time(end) / 1e3 / REPLAYS
    return seconds


def start_up_costs(runner, widths: VerifyWidths, draft_step) -> tuple[Optional[dict], str]:
    """The step costs the width policy starts from: with verify graphs, `cost_table` over them and
    the draft step's (`draft/step.py`, `DraftStep`); else None, learnt online."""
    if not widths.graphed:
        return None, "learnt online"
    return cost_table(runner, widths, draft_step.timing_graphs())


def cost_table(runner, widths: VerifyWidths, draft_graphs: dict[int, object]) -> tuple[Optional[dict], str]:
    """(batch size, width) -> seconds of a step, from every verify graph (B's is SGLang's own)
    and the draft step's graphs, each replayed and timed; or None with the reason."""
    verify = {widths.num_draft_tokens: runner_graphs(runner.decode_cuda_graph_runner)}
    verify.update({w: runner_graphs(pair.graph_runner) for w, pair in widths.pairs.items()})
    unread = sorted(w for w, graphs in verify.items() if graphs is None)
    if unread:
        return None, f"the graphs of widths {unread} are not where SGLang's full graph backend keeps them"
    if not draft_graphs:
        return None, "the draft step has no graphs"
    start = time.perf_counter()
    table = step_cost_table(
        {w: replay_seconds(graphs) for w, graphs in verify.items()}, replay_seconds(draft_graphs)
    )
    return (
        table,
        f"{len(table)} (batch size, width) costs from graph replays in {time.perf_counter() - start:.1f} s",
    )


def _uses_hybrid_state(runner) -> bool:
    from sglang.srt.configs.hybrid_arch import mambaish_config

    return mambaish_config(runner.model_config) is not None


def verify_widths_for(
    runner, num_draft_tokens: int, mode: VerifyGraphs, tp_size: int, widths: Sequence[int]
) -> tuple[Optional[VerifyWidths], str]:
    """The target's pairs at `widths` (`verify_widths.widths_to_build`), built now (after
    SGLang's width-B graphs, so narrower graphs reuse the pool's blocks), or None; with the
    reason or the description."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
    from sglang.srt.runtime_context import get_disagg, get_exec, get_lora

    reason = why_not_per_width(
        device_type=torch.device(runner.device).type,
        mode=mode,
        num_draft_tokens=num_draft_tokens,
        tp_size=tp_size,
        hybrid=_uses_hybrid_state(runner),
        lora=bool(get_lora().enable_lora),
        two_batch_overlap=bool(get_exec().overlap.enable_two_batch_overlap),
        torch_compile=bool(get_exec().graph.enable_torch_compile),
        pdmux=bool(get_disagg().enable_pdmux),
        disaggregation=str(get_disagg().disaggregation_mode),
        graphs_disabled=check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED),
    )
    if reason is None and not widths:
        reason = "the width is fixed at B (SGLANG_DFLASH_ADAPTIVE_WIDTH=0) and no test aid forces another"
    if reason is not None:
        return None, f"none ({reason})"
    graphed = mode != "eager"
    full_gb = float((getattr(runner, "graph_memory_usage", None) or {}).get("target_verify", 0.0) or 0.0)
    widths = VerifyWidths.build(
        runner,
        num_draft_tokens,
        lambda width: make_pair(runner, width, graphed),
        free_gb=(lambda: _free_gb(runner)) if graphed else None,
        full_width_gb=full_gb,
        widths=widths,
    )
    if not widths.pairs:  # every narrower width dropped: B alone, as without them
        return None, widths.describe()
    return widths, widths.describe()

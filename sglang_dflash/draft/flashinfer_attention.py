"""Draft attention on CUDA through FlashInfer (same contract as `attention.SdpaDraftAttention`).

Layout. The block's own K/V are written, per layer, into *scratch slots* of the draft KV store:
batch row i's block occupies slots `scratch_base + i*Bd .. scratch_base + (i+1)*Bd - 1`, past
the target's slot range, so they are never committed, never shared with the radix cache, and
never collide with the verify window. Each request's keys are then one paged sequence (page
size 1) of length C_i + Bd:

    [req_to_token[r_i, 0:C_i] ; scratch slots of row i]

and its Bd queries sit at positions C_i .. C_i+Bd-1, aligned with the end of that sequence,
which is exactly how FlashInfer defines its causal and sliding-window masks. With a context
window W (`--speculative-draft-window-size`) the context part is the last min(C_i, W) committed
slots instead, `req_to_token[r_i, C_i - V_i : C_i]`: a contiguous suffix, so distances, and with
them the masks, are unchanged. One paged prefill
per layer then gives `visibility(...)`: full-attention layers non-causal, sliding layers with
`window_left = sliding_window - 1` (causal or not, per `DFlashDraftConfig.layer_is_causal`).

Window ring. Where the store keeps its windowed layers in a window ring (`window_ring.py`),
those layers get a second layout over the ring's tensors: each request's context is the ring
rows of its last min(C_i, reach) positions, in position order,

    [r_i * R + p % R for p in C_i - V_i .. C_i - 1 ; ring scratch rows of row i]

(reach = R - Bd, the longest windowed layer's: `WindowRing.for_reach`), then its block in
scratch rows past the ring's sink. Listed in position order the keys are again a contiguous
run of positions ending at the block, so FlashInfer's masks are those above. The two layouts
(`KVSource`: the store's slot ids, the ring's rows) are planned side by side, each with one
wrapper per layer kind, and each layer runs on its own.

Planning, once per step and per layer kind, with no host sync: FlashInfer schedules its work
from host lengths (`attention.planning_lens`: the scheduler's `batch.seq_lens_cpu`, exact, else
`DFlashDraftInputV2.nxt_kv_lens_cpu`, an upper bound); the device indptr and page indices are
built on the GPU from the exact device lengths, and the fa2 kernels clamp every KV tile to the
device lengths. (The plan copies the host indptr to the device; we then point the wrapper at the
exact device indptr.) Split-KV must see exact host lengths: the plan sizes each request's KV
chunks and the merge of their partial outputs from the host lengths, while the kernel counts
chunks from the device lengths, so with an upper bound the two disagree and partial outputs of
different rows are merged together. With upper-bound host lengths the plan therefore disables
split-KV (one chunk per request and query tile: correct, and slower for long contexts at small
batch, where split-KV is what fills the GPU).

CUDA-graph mode (`graph_batch_size=b`, for `step.py`): the wrappers are FlashInfer's
graph-mode ones for exactly b requests, over fixed buffers (`GraphBuffers`: the page indices,
sized by `kv_indices_capacity`, and the workspaces, shared by every bucket, since only one
bucket runs a step), so a captured `run` reads whatever the last plan wrote there. Planning
stays outside the graph, before each replay, with exact host lengths (the only kind graph mode
takes): FlashInfer's graph-mode plan always splits the KV, pads its grid to a size that does
not depend on the lengths, and keeps its work partition in device buffers at fixed offsets, so
one captured `run` serves every later plan of the same batch size.

Plan-free graphs (`plan_free_max_len=n`, graph mode): with split-KV off, FlashInfer's graph-mode plan
depends on nothing but the batch size and the query rows (b x Bd): one chunk per request and
query tile, a grid padded to a fixed size with a mask over the padding, and the kernel reading
each request's KV length from the device `kv_indptr` (FlashInfer 0.7.2, `PrefillSplitQOKVIndptr`
and `PrefillPlanImpl` in `attention/scheduler.cuh`). Such an attention plans once, at capture,
into int workspaces of its own (another bucket's plan must not overwrite it), and its
`bind_on_device` builds the layout from device tensors only, into the fixed buffers, inside the
captured graph: a replay then needs no host work beyond copying its inputs in. The price is
split-KV's parallelism (one CTA per KV head and query tile of a request), so `step.py` replays
these graphs only for contexts up to a bound, and the layout covers b x (bound + Bd) entries.

A plan writes its work partition into a pinned host buffer and copies it to the device
asynchronously; nothing in FlashInfer stops the next plan of the same wrapper from overwriting
that host buffer before the copy has run. `bind` therefore waits for the previous plan's copies
(an event recorded after them) before planning again: a host wait that returns at once unless
the device is more than a whole step behind.

`flashinfer` is imported lazily: this module imports on CPU-only hosts.

See docs/gpu.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.block import context_window
from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.window_ring import WindowRing

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's split-KV scratch (its recommended size)
INT_WORKSPACE_BYTES = 8 * 1024 * 1024  # a plan's work partition (what each wrapper allocates)


def num_scratch_slots(max_batch_size: int, block_size: int) -> int:
    """Extra draft-KV-store slots `FlashInferDraftAttention` needs past the target's slots."""
    return max_batch_size * block_size


def kv_indices_capacity(
    max_batch_size: int, max_context_len: int, block_size: int, context_window: Optional[int] = None
) -> int:
    """Page indices a step of up to `max_batch_size` requests can list (page size 1): each
    request's visible context, at most `max_context_len` (or the draft window), and its block.
    Requests sharing a cached prefix each list it, so the pool's size is no bound.
    E.g., 4 requests, context 1000, Bd 16 -> 4 * 1016; with a window of 256 -> 4 * 272."""
    visible = max_context_len if context_window is None else min(max_context_len, context_window)
    return max_batch_size * (visible + block_size)


# FlashInfer's fa2 prefill kernels: half-precision queries and K/V, and these head sizes.
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256, 512)


def unavailable_reason(
    config: DFlashDraftConfig, device: torch.device, dtype: Optional[torch.dtype] = None
) -> Optional[str]:
    """Why FlashInfer cannot run this draft's attention on `device` in `dtype` (the draft's
    compute dtype; None: not checked), or None if it can."""
    if device.type != "cuda":
        return f"the draft runs on {device.type}"
    if config.attention_sink_bias:
        return "the draft has attention sinks (MiMo), which this FlashInfer draft attention does not apply"
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        return f"FlashInfer's prefill kernels take fp16 or bf16, the draft runs in {dtype}"
    if config.head_dim not in FLASHINFER_HEAD_DIMS:
        dims = ", ".join(map(str, FLASHINFER_HEAD_DIMS))
        return f"FlashInfer's prefill kernels are built for head_dim {dims}, the draft's is {config.head_dim}"
    try:
        import flashinfer  # noqa: F401
    except ImportError as error:
        return f"flashinfer is not importable ({error})"
    for layer_id in range(config.num_hidden_layers):
        window = config.layer_window(layer_id)
        if window is not None and not config.layer_is_causal(layer_id) and window < config.block_size:
            # Non-causal sliding layers also mask keys more than `window` to the right; within a
            # block that only happens when the window is shorter than the block.
            block = config.block_size
            return f"layer {layer_id} is non-causal with sliding_window {window} < block_size {block}"
    return None


@dataclass(frozen=True)
class LayerKind:
    causal: bool
    window_left: int  # FlashInfer's: keys at most window_left positions left of the query; -1: all


def layer_kind(config: DFlashDraftConfig, layer_id: int) -> LayerKind:
    window = config.layer_window(layer_id)
    return LayerKind(config.layer_is_causal(layer_id), -1 if window is None else window - 1)


@dataclass(frozen=True)
class KVSource:
    """Where a group of draft layers keeps its context K/V, as one paged layout lists it: the
    store's slot ids (`ring` None: through the target's req_to_token), or the window ring's
    rows. Each batch row's block goes to `Bd` scratch rows from `scratch_base + i * Bd`."""

    ring: Optional[WindowRing]
    window: Optional[int]  # the most context rows a block is listed (None: all)
    scratch_base: int

    @property
    def in_ring(self) -> bool:
        return self.ring is not None


WrapperKey = tuple  # (in the ring: bool, LayerKind): one FlashInfer wrapper each


def ring_reach(ring: WindowRing, block_size: int) -> int:
    """The longest windowed layer's reach, which the ring was sized for (`WindowRing.for_reach`:
    R = reach + Bd). E.g., R 48, Bd 16 -> 32."""
    return ring.rows_per_request - block_size


def kv_sources(
    store: DraftKVStore, scratch_base: int, block_size: int, context_window: Optional[int]
) -> dict[bool, KVSource]:
    """The store's layouts (in the ring -> source): the slot ids where it keeps full layers,
    the window ring's rows where it keeps windowed ones there; the ring's scratch rows follow
    its sink. E.g., a ring of 3 x 48 rows, Bd 16: ring scratch from row 145, window 32."""
    sources = {}
    if store.k.shape[0]:
        sources[False] = KVSource(None, context_window, scratch_base)
    if store.ring is not None:
        sources[True] = KVSource(store.ring, ring_reach(store.ring, block_size), store.ring.num_rows)
    return sources


@dataclass
class GraphBuffers:
    """What the graph-mode attentions of every bucket share (one bucket plans and runs a step):
    the page indices of each layout, the split-KV scratch, and one plan workspace per wrapper
    (the wrappers of one step are planned together, so each needs its own)."""

    kv_indices: dict  # in the ring (bool) -> [capacity] int32
    workspace: torch.Tensor  # [>= WORKSPACE_BYTES] uint8
    int_workspaces: dict  # WrapperKey -> [>= INT_WORKSPACE_BYTES] uint8

    @property
    def capacity(self) -> int:
        """Page indices the largest layout's buffer holds (the draft step's check)."""
        return max(t.numel() for t in self.kv_indices.values())

    def grow(self, key: WrapperKey, float_bytes: int, int_bytes: int) -> None:
        """Make the workspaces at least this large (before any wrapper plans into them: the
        largest bucket is built first, and the rest then get the grown ones)."""
        device = self.workspace.device
        if float_bytes > self.workspace.numel():
            self.workspace = torch.empty(float_bytes, dtype=torch.uint8, device=device)
        if int_bytes > self.int_workspaces[key].numel():
            self.int_workspaces[key] = torch.empty(int_bytes, dtype=torch.uint8, device=device)

    @classmethod
    def allocate(cls, keys, capacities: dict, workspace: torch.Tensor) -> "GraphBuffers":
        """`keys`: the wrappers' keys; `capacities`: in the ring -> page indices of its layout."""
        device = workspace.device
        return cls(
            kv_indices={g: torch.zeros(n, dtype=torch.int32, device=device) for g, n in capacities.items()},
            workspace=workspace,
            int_workspaces={
                k: torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device) for k in set(keys)
            },
        )


@dataclass
class PagedLayout:
    """One step's paged KV layout. Device tensors are exact; host ones may be upper bounds."""

    qo_indptr_host: torch.Tensor  # [bs + 1] int32, CPU: i * Bd
    kv_indptr_host: torch.Tensor  # [bs + 1] int32, CPU: cumsum(context_lens_cpu + Bd)
    last_page_len_host: torch.Tensor  # [bs] int32, CPU: ones (page size 1)
    kv_indptr: torch.Tensor  # [bs + 1] int32, device: cumsum(context_lens + Bd)
    kv_indices: torch.Tensor  # [kv_indptr_host[-1]] int32, device; valid up to kv_indptr[-1]


def device_layout(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scratch_base: int,
    window: Optional[int],
    total: int,
    ring: Optional[WindowRing] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [bs + 1], kv_indices [total]) int32 on the device, from device tensors only:
    each request's visible committed context (the last `window` tokens, or all), then its
    block's scratch slots. `total` >= the exact sum of the lengths (a host bound); the entries
    past the exact sum are never read. No host sync, so it can run inside a CUDA graph.
    With a `ring` the context is listed by ring rows (`WindowRing.rows`) instead of
    req_to_token's slot ids.

    req_to_token [pool, max_len], req_pool_indices [bs], context_lens [bs] (exact).
    E.g., C = [2, 1], Bd = 2, scratch_base = 100, rows r0 -> [5, 6, ...], r1 -> [9, ...]:
    kv_indptr = [0, 4, 7], kv_indices = [5, 6, 100, 101, 9, 102, 103]; with window = 1,
    kv_indptr = [0, 3, 6], kv_indices = [6, 100, 101, 9, 102, 103]. With a ring of R = 4 for
    request slots r0 = 0, r1 = 2 (window 1, scratch_base 100): [1, 100, 101, 8, 102, 103].
    """
    bs, device = context_lens.shape[0], context_lens.device
    start, visible = context_window(context_lens, window)  # [bs], [bs]
    lens = visible.to(torch.int32) + block_size
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    torch.cumsum(lens, dim=0, dtype=torch.int32, out=kv_indptr[1:])
    t = torch.arange(total, dtype=torch.int32, device=device)
    # Request of each entry; entries past the exact total (host slack) land in the last row and
    # are never read.
    row = torch.searchsorted(kv_indptr[1:], t, right=True).clamp_(max=bs - 1)
    offset = t - kv_indptr[row]
    row_context = visible.to(torch.int32)[row]
    position = start.to(torch.int32)[row] + offset
    reqs = req_pool_indices.to(torch.int64)[row]
    if ring is None:
        col = position.clamp(0, req_to_token.shape[1] - 1).to(torch.int64)
        context_slot = req_to_token[reqs, col].to(torch.int32)
    else:
        context_slot = ring.rows(reqs, position).to(torch.int32)
    block_slot = scratch_base + row * block_size + (offset - row_context)
    return kv_indptr, torch.where(offset < row_context, context_slot, block_slot).to(torch.int32)


def paged_layout(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    context_lens: torch.Tensor,
    context_lens_cpu: torch.Tensor,
    block_size: int,
    scratch_base: int,
    window: Optional[int] = None,
    ring: Optional[WindowRing] = None,
) -> PagedLayout:
    """`device_layout` sized by the host lengths, with the host indptrs a plan takes.
    context_lens [bs] (device, exact), context_lens_cpu [bs] (host, >= context_lens)."""
    bs = context_lens.shape[0]
    visible_cpu = context_lens_cpu if window is None else context_lens_cpu.clamp(max=window)
    host_lens = visible_cpu.to(torch.int32) + block_size
    kv_indptr_host = torch.zeros(bs + 1, dtype=torch.int32)
    torch.cumsum(host_lens, dim=0, dtype=torch.int32, out=kv_indptr_host[1:])
    kv_indptr, kv_indices = device_layout(
        req_to_token,
        req_pool_indices,
        context_lens,
        block_size,
        scratch_base,
        window,
        int(kv_indptr_host[-1]),
        ring,
    )
    return PagedLayout(
        qo_indptr_host=torch.arange(bs + 1, dtype=torch.int32) * block_size,
        kv_indptr_host=kv_indptr_host,
        last_page_len_host=torch.ones(bs, dtype=torch.int32),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
    )


class FlashInferDraftAttention:
    """One step's draft attention over the store through FlashInfer's paged prefill (fa2)."""

    def __init__(
        self,
        config: DFlashDraftConfig,
        store: DraftKVStore,
        *,
        scratch_base: int,
        max_batch_size: int,
        context_window: Optional[int] = None,
        q_dtype: Optional[torch.dtype] = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        workspace: Optional[torch.Tensor] = None,
        graph_batch_size: Optional[int] = None,
        graph_buffers: Optional[GraphBuffers] = None,
        plan_free_max_len: Optional[int] = None,
    ):
        """`scratch_base`: the first of the slot-id layout's scratch slots (the ring's follow its
        sink). `workspace`: FlashInfer's float workspace, to share between instances that never
        run at once (else `workspace_bytes` are allocated). `graph_batch_size`: CUDA-graph mode
        for exactly that many requests, over `graph_buffers`. `plan_free_max_len`: graph mode
        planned once, without split-KV, for visible contexts up to that many tokens
        (`plan_once`, `bind_on_device`; module docstring)."""
        reason = unavailable_reason(config, store.k.device, q_dtype or store.k.dtype)
        if reason is not None:
            raise ValueError(f"FlashInfer draft attention is unavailable: {reason}")
        self.sources = kv_sources(store, scratch_base, config.block_size, context_window)
        scratch = num_scratch_slots(max_batch_size, config.block_size)
        for in_ring, source in self.sources.items():
            rows = store.ring_k.shape[1] if in_ring else store.num_slots
            if rows < source.scratch_base + scratch:
                what = "window ring" if in_ring else "draft KV store"
                raise ValueError(
                    f"the {what} has {rows} rows; FlashInfer draft attention needs "
                    f"{source.scratch_base + scratch} (scratch_base {source.scratch_base} + "
                    f"max_batch_size {max_batch_size} x block_size {config.block_size})"
                )
        import flashinfer

        self.config = config
        self.store = store
        self.scratch_base = scratch_base
        self.max_batch_size = max_batch_size
        self.context_window = context_window
        self.q_dtype = q_dtype or store.k.dtype  # the draft's compute dtype; the store may be fp8
        self.scale = config.head_dim**-0.5
        # The heads this rank attends over: the store holds its share of the KV heads (all of
        # them without tensor parallelism), and the query heads split in the same proportion.
        self.num_kv_heads = store.k.shape[2]
        self.num_heads = config.num_attention_heads * self.num_kv_heads // config.num_key_value_heads
        layers = range(config.num_hidden_layers)
        # layer id -> its wrapper's key: (in the ring, kind)
        self.keys = [(store.ring is not None and store.in_ring(i), layer_kind(config, i)) for i in layers]
        device = store.k.device
        self.graph_batch_size = graph_batch_size
        graph_mode = {g: {} for g in self.sources}
        self.plan_free_max_len = plan_free_max_len
        if plan_free_max_len is not None and graph_batch_size is None:
            raise ValueError("plan_free_max_len needs CUDA-graph mode (graph_batch_size)")
        if graph_batch_size is not None:
            if graph_batch_size != max_batch_size or graph_buffers is None:
                raise ValueError(
                    f"CUDA-graph mode needs graph_buffers and graph_batch_size ({graph_batch_size}) "
                    f"== max_batch_size ({max_batch_size})"
                )
            workspace = graph_buffers.workspace
            b = graph_batch_size
            # One set per layout, for all its layer kinds: each kind's plan writes the same
            # layout into them.
            for g in self.sources:
                graph_mode[g] = {
                    "use_cuda_graph": True,
                    "qo_indptr_buf": torch.zeros(b + 1, dtype=torch.int32, device=device),
                    "paged_kv_indptr_buf": torch.zeros(b + 1, dtype=torch.int32, device=device),
                    "paged_kv_indices_buf": graph_buffers.kv_indices[g],
                    "paged_kv_last_page_len_buf": torch.ones(b, dtype=torch.int32, device=device),
                }
        if workspace is None:
            workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.workspace = workspace
        self.wrappers = {
            key: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, "NHD", backend="fa2", **graph_mode[key[0]]
            )
            for key in set(self.keys)
        }
        self.layout_totals: dict = {}  # in the ring -> a plan-free layout's page indices
        if plan_free_max_len is not None:
            # Planned once and replayed from then on: int workspaces of its own, which no other
            # bucket's plan rewrites. Without split-KV the float workspace is not used.
            for key, wrapper in self.wrappers.items():
                _, int_bytes = self._graph_workspace_bytes(
                    wrapper, key, graph_batch_size, disable_split_kv=True
                )
                own = torch.empty(max(int_bytes, 1024), dtype=torch.uint8, device=device)
                wrapper.reset_workspace_buffer(graph_buffers.workspace, own)
            self.workspace = graph_buffers.workspace
            for g, source in self.sources.items():
                self.layout_totals[g] = self.plan_free_total(
                    graph_batch_size, config.block_size, source.window
                )
                if self.layout_totals[g] > graph_buffers.kv_indices[g].numel():
                    raise ValueError(
                        f"a plan-free layout of {graph_batch_size} x ({plan_free_max_len} + "
                        f"{config.block_size}) page indices exceeds the buffer "
                        f"({graph_buffers.kv_indices[g].numel()})"
                    )
        elif graph_buffers is not None:
            # Graph mode always splits the KV, over a grid padded for b requests: its scratch
            # grows with b (about 200 MB at b = 256 for 32/8 heads of 128), past the default.
            for key, wrapper in self.wrappers.items():
                graph_buffers.grow(key, *self._graph_workspace_bytes(wrapper, key, graph_batch_size))
            for key, wrapper in self.wrappers.items():
                wrapper.reset_workspace_buffer(graph_buffers.workspace, graph_buffers.int_workspaces[key])
            self.workspace = graph_buffers.workspace
        self._planned = None  # a CUDA event after the last plan's copies
        for wrapper in self.wrappers.values():
            # We point the planned indptr at the exact device one (see the module docstring).
            if not hasattr(wrapper, "_paged_kv_indptr_buf"):
                raise RuntimeError(
                    "this FlashInfer version has no BatchPrefillWithPagedKVCacheWrapper._paged_kv_indptr_buf"
                )

    @property
    def longest_visible(self) -> Optional[int]:
        """The most context rows any layout lists for a request (None: the whole context): what
        bounds a step's page indices and the plan-free graphs' reach (`draft/step.py`)."""
        windows = [source.window for source in self.sources.values()]
        return None if None in windows else max(windows)

    def graph_buffers(
        self, max_batch_size: int, max_context_len: int, workspace: Optional[torch.Tensor] = None
    ) -> GraphBuffers:
        """The buffers the graph-mode attentions of buckets up to `max_batch_size` share, for
        contexts up to `max_context_len` (`workspace`: FlashInfer's float one, else this one's)."""
        block = self.config.block_size
        capacities = {
            g: kv_indices_capacity(max_batch_size, max_context_len, block, source.window)
            for g, source in self.sources.items()
        }
        return GraphBuffers.allocate(
            self.keys, capacities, self.workspace if workspace is None else workspace
        )

    def plan_free_total(self, b: int, block_size: int, window: Optional[int]) -> int:
        """Page indices a plan-free layout lists for b requests: each request's visible context
        at most `plan_free_max_len` (or the layout's `window`), and its block.
        E.g., b 4, bound 2048, Bd 16 -> 4 * 2064; with a window of 256 -> 4 * 272."""
        return kv_indices_capacity(b, self.plan_free_max_len, block_size, window)

    def _graph_workspace_bytes(
        self, wrapper, key: WrapperKey, b: int, disable_split_kv: bool = False
    ) -> tuple[int, int]:
        """FlashInfer's (float, int) workspace bytes for a graph-mode plan of b requests. Its
        grid and split-KV scratch depend on b and the query rows (b x Bd), not on the context
        lengths, so b empty requests stand for every plan of this bucket."""
        block, kind = self.config.block_size, key[1]
        indptr = torch.arange(b + 1, dtype=torch.int32) * block
        return wrapper.workspace_size(
            indptr,
            indptr,
            torch.zeros(b * block, dtype=torch.int32, device=self.store.k.device),
            torch.ones(b, dtype=torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.config.head_dim,
            1,
            causal=kind.causal,
            window_left=kind.window_left,
            q_data_type=self.q_dtype,
            kv_data_type=self.store.k.dtype,
            disable_split_kv=disable_split_kv,
        )

    def bind(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        context_lens: torch.Tensor,
        context_lens_cpu: torch.Tensor,
        block_size: int,
        host_lens_exact: bool = True,
    ) -> "FlashInferDraftAttention":
        """Plan this step. context_lens [bs] on the GPU (exact); context_lens_cpu [bs] on the host,
        exact (`host_lens_exact`) or an upper bound, which turns split-KV off (module docstring)."""
        bs = context_lens.shape[0]
        if not 1 <= bs <= self.max_batch_size:
            raise ValueError(f"batch size {bs} is outside [1, {self.max_batch_size}]")
        if self.graph_batch_size is not None and (bs != self.graph_batch_size or not host_lens_exact):
            raise ValueError(
                f"CUDA-graph mode plans exactly {self.graph_batch_size} requests with exact host "
                f"lengths, got {bs} (exact: {host_lens_exact})"
            )
        if block_size != self.config.block_size:
            raise ValueError(f"block_size {block_size} differs from the draft's {self.config.block_size}")
        if self.plan_free_max_len is not None:
            raise ValueError("a plan-free attention is planned once (plan_once) and bound on the device")
        self.bs, self.block_size = bs, block_size
        layouts = {
            g: paged_layout(
                req_to_token,
                req_pool_indices,
                context_lens,
                context_lens_cpu,
                block_size,
                source.scratch_base,
                source.window,
                source.ring,
            )
            for g, source in self.sources.items()
        }
        if self._planned is not None:
            # The previous plan's pinned host buffer must have reached the device before this
            # plan rewrites it (module docstring); normally long done, so this returns at once.
            self._planned.synchronize()
        for key, wrapper in self.wrappers.items():
            layout = layouts[key[0]]
            self._plan(
                wrapper,
                key[1],
                layout.qo_indptr_host,
                layout.kv_indptr_host,
                layout.kv_indices,
                layout.last_page_len_host,
                disable_split_kv=not host_lens_exact,
            )
            if self.graph_batch_size is None:
                wrapper._paged_kv_indptr_buf = layout.kv_indptr
            else:  # a captured run reads the fixed buffer
                wrapper._paged_kv_indptr_buf.copy_(layout.kv_indptr)
        self._record_planned()
        self.layouts = layouts  # keeps the device buffers alive for the step
        return self

    def _plan(self, wrapper, kind: LayerKind, qo_indptr, kv_indptr, kv_indices, last_page_len, **options):
        """FlashInfer's plan of one layer kind, page size 1, on this draft's heads and dtypes."""
        wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.config.head_dim,
            1,  # page size
            causal=kind.causal,
            window_left=kind.window_left,
            sm_scale=self.scale,
            q_data_type=self.q_dtype,
            kv_data_type=self.store.k.dtype,
            non_blocking=True,
            **options,
        )

    def _record_planned(self) -> None:
        if self.store.k.device.type == "cuda":
            if self._planned is None:
                self._planned = torch.cuda.Event()
            self._planned.record()

    def plan_once(self, block_size: int) -> None:
        """A plan-free attention's only plan: b requests of Bd query rows each, split-KV off.
        The work partition it writes depends on nothing else (module docstring), so every later
        replay reuses it; the KV lengths come from the device indptr `bind_on_device` writes."""
        b = self.graph_batch_size
        if self.plan_free_max_len is None:
            raise ValueError("plan_once is for plan-free attentions (plan_free_max_len)")
        if block_size != self.config.block_size:
            raise ValueError(f"block_size {block_size} differs from the draft's {self.config.block_size}")
        indptr = torch.arange(b + 1, dtype=torch.int32) * block_size  # empty contexts
        device = self.store.k.device
        indices = torch.zeros(b * block_size, dtype=torch.int32, device=device)
        for key, wrapper in self.wrappers.items():
            self._plan(
                wrapper,
                key[1],
                indptr,
                indptr,
                indices,
                torch.ones(b, dtype=torch.int32),
                disable_split_kv=True,
            )
        self._record_planned()

    def bind_on_device(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
    ) -> "FlashInferDraftAttention":
        """A plan-free attention's per-step binding, from device tensors only (captured in the
        graph): this step's layouts into the fixed buffers the planned kernels read. Every
        request's visible context must be at most `plan_free_max_len` (the caller's check)."""
        if self.plan_free_max_len is None:
            raise ValueError("bind_on_device is for plan-free attentions (plan_free_max_len)")
        for g, source in self.sources.items():
            total = self.layout_totals[g]
            kv_indptr, kv_indices = device_layout(
                req_to_token,
                req_pool_indices,
                context_lens,
                block_size,
                source.scratch_base,
                source.window,
                total,
                source.ring,
            )
            # One pair of buffers for every layer kind of the layout.
            wrapper = next(w for key, w in self.wrappers.items() if key[0] == g)
            wrapper._paged_kv_indptr_buf.copy_(kv_indptr)
            wrapper._paged_kv_indices_buf[:total].copy_(kv_indices)
        self.bs, self.block_size = context_lens.shape[0], block_size
        return self

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [bs*Bd, heads, d], k/v [bs*Bd, kv_heads, d] -> [bs*Bd, heads, d]
        key = self.keys[layer_id]
        base = self.sources[key[0]].scratch_base
        rows = slice(base, base + self.bs * self.block_size)
        k_cache, v_cache = self.store.layer(layer_id)  # [rows, kv_heads, d]: slot ids or ring rows
        k_cache[rows] = k  # cast to the store dtype
        v_cache[rows] = v
        return self.wrappers[key].run(
            q.to(self.q_dtype).contiguous(), (k_cache.unsqueeze(1), v_cache.unsqueeze(1))
        )

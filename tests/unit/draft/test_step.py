"""The draft step (`draft/step.py`): its bucket, padding and fallback decisions (pure, CPU), the
graph path's data flow against the eager step (CPU, with a stand-in graph that re-runs the
captured function into the captured outputs, as a CUDA graph replays its kernels into them),
and real CUDA graphs against the eager step (GPU).

The eager step is the oracle: the same forward over the same store, planned for exactly the
batch. The graph path must give the same block, positions and hidden states for every bucket,
with padding, after the contexts grow between replays, and after the pool's slots are reused.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from sglang_dflash.draft import step as draft_step
from sglang_dflash.draft.attention import SdpaDraftAttention
from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.step import DraftStep
from tests.support.draft_models import make_model

BLOCK = 16
VOCAB = 97

# ------------------------------------------------------------------ pure decisions


def test_capture_sizes_clamp_to_the_request_pool_as_sglang_does():
    sglang = [1, 2, 4, 8, 16, 24, 32]
    assert draft_step.capture_sizes(sglang, 20) == (1, 2, 4, 8, 16, 20)
    assert draft_step.capture_sizes(sglang, 64) == tuple(sglang)
    assert draft_step.capture_sizes([8, 1, 4, 4, 2], 8) == (1, 2, 4, 8)
    assert draft_step.capture_sizes(None, 8) == ()


@pytest.mark.parametrize("bs,bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)])
def test_a_batch_replays_the_smallest_bucket_that_holds_it(bs, bucket):
    assert draft_step.bucket_for(bs, (1, 2, 4, 8)) == bucket


def test_padded_host_lens():
    assert draft_step.padded_host_lens(torch.tensor([5, 9]), 4).tolist() == [5, 9, 0, 0]
    lens = torch.tensor([5, 9])
    assert draft_step.padded_host_lens(lens, 2) is lens


def test_why_no_graphs_at_all():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    reason = draft_step.graphs_unavailable_reason
    assert reason(device=cuda, attention_name="flashinfer", disable_cuda_graph=False) is None
    assert reason(device=cuda, attention_name="flashinfer", disable_cuda_graph=False, enabled=True) is None
    assert (
        reason(device=cpu, attention_name="flashinfer", disable_cuda_graph=False) == "the draft runs on cpu"
    )
    assert reason(device=cuda, attention_name="flashinfer", disable_cuda_graph=True) == "--disable-cuda-graph"
    assert "SGLANG_DFLASH_DRAFT_CUDA_GRAPH=0" in reason(
        device=cuda, attention_name="flashinfer", disable_cuda_graph=False, enabled=False
    )
    assert "torch-sdpa" in reason(device=cuda, attention_name="torch-sdpa (x)", disable_cuda_graph=False)


def test_why_a_step_runs_eagerly():
    sizes = (1, 2, 4)
    assert draft_step.eager_reason(3, sizes, True, 100, 100) is None
    assert "above the largest graph (4)" in draft_step.eager_reason(5, sizes, True, 1, 100)
    assert "upper-bound" in draft_step.eager_reason(3, sizes, False, 1, 100)
    assert "page indices" in draft_step.eager_reason(3, sizes, True, 101, 100)


def test_kv_indices_capacity():
    from sglang_dflash.draft.flashinfer_attention import kv_indices_capacity

    assert kv_indices_capacity(4, 1000, 16) == 4 * 1016
    assert kv_indices_capacity(4, 1000, 16, context_window=256) == 4 * 272
    assert kv_indices_capacity(4, 100, 16, context_window=256) == 4 * 116


# ------------------------------------------------------------------ the graph path's data flow


class Rerun:
    """A CUDA graph's contract without a GPU: `replay()` writes the captured function's results
    into the tensors the capture returned, and counts replays."""

    replays = 0

    def __init__(self, run):
        self.run = run

    def replay(self):
        for static, value in zip(self.outputs, self.run()):
            static.copy_(value)
        Rerun.replays += 1


class Frozen(Rerun):
    """A broken graph: replays nothing (the negative control)."""

    def replay(self):
        Rerun.replays += 1


def rerun_capture(kind=Rerun):
    def capture(run, pool, stream):
        graph = kind(run)
        graph.outputs = tuple(t.clone() for t in run())
        return graph, graph.outputs

    return capture


@contextlib.contextmanager
def no_stream():
    yield None


class Setup:
    """A draft, a store of random context K/V, and a request pool whose rows are shuffled."""

    def __init__(
        self,
        *,
        device="cpu",
        dtype=torch.float32,
        forward=None,
        num_slots=6000,
        pool_rows=12,
        shape="small",
        sliding_window=None,
        ring=None,
        ring_scratch_rows=0,
    ):
        """`sliding_window`: every draft layer sliding, in the window `ring` if one is given
        (with `ring_scratch_rows` past its sink)."""
        torch.manual_seed(0)
        self.model = make_model(shape, device=device, sliding_window=sliding_window).to(dtype)
        config = self.model.config
        self.device, self.dtype = device, dtype
        self.store = DraftKVStore(
            num_slots=num_slots,
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
            ring=ring,
            windowed_layers=range(config.num_hidden_layers) if ring is not None else (),
            ring_scratch_rows=ring_scratch_rows,
        )
        for t in (self.store.k, self.store.v, self.store.ring_k, self.store.ring_v):
            if t is not None:
                t.normal_()
        self.num_target_slots = num_slots
        self.req_to_token = torch.zeros(pool_rows, 2048, dtype=torch.int32, device=device)
        # Frozen, as served: a grad-requiring embedding would make every eager step record
        # autograd history (test_the_benchmark_keeps_no_autograd_history_across_steps).
        self.embedding = torch.nn.Embedding(VOCAB, config.hidden_size).to(device, dtype).requires_grad_(False)
        self.forward = forward or self.model

    def batch(self, context_lens, seed):
        """Fill distinct pool rows with fresh slots -> (req_pool_indices, bonus, seq_lens, host_lens)."""
        g = torch.Generator().manual_seed(seed)
        bs = len(context_lens)
        rows = torch.randperm(self.req_to_token.shape[0] - 1, generator=g)[:bs] + 1  # row 0: padding
        for row, c in zip(rows.tolist(), context_lens):
            slots = torch.randperm(self.num_target_slots - 1, generator=g)[:c] + 1
            self.req_to_token[row, :c] = slots.to(self.req_to_token)
        bonus = torch.randint(0, VOCAB, (bs,), generator=g)
        lens = torch.tensor(context_lens)
        return rows.to(self.device), bonus.to(self.device), lens.to(self.device), lens


def sdpa_step(s: Setup, **kwargs) -> DraftStep:
    attention = SdpaDraftAttention(s.model.config, s.store)
    return DraftStep(s.forward, s.embedding, attention, block_size=BLOCK, mask_token_id=1, **kwargs)


def capture_sdpa(step: DraftStep, s: Setup, sizes, capture=None):
    step.capture(
        sizes,
        lambda b: SdpaDraftAttention(s.model.config, s.store),
        s.req_to_token,
        kv_indices_capacity=10**6,
        capture_context=no_stream,
        capture_graph=capture or rerun_capture(),
    )


def assert_same_step(got, want, **tol):
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], **tol)


BATCHES = [[40], [5, 300], [7, 1, 120], [33, 2, 9, 80], [600, 3, 3]]


def test_replays_equal_the_eager_step_across_buckets_padding_and_growing_contexts():
    s = Setup()
    graphed, eager = sdpa_step(s), sdpa_step(s)
    capture_sdpa(graphed, s, [1, 2, 4])
    Rerun.replays = 0
    for seed, lens in enumerate(BATCHES[:4]):
        for grow in (0, 1, 17):  # the same requests, a few steps later
            rows, bonus, seq_lens, host = s.batch([c + grow for c in lens], seed)
            got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
            want = eager(s.req_to_token, rows, bonus, seq_lens, host, True)
            assert_same_step(got, want, rtol=1e-5, atol=1e-5)
    assert Rerun.replays == 12 and graphed.eager_steps == {}


def test_replay_after_the_pools_slots_are_reused():
    s = Setup()
    graphed, eager = sdpa_step(s), sdpa_step(s)
    capture_sdpa(graphed, s, [2, 4])
    rows, bonus, seq_lens, host = s.batch([50, 9, 30], 0)
    first = [t.clone() for t in graphed(s.req_to_token, rows, bonus, seq_lens, host, True)]
    # The requests finish; new ones take their pool rows and slots, with other K/V there.
    s.store.k.normal_()
    s.store.v.normal_()
    rows2, bonus2, seq_lens2, host2 = s.batch([50, 9, 30], 1)
    got = graphed(s.req_to_token, rows2, bonus2, seq_lens2, host2, True)
    assert_same_step(got, eager(s.req_to_token, rows2, bonus2, seq_lens2, host2, True), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[2], first[2])


def test_block_and_positions_outlive_the_next_replay_in_the_pool():
    """The target's verify graph, captured earlier in SGLang's shared pool, may reuse the draft
    graph's output memory for its intermediates; the step needs the block and positions after
    the verify, so they must not be the static outputs (it fails if they are)."""
    s = Setup()
    graphed = sdpa_step(s)
    capture_sdpa(graphed, s, [4])
    rows, bonus, seq_lens, host = s.batch([5, 30, 2], 3)
    block_ids, positions, _ = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
    want = block_ids.clone(), positions.clone()
    for static in graphed.graphs[4].outputs:  # another graph of the pool replays
        static.fill_(-1)
    assert torch.equal(block_ids, want[0]) and torch.equal(positions, want[1])


def in_place_capture(run, pool, stream):
    """A capture whose static outputs are what the captured function returned (as
    `torch.cuda.graph` leaves them), replayed by rerunning it."""
    graph = Rerun(run)
    graph.outputs = run()
    return graph, graph.outputs


def test_every_bucket_writes_its_hidden_states_into_one_shared_buffer():
    """One bucket replays per step and its hidden states are read before the next replay, so the
    buckets share one [max b, Bd, H] output: per-bucket outputs would all stay allocated."""
    s = Setup()
    graphed, eager = sdpa_step(s), sdpa_step(s)
    capture_sdpa(graphed, s, [1, 2, 4], capture=in_place_capture)
    buffers = {g.outputs[2].untyped_storage().data_ptr() for g in graphed.graphs.values()}
    assert len(buffers) == 1
    assert graphed.graphs[4].outputs[2].untyped_storage().nbytes() == graphed.graphs[4].outputs[2].nbytes
    for lens, seed in (([5, 30, 2], 1), ([40], 2)):  # bucket 4, then bucket 1 over the same memory
        rows, bonus, seq_lens, host = s.batch(lens, seed)
        got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
        assert_same_step(got, eager(s.req_to_token, rows, bonus, seq_lens, host, True), rtol=1e-5, atol=1e-5)


def test_a_graph_that_does_not_replay_is_caught():
    s = Setup()
    graphed, eager = sdpa_step(s), sdpa_step(s)
    capture_sdpa(graphed, s, [4], capture=rerun_capture(Frozen))
    rows, bonus, seq_lens, host = s.batch([5, 300, 2], 3)
    got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
    want = eager(s.req_to_token, rows, bonus, seq_lens, host, True)
    assert not torch.equal(got[1], want[1])


def test_steps_without_a_graph_run_eagerly_and_are_counted(caplog):
    s = Setup()
    graphed, eager = sdpa_step(s), sdpa_step(s)
    capture_sdpa(graphed, s, [1, 2])
    Rerun.replays = 0
    rows, bonus, seq_lens, host = s.batch([5, 8, 13], 0)
    got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)  # bs 3 > 2
    assert_same_step(got, eager(s.req_to_token, rows, bonus, seq_lens, host, True), rtol=0, atol=0)
    rows, bonus, seq_lens, host = s.batch([5, 8], 1)
    graphed(s.req_to_token, rows, bonus, seq_lens, host + 4, False)  # upper-bound host lengths
    graphed(s.req_to_token, rows, bonus, seq_lens, host, True)  # replayed
    assert Rerun.replays == 1
    assert graphed.eager_steps == {
        "batch size above the largest graph (2)": 1,
        "only upper-bound host lengths": 1,
    }


# ------------------------------------------------------------------ plan-free graphs


class PlanFreeSdpa(SdpaDraftAttention):
    """A plan-free attention's contract on the CPU: planned once, then bound from device
    tensors only, for contexts up to `bound` (the gather is padded to the bound, as the
    FlashInfer layout is). Counts its plans and host-planned binds."""

    def __init__(self, config, store, bound, window=None):
        super().__init__(config, store, window)
        self.bound, self.plans, self.host_binds = bound, 0, 0

    def plan_once(self, block_size):
        self.plans += 1

    def bind(self, *args, **kwargs):
        self.host_binds += 1
        return super().bind(*args, **kwargs)

    def bind_on_device(self, req_to_token, req_pool_indices, seq_lens, block_size):
        host_bound = torch.full((seq_lens.shape[0],), self.bound)  # a constant: no read of seq_lens
        return super().bind(req_to_token, req_pool_indices, seq_lens, host_bound, block_size, False)


class LayoutFrozenAtCapture(PlanFreeSdpa):
    """A broken plan-free attention whose layout is built once, outside the graph (the negative
    control: a replay would then attend over the capture's lengths and rows)."""

    def bind_on_device(self, *args):
        if not hasattr(self, "frozen"):
            self.frozen = super().bind_on_device(*args)
        return self.frozen


def capture_plan_free(step: DraftStep, s: Setup, sizes, bound, kind=PlanFreeSdpa):
    made = []

    def make_plan_free(b):
        made.append(kind(s.model.config, s.store, bound, step.context_window))
        return made[-1]

    step.capture(
        sizes,
        lambda b: SdpaDraftAttention(s.model.config, s.store, step.context_window),
        s.req_to_token,
        kv_indices_capacity=10**6,
        capture_context=no_stream,
        capture_graph=rerun_capture(),
        make_plan_free=make_plan_free,
        plan_free_max_len=bound,
    )
    return made


def test_plan_free_graphs_replay_without_a_host_plan_up_to_their_bound():
    """Every bucket gets a plan-free graph, planned once at capture. Steps whose visible
    contexts are within the bound replay it, also on upper-bound host lengths, with no plan on
    the host, and equal the eager step across buckets, padding, growing contexts and reused
    pool rows; a longer context replays the split-KV graph, planned for the step."""
    s = Setup()
    graphed, eager = sdpa_step(s), sdpa_step(s)
    made = capture_plan_free(graphed, s, [1, 2, 4], bound=400)
    assert sorted(graphed.plan_free) == [1, 2, 4] and [a.plans for a in made] == [1, 1, 1]
    Rerun.replays = 0
    for seed, lens in enumerate(BATCHES[:4]):
        for grow, slack in ((0, 0), (1, 0), (17, 60)):  # a few steps later; host bounds
            rows, bonus, seq_lens, host = s.batch([c + grow for c in lens], seed)
            got = graphed(s.req_to_token, rows, bonus, seq_lens, host + slack, slack == 0)
            want = eager(s.req_to_token, rows, bonus, seq_lens, host, True)
            assert_same_step(got, want, rtol=1e-5, atol=1e-5)
    assert Rerun.replays == 12 and graphed.eager_steps == {}
    assert [a.host_binds for a in made] == [0, 0, 0] and [a.plans for a in made] == [1, 1, 1]
    # The split-KV graphs' attentions are still as planned at capture, for empty requests.
    assert all(g.attention.context_slots.shape[1] == 0 for g in graphed.graphs.values())
    # Past the bound: the split-KV graph of the bucket, planned on the host for this step.
    rows, bonus, seq_lens, host = s.batch([401, 3], 7)
    got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
    assert_same_step(got, eager(s.req_to_token, rows, bonus, seq_lens, host, True), rtol=1e-5, atol=1e-5)
    assert Rerun.replays == 13 and graphed.graphs[2].attention.context_slots.shape[1] == 401
    # Another request pool than the one captured is refused, never read silently.
    other = s.req_to_token.clone()
    with pytest.raises(ValueError, match="another req_to_token"):
        graphed(other, *s.batch([5], 8)[:3], torch.tensor([5]), True)


def test_a_plan_free_layout_frozen_at_capture_is_caught():
    """The negative control of the test above: a layout built outside the captured graph."""
    s = Setup()
    graphed, eager = sdpa_step(s), sdpa_step(s)
    capture_plan_free(graphed, s, [4], bound=400, kind=LayoutFrozenAtCapture)
    rows, bonus, seq_lens, host = s.batch([5, 300, 2], 3)
    got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
    want = eager(s.req_to_token, rows, bonus, seq_lens, host, True)
    assert torch.equal(got[1], want[1])  # positions come from the static inputs
    assert not torch.allclose(got[2], want[2], rtol=1e-3, atol=1e-3)


def test_plan_free_bound_within_the_draft_window():
    """With a draft window, visible contexts never pass it: every step replays plan-free."""
    s = Setup()
    graphed = sdpa_step(s, context_window=8)
    window = SdpaDraftAttention(s.model.config, s.store, 8)
    eager = DraftStep(s.forward, s.embedding, window, block_size=BLOCK, mask_token_id=1, context_window=8)
    capture_plan_free(graphed, s, [2], bound=8)
    Rerun.replays = 0
    rows, bonus, seq_lens, host = s.batch([500, 900], 0)
    got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
    assert_same_step(got, eager(s.req_to_token, rows, bonus, seq_lens, host, True), rtol=1e-5, atol=1e-5)
    assert Rerun.replays == 1 and graphed.graphs[2].attention.context_slots.shape[1] == 0


def test_page_indices_are_counted_within_the_draft_window():
    s = Setup()
    graphed = sdpa_step(s, context_window=8)
    graphed.capture(
        [2],
        lambda b: SdpaDraftAttention(s.model.config, s.store, 8),
        s.req_to_token,
        kv_indices_capacity=2 * (8 + BLOCK),
        capture_context=no_stream,
        capture_graph=rerun_capture(),
    )
    rows, bonus, seq_lens, host = s.batch([500, 900], 0)
    graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
    assert graphed.eager_steps == {}


def sliding_ring_setup(window: int, max_bs: int, **setup) -> Setup:
    """`Setup` (`setup`: its arguments) with the draft re-declared all-sliding (`window`), its
    layers in a window ring of the pool's request slots, with FlashInfer's scratch rows past the
    sink."""
    from sglang_dflash.draft import flashinfer_attention as fia
    from sglang_dflash.draft.window_ring import WindowRing

    return Setup(
        sliding_window=window,
        ring=WindowRing.for_reach(window, BLOCK, num_requests=12),  # Setup's pool rows
        ring_scratch_rows=fia.num_scratch_slots(max_bs, BLOCK),  # no slot-id layers: no slot scratch
        **setup,
    )


class CountedRerun(Rerun):
    def replay(self):
        self.count = getattr(self, "count", 0) + 1
        super().replay()


def ring_graphed_step(s: Setup, sizes, plan_free: int, **capture) -> DraftStep:
    """A draft step over `s`'s ring with FlashInfer's attention, its split-KV and plan-free
    (up to `plan_free`) graphs captured (`capture`: `DraftStep.capture`'s test options), wired
    as the runtime wires it: the step's visible bound is the attention's `longest_visible`."""
    from sglang_dflash.draft import flashinfer_attention as fia

    config, max_bs = s.model.config, max(sizes)
    common = dict(scratch_base=s.num_target_slots)
    attention = fia.FlashInferDraftAttention(
        config, s.store, max_batch_size=max_bs, q_dtype=s.dtype, **common
    )
    step = DraftStep(
        s.forward,
        s.embedding,
        attention,
        block_size=BLOCK,
        mask_token_id=1,
        context_window=attention.longest_visible,
    )
    buffers = attention.graph_buffers(max_bs, max(s.req_to_token.shape[1], plan_free))

    def make(b, **graph):
        return fia.FlashInferDraftAttention(
            config, s.store, max_batch_size=b, graph_batch_size=b, graph_buffers=buffers, **common, **graph
        )

    step.capture(
        sizes,
        make,
        s.req_to_token,
        kv_indices_capacity=buffers.capacity,
        make_plan_free=lambda b: make(b, plan_free_max_len=plan_free),
        plan_free_max_len=plan_free,
        **capture,
    )
    return step


RING_BATCHES = [[900, 3], [5, 1500, 41], [2000, 64, 65, 1]]


def test_flashinfer_graphs_over_a_window_ring_replay_plan_free_at_any_context(monkeypatch):
    """Every layer sliding, in a window ring, under FlashInfer (its paged prefill's PyTorch
    stand-in, tests/support/flashinfer_stand_in.py): the step's visible bound is the ring's
    reach, so contexts far past the plan-free bound (64) replay the plan-free graphs; every step
    equals SDPA's eager step over the same ring."""
    from tests.support.flashinfer_stand_in import installed

    s = sliding_ring_setup(window=40, max_bs=4)
    with installed(monkeypatch):
        graphed = ring_graphed_step(
            s, [2, 4], 64, capture_context=no_stream, capture_graph=rerun_capture(CountedRerun)
        )
    assert graphed.context_window == 40 and graphed.kv_indices_capacity == 4 * (40 + BLOCK)
    eager = sdpa_step(s)
    for seed, lens in enumerate(RING_BATCHES):
        rows, bonus, seq_lens, host = s.batch(lens, seed)
        got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
        assert_same_step(got, eager(s.req_to_token, rows, bonus, seq_lens, host, True), rtol=1e-4, atol=1e-4)
    assert graphed.eager_steps == {}
    assert {b: g.graph.count for b, g in graphed.plan_free.items()} == {2: 1, 4: 2}
    assert all(getattr(g.graph, "count", 0) == 0 for g in graphed.graphs.values())


# ------------------------------------------------------------------ CUDA graphs (GPU)

gpu = pytest.mark.gpu


def flashinfer_step(s: Setup, sizes, max_bs=8, plan_free=None):
    from sglang_dflash.draft import flashinfer_attention as fia

    config = s.model.config
    store = DraftKVStore(
        num_slots=s.num_target_slots + fia.num_scratch_slots(max_bs, BLOCK),
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=s.dtype,
        device="cuda",
    )
    store.k[:, : s.num_target_slots].copy_(s.store.k)
    store.v[:, : s.num_target_slots].copy_(s.store.v)
    s.store = store  # slot reuse below rewrites this one

    def make(b=None, **plan_free):
        return fia.FlashInferDraftAttention(
            config,
            store,
            scratch_base=s.num_target_slots,
            max_batch_size=b or max_bs,
            graph_batch_size=b,
            graph_buffers=buffers if b else None,
            **plan_free,
        )

    eager_attention = make()
    buffers = eager_attention.graph_buffers(max(sizes), s.req_to_token.shape[1])
    capacity = buffers.capacity
    graphed = DraftStep(s.forward, s.embedding, eager_attention, block_size=BLOCK, mask_token_id=1)
    eager = DraftStep(s.forward, s.embedding, make(), block_size=BLOCK, mask_token_id=1)
    graphed.capture(
        sizes,
        make,
        s.req_to_token,
        kv_indices_capacity=capacity,
        make_plan_free=(lambda b: make(b, plan_free_max_len=plan_free)) if plan_free else None,
        plan_free_max_len=plan_free,
    )
    return graphed, eager


def decided_rows(got_logits: torch.Tensor, want_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] x2 -> [...] bool: the rows whose argmax the measured difference cannot flip.
    Where every logit moved by at most d = max|got - want|, the top two of `want` can swap only
    if their gap is at most 2d; rows with a wider gap must agree. A fixed gap threshold instead
    depends on the logits' scale (about 16 for a random head over 256 features, where a 1-ulp
    bf16 change in the hidden state moves a logit by up to ~0.1)."""
    top2 = want_logits.topk(2, dim=-1).values
    moved = (got_logits - want_logits).abs().amax(-1)
    return (top2[..., 0] - top2[..., 1]) > 2 * moved


def test_decided_rows_excludes_what_the_measured_difference_can_flip():
    want = torch.tensor([[5.0, 4.9, 0.0], [5.0, 3.0, 0.0], [1.0, 0.0, 0.2]])
    got = want + torch.tensor([[-0.06, 0.06, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 0.1]])
    # Row 0: gap 0.1 > a fixed 0.05, yet a 0.06 move each way flips it: not decided.
    assert decided_rows(got, want).tolist() == [False, True, True]
    assert got[0].argmax() != want[0].argmax()  # the flip a fixed threshold would have failed on


def assert_same_proposals(got, want, base_tol):
    """Same block and positions; hidden within tolerance (the graph-mode plan splits the KV
    where the eager one may not); the same argmax through a random head wherever the measured
    difference cannot flip it."""
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2].float(), want[2].float(), **base_tol)
    head = torch.randn(
        VOCAB, got[2].shape[-1], device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    a, b = got[2].float() @ head.T, want[2].float() @ head.T
    decided = decided_rows(a, b)
    assert decided.float().mean() > 0.5, "too few rows decided to compare the proposals"
    assert torch.equal(a.argmax(-1)[decided], b.argmax(-1)[decided])


class ScratchWritingSdpa(SdpaDraftAttention):
    """SDPA that first writes the block's K/V into the store, at rows past the target's, as
    FlashInfer's draft attention does (`draft/flashinfer_attention.py`: `k_cache[rows] = k`)."""

    def __call__(self, layer_id, q, k, v):
        rows = slice(self.store.num_slots - k.shape[0], self.store.num_slots)
        self.store.k[layer_id][rows] = k
        self.store.v[layer_id][rows] = v
        return super().__call__(layer_id, q, k, v)


@pytest.mark.parametrize("served", [True, False])
def test_the_benchmark_keeps_no_autograd_history_across_steps(served):
    """scripts/bench/draft_step.py runs the eager module path with its own embedding. As served
    (a frozen embedding, no autograd) the store stays a plain tensor. The negative control is
    the benchmark before its fix: a grad-requiring embedding and autograd on chain every step's
    graph to the store through the block's K/V write, keeping every step's activations alive."""
    import contextlib

    from scripts.bench import draft_step as bench_draft_step

    s = Setup()
    head = bench_draft_step.Head(VOCAB, s.model.config.hidden_size, device="cpu", dtype=torch.float32)
    if not served:
        head.embedding.requires_grad_(True)
    step = DraftStep(
        s.model,
        head.embedding,
        ScratchWritingSdpa(s.model.config, s.store),
        block_size=BLOCK,
        mask_token_id=1,
    )
    with bench_draft_step.as_served() if served else contextlib.nullcontext():
        for seed in range(3):
            rows, bonus, seq_lens, host = s.batch([5, 9], seed)
            step(s.req_to_token, rows, bonus, seq_lens, host, True)
    assert (s.store.k.grad_fn is None) == served


@gpu
@pytest.mark.parametrize("plan_free", [None, 1024], ids=["split-kv-graphs", "plan-free-up-to-1024"])
@pytest.mark.parametrize("forward", ["module", "fused"])
def test_cuda_graphs_equal_the_eager_step(forward, plan_free):
    """With plan-free graphs up to 1024 tokens, the contexts below replay them and the longer
    ones (600 + 700, 1300) the split-KV graphs."""
    from sglang_dflash.draft.fused_forward import FusedDraftForward

    s = Setup(device="cuda", dtype=torch.bfloat16, shape="small-hd128")
    if forward == "fused":
        s.forward = FusedDraftForward(s.model, 4096)
    graphed, eager = flashinfer_step(s, [1, 2, 4, 8], plan_free=plan_free)
    assert len(graphed.plan_free) == (4 if plan_free else 0)
    tol = dict(rtol=5e-2, atol=5e-2)  # bf16; the argmax check below is the tight one
    for seed, lens in enumerate(BATCHES):
        for grow in (0, 1, 700):  # longer contexts than at capture, and than the last replay
            rows, bonus, seq_lens, host = s.batch([c + grow for c in lens], seed)
            got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
            want = eager(s.req_to_token, rows, bonus, seq_lens, host, True)
            assert_same_proposals(got, want, tol)
    assert graphed.eager_steps == {}
    # Slots reused: new requests in the same pool rows, other K/V at their slots.
    s.store.k.normal_()
    s.store.v.normal_()
    rows, bonus, seq_lens, host = s.batch([50, 1300, 2], 99)
    got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
    assert_same_proposals(got, eager(s.req_to_token, rows, bonus, seq_lens, host, True), tol)


def test_the_worker_asks_the_draft_step_and_gets_a_replay():
    """`DFlashWorker._draft`, as served: its step comes from the captured graph (no eager step),
    its ids and positions cut to the step's verify width, its hidden states the whole block's
    (Domino's candidate pool spans the block)."""
    from types import SimpleNamespace

    from sglang_dflash.worker import DFlashWorker

    s = Setup()
    step = sdpa_step(s)
    capture_sdpa(step, s, [4])
    rows, bonus, seq_lens, host = s.batch([12, 3, 40], 0)
    worker = SimpleNamespace(
        runtime=SimpleNamespace(step=step), req_to_token_pool=SimpleNamespace(req_to_token=s.req_to_token)
    )
    batch = SimpleNamespace(
        spec_info=SimpleNamespace(bonus_tokens=bonus), seq_lens=seq_lens, req_pool_indices=rows
    )
    Rerun.replays = 0
    block_ids, positions, hidden = DFlashWorker._draft(worker, batch, 5, host, True)
    assert Rerun.replays == 1 and step.eager_steps == {}
    assert (
        block_ids.shape == (3, 5) and positions.shape == (3, 5) and hidden.shape == (3, 16, 256)
    )  # window rows 0..W-1; the block's 16 rows
    assert block_ids[:, 0].tolist() == bonus.tolist()
    assert positions[:, 0].tolist() == [12, 3, 40]


# ------------------------------------------------------------------ start-up timing


class SharedWorkspace:
    """FlashInfer's split-KV plan, as the draft's graph-mode attentions hold it: the buckets of one
    layer kind share one int workspace, and each plan writes that bucket's offsets into it."""

    def __init__(self):
        self.planned_for = None  # (padded batch, its lengths) of the last plan


class SharedPlanAttention:
    def __init__(self, workspace):
        self.workspace, self.binds = workspace, 0

    def bind(self, req_to_token, pool_rows, seq_lens, host_lens, block_size, **kwargs):
        self.binds += 1
        self.workspace.planned_for = (int(pool_rows.shape[0]), host_lens.tolist())


class PlanReadingGraph:
    """A split-KV graph's replay: it reads whatever plan the workspace holds."""

    def __init__(self, workspace):
        self.workspace, self.read = workspace, []

    def replay(self):
        self.read.append(self.workspace.planned_for)


def bucket(size, attention, graph):
    g = draft_step.BucketGraph(
        size=size,
        attention=attention,
        bonus=torch.full((size,), 7),
        seq_lens=torch.full((size,), 300),  # what the last served step left in them
        pool_rows=torch.arange(size),
    )
    g.graph = graph
    return g


def test_the_start_up_timing_replays_each_split_kv_graph_on_its_own_plan():
    """The cost table times every bucket's graph on its capture-time inputs (empty requests).
    A split-KV graph reads the plan in its attention's shared workspace, which the last plan
    (the smallest bucket's, at capture) filled for another padded batch: each is planned again,
    for its own bucket and empty requests, before its first timed replay, and only then."""
    workspace = SharedWorkspace()
    step = DraftStep(None, None, None, block_size=BLOCK, mask_token_id=1)
    step.req_to_token = torch.zeros(8, 64, dtype=torch.int32)
    attentions = {size: SharedPlanAttention(workspace) for size in (4, 2, 1)}
    graphs = {size: PlanReadingGraph(workspace) for size in (4, 2, 1)}
    step.graphs = {size: bucket(size, attentions[size], graphs[size]) for size in (4, 2, 1)}
    workspace.planned_for = (1, [0])  # the capture's last plan
    timed = step.timing_graphs()
    for size in (4, 2, 1):
        for _ in range(3):
            timed[size].replay()
    for size in (4, 2, 1):
        assert graphs[size].read == [(size, [0] * size)] * 3
        assert attentions[size].binds == 1
        assert step.graphs[size].seq_lens.tolist() == [0] * size  # empty requests, as captured
    # The plan-free graphs plan nothing: they were planned once at capture, in buffers of their own.
    plan_free = {size: PlanReadingGraph(workspace) for size in (4, 2, 1)}
    step.plan_free = {
        size: bucket(size, SharedPlanAttention(workspace), plan_free[size]) for size in (4, 2, 1)
    }
    binds = workspace.planned_for
    for size, graph in step.timing_graphs().items():
        graph.replay()
        assert plan_free[size].read == [binds]
    assert all(g.attention.binds == 0 for g in step.plan_free.values())


@gpu
@pytest.mark.parametrize("plan_free", [32, 2048], ids=["split-kv-past-32", "plan-free-up-to-2048"])
def test_cuda_graphs_over_a_window_ring_equal_the_eager_sdpa_step(plan_free):
    """Every layer sliding (window 40) in a window ring: FlashInfer's graphs against SDPA's eager
    step over the same ring, bf16. Below the ring's reach (a plan-free bound of 32) the longer
    contexts replay the split-KV graphs; past it (2048) every step replays a plan-free one."""
    s = sliding_ring_setup(40, 8, device="cuda", dtype=torch.bfloat16, shape="small-hd128")
    graphed = ring_graphed_step(s, [1, 2, 4, 8], plan_free)
    eager = sdpa_step(s)
    tol = dict(rtol=5e-2, atol=5e-2)  # bf16; the argmax check is the tight one
    for seed, lens in enumerate(RING_BATCHES + BATCHES):
        rows, bonus, seq_lens, host = s.batch(lens, seed)
        got = graphed(s.req_to_token, rows, bonus, seq_lens, host, True)
        assert_same_proposals(got, eager(s.req_to_token, rows, bonus, seq_lens, host, True), tol)
    assert graphed.eager_steps == {}

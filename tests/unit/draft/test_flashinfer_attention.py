"""FlashInfer draft attention: its paged layout and mask mapping (CPU), and its output against
`SdpaDraftAttention` on random data (GPU).

The CPU tests pin the two facts the CUDA path rests on: the page indices list each request's
committed context and then its block's scratch slots, exactly (device side) even when the host
lengths are upper bounds; and FlashInfer's mask rule, applied to that layout with our
(causal, window_left) per layer kind, is `attention.visibility`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft import flashinfer_attention as fia
from sglang_dflash.draft.attention import SdpaDraftAttention, planning_lens, visibility
from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.window_ring import WindowRing
from tests.support.flashinfer_stand_in import flashinfer_mask, installed

BLOCK = 16


def make_config(layer_types, *, window=None, is_causal=None, heads=8, kv_heads=2, head_dim=128):
    raw = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": heads * head_dim,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 64,
        "block_size": BLOCK,
        "mask_token_id": 1,
        "layer_types": list(layer_types),
    }
    if window is not None:
        raw["sliding_window"] = window
    if is_causal is not None:
        raw["is_causal"] = is_causal
    return DFlashDraftConfig.from_dict(raw)


def make_req_to_token(context_lens: list[int], num_slots: int, seed: int = 0):
    """Rows of distinct random slots (>= 1), shuffled request-pool rows."""
    g = torch.Generator().manual_seed(seed)
    bs, width = len(context_lens), max(context_lens) + 2 * BLOCK
    pool = torch.zeros(bs + 3, width, dtype=torch.int32)
    slots = torch.randperm(num_slots - 1, generator=g)[: bs * width].view(bs, width) + 1
    rows = torch.randperm(bs + 3, generator=g)[:bs]
    pool[rows] = slots.to(torch.int32)
    return pool, rows


# ----------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("window", [None, 5], ids=["all-context", "window-5"])
@pytest.mark.parametrize("slack", [0, 5], ids=["exact-host-lens", "upper-bound-host-lens"])
def test_paged_layout_lists_context_then_scratch(slack, window):
    context_lens = [3, 1, 40, 7]
    scratch_base = 1000
    req_to_token, rows = make_req_to_token(context_lens, 500)
    lens = torch.tensor(context_lens)
    layout = fia.paged_layout(req_to_token, rows, lens, lens + slack, BLOCK, scratch_base, window)
    expected, indptr, host = [], [0], [0]
    for i, (row, c) in enumerate(zip(rows.tolist(), context_lens)):
        start = 0 if window is None else max(0, c - window)  # the last `window` tokens
        expected += req_to_token[row, start:c].tolist()
        expected += [scratch_base + i * BLOCK + j for j in range(BLOCK)]
        indptr.append(len(expected))
        host.append(host[-1] + min(c + slack, window or c + slack) + BLOCK)
    assert layout.kv_indptr.tolist() == indptr
    assert layout.kv_indptr_host.tolist() == host
    assert layout.kv_indices.dtype == torch.int32
    assert layout.kv_indices.shape[0] == int(layout.kv_indptr_host[-1])
    assert layout.kv_indices[: indptr[-1]].tolist() == expected
    assert layout.qo_indptr_host.tolist() == [i * BLOCK for i in range(len(context_lens) + 1)]
    assert layout.last_page_len_host.tolist() == [1] * len(context_lens)


def test_planning_lens_prefer_the_exact_host_lengths():
    committed, reserved = torch.tensor([5, 40]), torch.tensor([32, 64])  # reserved: + 2B, aligned
    assert planning_lens(committed, reserved) == (committed, True)
    assert planning_lens(committed, None) == (committed, True)
    assert planning_lens(None, reserved) == (reserved, False)
    with pytest.raises(ValueError, match="neither seq_lens_cpu nor reserved lengths"):
        planning_lens(None, None)


@pytest.mark.parametrize("exact", [True, False])
def test_upper_bound_host_lengths_plan_without_split_kv(exact, monkeypatch):
    """The plan FlashInfer gets (CPU, with the stand-in wrapper): split-KV only on exact host
    lengths, whose per-request chunk counts then match the kernel's (module docstring)."""
    config = make_config(["full_attention", "sliding_attention"], window=24)
    store = DraftKVStore(
        num_slots=200, num_layers=2, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, device="cpu"
    )
    with installed(monkeypatch):
        attn = fia.FlashInferDraftAttention(config, store, scratch_base=100, max_batch_size=4)
    req_to_token, rows = make_req_to_token([3, 9], 100)
    lens = torch.tensor([3, 9])
    attn.bind(req_to_token, rows, lens, lens if exact else lens + 16, BLOCK, host_lens_exact=exact)
    plans = [plan for w in attn.wrappers.values() for plan in w.plans]
    assert len(plans) == 2  # one per layer kind
    for args, kwargs in plans:
        assert kwargs["disable_split_kv"] is (not exact)
        assert args[1].tolist() == ([0, 19, 44] if exact else [0, 35, 76])  # host kv indptr
    assert all(w._paged_kv_indptr_buf.tolist() == [0, 19, 44] for w in attn.wrappers.values())


@pytest.mark.parametrize(
    "layer_types,window,is_causal",
    [
        (["full_attention"], None, None),
        (["full_attention"], None, True),
        (["sliding_attention"], 5, None),
        (["sliding_attention"], 20, False),
    ],
    ids=["full", "full-causal", "sliding-causal", "sliding-noncausal"],
)
def test_flashinfer_masks_on_our_layout_are_visibility(layer_types, window, is_causal):
    config = make_config(layer_types, window=window, is_causal=is_causal)
    kind = fia.layer_kind(config, 0)
    for context_len in (0, 1, 3, 30):
        # The paged sequence is positions 0..C+Bd-1 (context, then block); queries at C..C+Bd-1.
        k_pos = torch.arange(context_len + BLOCK)
        q_pos = context_len + torch.arange(BLOCK)
        want = visibility(
            q_pos,
            k_pos,
            torch.ones_like(k_pos, dtype=torch.bool),
            causal=config.layer_is_causal(0),
            window=config.layer_window(0),
        )
        got = flashinfer_mask(BLOCK, context_len + BLOCK, kind.causal, kind.window_left)
        assert torch.equal(got, want), (context_len, kind)


def test_non_causal_window_shorter_than_the_block_is_refused():
    config = make_config(["sliding_attention"], window=BLOCK - 1, is_causal=False)
    reason = fia.unavailable_reason(config, torch.device("cuda"))
    assert reason is not None and "non-causal with sliding_window 15 < block_size 16" in reason


def test_float32_and_other_head_sizes_take_sdpa():
    """A float32 draft (e.g. served with --dtype float32 on the Triton backend) or a head size
    FlashInfer's prefill kernels are not built for: SDPA, with the reason named."""
    config = make_config(["full_attention"])
    reason = fia.unavailable_reason(config, torch.device("cuda"), torch.float32)
    assert reason == "FlashInfer's prefill kernels take fp16 or bf16, the draft runs in torch.float32"
    reason = fia.unavailable_reason(make_config(["full_attention"], head_dim=16), torch.device("cuda"))
    assert reason is not None and "head_dim 64, 128, 256, 512, the draft's is 16" in reason


def test_unavailable_on_cpu():
    config = make_config(["full_attention"])
    assert fia.unavailable_reason(config, torch.device("cpu")) == "the draft runs on cpu"
    store = DraftKVStore(
        num_slots=8, num_layers=1, num_kv_heads=2, head_dim=128, dtype=torch.float32, device="cpu"
    )
    with pytest.raises(ValueError, match="FlashInfer draft attention is unavailable: the draft runs on cpu"):
        fia.FlashInferDraftAttention(config, store, scratch_base=0, max_batch_size=1)


def test_importing_the_module_does_not_import_flashinfer():
    code = "import sys, sglang_dflash.draft.flashinfer_attention; assert 'flashinfer' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_scratch_size():
    assert fia.num_scratch_slots(max_batch_size=48, block_size=16) == 768


def test_a_ring_layout_lists_ring_rows_in_position_order_then_ring_scratch():
    """A windowed layer in a window ring: each request's last `window` positions as ring rows
    (request slot x R + position % R), oldest first, then its block's scratch rows past the sink."""
    ring = WindowRing(rows_per_request=8, num_requests=5)
    context_lens = [3, 12, 30]
    req_to_token, _ = make_req_to_token(context_lens, 500)
    rows = torch.tensor([4, 0, 2])
    lens = torch.tensor(context_lens)
    base = ring.num_rows
    layout = fia.paged_layout(req_to_token, rows, lens, lens + 2, BLOCK, base, 6, ring)
    expected = []
    for i, (r, c) in enumerate(zip(rows.tolist(), context_lens)):
        expected += [r * 8 + p % 8 for p in range(max(0, c - 6), c)]
        expected += [base + i * BLOCK + j for j in range(BLOCK)]
    assert layout.kv_indptr.tolist() == [0, 3 + BLOCK, 9 + 2 * BLOCK, 15 + 3 * BLOCK]
    assert layout.kv_indices[: len(expected)].tolist() == expected
    # E.g. request slot 0 at context 12: positions 6..11 -> rows 6, 7, 0, 1, 2, 3.
    assert expected[3 + BLOCK : 9 + BLOCK] == [6, 7, 0, 1, 2, 3]


def random_store(cfg, num_slots: int, dtype=torch.bfloat16, device="cuda", **ring) -> DraftKVStore:
    """A store of random K/V (`ring`: `DraftKVStore`'s window ring arguments)."""
    store = DraftKVStore(
        num_slots=num_slots,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
        device=device,
        **ring,
    )
    for t in (store.k, store.v, store.ring_k, store.ring_v):
        if t is not None:
            t.normal_()
    return store


RING_DRAFTS = {
    # every layer sliding (causal): all in the ring, no slot-id layout
    "all-sliding": (["sliding_attention", "sliding_attention"], 40, None, None),
    # a full layer at slot ids, sliding ones in the ring (one non-causal)
    "mixed": (["full_attention", "sliding_attention"], 24, False, None),
    # --speculative-draft-window-size 32: every layer windowed, the full one too
    "draft-window": (["full_attention", "sliding_attention"], 24, None, 32),
}


def ring_case(name, bs, max_bs, device="cpu", dtype=torch.float32, seed=0):
    layer_types, window, is_causal, context_window = RING_DRAFTS[name]
    torch.manual_seed(seed)
    cfg = make_config(layer_types, window=window, is_causal=is_causal)
    windowed = [i for i in range(cfg.num_hidden_layers) if cfg.layer_window(i) or context_window]
    reach = max(min(w for w in (cfg.layer_window(i), context_window) if w) for i in windowed)
    ring = WindowRing.for_reach(reach, BLOCK, num_requests=bs + 3)
    target_slots = 3000
    scratch = fia.num_scratch_slots(max_bs, BLOCK)
    store = random_store(
        cfg,
        target_slots + scratch,
        dtype,
        device,
        ring=ring,
        windowed_layers=windowed,
        ring_scratch_rows=scratch,
    )
    return cfg, store, target_slots, context_window


def sdpa_on(cfg, store, context_window, req_to_token, rows, lens, q, k, v, layer_id):
    """The oracle: `SdpaDraftAttention` over the same store (its own gather of the ring), fp32."""
    attend = SdpaDraftAttention(cfg, store, context_window).bind(req_to_token, rows, lens, lens.cpu(), BLOCK)
    return attend(layer_id, q, k, v)


def committed_rows(store, target_slots):
    """What a step must not touch: the ring's rows up to its sink, the target's slots."""
    return store.ring_k[:, : store.ring.num_rows].clone(), store.k[:, :target_slots].clone()


RING_MODES = ["eager", "eager-upper-bound", "split-kv-graph", "plan-free"]


def check_ring_attention(draft, mode, device="cpu", dtype=torch.float32, tol=1e-4):
    """FlashInfer's layouts over a window ring against SDPA's own reading of the same ring, in
    float32: every layer, contexts shorter and much longer than the ring, padded rows (pool row
    0, no context) in the graph modes, and nothing written but the scratch rows."""
    context_lens = [3, 200, 41, 0] if mode in ("split-kv-graph", "plan-free") else [3, 200, 41]
    bs = len(context_lens)
    cfg, store, target_slots, context_window = ring_case(draft, bs, bs, device, dtype)
    req_to_token, rows = make_req_to_token(context_lens, target_slots)
    if bs == 4:
        rows[-1] = 0  # a padded row
    req_to_token, rows, lens = req_to_token.to(device), rows.to(device), torch.tensor(context_lens)
    common = dict(scratch_base=target_slots, max_batch_size=bs, context_window=context_window)
    eager = fia.FlashInferDraftAttention(cfg, store, **common)
    if mode == "eager":
        attn = eager.bind(req_to_token, rows, lens.to(device), lens, BLOCK)
    elif mode == "eager-upper-bound":
        attn = eager.bind(req_to_token, rows, lens.to(device), lens + 40, BLOCK, host_lens_exact=False)
    else:
        graph = dict(graph_batch_size=bs, graph_buffers=eager.graph_buffers(bs, 256))
        if mode == "plan-free":
            graph["plan_free_max_len"] = 256
        attn = fia.FlashInferDraftAttention(cfg, store, **common, **graph)
        if mode == "plan-free":
            attn.plan_once(BLOCK)
            attn.bind_on_device(req_to_token, rows, lens.to(device), BLOCK)
        else:
            attn.bind(req_to_token, rows, lens.to(device), lens, BLOCK)
    assert (False in attn.sources) == (draft == "mixed")  # a slot-id layout only for full layers
    assert attn.longest_visible == (None if draft == "mixed" else store.ring.rows_per_request - BLOCK)
    before = committed_rows(store, target_slots)
    n = bs * BLOCK
    for layer_id in range(cfg.num_hidden_layers):
        q = torch.randn(n, cfg.num_attention_heads, cfg.head_dim, device=device)
        k, v = torch.randn(2, n, cfg.num_key_value_heads, cfg.head_dim, device=device).unbind(0)
        got = attn(layer_id, q.to(dtype), k.to(dtype), v.to(dtype))
        # The oracle reads the store's (rounded) K/V in float32, and the block as FlashInfer stored it.
        k, v = k.to(dtype).float(), v.to(dtype).float()
        want = sdpa_on(
            cfg,
            store,
            context_window,
            req_to_token,
            rows,
            lens.to(device),
            q.to(dtype).float(),
            k,
            v,
            layer_id,
        )
        torch.testing.assert_close(
            got.float(), want, rtol=tol, atol=tol, msg=f"{draft} {mode} layer {layer_id}"
        )
    after = committed_rows(store, target_slots)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]), (
        "a step wrote past its scratch"
    )


@pytest.mark.parametrize("mode", RING_MODES)
@pytest.mark.parametrize("draft", list(RING_DRAFTS))
def test_flashinfer_over_a_window_ring_matches_sdpa(draft, mode, monkeypatch):
    """`check_ring_attention`, with FlashInfer's paged prefill as its PyTorch stand-in
    (`tests/support/flashinfer_stand_in.py`)."""
    with installed(monkeypatch):
        check_ring_attention(draft, mode)


def test_a_ring_without_scratch_rows_is_refused(monkeypatch):
    cfg, _, target_slots, _ = ring_case("all-sliding", 2, 2)
    ring = WindowRing.for_reach(40, BLOCK, 5)
    store = random_store(
        cfg, target_slots, torch.float32, "cpu", ring=ring, windowed_layers=[0, 1], ring_scratch_rows=BLOCK
    )
    with (
        installed(monkeypatch),
        pytest.raises(ValueError, match="the window ring has 297 rows; FlashInfer draft attention needs 313"),
    ):
        fia.FlashInferDraftAttention(cfg, store, scratch_base=target_slots, max_batch_size=2)


# ----------------------------------------------------------------------------- GPU


def test_a_bounded_device_layout_lists_what_the_host_sized_one_lists():
    """The plan-free layout: sized by a bound fixed at capture (not by this step's host
    lengths), from device tensors only; its first kv_indptr[-1] entries are the exact layout.
    Padded rows (pool row 0, no context) list only their block."""
    context_lens = [3, 1, 40, 0]
    req_to_token, rows = make_req_to_token(context_lens, 500)
    rows[-1] = 0
    lens = torch.tensor(context_lens)
    for window in (None, 5):
        exact = fia.paged_layout(req_to_token, rows, lens, lens, BLOCK, 1000, window)
        kv_indptr, kv_indices = fia.device_layout(
            req_to_token, rows, lens, BLOCK, 1000, window, 4 * (64 + BLOCK)
        )
        n = int(exact.kv_indptr[-1])
        assert torch.equal(kv_indptr, exact.kv_indptr) and kv_indices.shape == (4 * (64 + BLOCK),)
        assert torch.equal(kv_indices[:n], exact.kv_indices[:n])
        assert kv_indices[n - BLOCK : n].tolist() == [1000 + 3 * BLOCK + j for j in range(BLOCK)]


def plan_free_stand_in(b, bound, window=None, monkeypatch=None):
    """A plan-free attention over the stand-in wrappers, with the fixed buffers FlashInfer's
    graph mode gives every layer kind; and its wrappers' plans."""
    config = make_config(["full_attention", "sliding_attention"], window=24)
    store = DraftKVStore(
        num_slots=200, num_layers=2, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, device="cpu"
    )
    with installed(monkeypatch):
        eager = fia.FlashInferDraftAttention(config, store, scratch_base=100, max_batch_size=b)
        attn = fia.FlashInferDraftAttention(
            config,
            store,
            scratch_base=100,
            max_batch_size=b,
            context_window=window,
            graph_batch_size=b,
            graph_buffers=eager.graph_buffers(b, bound),
            plan_free_max_len=bound,
        )
    return attn, [w.plans for w in attn.wrappers.values()]


def test_a_plan_free_attention_plans_once_without_split_kv_and_binds_on_the_device(monkeypatch):
    """Its one plan: b empty requests of Bd rows, split-KV off, per layer kind (the work
    partition then depends on nothing else). Each step's binding plans nothing and writes the
    exact layout into the buffers the planned kernels read."""
    attn, by_wrapper = plan_free_stand_in(b=4, bound=64, monkeypatch=monkeypatch)
    assert attn.layout_totals == {False: 4 * (64 + BLOCK)}
    attn.plan_once(BLOCK)
    plans = [plan for wrapper_plans in by_wrapper for plan in wrapper_plans]
    assert len(plans) == 2
    for args, kwargs in plans:
        assert kwargs["disable_split_kv"] is True
        assert args[0].tolist() == args[1].tolist() == [i * BLOCK for i in range(5)]
    context_lens = [3, 9, 64, 0]
    req_to_token, rows = make_req_to_token(context_lens, 1000)
    rows[-1] = 0  # a padded row
    lens = torch.tensor(context_lens)
    assert attn.bind_on_device(req_to_token, rows, lens, BLOCK) is attn and len(plans) == 2
    exact = fia.paged_layout(req_to_token, rows, lens, lens, BLOCK, 100)
    wrapper = next(iter(attn.wrappers.values()))
    n = int(exact.kv_indptr[-1])
    assert torch.equal(wrapper._paged_kv_indptr_buf, exact.kv_indptr)
    assert torch.equal(wrapper._paged_kv_indices_buf[:n], exact.kv_indices[:n])
    assert attn.bs == 4
    with pytest.raises(ValueError, match="planned once"):
        attn.bind(req_to_token, rows, lens, lens, BLOCK)
    # Within a draft window the bound is the window's.
    attn = plan_free_stand_in(b=2, bound=64, window=8, monkeypatch=monkeypatch)[0]
    assert attn.layout_totals == {False: 2 * (8 + BLOCK)}


def sdpa_oracle(config, store, req_to_token, rows, lens, q, k, v, layer_id, dtype, window=None):
    """SdpaDraftAttention on the same store, in `dtype`."""
    c_max = int(lens.max())
    fp_store = DraftKVStore(
        num_slots=store.num_slots,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=dtype,
        device="cuda",
    )
    fp_store.k.copy_(store.k)
    fp_store.v.copy_(store.v)
    context_slots = req_to_token[rows.long()][:, :c_max].long().cuda()
    bs = context_slots.shape[0]
    attend = SdpaDraftAttention(config, fp_store, window).bind(
        context_slots, torch.arange(bs, device="cuda"), lens.cuda(), lens, BLOCK
    )
    return attend(layer_id, q.to(dtype), k.to(dtype), v.to(dtype))


def assert_layers_match_sdpa(attn, cfg, store, req_to_token, rows, lens, window, bs, label=()):
    """Every layer's output on random q/k/v against the SDPA oracle in float32, within twice the
    error SDPA itself makes in the store's dtype."""
    dtype = store.k.dtype
    n, heads, kvh, d = bs * BLOCK, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for layer_id in range(cfg.num_hidden_layers):
        q = torch.randn(n, heads, d, device="cuda", dtype=dtype)
        k = torch.randn(n, kvh, d, device="cuda", dtype=dtype)
        v = torch.randn(n, kvh, d, device="cuda", dtype=dtype)
        got = attn(layer_id, q, k, v)
        inputs = (cfg, store, req_to_token, rows, lens, q, k, v, layer_id)
        want = sdpa_oracle(*inputs, torch.float32, window)
        same_dtype = sdpa_oracle(*inputs, dtype, window)
        err, base = (got.float() - want).abs().max(), (same_dtype.float() - want).abs().max()
        assert got.shape == (n, heads, d)
        assert err <= max(2 * base, 1e-2), (*label, layer_id, float(err), float(base))


@pytest.mark.gpu
# A large slack makes the plan split the (host-)longer KV into more chunks than exist on the device.
@pytest.mark.parametrize("slack", [0, 2500], ids=["exact-host-lens", "upper-bound-host-lens"])
@pytest.mark.parametrize(
    "context_lens", [[1], [17, 300, 2000, 5], [4096, 1, 64]], ids=["bs1", "bs4", "bs3-long"]
)
@pytest.mark.parametrize("window", [None, 256], ids=["all-context", "draft-window-256"])
def test_matches_sdpa(context_lens, slack, window):
    """Full (non-causal), sliding causal and sliding non-causal layers, GQA 8/2, bf16; with and
    without a context window (--speculative-draft-window-size)."""
    configs = [
        # full layers non-causal, sliding layers causal (the reference's default)
        make_config(["full_attention", "sliding_attention", "full_attention"], window=40),
        make_config(["sliding_attention"], window=24, is_causal=False),
    ]
    for cfg in configs:
        torch.manual_seed(0)
        bs = len(context_lens)
        target_slots = 3 * (max(context_lens) + 2 * BLOCK) * bs + 8
        max_bs = bs + 2
        store = random_store(cfg, target_slots + fia.num_scratch_slots(max_bs, BLOCK))
        req_to_token, rows = make_req_to_token(context_lens, target_slots)
        lens = torch.tensor(context_lens)
        attn = fia.FlashInferDraftAttention(
            cfg, store, scratch_base=target_slots, max_batch_size=max_bs, context_window=window
        )
        # Upper-bound host lengths are planned without split-KV (module docstring).
        host_lens, exact = lens + slack, slack == 0
        attn.bind(req_to_token.cuda(), rows.cuda(), lens.cuda(), host_lens, BLOCK, host_lens_exact=exact)
        committed = store.k[:, :target_slots].clone()
        assert_layers_match_sdpa(attn, cfg, store, req_to_token, rows, lens, window, bs)
        assert torch.equal(store.k[:, :target_slots], committed), "block K/V leaked into committed slots"


@pytest.mark.gpu
def test_construction_and_bind_reject_bad_sizes():
    config = make_config(["full_attention"])

    def store(num_slots):
        return DraftKVStore(
            num_slots=num_slots,
            num_layers=1,
            num_kv_heads=2,
            head_dim=128,
            dtype=torch.bfloat16,
            device="cuda",
        )

    with pytest.raises(ValueError, match="has 95 slots; FlashInfer draft attention needs 96"):
        fia.FlashInferDraftAttention(config, store(95), scratch_base=64, max_batch_size=2)
    attn = fia.FlashInferDraftAttention(config, store(128), scratch_base=64, max_batch_size=4)
    # 5 rows of 3 + 2 * BLOCK slots need 175 distinct ids; bind refuses the batch before reading any.
    req_to_token, rows = make_req_to_token([3] * 5, 5 * (3 + 2 * BLOCK) + 1)
    lens = torch.full((5,), 3)
    with pytest.raises(ValueError, match="batch size 5 is outside"):
        attn.bind(req_to_token.cuda(), rows.cuda(), lens.cuda(), lens, BLOCK)


@pytest.mark.gpu
def test_graph_mode_grows_the_shared_workspace_for_large_buckets():
    """Graph mode always splits the KV over a grid padded for the bucket: at 256 requests with
    32/8 heads of 128 its scratch passes FlashInfer's default 128 MB. The largest bucket's
    attention grows the shared workspace, and its plan then fits."""
    config = make_config(["full_attention"], heads=32, kv_heads=8)
    b = 256
    store = DraftKVStore(
        num_slots=64 + fia.num_scratch_slots(b, BLOCK),
        num_layers=1,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    small = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    eager = fia.FlashInferDraftAttention(config, store, scratch_base=64, max_batch_size=b)
    buffers = eager.graph_buffers(b, 8, workspace=small)
    attn = fia.FlashInferDraftAttention(
        config, store, scratch_base=64, max_batch_size=b, graph_batch_size=b, graph_buffers=buffers
    )
    assert buffers.workspace.numel() > small.numel() and attn.workspace is buffers.workspace
    req_to_token = torch.zeros(b, 8, dtype=torch.int32, device="cuda")
    lens = torch.full((b,), 8)
    attn.bind(req_to_token, torch.arange(b, device="cuda"), lens.cuda(), lens, BLOCK)
    q = torch.randn(b * BLOCK, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b * BLOCK, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert attn(0, q, k, torch.randn_like(k)).isfinite().all()


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256], ids=["all-context", "draft-window-256"])
def test_one_plan_free_plan_serves_every_later_step(window):
    """The plan-free claim on FlashInfer's kernels: one plan, made at capture for empty requests
    with split-KV off, then steps of other lengths (up to the bound, padded rows included) bound
    on the device only, each against the SDPA oracle, in a graph-mode wrapper."""
    cfg = make_config(["full_attention", "sliding_attention", "full_attention"], window=40)
    b, bound = 4, 2048
    target_slots = 3 * (bound + 2 * BLOCK) * b + 8
    store = random_store(cfg, target_slots + fia.num_scratch_slots(b, BLOCK))
    buffers = fia.FlashInferDraftAttention(
        cfg, store, scratch_base=target_slots, max_batch_size=b
    ).graph_buffers(b, bound)
    attn = fia.FlashInferDraftAttention(
        cfg,
        store,
        scratch_base=target_slots,
        max_batch_size=b,
        context_window=window,
        graph_batch_size=b,
        graph_buffers=buffers,
        plan_free_max_len=bound,
    )
    attn.plan_once(BLOCK)
    for seed, context_lens in enumerate([[1, 2000, 17, 300], [2048, 5, 0, 0], [64, 64, 64, 1500]]):
        torch.manual_seed(seed)
        req_to_token, rows = make_req_to_token(context_lens, target_slots, seed)
        lens = torch.tensor(context_lens)
        attn.bind_on_device(req_to_token.cuda(), rows.cuda(), lens.cuda(), BLOCK)
        assert_layers_match_sdpa(attn, cfg, store, req_to_token, rows, lens, window, b, (seed,))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", RING_MODES)
@pytest.mark.parametrize("draft", list(RING_DRAFTS))
def test_flashinfer_over_a_window_ring_matches_sdpa_on_cuda(draft, mode):
    """`check_ring_attention` on FlashInfer's kernels, bf16 (head_dim 128, GQA 8/2)."""
    check_ring_attention(draft, mode, device="cuda", dtype=torch.bfloat16, tol=2e-2)

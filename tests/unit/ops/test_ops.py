"""The context-KV injection ops: the fused op's maths, its registration, the selector, and (on a
GPU) the CUDA kernel against the references.

Oracles:
  * `reference.inject_context_kv`: the draft's own layer maths (`DFlashDraftModel`).
  * an fp32 run of that reference on the same (rounded) weights: the "true" value, to check that
    the fused op is at least as accurate as the bf16/fp16 reference.
  * `reference.fused_inject_reference`: the fused op's maths step by step (the op's CPU kernel),
    the tight oracle for the CUDA kernel (same cuBLAS GEMMs, fp32 epilogue).

Stated tolerances (measured on CPU, see `test_fused_maths_is_as_accurate_as_the_reference`):
the fused op folds `hidden_norm`'s weight into the stacked K/V weight and keeps its epilogue in
fp32 (one rounding, at the store), while the reference rounds after every module. The
reference's own error is therefore ~2 ulps *of the head's largest element* (its bf16 RoPE
products cancel), and so is the difference between the two: |fused - ref| <= EPS * (|ref| +
max|ref|) with EPS = 2^-6 (bf16), 2^-9 (fp16), 1e-5 (fp32); max|ref| is ~6 for K after k_norm.
Vs the fp32 oracle, the fused op's RMS error is no larger than the reference's.
"""

from __future__ import annotations

import copy
import logging
import os
import sys

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.ops import _cuda, reference
from tests.support.draft_models import SHAPES, make_model

REF_EPS = {torch.bfloat16: 2**-6, torch.float16: 2**-9, torch.float32: 1e-5}
# CUDA kernel vs `fused_inject_reference` on the same GPU: identical GEMMs, fp32 epilogues that
# differ only in summation order -> at most one rounding step of the output dtype.
KERNEL_TOL = {
    torch.bfloat16: dict(rtol=1e-2, atol=1e-3),
    torch.float16: dict(rtol=1.5e-3, atol=1e-4),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
}


def make_inputs(model: DFlashDraftModel, num_tokens: int, num_slots: int, *, seed: int = 1, device="cpu"):
    """Target features with outlier channels, positions up to 40k, distinct slots >= 1."""
    g = torch.Generator().manual_seed(seed)
    width = model.fc.weight.shape[1]
    x = torch.randn(num_tokens, width, generator=g)
    x[:, ::97] *= 30
    positions = torch.randint(0, 40000, (num_tokens,), generator=g)
    slots = torch.randperm(num_slots - 1, generator=g)[:num_tokens] + 1
    dtype = model.fc.weight.dtype
    return x.to(device, dtype), positions.to(device), slots.to(device)


def make_store(model: DFlashDraftModel, num_slots: int, dtype=None, device="cpu") -> DraftKVStore:
    c = model.config
    return DraftKVStore(
        num_slots=num_slots,
        num_layers=c.num_hidden_layers,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        dtype=dtype or model.fc.weight.dtype,
        device=device,
    )


def run_inject(fn, model, x, positions, slots, num_slots, dtype=None):
    store = make_store(model, num_slots, dtype, device=x.device)
    fn(model, store, x, positions, slots)
    return store


def run_fused_reference(model, store, x, positions, slots):
    w = reference.fuse_weights(model)
    reference.fused_inject_reference(x, positions, slots, *w.op_args(), store.k, store.v)


def assert_close_to_reference(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """The stated tolerance vs the module-by-module reference (see the module docstring)."""
    eps = REF_EPS[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=eps, atol=eps * float(ref.float().abs().max()))


def rms(a: torch.Tensor) -> float:
    return float(a.float().pow(2).mean().sqrt())


def requires_extension():
    error = _cuda.load_error()
    if error is not None:
        pytest.skip(error)


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Each test decides the implementation afresh."""
    monkeypatch.delenv(ops.ENV, raising=False)
    ops._CHOSEN.clear()
    yield
    ops._CHOSEN.clear()


# --------------------------------------------------------------- the fused maths (CPU)


@pytest.mark.parametrize(
    "bias,rope",
    [
        (False, None),
        (True, None),
        (False, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    ],
    ids=["plain", "bias", "yarn"],
)
def test_fused_maths_equals_model_maths_in_fp32(bias, rope):
    """Folding hidden_norm into the stacked K/V weight, the layer order and the RoPE halves are
    exact algebra: in fp32 the two paths agree to rounding noise."""
    model = make_model(bias=bias, rope=rope)
    assert (rope is None) == (model.rotary_emb.attention_scaling == 1.0)
    x, positions, slots = make_inputs(model, 37, 64)
    ref = run_inject(reference.inject_context_kv, model, x, positions, slots, 64)
    fused = run_inject(run_fused_reference, model, x, positions, slots, 64)
    torch.testing.assert_close(fused.k, ref.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.v, ref.v, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert fused.k[:, untouched].eq(0).all() and fused.v[:, untouched].eq(0).all()


def test_fused_maths_detects_a_wrong_fold():
    """The comparison above can fail: drop hidden_norm's weight from the fold and it does."""
    model = make_model()
    x, positions, slots = make_inputs(model, 16, 32)
    ref = run_inject(reference.inject_context_kv, model, x, positions, slots, 32)
    w = reference.fuse_weights(model)
    hidden_w = model.hidden_norm.weight
    unfolded = dict(vars(w), kv_weight=w.kv_weight / hidden_w[None, :])
    store = make_store(model, 32)
    reference.fused_inject_reference(
        x, positions, slots, *reference.FusedKVWeights(**unfolded).op_args(), store.k, store.v
    )
    assert not torch.allclose(store.v, ref.v, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fused_maths_is_as_accurate_as_the_reference(dtype, bias):
    """In low precision the fused maths (fp32 epilogue, one rounding) is no less accurate than
    the module-by-module reference, and within the stated tolerance of it."""
    model32 = make_model(bias=bias)
    model = copy.deepcopy(model32).to(dtype)
    oracle_model = copy.deepcopy(model).float()  # the same rounded weights, in fp32
    x, positions, slots = make_inputs(model, 200, 256)
    oracle = run_inject(reference.inject_context_kv, oracle_model, x.float(), positions, slots, 256)
    ref = run_inject(reference.inject_context_kv, model, x, positions, slots, 256)
    fused = run_inject(run_fused_reference, model, x, positions, slots, 256)
    for name in ("k", "v"):
        want, got_ref, got = (getattr(s, name)[:, slots].float() for s in (oracle, ref, fused))
        assert rms(got - want) <= 1.1 * rms(got_ref - want), name
        assert float((got - want).abs().max()) <= 2.5 * float((got_ref - want).abs().max()), name
        assert_close_to_reference(got, got_ref, dtype)


def test_fuse_weights_layout():
    model = make_model(bias=True)
    c = model.config
    w = reference.fuse_weights(model)
    kv = c.num_key_value_heads * c.head_dim
    assert w.fc_weight.data_ptr() == model.fc.weight.data_ptr()  # no copy of the big GEMM weight
    assert w.kv_weight.shape == (c.num_hidden_layers * 2 * kv, c.hidden_size)
    layer1_v = model.layers[1].self_attn.v_proj.weight * model.hidden_norm.weight[None, :]
    torch.testing.assert_close(w.kv_weight[3 * kv : 4 * kv], layer1_v)
    torch.testing.assert_close(w.kv_bias[2 * kv : 3 * kv], model.layers[1].self_attn.k_proj.bias)
    assert w.k_norm_weight.shape == (c.num_hidden_layers, c.head_dim)
    assert w.inv_freq.dtype == torch.float32 and w.inv_freq.shape == (c.head_dim // 2,)


def test_fused_weights_are_prepared_once_per_model():
    model = make_model()
    first = _cuda.fused_weights(model)
    assert _cuda.fused_weights(model) is first
    assert _cuda.fused_weights(make_model()) is not first
    ops.forget(model)  # after an in-place weight change
    assert _cuda.fused_weights(model) is not first


def test_fuse_weights_refuses_mixed_k_norm_eps():
    model = make_model()
    model.layers[1].self_attn.k_norm.eps = 1e-5
    assert "k_norm eps" in reference.fusion_unsupported_reason(model)
    with pytest.raises(ValueError, match="k_norm eps"):
        reference.fuse_weights(model)


# ----------------------------------------------------- registration, fake, opcheck (CPU)


def test_extension_is_built_when_the_build_requires_it():
    """CI builds with SGLANG_DFLASH_BUILD_CUDA=1: then the extension must load here."""
    if os.environ.get("SGLANG_DFLASH_BUILD_CUDA") != "1":
        pytest.skip("SGLANG_DFLASH_BUILD_CUDA is not 1")
    assert _cuda.load_error() is None


def test_op_schema_declares_the_mutated_caches():
    requires_extension()
    schema = _cuda.op()._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["k_cache", "v_cache"]
    assert len(schema.returns) == 0
    assert torch._C._dispatch_has_kernel_for_dispatch_key("sglang_dflash::inject_context_kv", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("sglang_dflash::inject_context_kv", "CPU")


def op_samples(device: str, dtype=torch.float32):
    """(args, description) for opcheck: bias or not, int32/int64 indices, strided rows."""
    samples = []
    for bias, index_dtype, strided in [(False, torch.int64, False), (True, torch.int32, True)]:
        model = make_model(bias=bias, device=device).to(dtype)
        x, positions, slots = make_inputs(model, 9, 24, device=device)
        if strided:
            x = torch.cat([x, x], dim=1)[:, : x.shape[1]]  # rows with stride 2*K*H
        store = make_store(model, 24, device=device)
        w = reference.fuse_weights(model)
        args = (x, positions.to(index_dtype), slots.to(index_dtype), *w.op_args(), store.k, store.v)
        samples.append(args)
    return samples


def test_opcheck_on_cpu():
    """Schema, fake (meta) implementation and autograd registration, through the CPU kernel."""
    requires_extension()
    for args in op_samples("cpu"):
        torch.library.opcheck(_cuda.op(), args)


def test_cpu_kernel_through_the_dispatcher_matches_the_model():
    requires_extension()
    model = make_model(bias=True)
    x, positions, slots = make_inputs(model, 21, 40)
    ref = run_inject(reference.inject_context_kv, model, x, positions, slots, 40)
    store = make_store(model, 40)
    _cuda.op()(x, positions, slots, *reference.fuse_weights(model).op_args(), store.k, store.v)
    assert_close_to_reference(store.k, ref.k, torch.float32)
    assert_close_to_reference(store.v, ref.v, torch.float32)


def test_fake_implementation_checks_shapes():
    requires_extension()
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = make_model()
    x, positions, slots = make_inputs(model, 5, 16)
    store = make_store(model, 16)
    w = reference.fuse_weights(model)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in (x, positions, slots, store.k, store.v)]
        _cuda.op()(*fake[:3], *w.op_args(), *fake[3:])  # well-formed: no error
        with pytest.raises(RuntimeError, match="slots shape"):
            _cuda.op()(fake[0], fake[1], fake[2][:4], *w.op_args(), *fake[3:])


# ------------------------------------------------------------------------ the selector


def test_selector_picks_the_fused_maths_in_pytorch_on_cpu_and_says_why(caplog):
    model = make_model(bias=True)
    store = make_store(model, 40)
    with caplog.at_level(logging.INFO, logger="sglang_dflash.ops"):
        assert ops.choose_inject_context_kv(model, store) == "fused-torch"
    assert "the fused op's maths in PyTorch (the draft KV store is on cpu" in caplog.text
    x, positions, slots = make_inputs(model, 9, 40)
    slots[:2] = 0  # rows to drop go to the sink slot
    ops.inject_context_kv(model, store, x, positions, slots)
    ref = run_inject(reference.inject_context_kv, model, x, positions, slots, 40)
    assert_close_to_reference(store.k[:, 1:], ref.k[:, 1:], torch.float32)
    assert_close_to_reference(store.v[:, 1:], ref.v[:, 1:], torch.float32)
    assert (store.k[:, slots[2:]] != 0).all()


def test_selector_picks_the_module_reference_when_the_draft_cannot_be_fused(caplog):
    model = make_model()
    model.layers[1].self_attn.k_norm.eps = 1e-5  # differs from layer 0's: not one fused epilogue
    with caplog.at_level(logging.INFO, logger="sglang_dflash.ops"):
        assert ops.choose_inject_context_kv(model, make_store(model, 16)) == "reference"
    assert "PyTorch reference (the draft KV store is on cpu)" in caplog.text


def test_selector_decides_once_per_model(monkeypatch):
    calls = []

    def counting(model, store):
        calls.append(model)
        return "test reason"

    monkeypatch.setattr(_cuda, "unsupported_reason", counting)
    model = make_model()
    store = make_store(model, 32)
    x, positions, slots = make_inputs(model, 4, 32)
    for _ in range(3):
        ops.inject_context_kv(model, store, x, positions, slots)
    assert calls == [model]
    ops.inject_context_kv(make_model(seed=3), store, x, positions, slots)
    assert len(calls) == 2


def test_selector_never_falls_back_at_run_time(monkeypatch):
    """Once the fused op is chosen, its errors propagate; the reference is not tried."""
    monkeypatch.setattr(_cuda, "unsupported_reason", lambda model, store: None)

    def failing(*args):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(_cuda, "inject_context_kv", failing)
    monkeypatch.setattr(reference, "inject_context_kv", lambda *a: pytest.fail("fell back to the reference"))
    model = make_model()
    store = make_store(model, 32)
    x, positions, slots = make_inputs(model, 4, 32)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="kernel failed"):
            ops.inject_context_kv(model, store, x, positions, slots)


def test_selector_env_overrides(monkeypatch, caplog):
    model = make_model()
    store = make_store(model, 16)
    monkeypatch.setenv(ops.ENV, "cuda")
    with pytest.raises(RuntimeError, match="SGLANG_DFLASH_OPS=cuda, but .* on cpu"):
        ops.choose_inject_context_kv(model, store)
    monkeypatch.setenv(ops.ENV, "fast")
    with pytest.raises(ValueError, match="SGLANG_DFLASH_OPS='fast' is not one of auto, reference, cuda"):
        ops.choose_inject_context_kv(model, store)
    monkeypatch.setenv(ops.ENV, "reference")
    with caplog.at_level(logging.INFO, logger="sglang_dflash.ops"):
        assert ops.choose_inject_context_kv(model, store) == "reference"
    assert "SGLANG_DFLASH_OPS=reference" in caplog.text


def test_unsupported_reasons():
    model = make_model()
    cpu_store = make_store(model, 8)
    assert _cuda.unsupported_reason(model, cpu_store) == "the draft KV store is on cpu"
    assert (
        _cuda.unsupported_reason(model, make_store(model, 8, device="meta"))
        == "the draft KV store is on meta"
    )


def test_missing_extension_message_says_how_to_build(monkeypatch):
    monkeypatch.setattr(_cuda, "load_error", lambda: "sglang_dflash._C is not built (x); " + _cuda.BUILD_HINT)
    with pytest.raises(RuntimeError, match="--no-build-isolation"):
        _cuda.op()


# ------------------------------------------------------------------------- CUDA (GPU)

gpu = pytest.mark.gpu
TOKENS = [1, 7, 64, 513, 4096]


def cuda_case(shape: str, dtype: torch.dtype, num_tokens: int, *, bias: bool = False, sink_every: int = 0):
    model = make_model(shape, bias=bias, device="cuda").to(dtype)
    num_slots = num_tokens + 64
    x, positions, slots = make_inputs(model, num_tokens, num_slots, device="cuda")
    if sink_every:
        slots[::sink_every] = 0
    return model, x, positions, slots, num_slots


def assert_kernel_matches(model, x, positions, slots, num_slots, dtype):
    """The CUDA op vs (a) its maths on the same GPU, tightly, and (b) the model reference with
    the stated tolerance; slots not named stay untouched; slot 0 (the sink) is not compared."""
    sentinel = 7.0
    store = make_store(model, num_slots, device="cuda")
    store.k.fill_(sentinel)
    store.v.fill_(sentinel)
    _cuda.inject_context_kv(model, store, x, positions, slots)
    tight = make_store(model, num_slots, device="cuda")
    tight.k.fill_(sentinel)
    tight.v.fill_(sentinel)
    run_fused_reference(model, tight, x, positions, slots)
    ref = run_inject(reference.inject_context_kv, model, x, positions, slots, num_slots)
    written = torch.zeros(num_slots, dtype=torch.bool, device="cuda")
    written[slots] = True
    written[0] = False
    for name in ("k", "v"):
        got = getattr(store, name)
        torch.testing.assert_close(got[:, written], getattr(tight, name)[:, written], **KERNEL_TOL[dtype])
        assert_close_to_reference(got[:, written], getattr(ref, name)[:, written], dtype)
        untouched = ~written
        untouched[0] = False
        assert got[:, untouched].eq(sentinel).all(), f"{name}: wrote outside the named slots"


@gpu
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_op_matches_references_bf16(shape, num_tokens):
    requires_extension()
    assert_kernel_matches(*cuda_case(shape, torch.bfloat16, num_tokens), torch.bfloat16)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 513])
def test_cuda_op_matches_references_other_dtypes(dtype, num_tokens):
    requires_extension()
    assert_kernel_matches(*cuda_case("small", dtype, num_tokens), dtype)


@gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_op_with_bias_and_sink_rows(shape):
    requires_extension()
    assert_kernel_matches(*cuda_case(shape, torch.bfloat16, 200, bias=True, sink_every=3), torch.bfloat16)


@gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_op_non_contiguous_inputs(shape):
    """Rows of a wider buffer, every other row, strided positions/slots, int32 indices."""
    requires_extension()
    model, x, positions, slots, num_slots = cuda_case(shape, torch.bfloat16, 130)
    wide = torch.cat([x, torch.randn_like(x)], dim=1)[:, : x.shape[1]]
    assert wide.stride(0) == 2 * x.shape[1]
    assert_kernel_matches(model, wide, positions, slots, num_slots, torch.bfloat16)
    every_other = torch.stack([x, x], dim=1).flatten(0, 1)[::2]
    # Cast first, then take every other element: `.to()` of a strided view returns a contiguous copy.
    strided_pos = torch.stack([positions, positions], dim=1).flatten().to(torch.int32)[::2]
    strided_slots = torch.stack([slots, slots], dim=1).flatten().to(torch.int32)[::2]
    assert strided_pos.stride(0) == 2 and strided_slots.stride(0) == 2
    assert_kernel_matches(model, every_other, strided_pos, strided_slots, num_slots, torch.bfloat16)


@gpu
def test_cuda_op_zero_tokens_is_a_no_op():
    requires_extension()
    model, x, positions, slots, num_slots = cuda_case("small", torch.bfloat16, 0)
    store = make_store(model, num_slots, device="cuda")
    _cuda.inject_context_kv(model, store, x, positions, slots)
    assert store.k.eq(0).all() and store.v.eq(0).all()


@gpu
def test_cuda_op_validates_inputs():
    requires_extension()
    model, x, positions, slots, num_slots = cuda_case("small", torch.bfloat16, 8)
    store = make_store(model, num_slots, device="cuda")
    w = reference.fuse_weights(model)
    op = _cuda.op()
    with pytest.raises(RuntimeError, match="slots must be int32 or int64"):
        op(x, positions, slots.float(), *w.op_args(), store.k, store.v)
    with pytest.raises(RuntimeError, match="target_features must have dtype"):
        op(x.float(), positions, slots, *w.op_args(), store.k, store.v)
    with pytest.raises(RuntimeError, match="k_cache must be contiguous"):
        op(x, positions, slots, *w.op_args(), store.k.transpose(2, 3), store.v.transpose(2, 3))
    with pytest.raises(RuntimeError, match="positions must have shape"):
        op(x, positions[:3], slots, *w.op_args(), store.k, store.v)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        op(x, positions.cpu(), slots, *w.op_args(), store.k, store.v)


@gpu
def test_opcheck_on_cuda():
    requires_extension()
    for args in op_samples("cuda", torch.bfloat16):
        torch.library.opcheck(_cuda.op(), args)


@gpu
def test_cuda_graph_capture_and_replay():
    requires_extension()
    model, x, positions, slots, num_slots = cuda_case("small", torch.bfloat16, 64)
    store = make_store(model, num_slots, device="cuda")
    static = [t.clone() for t in (x, positions, slots)]
    _cuda.inject_context_kv(model, store, *static)  # warm up: cuBLAS handles, weights cache
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _cuda.inject_context_kv(model, store, *static)
    _, x2, positions2, slots2, _ = cuda_case("small", torch.bfloat16, 64)
    for buf, new in zip(static, (x2, positions2, slots2)):
        buf.copy_(new)
    store.k.zero_()
    store.v.zero_()
    graph.replay()
    eager = make_store(model, num_slots, device="cuda")
    _cuda.inject_context_kv(model, eager, x2, positions2, slots2)
    torch.testing.assert_close(store.k, eager.k, **KERNEL_TOL[torch.bfloat16])
    torch.testing.assert_close(store.v, eager.v, **KERNEL_TOL[torch.bfloat16])


@gpu
def test_selector_picks_the_cuda_op_on_gpu(caplog):
    requires_extension()
    model = make_model(device="cuda").to(torch.bfloat16)
    store = make_store(model, 16, device="cuda")
    with caplog.at_level(logging.INFO, logger="sglang_dflash.ops"):
        assert ops.choose_inject_context_kv(model, store) == "cuda"
    assert "fused CUDA op" in caplog.text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

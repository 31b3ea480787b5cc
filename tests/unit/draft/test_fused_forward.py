"""The fused draft forward (`draft/fused_forward.py`) against the module's own maths.

CPU: the fused data flow (stacked projections, the residual carried through add + norm, the RoPE
cache, strided q/k/v views) with `TorchKernels`, the kernels' contract in PyTorch, against
`DFlashDraftModel.forward` in fp32. GPU: FlashInfer's kernels against that contract one by one,
and the whole fused forward in bf16 against the module forward, within the module's own bf16
error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_dflash.draft import fused_forward
from sglang_dflash.draft.attention import SdpaDraftAttention
from sglang_dflash.draft.fused_forward import FusedDraftForward, TorchKernels, rope_cache
from sglang_dflash.draft.kv_store import DraftKVStore
from tests.support.draft_models import make_model

BLOCK = 16
MAX_POSITIONS = 41000


def make_step(model, context_lens, *, seed=0, device="cpu", dtype=torch.float32):
    """A random store and request pool, an SDPA attention bound over them, block embeddings and
    positions: (attend, embeds [bs*Bd, H], positions [bs*Bd])."""
    g = torch.Generator().manual_seed(seed)
    config = model.config
    num_slots = sum(context_lens) + 8
    store = DraftKVStore(
        num_slots=num_slots,
        num_layers=config.num_hidden_layers,
        num_kv_heads=model.layers[0].self_attn.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
        device=device,
    )
    store.k.copy_(torch.randn(store.k.shape, generator=g))
    store.v.copy_(torch.randn(store.v.shape, generator=g))
    bs, width = len(context_lens), max(context_lens)
    slots = (torch.randperm(num_slots - 1, generator=g) + 1)[: bs * width]
    req_to_token = torch.zeros(bs, width, dtype=torch.int64)
    req_to_token.view(-1)[: slots.numel()] = slots
    lens = torch.tensor(context_lens)
    attend = SdpaDraftAttention(config, store).bind(
        req_to_token.to(device), torch.arange(bs, device=device), lens.to(device), lens, BLOCK
    )
    embeds = torch.randn(bs * BLOCK, config.hidden_size, generator=g).to(device, dtype)
    # Late positions too: the RoPE cache is read far from its start.
    starts = lens + torch.tensor([0, 37000, 11, 5][:bs])
    positions = (starts[:, None] + torch.arange(BLOCK)).reshape(-1).to(device)
    return attend, embeds, positions


def with_embed_scale(model, scale: float):
    model.config = dataclasses.replace(model.config, input_embedding_scale=scale)
    return model


# ----------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "qkv-bias"])
@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0}], ids=["rope", "linear-rope"])
@pytest.mark.parametrize("embed_scale", [1.0, 0.5])
def test_fused_data_flow_equals_the_module_in_fp32(bias, rope, embed_scale):
    model = with_embed_scale(make_model("small", bias=bias, rope=rope), embed_scale)
    attend, embeds, positions = make_step(model, [3, 40, 1, 17])
    want = model(embeds, positions, attend)
    fused = FusedDraftForward(model, MAX_POSITIONS, kernels=TorchKernels())
    got = fused(embeds.clone(), positions, attend)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    # The module still computes the same on its re-pointed (stacked) weights.
    torch.testing.assert_close(model(embeds, positions, attend), want, rtol=0, atol=0)


class NoRope(TorchKernels):
    def rope(self, positions, q, k, cos_sin):
        pass


class NoResidual(TorchKernels):
    def fused_add_rmsnorm(self, x, residual, weight, eps):
        residual.copy_(x)  # drops the carried residual
        x.copy_(self.rmsnorm(residual, weight, eps))


@pytest.mark.parametrize("broken", [NoRope, NoResidual])
def test_the_comparison_catches_a_broken_kernel(broken):
    model = make_model("small")
    attend, embeds, positions = make_step(model, [3, 40])
    want = model(embeds, positions, attend)
    got = FusedDraftForward(model, MAX_POSITIONS, kernels=broken())(embeds.clone(), positions, attend)
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_stacking_re_points_the_modules_without_copies():
    model = make_model("small", bias=True)
    fused = FusedDraftForward(model, 64, kernels=TorchKernels())
    for layer, stacked in zip(model.layers, fused.stacked):
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        base = stacked.qkv_weight.data_ptr()
        step = stacked.qkv_weight.element_size() * stacked.qkv_weight.shape[1]
        assert attn.q_proj.weight.data_ptr() == base
        assert attn.k_proj.weight.data_ptr() == base + q * step
        assert attn.v_proj.weight.data_ptr() == base + (q + kv) * step
        assert attn.v_proj.bias.data_ptr() == stacked.qkv_bias.data_ptr() + (q + kv) * 4
        assert mlp.up_proj.weight.data_ptr() == stacked.gate_up_weight.data_ptr() + (
            mlp.gate_proj.weight.shape[0] * step
        )


@pytest.mark.parametrize(
    "rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}]
)
def test_rope_cache_rows_are_the_modules_cos_sin(rope):
    model = make_model("small", rope=rope)
    cache = rope_cache(model, 41000, "cpu")
    positions = torch.tensor([0, 1, 7, 4095, 40999])
    cos, sin = model.rotary_emb.cos_sin(positions, torch.float32)  # [N, d]: two equal halves
    half = cache.shape[1] // 2
    torch.testing.assert_close(cache[positions, :half], cos[:, :half], rtol=0, atol=0)
    torch.testing.assert_close(cache[positions, half:], sin[:, :half], rtol=0, atol=0)


def test_torch_kernels_rope_is_the_modules_rotation():
    model = make_model("small")
    cache = rope_cache(model, 100, "cpu")
    positions = torch.tensor([3, 50, 99])
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    cos, sin = model.rotary_emb.cos_sin(positions, torch.float32)
    want_q, want_k = (model.rotary_emb.apply(x, cos, sin) for x in (q, k))
    TorchKernels().rope(positions, q, k, cache)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)


@pytest.mark.parametrize("cuda_jit", [True, False])
def test_the_start_up_line_names_the_norm_path(monkeypatch, cuda_jit):
    """FlashInfer serves RMSNorm from its CuTe-DSL kernels where nvidia-cutlass-dsl targets the
    GPU, else from its CUDA JIT ones: the `draft_forward=` line says which ran."""
    import flashinfer.norm

    monkeypatch.setattr(flashinfer.norm, "_use_cuda_norm", lambda device: cuda_jit)
    described = fused_forward.FlashInferKernels().describe(torch.device("cuda"))
    assert described == f"FlashInfer norm ({'CUDA JIT' if cuda_jit else 'CuTe DSL'}), RoPE and SiLU kernels"


def test_unavailable_off_cuda_and_in_fp32():
    model = make_model("small")
    assert fused_forward.unavailable_reason(model, torch.device("cpu")) == "the draft runs on cpu"
    reason = fused_forward.unavailable_reason(model, torch.device("cuda"))
    assert reason is not None and "fp16 or bf16, the draft is torch.float32" in reason


# ----------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
BF16 = dict(rtol=2e-2, atol=2e-2)


@gpu
def test_flashinfer_kernels_keep_the_contract():
    torch.manual_seed(0)
    fi, ref = fused_forward.FlashInferKernels(), TorchKernels()
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(37, 1024, device=dev, dtype=dt)
    w = (1 + 0.3 * torch.randn(1024, device=dev)).to(dt)
    torch.testing.assert_close(fi.rmsnorm(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6), **BF16)
    # Per-head norms over strided views of a q/k/v GEMM output.
    qkv = torch.randn(37, (8 + 2 + 2) * 128, device=dev, dtype=dt)
    q, k, _ = qkv.split([8 * 128, 256, 256], dim=-1)
    hw = (1 + 0.3 * torch.randn(128, device=dev)).to(dt)
    for view, heads in ((q, 8), (k, 2)):
        torch.testing.assert_close(
            fi.rmsnorm(view.view(37, heads, 128), hw, 1e-6),
            ref.rmsnorm(view.view(37, heads, 128), hw, 1e-6),
            **BF16,
        )
    residual = torch.randn_like(x)
    x1, r1, x2, r2 = x.clone(), residual.clone(), x.clone(), residual.clone()
    fi.fused_add_rmsnorm(x1, r1, w, 1e-6)
    ref.fused_add_rmsnorm(x2, r2, w, 1e-6)
    torch.testing.assert_close(r1, r2, rtol=0, atol=0)
    torch.testing.assert_close(x1, x2, **BF16)
    gate_up = torch.randn(37, 2 * 3072, device=dev, dtype=dt)
    torch.testing.assert_close(fi.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **BF16)
    cache = rope_cache(make_model("small", device=dev), 41000, dev)
    positions = torch.randint(0, 41000, (37,), device=dev)
    qh, kh = torch.randn(37, 4, 64, device=dev, dtype=dt), torch.randn(37, 2, 64, device=dev, dtype=dt)
    q1, k1, q2, k2 = qh.clone(), kh.clone(), qh.clone(), kh.clone()
    fi.rope(positions, q1, k1, cache)
    ref.rope(positions, q2, k2, cache)
    torch.testing.assert_close(q1, q2, **BF16)
    torch.testing.assert_close(k1, k2, **BF16)


@gpu
@pytest.mark.parametrize("shape", ["small", "qwen3-8b"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "qkv-bias"])
def test_fused_forward_in_bf16_is_as_close_to_fp32_as_the_module(shape, bias):
    """Error of the fused bf16 forward against the module in fp32 is within twice the module's
    own bf16 error (plus a small floor)."""
    fp32 = make_model(shape, bias=bias, device="cuda")
    bf16 = make_model(shape, bias=bias, device="cuda").to(torch.bfloat16)
    lens = [1, 300, 2000, 64]
    attend32, embeds, positions = make_step(fp32, lens, device="cuda")
    attend16, embeds16, _ = make_step(bf16, lens, device="cuda", dtype=torch.bfloat16)
    want = fp32(embeds, positions, attend32)
    module = bf16(embeds16, positions, attend16)
    fused = FusedDraftForward(bf16, MAX_POSITIONS)(embeds16.clone(), positions, attend16)
    err = (fused.float() - want).abs().max()
    base = (module.float() - want).abs().max()
    assert err <= max(2 * base, 5e-2), (float(err), float(base))

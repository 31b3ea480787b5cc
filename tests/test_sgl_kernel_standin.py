"""The GPU serving kit's labelled stand-in for sgl_kernel and its import-time adjustments
(scripts/gpu/serve/standin/). On CPU: it is used only when asked, never where a real sgl_kernel
would load, and it offers every name SGLang's dense CUDA path imports, refusing the rest. On a
GPU: each kernel it provides against a PyTorch reference."""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import sys

import pytest
import torch

from tests import gpu_machine

# The modules whose sgl_kernel imports run at import on SGLang's dense CUDA serving path.
IMPORTERS = (
    "srt/layers/layernorm.py",
    "srt/layers/activation.py",
    "srt/layers/sampler.py",
    "srt/layers/quantization/w8a8_int8.py",
    "srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py",
    "srt/layers/quantization/gguf.py",
    "srt/layers/moe/moe_runner/triton_utils/fused_moe.py",
    "srt/mem_cache/memory_pool_host.py",
    "srt/mem_cache/hisparse_memory_pool.py",
    "srt/mem_cache/pool_host/mha.py",
    "srt/mem_cache/pool_host/mla.py",
    "srt/mem_cache/pool_host/mamba.py",
    "srt/mem_cache/pool_host/unified.py",
    "srt/layers/attention/triton_backend.py",
    "srt/model_executor/runner_backend_utils/weak_ref_tensor.py",
)


def cuda_imports(source: str) -> set[tuple[str, str]]:
    """(module, name) of each `from sgl_kernel... import name` that runs at import under an `if`
    naming CUDA (e.g. `if _is_cuda:`), not inside a function or a try."""
    found = set()

    def visit(nodes, under_cuda: bool):
        for node in nodes:
            if isinstance(node, ast.If):
                cuda = under_cuda or "cuda" in ast.unparse(node.test).lower()
                visit(node.body, cuda)
                visit(node.orelse, under_cuda)
            elif (
                isinstance(node, ast.ImportFrom)
                and under_cuda
                and (node.module or "").startswith("sgl_kernel")
            ):
                found.update((node.module, alias.name) for alias in node.names)

    visit(ast.parse(source).body, False)
    return found


@pytest.fixture(scope="module")
def view(tmp_path_factory):
    return gpu_machine.python(tmp_path_factory.mktemp("gpu-machine"))


def test_it_is_not_used_unless_asked(view):
    result = gpu_machine.run(view, "import sgl_kernel", kit=False)
    assert result.returncode != 0 and "SGLANG_DFLASH_SGL_KERNEL_STANDIN=1" in result.stderr


def test_it_refuses_where_a_real_sgl_kernel_would_load(view, tmp_path):
    real = tmp_path / "elsewhere" / "sgl_kernel"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("")
    result = gpu_machine.run(view, "import sgl_kernel", extra_path=[tmp_path / "elsewhere"])
    assert result.returncode != 0 and "a real sgl_kernel is installed" in result.stderr
    assert str(real) in result.stderr


def test_it_offers_every_name_sglangs_cuda_path_imports_and_refuses_the_rest(view):
    sglang = pathlib.Path(pytest.importorskip("sglang").__file__).parent
    wanted = set()
    for relative in IMPORTERS:
        wanted |= cuda_imports((sglang / relative).read_text())
    assert ("sgl_kernel", "rmsnorm") in wanted and ("sgl_kernel.kvcacheio", "transfer_kv_direct") in wanted
    code = "import importlib, sgl_kernel\n"
    code += "".join(f"getattr(importlib.import_module({m!r}), {n!r})\n" for m, n in sorted(wanted))
    # Absent, so that SGLang's guarded imports fall back (NCCL all-reduce, mock scalar types).
    absent = ["import sgl_kernel.allreduce", "import sgl_kernel.scalar_type", "import sgl_kernel.flash_attn"]
    for statement in absent + ["from sgl_kernel import fp8_scaled_mm"]:
        code += f"try:\n    {statement}\nexcept ImportError:\n    pass\n"
        code += f"else:\n    raise SystemExit({statement!r})\n"
    result = gpu_machine.run(view, code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sglang-dflash's FlashInfer stand-in, not sgl-kernel" in result.stderr  # labelled


def test_a_name_imported_but_not_provided_raises_naming_itself_when_called(view):
    code = "from sgl_kernel.kvcacheio import transfer_kv_direct\ntransfer_kv_direct(1, 2)\n"
    result = gpu_machine.run(view, code)
    assert "NotImplementedError: sgl_kernel.kvcacheio.transfer_kv_direct is not provided" in result.stderr


def test_the_kit_stands_in_for_the_dual_gemm(view):
    code = "from sglang.kernels.ops.gemm import cutedsl_dual_gemm as m\n"
    code += "assert m.can_use_dual_gemm(1, 4096, 12288, m.DualGemmQuantMode.UNQUANT) is False\n"
    result = gpu_machine.run(view, code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no dual GEMM" in result.stderr
    # Without the kit's switch, SGLang's module needs the CuTe DSL, which the kit does not carry.
    result = gpu_machine.run(view, "import sglang.kernels.ops.gemm.cutedsl_dual_gemm", kit=False)
    assert "No module named 'cuda" in result.stderr or "No module named 'cutlass'" in result.stderr


def test_the_kits_ragged_prefill_wrapper_asks_flashinfer_for_fa2():
    """SGLang imports FlashInfer's wrappers on CUDA only, so the class is checked directly here."""
    sys.path.insert(0, str(gpu_machine.STANDIN))
    try:
        kit = importlib.import_module("sitecustomize")
    finally:
        sys.path.remove(str(gpu_machine.STANDIN))
    assert kit.__file__.startswith(str(gpu_machine.STANDIN))

    class BatchPrefillWithRaggedKVCacheWrapper:  # FlashInfer's signature; its __init__ needs a GPU
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, backend="auto"):
            self._backend = backend

    wrapper_cls = kit.ragged_fa2(BatchPrefillWithRaggedKVCacheWrapper)
    assert wrapper_cls(None, "NHD", backend="auto")._backend == "fa2"
    assert wrapper_cls(None, "NHD")._backend == "fa2"
    assert wrapper_cls(None, "NHD", backend="fa3")._backend == "fa3"  # an explicit choice stays
    assert wrapper_cls.__name__ == "BatchPrefillWithRaggedKVCacheWrapper"


# ---- on a GPU: the kernels against PyTorch ----------------------------------------------


@pytest.fixture(scope="module")
def standin():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    os.environ["SGLANG_DFLASH_SGL_KERNEL_STANDIN"] = "1"
    sys.path.insert(0, str(gpu_machine.STANDIN))
    try:
        return importlib.import_module("sgl_kernel")
    finally:
        sys.path.remove(str(gpu_machine.STANDIN))


def _rmsnorm(x, w, eps, gemma=False):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (w.float() + gemma)).to(x.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma"])
def test_norms_match_pytorch(standin, gemma):
    torch.manual_seed(0)
    x, r = torch.randn(2, 7, 4096, device="cuda", dtype=torch.bfloat16).unbind(0)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    norm = standin.gemma_rmsnorm if gemma else standin.rmsnorm
    add = standin.gemma_fused_add_rmsnorm if gemma else standin.fused_add_rmsnorm
    torch.testing.assert_close(norm(x, w, 1e-6), _rmsnorm(x, w, 1e-6, gemma), atol=2e-2, rtol=2e-2)
    x2, r2 = x.clone(), r.clone()
    add(x2, r2, w, 1e-6)  # in place: residual += x, x = norm(residual)
    torch.testing.assert_close(r2, x + r, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(x2, _rmsnorm(x + r, w, 1e-6, gemma), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_activations_renorms_and_merge_match_pytorch(standin):
    torch.manual_seed(0)
    x = torch.randn(5, 2 * 1000, device="cuda", dtype=torch.bfloat16)
    gate, up = x.float().chunk(2, -1)
    act = torch.nn.functional
    pairs = [
        (standin.silu_and_mul(x), act.silu(gate) * up),
        (standin.gelu_and_mul(x), act.gelu(gate) * up),
        (standin.gelu_tanh_and_mul(x), act.gelu(gate, approximate="tanh") * up),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    probs = torch.softmax(torch.randn(4, 300, device="cuda"), -1)
    top = torch.topk(probs, 5, -1)
    want = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
    torch.testing.assert_close(standin.top_k_renorm_prob(probs, 5), want / want.sum(-1, keepdim=True))
    # Two attention partials over disjoint keys merge into the softmax over all of them.
    v_a, v_b = torch.randn(2, 3, 4, 64, device="cuda", dtype=torch.float16).unbind(0)
    s_a, s_b = torch.randn(2, 3, 4, device="cuda").unbind(0)
    v, s = standin.merge_state_v2(v_a, s_a, v_b, s_b)
    # sgl-kernel's log-sum-exps are natural logs (FlashInfer's are base 2).
    w_a = torch.sigmoid(s_a - s_b)[..., None]
    torch.testing.assert_close(v.float(), (w_a * v_a.float() + (1 - w_a) * v_b.float()), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(s, torch.logaddexp(s_a, s_b))


@pytest.mark.gpu
def test_weak_ref_tensor_aliases_without_owning(standin):
    t = torch.arange(12, device="cuda", dtype=torch.float32).view(3, 4)[:, 1:]
    weak = standin.weak_ref_tensor(t)
    assert weak.data_ptr() == t.data_ptr() and weak.shape == t.shape and weak.stride() == t.stride()
    # A storage of its own starting at the view's first element (from_blob), not t's storage.
    assert weak.untyped_storage().data_ptr() == t.data_ptr() != t.untyped_storage().data_ptr()
    t.add_(1)
    torch.testing.assert_close(weak, t)
    assert standin.weak_ref_tensor(3) == 3

"""The GPU serving kit's labelled stand-in for sgl_kernel and its import-time adjustments
(tests/gpu_kit/serve/standin/). On CPU: it is used only when asked, never where a real sgl_kernel
would load, and it offers every name SGLang's dense CUDA path imports, refusing the rest. On a
GPU: each kernel it provides against a PyTorch reference."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pathlib
import re
import sys

import pytest
import torch

from tests.support import gpu_machine

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


def registry_targets(sglang: pathlib.Path) -> set[str]:
    """The sgl_kernel names SGLang's kernel registry loads on CUDA (`KernelSpec(target=
    "sgl_kernel:<name>")`, those not limited to HIP)."""
    names = set()
    for path in (sglang / "kernels").rglob("*.py"):
        for spec in path.read_text().split("KernelSpec(")[1:]:
            spec = spec.split("\n)")[0]
            found = re.search(r'target="sgl_kernel:(\w+)"', spec)
            if found and "capabilities=_HIP" not in spec:
                names.add(found.group(1))
    return names


def test_it_offers_every_name_sglangs_kernel_registry_loads_on_cuda(view):
    """The registry resolves "sgl_kernel:<name>" with getattr at the first call, which the
    import-time check above does not see."""
    sglang = pathlib.Path(pytest.importorskip("sglang").__file__).parent
    names = registry_targets(sglang)
    assert "moe_align_block_size" in names
    code = "import sgl_kernel\n" + "".join(f"sgl_kernel.{name}\n" for name in sorted(names))
    result = gpu_machine.run(view, code)
    assert result.returncode == 0, result.stderr[-2000:]


def _load_standin_module(name: str):
    """One module of the stand-in's package, loaded from its file (no opt-in, no sgl_kernel)."""
    path = gpu_machine.STANDIN / "sgl_kernel" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"standin_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_moe():
    return _load_standin_module("moe")


def _align_by_loop(topk_ids: list[int], buckets: int, block: int):
    """sgl-kernel's moe_align_block_size by its definition (+1 offset, ascending in a bucket)."""
    n = len(topk_ids)
    sorted_ids, experts = [], []
    for b in range(buckets):
        mine = [i for i, e in enumerate(topk_ids) if e + 1 == b]
        padded = -(-len(mine) // block) * block
        sorted_ids += mine + [n] * (padded - len(mine))
        experts += [b - 1] * (padded // block)
    return sorted_ids, experts


@pytest.mark.parametrize(
    "tokens, top_k, experts, block", [(2, 2, 2, 2), (37, 8, 16, 16), (5, 4, 64, 64), (300, 2, 8, 32)]
)
def test_moe_align_block_size_matches_its_definition(tokens, top_k, experts, block):
    """On CPU tensors, buffers sized as SGLang sizes them, ids -1 (filtered by expert
    parallelism) among them; the docstring's example first."""
    moe = _load_moe()
    gen = torch.Generator().manual_seed(tokens)
    if tokens == 2:
        topk = torch.tensor([[1, 0], [1, -1]], dtype=torch.int32)
    else:
        topk = torch.randint(-1, experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    buckets, numel = experts + 1, topk.numel()
    size = numel * block if numel < buckets else numel + buckets * (block - 1)
    size = (size + 3) // 4 * 4
    sorted_ids = torch.full((size,), -7, dtype=torch.int32)
    expert_ids = torch.full((-(-size // block),), -7, dtype=torch.int32)
    total, cumsum = torch.zeros(1, dtype=torch.int32), torch.zeros(buckets + 1, dtype=torch.int32)
    moe.moe_align_block_size(topk, buckets, block, sorted_ids, expert_ids, total, cumsum, True)
    want_sorted, want_experts = _align_by_loop(topk.flatten().tolist(), buckets, block)
    if tokens == 2:
        assert (want_sorted, want_experts) == ([3, 4, 1, 4, 0, 2], [-1, 0, 1])
    assert int(total) == len(want_sorted) == int(cumsum[-1])
    assert sorted_ids[: len(want_sorted)].tolist() == want_sorted
    assert (sorted_ids[len(want_sorted) :] == numel).all()  # the rest padded too
    assert expert_ids[: len(want_experts)].tolist() == want_experts
    assert (expert_ids[len(want_experts) :] == -7).all()  # blocks past the total left alone
    with pytest.raises(NotImplementedError, match="ignore_invalid_expert"):
        moe.moe_align_block_size(topk, buckets, block, sorted_ids, expert_ids, total, cumsum, True, True)


def test_moe_sum_reduce_sums_the_top_k_and_scales():
    moe = _load_moe()
    x = torch.randn(40, 8, 64, dtype=torch.bfloat16)
    out = torch.empty(40, 64, dtype=torch.bfloat16)
    moe.moe_sum_reduce(x, out, 2.5)
    torch.testing.assert_close(out, (x.float().sum(1) * 2.5).to(torch.bfloat16))


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


@pytest.mark.gpu
def test_moe_align_block_size_matches_sglangs_reference_inside_a_cuda_graph(standin):
    """Against SGLang's Triton reference (no +1 offset: it is given ids + 1), each block holding
    the same flat indices; captured in a CUDA graph and replayed on other ids."""
    from sglang.test.kernels.moe_align import moe_align_block_size_triton

    tokens, top_k, experts, block = 300, 8, 16, 16
    buckets = experts + 1
    size = tokens * top_k + buckets * (block - 1)
    size = (size + 3) // 4 * 4

    def buffers():
        return (
            torch.empty(size, dtype=torch.int32, device="cuda"),
            torch.full((-(-size // block),), -7, dtype=torch.int32, device="cuda"),
            torch.empty(1, dtype=torch.int32, device="cuda"),
        )

    ids = torch.randint(-1, experts, (tokens, top_k), dtype=torch.int32, device="cuda")
    got = buffers()
    cumsum = torch.empty(buckets + 1, dtype=torch.int32, device="cuda")
    standin.moe_align_block_size(ids, buckets, block, *got, cumsum, True)  # warm-up, eager
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        standin.moe_align_block_size(ids, buckets, block, *got, cumsum, True)
    ids.copy_(torch.randint(-1, experts, (tokens, top_k), dtype=torch.int32, device="cuda"))
    graph.replay()
    want = buffers()
    want[0].fill_(tokens * top_k)
    moe_align_block_size_triton(ids + 1, buckets, block, *want)
    total = int(want[2])
    assert int(got[2]) == total
    assert torch.equal(got[1][: total // block], want[1][: total // block] - 1)
    torch.testing.assert_close(
        got[0][:total].view(-1, block).sort(-1).values, want[0][:total].view(-1, block).sort(-1).values
    )


def test_float32_norms_and_activations_match_pytorch():
    """The stand-in's float32 path (FlashInfer's kernels take fp16/bf16 only), against
    PyTorch's own RMSNorm and gated activations; the fused norm in place, as sgl-kernel's."""
    f32 = _load_standin_module("float32")
    x, w = torch.randn(5, 64), torch.randn(64)
    want = torch.nn.functional.rms_norm(x, (64,), w, 1e-6)
    torch.testing.assert_close(f32.rmsnorm(x, w, 1e-6), want)
    torch.testing.assert_close(
        f32.rmsnorm(x, w, 1e-6, gemma=True), torch.nn.functional.rms_norm(x, (64,), w + 1, 1e-6)
    )
    out = torch.empty_like(x)
    assert f32.rmsnorm(x, w, 1e-6, out=out) is out and torch.allclose(out, want)
    inp, residual = x.clone(), torch.randn(5, 64)
    total = x + residual
    f32.fused_add_rmsnorm(inp, residual, w, 1e-6)
    torch.testing.assert_close(residual, total)
    torch.testing.assert_close(inp, torch.nn.functional.rms_norm(total, (64,), w, 1e-6))
    gate_up = torch.randn(3, 2 * 32)
    gate, up = gate_up[:, :32], gate_up[:, 32:]
    torch.testing.assert_close(f32.gated(gate_up, act="silu"), torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(f32.gated(gate_up, act="gelu"), torch.nn.functional.gelu(gate) * up)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(f32.gated(gate_up, act="gelu_tanh"), want)

"""The GPU check kit (`make gpu-check`, scripts/gpu_check.sh, scripts/gpu_bundle.py): what it
needs from a GPU machine that has PyTorch and no SGLang, checked here on CPU."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from scripts import gpu_bundle

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A Python whose imports of SGLang, its kernels and FlashInfer fail, as on that machine.
BLOCKER = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"sglang", "sgl_kernel", "flashinfer"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
"""


def gpu_test_files() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("test_*.py")
        if re.search(r"^(@pytest\.mark\.gpu|\w+ = pytest\.mark\.gpu)$", path.read_text(), re.M)
    )


def test_the_check_runs_every_gpu_test_file():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    listed = re.search(r'^GPU_TESTS="([^"]*)"', script, re.M).group(1).split()
    assert sorted(listed) == gpu_test_files()


def test_gpu_modules_and_gpu_tests_import_without_sglang_or_flashinfer():
    modules = [
        "sglang_dflash.attention",
        "sglang_dflash.draft_model",
        "sglang_dflash.draft_step",
        "sglang_dflash.flashinfer_attention",
        "sglang_dflash.fused_forward",
        "sglang_dflash.kv_store",
        "sglang_dflash.ops",
        "sglang_dflash.sampling",
        "sglang_dflash.penalties",
        "tests.conftest",
        *(name.replace("/", ".").removesuffix(".py") for name in gpu_test_files()),
    ]
    code = BLOCKER + "".join(f"import {m}\n" for m in modules)
    code += "assert not {'sglang', 'flashinfer'} & set(sys.modules)\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_blocker_blocks():
    code = BLOCKER + "import sglang.srt.server_args\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and "No module named 'sglang" in result.stderr


def test_the_bundle_keeps_what_the_draft_attention_compiles():
    keep = gpu_bundle.keep
    assert keep("flashinfer/prefill.py") and keep("flashinfer/jit/attention/modules.py")
    assert keep("flashinfer/data/csrc/batch_prefill.cu")
    assert keep("flashinfer/data/csrc/batch_prefill_paged_kernel_inst.jinja")
    assert keep("flashinfer/data/include/flashinfer/attention/prefill.cuh")
    assert keep("flashinfer/data/cccl/cub/cub/cub.cuh")
    assert keep("flashinfer/data/cccl/libcudacxx/include/cuda/std/cstdint")
    # The fused draft forward's kernels (FlashInfer's JIT norm, RoPE and SiLU-and-mul modules).
    for source in ("norm.cu", "flashinfer_norm_binding.cu", "rope.cu", "flashinfer_rope_binding.cu"):
        assert keep(f"flashinfer/data/csrc/{source}")
    assert keep("flashinfer/data/include/flashinfer/norm.cuh")
    assert keep("flashinfer/data/include/flashinfer/trtllm/common/reduceKernelUtils.cuh")
    assert keep("flashinfer/data/include/flashinfer/pos_enc.cuh")
    assert keep("flashinfer/data/include/flashinfer/activation.cuh")
    assert keep("flashinfer/jit/activation.py") and keep("flashinfer/norm/kernels/rmsnorm.py")
    assert keep("flashinfer/fused_moe/core.py")  # `import flashinfer` imports it
    assert keep("flashinfer_python-0.7.2.dist-info/METADATA")
    assert not keep("flashinfer/data/csrc/fused_moe/cutlass_kernels/moe.cu")
    assert not keep("flashinfer/data/cutlass/include/cutlass/cutlass.h")
    assert not keep("flashinfer/data/cccl/python/cuda_cccl/__init__.py")
    assert not keep("flashinfer/experimental/kernels/x.cu")

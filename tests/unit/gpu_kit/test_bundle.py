"""The GPU kits, checked here on CPU: `make gpu-check` (tests/gpu_kit/check.sh) needs only PyTorch
and FlashInfer there; `make gpu-proof` (tests/gpu_kit/proof.py) brings SGLang in one
archive (tests/gpu_kit/bundle.py --serve) that must hold everything SGLang imports that the GPU
machine lacks, and must fit one device call with the checkout."""

from __future__ import annotations

import functools
import pathlib
import re
import subprocess
import sys

import pytest

from tests.gpu_kit import bundle as gpu_bundle
from tests.support import gpu_machine, paths

ROOT = paths.REPO

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
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"^(@pytest\.mark\.gpu|\w+ = pytest\.mark\.gpu)$", path.read_text(), re.M)
    )


def test_the_checks_run_every_gpu_test_file_once():
    """make gpu-check runs the GPU tests that need no SGLang; the serving check (tests/gpu_kit/proof.py's
    standin-tests) the sgl_kernel stand-in's, whose kernels SGLang's path loads anyway."""
    from tests.gpu_kit import proof as gpu_proof

    script = (ROOT / "tests" / "gpu_kit" / "check.sh").read_text()
    listed = re.search(r'^GPU_TESTS="([^"]*)"', script, re.M).group(1).split()
    assert not set(listed) & set(gpu_proof.STANDIN_TESTS)
    assert sorted(listed + list(gpu_proof.STANDIN_TESTS)) == gpu_test_files()


# The folders that run on the GPU machine without SGLang (docs/architecture.md): every module in them.
GPU_SIDE_FOLDERS = ("checkpoint", "verify", "propose", "draft", "ops", "width")


def test_gpu_modules_and_gpu_tests_import_without_sglang_or_flashinfer():
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for folder in GPU_SIDE_FOLDERS
        for path in sorted((ROOT / "sglang_dflash" / folder).rglob("*.py"))
    ]
    assert "sglang_dflash.draft.flashinfer_attention" in modules and len(modules) > 30
    modules += ["tests.conftest", *(name.replace("/", ".").removesuffix(".py") for name in gpu_test_files())]
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
    # The serve bundle keeps CUTLASS's headers, which FlashInfer's sm90 kernels include.
    assert keep("flashinfer/data/cutlass/include/cutlass/arch/reg_reconfig.h", cutlass_headers=True)
    assert keep(
        "flashinfer/data/cutlass/tools/util/include/cutlass/util/packed_stride.hpp", cutlass_headers=True
    )
    assert not keep("flashinfer/data/cutlass/examples/00_basic_gemm/basic_gemm.cu", cutlass_headers=True)
    assert not keep("flashinfer/data/cccl/python/cuda_cccl/__init__.py")
    assert not keep("flashinfer/experimental/kernels/x.cu")


# ---- make gpu-proof: the serve bundle -----------------------------------------------------


def test_the_serve_bundle_leaves_out_sglangs_rust_extensions_and_what_serving_never_imports():
    keep = gpu_bundle.keep_sglang
    assert keep("sglang/srt/mem_cache/radix_cache.py")
    assert keep("sglang/srt/layers/attention/flashinfer_backend.py")
    assert keep("sglang/srt/mem_cache/rust_tree_core/__init__.py")  # its Python fallback stays
    assert not keep("sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so")
    assert not keep("sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so")
    for folder in ("multimodal_gen/runtime/x.py", "test/test_utils.py", "benchmark/x.py"):
        assert not keep("sglang/" + folder)


def test_record_rows_quote_file_names_with_commas():
    import csv

    row = gpu_bundle.record_line("a/E=256,N=64,device_name=H200.json", b"{}")
    name, digest, size = next(csv.reader([row]))
    assert name == "a/E=256,N=64,device_name=H200.json" and digest.startswith("sha256=") and size == "2"


def test_every_requirement_of_sglang_travels_is_on_the_gpu_machine_or_is_left_out_with_a_reason():
    assert gpu_bundle.unaccounted_requirements("sglang", gpu_bundle.installed_requirements) == {}
    # ... and the walk reports one that is none of these, naming who requires it.
    graph = {"sglang": ["fastapi", "torch", "sglang-kernel"], "fastapi": ["new-thing"]}
    missing = gpu_bundle.unaccounted_requirements("sglang", lambda name: graph.get(name, []))
    assert missing == {"new-thing": "fastapi"}


SERVING_MODULES = (
    "sglang",
    "sglang.launch_server",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.qwen3",
    "sglang.srt.models.llama",
    "sglang.srt.layers.attention.flashinfer_backend",
    "sglang.srt.speculative.dflash_worker_v2",
    "sglang.srt.constrained.xgrammar_backend",
    "sglang_dflash.plugin",
    "sglang_dflash.worker",
)


def test_sglangs_serving_modules_import_with_what_the_gpu_machine_has_and_the_bundle_brings(tmp_path):
    """E.g. `import sglang` imports IPython, and SGLang's configs import dill: neither is on the
    GPU machine. Taking either out of SERVE_DEPS fails this with its ModuleNotFoundError."""
    hidden = "import importlib.util; assert importlib.util.find_spec('outlines') is None\n"  # the view works
    code = hidden + "".join(f"import {m}\n" for m in SERVING_MODULES)
    result = gpu_machine.run(gpu_machine.python(tmp_path), code, kit=False, standin=False)
    assert result.returncode == 0, result.stderr[-3000:]


def _bundle(
    tmp_path: pathlib.Path, python_version: str = "{}.{}".format(*sys.version_info[:2])
) -> pathlib.Path:
    """A serve bundle as tests/gpu_kit/bundle.py lays it out, holding one module."""
    import json
    import tarfile

    from tests.gpu_kit.serve import unpack

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "kit_probe.py").write_text("VALUE = 7\n")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    with tarfile.open(bundle / "site.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "site", arcname="site")
    archive = dict(file="site.tar.xz", sha256=unpack.sha256(str(bundle / "site.tar.xz")), bytes=1)
    wheels = [dict(name="kit-probe", version="1.0")]
    manifest = dict(python_version=python_version, archive=archive, wheels=wheels)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


def test_the_bundle_unpacks_once_and_is_checked_against_its_manifest(tmp_path):
    from tests.gpu_kit.serve import unpack

    bundle = _bundle(tmp_path)
    site = unpack.unpack(str(bundle), str(tmp_path / "state"))
    assert (pathlib.Path(site) / "kit_probe.py").read_text() == "VALUE = 7\n"
    (pathlib.Path(site) / "kit_probe.py").write_text("edited")
    unpack.unpack(str(bundle), str(tmp_path / "state"))  # the marker matches: left as it is
    assert (pathlib.Path(site) / "kit_probe.py").read_text() == "edited"
    with open(bundle / "site.tar.xz", "ab") as f:
        f.write(b"tampered")
    with pytest.raises(SystemExit, match="sha256"):
        unpack.unpack(str(bundle), str(tmp_path / "state"))


def test_a_bundle_for_another_python_is_refused(tmp_path):
    from tests.gpu_kit.serve import unpack

    with pytest.raises(SystemExit, match="bundle is for Python 3.99"):
        unpack.unpack(str(_bundle(tmp_path, "3.99")), str(tmp_path / "state"))


def _aot(tmp_path: pathlib.Path, version: str = "0.7.2") -> pathlib.Path:
    """An AOT folder as tests/gpu_kit/aot.py lays it out, holding one module."""
    import json
    import tarfile

    from tests.gpu_kit.serve import unpack

    (tmp_path / "staged" / "norm").mkdir(parents=True)
    (tmp_path / "staged" / "norm" / "norm.so").write_bytes(b"\x7fELF")
    aot = tmp_path / "aot"
    aot.mkdir()
    with tarfile.open(aot / "flashinfer-aot.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "staged" / "norm", arcname="norm")
    archive = dict(file="flashinfer-aot.tar.xz", sha256=unpack.sha256(str(aot / "flashinfer-aot.tar.xz")))
    manifest = dict(flashinfer_version=version, archive=archive, modules=[dict(uri="norm")])
    (aot / "manifest.json").write_text(json.dumps(manifest))
    return aot


def _site(tmp_path: pathlib.Path) -> pathlib.Path:
    site = tmp_path / "site"
    (site / "flashinfer").mkdir(parents=True)
    (site / "flashinfer" / "_build_meta.py").write_text('__version__ = "0.7.2"\n')
    return site


def test_the_aot_modules_land_where_flashinfer_loads_them_without_compiling(tmp_path):
    from tests.gpu_kit.serve import unpack

    site = _site(tmp_path)
    assert unpack.install_aot(str(_aot(tmp_path)), str(site)) == ["norm"]
    assert (site / "flashinfer" / "data" / "aot" / "norm" / "norm.so").read_bytes() == b"\x7fELF"


def test_aot_modules_of_another_flashinfer_or_a_tampered_archive_are_refused(tmp_path):
    from tests.gpu_kit.serve import unpack

    site = _site(tmp_path)
    with pytest.raises(SystemExit, match="FlashInfer 0.6.0 modules"):
        unpack.install_aot(str(_aot(tmp_path / "old", version="0.6.0")), str(site))
    aot = _aot(tmp_path / "tampered")
    with open(aot / "flashinfer-aot.tar.xz", "ab") as f:
        f.write(b"x")
    with pytest.raises(SystemExit, match="sha256"):
        unpack.install_aot(str(aot), str(site))


def test_the_built_aot_archive_fits_one_call_with_the_serve_bundle_and_the_checkout():
    import json

    serve, aot = (
        ROOT / ".gpu-bundle" / "serve" / "manifest.json",
        ROOT / ".gpu-bundle" / "aot" / "manifest.json",
    )
    if not (serve.is_file() and aot.is_file()):
        pytest.skip("no serve bundle or AOT archive built here (make gpu-bundle gpu-aot)")
    carried = sum(json.loads(m.read_text())["archive"]["bytes"] for m in (serve, aot))
    assert carried + gpu_bundle.checkout_bytes(str(ROOT)) <= gpu_bundle.CALL_LIMIT


def test_the_built_serve_bundle_fits_one_call_with_the_checkout():
    """Checks the bundle `python tests/gpu_kit/bundle.py --serve` left here, if any (building it
    downloads ~110 MiB, so the suite does not)."""
    import json

    manifest = ROOT / ".gpu-bundle" / "serve" / "manifest.json"
    if not manifest.is_file():
        pytest.skip("no serve bundle built here (python tests/gpu_kit/bundle.py --serve)")
    data = json.loads(manifest.read_text())
    archive = manifest.parent / data["archive"]["file"]
    assert archive.stat().st_size == data["archive"]["bytes"]
    assert {w["name"] for w in data["wheels"]} == {
        "sglang",
        "flashinfer-python",
        "apache-tvm-ffi",
        *gpu_bundle.SERVE_DEPS,
    }
    assert data["archive"]["bytes"] + gpu_bundle.checkout_bytes(str(ROOT)) <= gpu_bundle.CALL_LIMIT


def test_the_checkout_is_registered_for_sglangs_plugin_discovery(tmp_path):
    """On the GPU machine the package is imported from the checkout (PYTHONPATH), which carries no
    metadata: without the dist-info the kit writes, SGLang would not find the plugin and would
    serve DFLASH with its built-in worker."""
    from tests.gpu_kit.serve import unpack

    view = gpu_machine.python(tmp_path / "view")
    code = "from importlib.metadata import entry_points\n"
    code += "print(sorted(e.value for e in entry_points(group='sglang.srt.plugins')))\n"
    site = tmp_path / "site"
    site.mkdir()
    # From elsewhere: a checkout where `pip install .` ran holds an egg-info, which the device
    # tool does not carry (git-ignored).
    run = functools.partial(
        gpu_machine.run, view, code, kit=False, standin=False, extra_path=[site], cwd=site
    )
    before = run()
    unpack.register_checkout(str(site), str(ROOT))
    after = run()
    assert "sglang_dflash.plugin:register" not in before.stdout, before.stderr[-2000:]
    assert "sglang_dflash.plugin:register" in after.stdout, after.stderr[-2000:]


def test_the_report_reads_start_up_phases_from_server_logs():
    from tests.gpu_kit.serve import report

    log = """[2026-11-25 12:00:00] server_args=ServerArgs(...)
[2026-11-25 12:00:40 TP0] Capture decode cuda graph end. bs=[1, 2, 4], elapsed=33.10 s, mem usage=0.40 GB.
[2026-11-25 12:00:41 TP0] DFLASH warm-up (injection, flashinfer draft attention, LM head): 0.2 s
[2026-11-25 12:00:45 TP0] DFLASH draft step: CUDA graphs for batch sizes [1, 2, 4] (0.12 GB, 3.5 s; ...
[2026-11-25 12:01:30] The server is fired up and ready to roll!
"""
    log += "[2026-11-25 12:01:29] Engine startup timings (s): load_weight=0.14, "
    log += "cuda_graph={prefill=0.00, decode=26.40}, tokenizer_e2e=45.50\n"
    assert report.startup(log) == {
        "capture decode cuda graph": 33.1,
        "capture draft step (sglang-dflash)": 3.5,
        "warm-up (sglang-dflash)": 0.2,
        "sglang load_weight": 0.14,
        "sglang decode": 26.4,  # prefill=0.00: nothing captured, left out
        "sglang tokenizer_e2e": 45.5,
        "log start to ready": 90.0,
    }

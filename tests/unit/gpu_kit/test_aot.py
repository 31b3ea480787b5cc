"""FlashInfer's precompiled modules for the GPU run (tests/gpu_kit/aot.py, `make gpu-aot`): the
modules the run's engines and draft step will ask for, derived from FlashInfer's own generator
functions with the real shapes and the serving path's own decisions, must all be built and
carried; a missing one would JIT-compile on the device for minutes."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest

from tests.gpu_kit import aot as gpu_aot
from tests.support import paths

ROOT = paths.REPO
AOT = ROOT / ".gpu-bundle" / "aot"


@pytest.fixture(autouse=True)
def sm90(monkeypatch):
    """FlashInfer's generators check the target architecture; there is no GPU here."""
    from flashinfer.jit import core

    monkeypatch.setattr(core.current_compilation_context, "TARGET_CUDA_ARCHS", {(9, "0a")})


def test_every_module_the_gpu_run_requests_is_built():
    requested = gpu_aot.requested()
    assert set(requested) <= set(gpu_aot.MODULES), set(requested) - set(gpu_aot.MODULES)
    # ... and nothing is built that no one asks for (each costs minutes of compile here).
    assert set(gpu_aot.MODULES) <= set(requested), set(gpu_aot.MODULES) - set(requested)


def test_modules_are_named_as_flashinfer_names_them():
    for uri, make in gpu_aot.MODULES.items():
        assert make().name == uri


def test_a_gqa_under_4_target_asks_for_the_cuda_core_decode_module():
    """SGLang decodes a GQA group under 4 with FlashInfer's CUDA-core kernels, a module of its
    own: the tiny lossless target has 8 query heads on 2 KV heads to use the tensor-core one, as
    Qwen3-8B does. With 4 on 2 (the kit's earlier tiny model), this module would be requested."""
    from tests.gpu_kit.serve import models

    config = dict(models.tiny_target_config(), num_attention_heads=4)
    uris = gpu_aot.target_modules(config, "bfloat16")
    decode = gpu_aot.decode_spec(gpu_aot.Attention("bfloat16", 128)).name
    assert decode in uris and decode not in gpu_aot.MODULES
    assert decode not in gpu_aot.target_modules(models.tiny_target_config(), "bfloat16")


def test_a_sliding_window_draft_asks_for_its_own_attention_module():
    from tests.gpu_kit.serve import models

    draft = models.qwen3_8b_dflash()
    layer_types = ["sliding_attention"] + ["full_attention"] * 4
    draft.update(sliding_window=512, use_sliding_window=True, layer_types=layer_types)
    uris = gpu_aot.draft_modules(draft, "bfloat16")
    sliding = gpu_aot.prefill_spec(gpu_aot.Attention("bfloat16", 128, sliding=True)).name
    assert sliding in uris


def test_the_matrix_asks_for_no_attention_module_and_nothing_the_kit_does_not_carry():
    """make gpu-matrix's families run on Triton attention and their drafts on SDPA (draft "a"'s
    head_dim 16, or float32, or MiMo's sinks): only the norm, RoPE, SiLU-and-mul and sampling
    modules, all carried. The requested() test above holds them too."""
    modules = gpu_aot.matrix_modules()
    assert set(modules) == {"norm", "rope", "silu_and_mul", "sampling"}, set(modules)
    # In float32 the stand-in's norms and SiLU-and-mul are PyTorch's, and the draft takes none.
    fp32 = {uri for uri, whys in modules.items() if any(w.startswith("matrix llama_fp32") for w in whys)}
    assert fp32 == {"sampling"}
    assert len(modules["sampling"]) == 5  # the draft families and llama_fp32


def test_a_draft_flashinfer_serves_asks_for_its_attention_module_and_one_it_refuses_does_not():
    from tests.gpu_kit.serve import models

    draft = models.qwen3_8b_dflash()  # head_dim 128: FlashInfer serves its attention in bf16
    prefill = gpu_aot.prefill_spec(gpu_aot.Attention("bfloat16", 128)).name
    assert prefill in gpu_aot.draft_modules(draft, "bfloat16")
    assert gpu_aot.draft_modules(draft, "float32") == {}  # refused: SDPA, and no fused kernels
    sinks = dict(draft, dflash_config=dict(draft.get("dflash_config", {}), attention_sink_bias=True))
    assert prefill not in gpu_aot.draft_modules(sinks, "bfloat16")


def built_manifest() -> dict:
    if not (AOT / "manifest.json").is_file():
        pytest.skip("no AOT archive built here (make gpu-aot: 20-30 CPU-minutes)")
    return json.loads((AOT / "manifest.json").read_text())


def test_the_built_archive_holds_every_module():
    manifest = built_manifest()
    assert [m["uri"] for m in manifest["modules"]] == list(gpu_aot.MODULES)
    with tarfile.open(AOT / manifest["archive"]["file"]) as tar:
        names = set(tar.getnames())
    assert {f"{uri}/{uri}.so" for uri in gpu_aot.MODULES} <= names


def test_flashinfer_loads_the_carried_modules_without_compiling(tmp_path):
    """FlashInfer's own resolver, pointed at the unpacked archive, finds each module as AOT and
    loads it (tvm-ffi; no GPU is needed to load)."""
    manifest = built_manifest()
    with tarfile.open(AOT / manifest["archive"]["file"]) as tar:
        tar.extractall(tmp_path, filter="data")
    code = f"""
import os
os.environ["FLASHINFER_DISABLE_JIT"] = "1"  # a module not found as AOT raises instead of compiling
from flashinfer.jit import core
core.current_compilation_context.TARGET_CUDA_ARCHS = {{(9, "0a")}}
from flashinfer.jit import env
env.FLASHINFER_AOT_DIR = __import__("pathlib").Path({str(tmp_path)!r})
from tests.gpu_kit import aot as gpu_aot
for uri, make in gpu_aot.MODULES.items():
    spec = make()
    assert spec.is_aot, uri
    assert spec.try_load() is not None, uri
print("ok", len(gpu_aot.MODULES))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]

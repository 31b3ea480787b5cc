"""The Triton pre-flight (tests/gpu_kit/triton_preflight.py, `make triton-preflight`): SGLang's
Triton kernels that `make gpu-matrix` runs compile for sm_90 under the GPU machine's Triton
3.6.0, here, without a GPU; and a kernel that does not compile fails it, by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import paths

ROOT = paths.REPO
TRITON36 = os.path.join(sys.prefix, "triton-3.6.0")  # the Makefile's $(VENV)/triton-3.6.0

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(TRITON36, ".installed")),
    reason="Triton 3.6.0 is not installed beside the venv (make triton-preflight installs it)",
)


def _python(tmp_path, *args) -> subprocess.CompletedProcess:
    # A cold cache of its own: every kernel is compiled here, none read from an earlier run.
    env = dict(
        os.environ, PYTHONPATH=f"{TRITON36}{os.pathsep}{ROOT}", TRITON_CACHE_DIR=str(tmp_path / "cache")
    )
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def test_the_matrix_kernels_compile_for_sm90_under_triton_3_6(tmp_path):
    out = tmp_path / "preflight.json"
    done = _python(tmp_path, "-m", "tests.gpu_kit.triton_preflight", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["triton"] == "3.6.0" and results["target"] == ["cuda", 90, 32]
    cases = results["cases"]
    assert {name: r["status"] for name, r in cases.items()} == dict.fromkeys(cases, "compiled")
    kernels = {k for r in cases.values() for k in r["kernels"]}
    # One kernel of each family's path, at least: attention prefill/verify and decode, the MoE
    # experts and their top-k sum, Gated DeltaNet's chunked prefill and verify update, Gemma's norms.
    for kernel in (
        "_fwd_kernel",
        "_fwd_grouped_kernel_stage1",
        "fused_moe_kernel",
        "_moe_sum_reduce_kernel",
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
        "fused_sigmoid_gating_delta_rule_update_kernel",
        "_gemma_qkv_rmsnorm_kernel",
    ):
        assert kernel in kernels, cases


def test_a_kernel_that_does_not_compile_fails_the_preflight_by_name(tmp_path):
    """MLA's Triton decode at the tiny MLA_SHAPE's latent (a KV LoRA of 32 and RoPE of 16: key
    blocks of 64, value blocks of 32) does not compile: the reason the MLA families are served
    with the published 512 + 64."""
    code = (
        "from tests.gpu_kit import triton_preflight as t\n"
        "t.pretend_h200(); compiled = t.compile_only(False); t.without_device_contexts()\n"
        "t.MLA_LORA, t.MLA_ROPE = 32, 16\n"
        "import json; print(json.dumps(t.run_case('attention-decode', compiled)))\n"
    )
    done = _python(tmp_path, "-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["status"] == "failed", found
    assert found["error"].startswith("_fwd_grouped_kernel_stage1: CompilationError"), found

"""Compile SGLang's own JIT kernels before the engines start, one process each, in parallel.

    python -m tests.gpu_kit.serve.warm_jit [NAME ... | --matrix]   # on the GPU machine, the kit's environment

SGLang 0.5.23 compiles a few tvm-ffi kernels with nvcc at their first call in each process, one
after another inside the engine's start-up. Their cache key hashes the torch version and the
compilers' version output (`sglang/kernels/jit/utils/compile/cache.py`), so they cannot be built
on another machine and carried, as FlashInfer's are (tests/gpu_kit/aot.py). Built here first, in
parallel on the CPU cores, every engine after finds them in `SGLANG_JIT_CACHE_DIR` (a file lock
and an atomic rename make concurrent builds of one kernel safe). Run it with the servers'
environment: CUDA_HOME and the compiler are part of the key.

The kernels, and who calls them on the kit's path (dense Qwen3, bf16, head_dim 128):
  qknorm          Qwen3's q/k RMSNorm (sglang/kernels/ops/layernorm/norm.py)
  fused_rope      RoPE (kernels/ops/attention/rope.py)
  kvcache         the KV store, per row width: Qwen3-8B 8 KV heads, the tiny model 2
                  (kernels/ops/kvcache/kvcache.py)
  activation      SiLU-and-mul of the MLP (kernels/ops/activation/activation.py)
  clamp_position  decode and verify positions (kernels/ops/attention/clamp_position.py)
  speculative_sampling  SGLang's built-in DFLASH warms its sampled verify at start-up
                  (speculative/dflash_worker_v2.py prewarm_sampling), vocab 151,936 -> vec 4

And `make gpu-matrix`'s families (tests/gpu_kit/serve/families.py; Triton attention, MoE and
Gated DeltaNet kernels are Triton's, not JIT), `matrix_*`:
  matrix_rotary   RoPE at head_dim 16, where SGLang takes its fallback kernel (one module for
                  every width and dtype; rotary_embedding/base.py)
  matrix_rope     Qwen3-MoE's head_dim 64 (neox), and the MLA targets' RoPE (64, interleaved)
  matrix_qknorm   Qwen3-MoE's q/k norm at head_dim 64
  matrix_kvcache  2 KV heads of 16 (bf16, float32) and of 64 (Qwen3-MoE)
  matrix_activation  SiLU-and-mul in float32 (llama_fp32)
"""

from __future__ import annotations

import subprocess
import sys
import time

HEAD_DIM = 128
KV_HEADS = (8, 2)  # Qwen3-8B, the tiny lossless model (tests/gpu_kit/serve/models.py)


def build(name: str) -> None:
    import torch

    bf16 = torch.bfloat16
    if name == "qknorm":
        from sglang.kernels.ops.layernorm.norm import _jit_qknorm_module

        _jit_qknorm_module(HEAD_DIM, bf16)
    elif name == "fused_rope":
        from sglang.kernels.ops.attention.rope import _jit_fused_rope_module

        _jit_fused_rope_module(True, HEAD_DIM, bf16, bf16)  # neox, full rotary dim
    elif name == "kvcache":
        from sglang.kernels.ops.kvcache.kvcache import _jit_kvcache_module

        for heads in KV_HEADS:
            row = heads * HEAD_DIM * bf16.itemsize
            _jit_kvcache_module(row, row, 0)  # 0: store_cache's own thread count
    elif name == "activation":
        from sglang.kernels.ops.activation.activation import activation_module

        activation_module(bf16)
    elif name == "clamp_position":
        from sglang.kernels.ops.attention.clamp_position import _jit_clamp_position_module

        _jit_clamp_position_module(torch.int64)
    elif name == "matrix_rotary":
        from sglang.kernels.ops.attention.rope import _jit_rotary_embedding_module

        _jit_rotary_embedding_module()
    elif name == "matrix_rope":
        from sglang.kernels.ops.attention.rope import _jit_fused_rope_module

        _jit_fused_rope_module(True, 64, bf16, bf16)  # Qwen3-MoE: neox, head_dim 64
        _jit_fused_rope_module(False, 64, bf16, bf16)  # MLA: interleaved, RoPE 64
    elif name == "matrix_qknorm":
        from sglang.kernels.ops.layernorm.norm import _jit_qknorm_module

        _jit_qknorm_module(64, bf16)
    elif name == "matrix_kvcache":
        from sglang.kernels.ops.kvcache.kvcache import _jit_kvcache_module

        for row in (2 * 16 * 2, 2 * 16 * 4, 2 * 64 * 2):  # bf16 and float32 at 16, bf16 at 64
            _jit_kvcache_module(row, row, 0)
    elif name == "matrix_activation":
        from sglang.kernels.ops.activation.activation import activation_module

        activation_module(torch.float32)
    elif name == "speculative_sampling":
        from sglang.kernels.ops.speculative.sampling import _jit_sampling_module

        _jit_sampling_module(4, True)
    else:
        raise SystemExit(f"unknown kernel {name!r} (one of {', '.join(KERNELS)})")


KERNELS = ("qknorm", "fused_rope", "kvcache", "activation", "clamp_position", "speculative_sampling")
MATRIX_KERNELS = ("matrix_rotary", "matrix_rope", "matrix_qknorm", "matrix_kvcache", "matrix_activation")


def main(names: list[str]) -> int:
    if names[:1] == ["--matrix"]:  # the kit's and the matrix's
        names = list(KERNELS + MATRIX_KERNELS)
    if names[:1] == ["--one"]:
        build(names[1])
        return 0
    start = time.perf_counter()
    procs = {
        n: subprocess.Popen([sys.executable, "-m", "tests.gpu_kit.serve.warm_jit", "--one", n]) for n in names
    }
    failed = []
    for name, proc in procs.items():
        if proc.wait() != 0:
            failed.append(name)
        state = "FAILED" if name in failed else "ready"
        print(f"warm_jit: {name} {state} at {time.perf_counter() - start:.0f} s", flush=True)
    # A kernel that failed here compiles (or fails) again in the engine, which says why.
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(KERNELS)))

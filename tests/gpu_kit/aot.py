"""FlashInfer's kernels for the GPU run, compiled here (nvcc, no GPU) and carried as one archive.

    python tests/gpu_kit/aot.py [--out .gpu-bundle] [--arch 9.0] [--jobs 2]      # make gpu-aot

A GPU machine without FlashInfer's kernels JIT-compiles each module at its first use, inside an
engine's start-up, one after another: minutes of device time. FlashInfer 0.7.2 loads a module
without building it when `<site>/flashinfer/data/aot/<uri>/<uri>.so` exists (`jit/env.py`,
`get_aot_artifacts`). Its modules link only against the CUDA runtime and tvm-ffi, not torch, so
one built here for sm_90a serves the GPU machine's torch and Python.

`requested(models)` names the modules the GPU run asks for, from FlashInfer's own generator
functions and the same decisions the serving path takes (SGLang's `should_use_tensor_core`, our
draft's layer kinds). `MODULES` is what this script builds: tests/unit/gpu_kit/test_aot.py checks that it
covers what the kit's models request, so a module the run would compile on the device fails on
CPU first. The archive (`aot/flashinfer-aot.tar.xz` with `aot/manifest.json`) is unpacked into
the serve bundle's site by `tests/gpu_kit/serve/unpack.py`.

What the build here needs (all set by this script): `FLASHINFER_CUDA_ARCH_LIST` (no GPU to
detect), `CUDA_HOME` at the real toolkit, an empty `libcuda.so` stub for the link (the driver's
library is on the GPU machine), and `CPATH` at a folder of only the cuBLAS/cuRAND headers
(FlashInfer includes them; the whole `nvidia/cu13/include` on CPATH breaks nvcc).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# ---- what the run asks for -------------------------------------------------------------------


@dataclass(frozen=True)
class Attention:
    """One attention shape as FlashInfer's module key sees it."""

    dtype: str  # "bfloat16" | "float16"
    head_dim: int
    sliding: bool = False

    def prefill_args(self):
        import torch

        dt = getattr(torch, self.dtype)
        # (backend, q, kv, o, idx, head_dim_qk, head_dim_vo, pos_encoding NONE, sliding window,
        # logits soft cap, fp16 qk reduction): what SGLang's wrappers and ours pass to plan().
        return ("fa2", dt, dt, dt, torch.int32, self.head_dim, self.head_dim, 0, self.sliding, False, False)


def prefill_spec(att: Attention):
    """The fa2 batch-prefill module: ragged extend, paged prefill and verify, tensor-core decode,
    and our draft attention (`flashinfer.prefill.get_batch_prefill_module`, backend fa2)."""
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module

    return _gen_batch_prefill_primary_module(*att.prefill_args())


def decode_spec(att: Attention):
    """The CUDA-core batch decode module (SGLang's decode for a GQA group under 4)."""
    import torch
    from flashinfer.jit.attention.modules import gen_batch_decode_module

    dt = getattr(torch, att.dtype)
    return gen_batch_decode_module(dt, dt, dt, torch.int32, att.head_dim, att.head_dim, 0, att.sliding, False)


def named_spec(name: str):
    """FlashInfer's fixed modules: norm, rope, silu_and_mul, cascade, sampling."""
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.cascade import gen_cascade_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module
    from flashinfer.jit.sampling import gen_sampling_module

    makers = {
        "norm": gen_norm_module,
        "sampling": gen_sampling_module,
        "rope": gen_rope_module,
        "silu_and_mul": lambda: gen_act_and_mul_module("silu"),
        "cascade": gen_cascade_module,
    }
    return makers[name]()


def target_modules(config: dict, dtype: str) -> dict:
    """{uri: why} for a dense target served by SGLang's FlashInfer backend through the kit."""
    import torch
    from sglang.srt.layers.attention.flashinfer_backend import should_use_tensor_core

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    sliding = bool(config.get("use_sliding_window") and config.get("sliding_window"))
    att = Attention(dtype, head_dim, sliding)
    prefill = prefill_spec(att).name
    out = {prefill: "extend and verify (fa2 batch prefill)"}
    if should_use_tensor_core(getattr(torch, dtype), heads, kv_heads):
        out[prefill] += ", decode (tensor cores)"
    else:
        out[decode_spec(att).name] = f"decode (GQA {heads // kv_heads} < 4: CUDA cores)"
    # The kit's sgl_kernel stand-in serves SGLang's RMSNorm and SiLU-and-mul through FlashInfer;
    # a radix-cache prefix hit merges the ragged and paged halves (flashinfer.cascade.merge_state).
    out.update(
        norm="stand-in rmsnorm", silu_and_mul="stand-in silu_and_mul", cascade="prefix-hit merge_state"
    )
    return out


def builtin_dflash_modules() -> dict:
    """{uri: why} that SGLang's built-in DFLASH adds to its target's: its start-up warms the
    sampled verify (`dflash_worker_v2.prewarm_sampling` -> flashinfer.sampling.top_p_renorm_probs)
    even when every request is greedy. Its draft attention is the target's fa2 prefill module."""
    return {"sampling": "SGLang built-in DFLASH: prewarm_sampling (top_p_renorm_probs)"}


def draft_modules(draft_config: dict, dtype: str) -> dict:
    """{uri: why} for our draft step on CUDA: FlashInfer attention per layer kind where FlashInfer
    serves the draft's attention (`flashinfer_attention.unavailable_reason`: else SDPA, no
    module), and the fused layers' norm, RoPE and SiLU-and-mul where their dtype is one
    FlashInfer's kernels take (sglang_dflash/draft/fused_forward.py)."""
    import torch

    from sglang_dflash.checkpoint.config import DFlashDraftConfig
    from sglang_dflash.draft import fused_forward
    from sglang_dflash.draft.flashinfer_attention import layer_kind, unavailable_reason

    config = DFlashDraftConfig.from_dict(draft_config)
    out = {}
    if unavailable_reason(config, torch.device("cuda"), getattr(torch, dtype)) is None:
        for i in range(config.num_hidden_layers):
            kind = layer_kind(config, i)
            att = Attention(dtype, config.head_dim, sliding=kind.window_left >= 0)
            out[prefill_spec(att).name] = "draft attention (fa2 batch prefill, paged)"
    if getattr(torch, dtype) in fused_forward.FUSED_DTYPES:
        out.update(
            norm="fused draft rmsnorm", rope="fused draft RoPE", silu_and_mul="fused draft SiLU-and-mul"
        )
    return out


def matrix_modules() -> dict:
    """{uri: why} for `make gpu-matrix`'s families (tests/gpu_kit/serve/families.py): their targets
    run on SGLang's Triton attention backend (no FlashInfer attention module: its kernels are
    Triton's, tests/gpu_kit/triton_preflight.py), their norms and SiLU-and-mul through the kit's
    sgl_kernel stand-in (FlashInfer's in bf16, PyTorch's in float32), the sampled requests
    through SGLang's sampler (FlashInfer's sampling), and each family's draft as `draft_modules`
    asks (draft "a" or its variant, built in a scratch folder)."""
    import tempfile

    from tests.gpu_kit.serve import families

    out: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        for family in families.select(""):
            args = family.engine_args("cuda")
            if args.get("attention_backend") != "triton":
                raise ValueError(f"{family.name}: this accounting assumes SGLang's Triton attention backend")
            dtype = args.get("dtype", "bfloat16")
            target = {}
            if dtype in ("bfloat16", "float16"):  # the stand-in takes float32 in PyTorch
                target.update(norm="stand-in rmsnorm", silu_and_mul="stand-in silu_and_mul")
            if family.sampled:
                target["sampling"] = "sampled requests (SGLang's sampler)"
            draft = os.path.join(scratch, family.draft)
            if not os.path.isdir(draft):
                families.build_draft(draft, family.draft)
            with open(os.path.join(draft, "config.json")) as f:
                draft_config = json.load(f)
            for who, modules in (("target", target), ("draft", draft_modules(draft_config, dtype))):
                for uri, why in modules.items():
                    out.setdefault(uri, []).append(f"matrix {family.name} {who}: {why}")
    return out


def kit_models() -> dict:
    """{name: (target config, draft config)} of every pair the GPU run serves: the shipped
    trained pair and the random head_dim-128 pair (lossless), the Qwen3-8B pair (the race; the
    draft-step benchmark uses its draft's shape). tests/gpu_kit/serve/models.py."""
    from tests.gpu_kit.serve import models

    return {
        "trained": models.trained_pair_configs(),
        "tiny": (models.tiny_target_config(), models.tiny_draft_config()),
        "qwen3-8b": (models.QWEN3_8B, models.qwen3_8b_dflash()),
    }


def requested(pairs: dict | None = None, dtype: str = "bfloat16") -> dict:
    """{uri: [who asks for it]} of every FlashInfer module the GPU run loads (the race serves
    the Qwen3-8B pair with ours and with SGLang's built-in DFLASH; `make gpu-matrix` its
    families, `matrix_modules`, unless `pairs` are given)."""
    out: dict = {uri: [why] for uri, why in builtin_dflash_modules().items()}
    if pairs is None:
        for uri, whys in matrix_modules().items():
            out.setdefault(uri, []).extend(whys)
    for name, (target, draft) in (pairs if pairs is not None else kit_models()).items():
        for who, modules in (
            (f"{name} target", target_modules(target, dtype)),
            (f"{name} draft", draft_modules(draft, dtype)),
        ):
            for uri, why in modules.items():
                out.setdefault(uri, []).append(f"{who}: {why}")
    return out


# What `make gpu-aot` builds: (uri, how to make its spec). tests/unit/gpu_kit/test_aot.py: covers requested().
MODULES = {
    "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_128"
    "_head_dim_vo_128_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False_kv_stride_equal": lambda: (
        prefill_spec(Attention("bfloat16", 128))
    ),
    "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_64"
    "_head_dim_vo_64_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False_kv_stride_equal": lambda: (
        prefill_spec(Attention("bfloat16", 64))
    ),
    "batch_decode_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_64"
    "_head_dim_vo_64_posenc_0_use_swa_False_use_logits_cap_False": lambda: decode_spec(
        Attention("bfloat16", 64)
    ),
    "norm": lambda: named_spec("norm"),
    "rope": lambda: named_spec("rope"),
    "silu_and_mul": lambda: named_spec("silu_and_mul"),
    "cascade": lambda: named_spec("cascade"),
    "sampling": lambda: named_spec("sampling"),
}


# ---- building ------------------------------------------------------------------------------


def cuda_home() -> str:
    """The real toolkit behind `nvcc` (which may be a wrapper script): nvcc's dry run names it."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    if shutil.which("nvcc") is None:
        raise SystemExit("nvcc is not on PATH: make gpu-aot needs a CUDA toolkit (no GPU)")
    cmd = ["nvcc", "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull]
    out = subprocess.run(cmd, capture_output=True, text=True)
    for line in (out.stdout + out.stderr).splitlines():  # "#$ TOP=/usr/local/cuda-13.0/bin/.."
        if line.startswith("#$ TOP="):
            return os.path.realpath(line.split("=", 1)[1].strip())
    raise SystemExit(f"cannot tell the CUDA toolkit from `{' '.join(cmd)}`: set CUDA_HOME")


def library_headers(into: str) -> str:
    """A folder holding only cuBLAS's and cuRAND's headers, from PyTorch's CUDA wheels."""
    import nvidia

    os.makedirs(into, exist_ok=True)
    found = 0
    for root in nvidia.__path__:
        for path in glob.glob(os.path.join(root, "*", "include", "cublas*.h")) + glob.glob(
            os.path.join(root, "*", "include", "curand*.h")
        ):
            shutil.copy(path, into)
            found += 1
    if not found:
        raise SystemExit("no cublas*.h / curand*.h in PyTorch's nvidia packages")
    return into


def libcuda_stub(into: str, home: str) -> str:
    """An empty shared library with SONAME libcuda.so.1: the link needs `-lcuda`; the GPU
    machine's driver provides the real one at load time."""
    os.makedirs(into, exist_ok=True)
    stub = os.path.join(into, "libcuda.so")
    if not os.path.exists(stub):
        src = os.path.join(into, "stub.c")
        with open(src, "w") as f:
            f.write("/* empty: libcuda.so.1 comes from the GPU machine's driver */\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", src, "-o", stub], check=True)
    return into


def build_env(work: str, arch: str, jobs: int) -> dict:
    work = os.path.abspath(work)  # ninja runs in each module's build folder
    home = cuda_home()
    env = dict(os.environ)
    env.update(
        FLASHINFER_CUDA_ARCH_LIST=arch,
        FLASHINFER_WORKSPACE_BASE=os.path.join(work, "workspace"),
        CUDA_HOME=home,
        CPATH=library_headers(os.path.join(work, "headers")),
        FLASHINFER_EXTRA_LDFLAGS=f"-L{libcuda_stub(os.path.join(work, 'stub'), home)}",
        MAX_JOBS=str(jobs),
    )
    return env


def build_one(uri: str) -> str:
    """Build MODULES[uri] in this process (the environment set by build_env) -> its .so path."""
    spec = MODULES[uri]()
    if spec.name != uri:
        raise SystemExit(f"MODULES names {uri!r} but its generator gives {spec.name!r}: FlashInfer changed")
    spec.build(verbose=False)
    return str(spec.jit_library_path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".gpu-bundle")
    p.add_argument("--arch", default="9.0", help="FLASHINFER_CUDA_ARCH_LIST (9.0 builds sm_90a)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel nvcc jobs")
    p.add_argument("--only", help="build these URIs (comma-separated) only")
    p.add_argument("--force", action="store_true", help="rebuild modules already staged")
    p.add_argument("--build-one", help=argparse.SUPPRESS)  # internal: one module, in a child
    args = p.parse_args()
    if args.build_one:
        print(build_one(args.build_one))
        return
    import flashinfer

    out = os.path.join(args.out, "aot")
    work = os.path.join(args.out, "aot-build")
    env = build_env(work, args.arch, args.jobs)
    uris = args.only.split(",") if args.only else list(MODULES)
    # Staged modules stay between runs (a rebuild of one module keeps the others).
    staged = os.path.join(work, "staged")
    record = os.path.join(staged, "built.json")
    built = json.load(open(record)) if os.path.isfile(record) else {}
    for i, uri in enumerate(uris, 1):
        if uri in built and os.path.isfile(os.path.join(staged, uri, f"{uri}.so")) and not args.force:
            print(f"[{i}/{len(uris)}] {uri}: staged earlier ({built[uri]['seconds']} s then)")
            continue
        start = time.perf_counter()
        print(f"[{i}/{len(uris)}] {uri}: compiling (minutes on a few cores) ...", flush=True)
        # A child process: FlashInfer reads FLASHINFER_* and CUDA_HOME at import.
        child = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--build-one", uri],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            sys.stderr.write((child.stdout + child.stderr)[-6000:])
            raise SystemExit(f"{uri}: the build failed (exit {child.returncode})")
        so = child.stdout.strip().splitlines()[-1]
        dest = os.path.join(staged, uri)
        os.makedirs(dest, exist_ok=True)
        shutil.copy(so, os.path.join(dest, f"{uri}.so"))
        built[uri] = dict(uri=uri, bytes=os.path.getsize(so), seconds=round(time.perf_counter() - start))
        with open(record, "w") as f:
            json.dump(built, f, indent=1)
        print(f"[{i}/{len(uris)}] {uri}: {built[uri]['bytes'] / 2**20:.1f} MiB in {built[uri]['seconds']} s")
    missing = [uri for uri in MODULES if uri not in built]
    if missing:
        print(f"not packed: {', '.join(missing)} are not built yet (run without --only)")
        return
    os.makedirs(out, exist_ok=True)
    archive = os.path.join(out, "flashinfer-aot.tar.xz")
    print(f"packing {archive} (xz) ...", flush=True)
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for uri in MODULES:
            tar.add(os.path.join(staged, uri), arcname=uri)
    from tests.gpu_kit.bundle import sha256

    manifest = dict(
        built_by="python tests/gpu_kit/aot.py",
        flashinfer_version=flashinfer.__version__,
        arch=args.arch,
        nvcc=subprocess.run(["nvcc", "--version"], capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1],
        archive=dict(file="flashinfer-aot.tar.xz", sha256=sha256(archive), bytes=os.path.getsize(archive)),
        modules=[built[uri] for uri in MODULES],
    )
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"{archive}: {len(MODULES)} modules, {os.path.getsize(archive) / 2**20:.1f} MiB (xz)")


if __name__ == "__main__":
    main()

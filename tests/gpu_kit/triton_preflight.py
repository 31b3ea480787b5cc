"""SGLang's Triton kernels that `make gpu-matrix` needs, compiled here for the GPU machine's
sm_90 by the GPU machine's Triton (3.6.0), without a GPU.

    make triton-preflight        # triton==3.6.0 into .venv/triton-3.6.0 once, then this
    PYTHONPATH=.venv/triton-3.6.0 python -m tests.gpu_kit.triton_preflight [--cases a,b]
                                               [--all-configs] [--out F.json] [--triton any]

SGLang 0.5.23's Triton kernels are written against the Triton of its torch (3.8 here); the GPU
machine has 3.6.0, and nothing there can install another. A kernel that does not compile under
3.6 stops its family at the first forward, after minutes of device time; here it is found in
seconds, by name.

How: each case calls SGLang's own wrapper (the function its backends call) with CPU tensors of
a matrix family's shapes and dtypes, with Triton made compile-only:
* a stand-in driver (`CompileOnlyDriver`): device 0, stream 0, target sm_90 with warps of 32;
* every launch (`JITFunction.run`) compiles for that target and returns without running
  (Triton specializes on dtypes, integer values and 16-byte alignment, never on where a
  tensor lives), so the outputs stay unwritten;
* an autotuned kernel compiles its first config (`--all-configs`: every config, as the GPU
  machine's first use benchmarks them all);
* a constexpr that a wrapper derives from where its tensors live takes the value CUDA tensors
  give (`CUDA_CONSTEXPRS`);
* torch.cuda answers as an H200 would (capability 9.0, 132 SMs) for the wrappers' and the
  kernel modules' own queries, set before SGLang is imported.

Each case reports the kernels it compiled, or the first error with the kernel it came from.
Exit 1 if any kernel failed to compile; a case whose wrapper could not be driven on CPU (a
harness limit, not a Triton one) is reported as such and does not fail the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import types
from typing import Callable

REPO = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)
from tests.gpu_kit.serve.families import BY_NAME, MLA_AS_PUBLISHED  # noqa: E402

TRITON_VERSION = "3.6.0"  # the GPU machine's (tests/gpu_kit/README.md, "The machine")
TARGET = ("cuda", 90, 32)  # backend, compute capability, warp size: H100 and H200
# What an H200 reports, for the wrappers that size grids or blocks from the device.
H200 = dict(
    name="NVIDIA H200",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=141 * 2**30,
    L2_cache_size=60 * 2**20,
    warp_size=32,
    max_shared_memory_per_block_optin=232448,
    shared_memory_per_block_optin=232448,
    regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048,
    gcnArchName="",
)


# Constexprs a wrapper derives from where its tensors live: set to what CUDA tensors give, so the
# variant compiled is the GPU's. E.g., the verify's sigmoid-gated update splits its grid by
# request and value head only for CUDA tensors (`split_n_hv_grid = q.device.type == "cuda"`).
CUDA_CONSTEXPRS = {"fused_sigmoid_gating_delta_rule_update_kernel": {"SPLIT_N_HV_GRID": True}}


class CompileError(Exception):
    """A kernel that Triton failed to compile: the finding this script exists for."""

    def __init__(self, kernel: str, error: BaseException):
        super().__init__(f"{kernel}: {type(error).__name__}: {str(error).strip()[-1500:]}")
        self.kernel = kernel


class CompileOnlyDriver:
    """Triton's active driver, answering for one sm_90 device that nothing runs on."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(*TARGET)
        self.utils = types.SimpleNamespace(get_device_properties=self.device_properties)

    @staticmethod
    def device_properties(device=0) -> dict:
        return {
            "multiprocessor_count": H200["multi_processor_count"],
            "max_shared_mem": H200["max_shared_memory_per_block_optin"],
            "max_num_regs": H200["regs_per_multiprocessor"],
            "warpSize": H200["warp_size"],
        }

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device) -> None:
        pass

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_device_interface(self):
        import torch

        return torch.cuda

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self) -> bool:
        return True

    def get_benchmarker(self):
        raise RuntimeError("compile-only: nothing is benchmarked")


class Compiled:
    """The kernels compiled so far, in order: [(kernel name, constexprs)]."""

    def __init__(self):
        self.kernels: list = []


def pretend_h200() -> None:
    """torch.cuda answers as an H200 (before SGLang is imported: its kernel modules ask at import)."""
    import torch

    props = types.SimpleNamespace(**H200)
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: (H200["major"], H200["minor"])
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.get_device_name = lambda device=None: H200["name"]
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0


def without_device_contexts() -> None:
    """FLA's input guard enters torch.cuda.device(i) around each call: nothing to enter here."""
    import contextlib

    from sglang.kernels.ops.attention.fla import utils

    utils.custom_device_ctx = lambda index: contextlib.nullcontext()


def compile_only(all_configs: bool, version: str = TRITON_VERSION) -> Compiled:
    """Make every Triton launch compile for sm_90 and return (see the module's docstring), under
    Triton `version` ("any": whichever is imported, to tell a Triton change from a shape SGLang
    does not take)."""
    import triton
    from triton.runtime import autotuner, jit
    from triton.runtime.driver import driver

    if version not in ("any", triton.__version__):
        raise SystemExit(
            f"Triton {triton.__version__} is imported, not {version}: run under "
            "PYTHONPATH=.venv/triton-3.6.0 (make triton-preflight installs it there)"
        )
    driver.set_active(CompileOnlyDriver())
    compiled, launch = Compiled(), jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kwargs.update(CUDA_CONSTEXPRS.get(self.fn.__name__, {}))
        try:
            kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as error:
            raise CompileError(self.fn.__qualname__, error) from error
        compiled.kernels.append(self.fn.__qualname__)
        return kernel

    def tune(self, *args, **kwargs):
        kwargs.pop("warmup", None)
        self.nargs = dict(zip(self.arg_names, args))
        try:
            configs = self.prune_configs(kwargs)
            for config in configs if all_configs else configs[:1]:
                self.fn.run(*args, **kwargs, **config.all_kwargs(), warmup=True)
        finally:
            self.nargs = None

    jit.JITFunction.run = run
    autotuner.Autotuner.run = tune
    return compiled


# ---- the cases: SGLang's wrappers at the matrix families' shapes ---------------------------------
# The families' targets (tests/gpu_kit/serve/families.py, shaped like tests/support/tiny/qwen3.py's target
# "a"): hidden 64, 4 query / 2 KV heads of 16 (Qwen3-MoE's of 64), windows of 8 (SGLang passes
# 7), MLA with the published latent (families.MLA_AS_PUBLISHED) and nope 32; 4 experts, top 2,
# experts' width 32, DeepSeek's routed scaling 2.5; Gated DeltaNet with 2 key / 4 value heads of
# 16 and a convolution of 4. Index dtypes and argument values are those SGLang's Triton backend
# passes (triton_backend.py, gdn_backend.py, the MoE runner).

CASES: dict[str, Callable] = {}
HQ, HKV, D, WINDOW = 4, 2, 16, 7
QWEN3_MOE_D = BY_NAME["qwen3_moe"].head_dim  # 64: see families.py
MLA_LORA, MLA_ROPE = MLA_AS_PUBLISHED["kv_lora_rank"], MLA_AS_PUBLISHED["qk_rope_head_dim"]
MLA_NOPE = 32  # tests/support/tiny/families.py's MLA_SHAPE
EXPERTS, TOPK, HIDDEN, EXPERT_WIDTH = 4, 2, 64, 32
GDN_H, GDN_HV, GDN_D, CONV = 2, 4, 16, 4
POOL = 64  # KV pool slots


def case(name: str):
    def register(fn):
        CASES[name] = fn
        return fn

    return register


def dtypes() -> list:
    import torch

    return [torch.bfloat16, torch.float32]  # the matrix serves bf16, and llama_fp32 in float32


@case("attention-extend")
def attention_extend() -> None:
    """Prefill and target verify on the Triton backend (extend_attention_fwd): GQA, gpt-oss's
    sinks and windows, Gemma-4's windows, both MLA forms; each verify as DFLASH passes it,
    eager and in its CUDA graph, and with EAGLE's custom mask."""
    import torch
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    lens, prefix = [7, 3], [5, 0]  # two requests: extend and prefix lengths
    qo = torch.tensor([0, 7, 10], dtype=torch.int64)
    kv_indptr = torch.tensor([0, 5, 5], dtype=torch.int32)
    kv_indices = torch.arange(1, 6, dtype=torch.int64)

    def call(dtype, hq=HQ, hkv=HKV, dqk=D, dv=D, window=-1, sinks=False, verify=None, buffers=None):
        """`verify`: None (prefill: qo_indptr int64, no mask), or a target verify as SGLang's
        Triton backend passes it: "mask" (a custom mask, EAGLE's), "eager" (DFLASH's: no mask,
        qo_indptr int32, window offsets int64) or "graph" (its CUDA graph's buffers: qo_indptr
        int64, window offsets int32); a verify always has a mask_indptr."""
        q = torch.randn(10, hq, dqk, dtype=dtype)
        k, v = torch.randn(10, hkv, dqk, dtype=dtype), torch.randn(10, hkv, dv, dtype=dtype)
        o = torch.empty(10, hq, dv, dtype=dtype)
        k_buffer, v_buffer = buffers or (
            torch.zeros(POOL, hkv, dqk, dtype=dtype),
            torch.zeros(POOL, hkv, dv, dtype=dtype),
        )
        extra = {}
        if window > 0:  # a window layer's rail starts at prefix - min(prefix, window)
            wide = verify in ("mask", "eager")
            extra["window_kv_offsets"] = torch.zeros(2, dtype=torch.int64 if wide else torch.int32)
        custom_mask, mask_indptr, indptr = None, None, qo
        if verify is not None:
            indptr = qo if verify == "graph" else qo.to(torch.int32)
            sizes = torch.tensor([e * (p + e) for e, p in zip(lens, prefix)])
            mask_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
        if verify == "mask":  # a full bool mask over prefix + block per request
            custom_mask = torch.ones(int(mask_indptr[-1]), dtype=torch.bool)
        extend_attention_fwd(
            q,
            k,
            v,
            o,
            k_buffer,
            v_buffer,
            indptr,
            kv_indptr,
            kv_indices,
            custom_mask,
            True,
            mask_indptr,
            max(lens),
            1.0,
            1.0,
            dqk**-0.5,
            logit_cap=0.0,
            sliding_window_size=window,
            sinks=torch.zeros(hq, dtype=dtype) if sinks else None,
            xai_temperature_len=-1,
            page_size=1,
            extend_seq_lens_cpu=lens,
            **extra,
        )

    def prefill_and_verify(dtype, **shape):
        for verify in (None, "mask", "eager", "graph"):
            call(dtype, verify=verify, **shape)

    bf16 = torch.bfloat16
    for dtype in dtypes():
        prefill_and_verify(dtype)  # Llama, the hybrids' full layers
    prefill_and_verify(bf16, dqk=QWEN3_MOE_D, dv=QWEN3_MOE_D)  # Qwen3-MoE
    prefill_and_verify(bf16, window=WINDOW, sinks=True)  # gpt-oss: window layers, with sinks
    prefill_and_verify(bf16, sinks=True)  # and its full layers
    prefill_and_verify(bf16, window=WINDOW)  # Gemma-4's window layers
    mla = mla_latent(bf16)
    call(bf16, hkv=HQ, dqk=MLA_NOPE + MLA_ROPE, dv=MLA_NOPE, buffers=mla)  # MLA's fresh prefill, as MHA
    prefill_and_verify(bf16, hkv=1, dqk=MLA_LORA + MLA_ROPE, dv=MLA_LORA, buffers=mla)  # absorbed


def mla_latent(dtype) -> tuple:
    """MLA's KV pool as SGLang's Triton backend reads it: the latent and RoPE key of each token,
    and as values the latent, its first columns."""
    import torch

    latent = torch.zeros(POOL, 1, MLA_LORA + MLA_ROPE, dtype=dtype)
    return latent, latent[..., :MLA_LORA]


@case("attention-decode")
def attention_decode() -> None:
    """Decode on the Triton backend (decode_attention_fwd, with its KV-split count kernel):
    GQA, gpt-oss's sinks, MLA absorbed."""
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    batch, splits = 2, 8  # --triton-attention-num-kv-splits' default
    kv_indptr = torch.tensor([0, 6, 16], dtype=torch.int32)
    kv_indices = torch.arange(1, 17, dtype=torch.int64)
    num_kv_splits, uneven = torch.empty(batch, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    get_num_kv_splits_triton[(1,)](
        num_kv_splits,
        torch.tensor([6, 10]),
        batch,
        1,
        HQ,
        HKV,
        splits,
        H200["multi_processor_count"],
        MAX_NUM_SEQ=256,
        uneven_batch_ptr=uneven,
    )

    def call(dtype, hkv=HKV, dk=D, dv=D, sinks=False, mla=False, buffers=None):
        q, o = torch.randn(batch, HQ, dk, dtype=dtype), torch.empty(batch, HQ, dv, dtype=dtype)
        k_buffer, v_buffer = buffers or (
            torch.zeros(POOL, hkv, dk, dtype=dtype),
            torch.zeros(POOL, hkv, dv, dtype=dtype),
        )
        logits = torch.empty(batch, HQ, splits, dv, dtype=torch.float32)
        lse = torch.empty(batch, HQ, splits, dtype=torch.float32)
        decode_attention_fwd(
            q,
            k_buffer,
            v_buffer,
            o,
            kv_indptr,
            kv_indices,
            logits,
            lse,
            num_kv_splits,
            splits,
            dk**-0.5,
            1.0,
            1.0,
            logit_cap=0.0,
            sinks=torch.zeros(HQ, dtype=dtype) if sinks else None,
            xai_temperature_len=-1,
            has_mla=mla,
            use_pdl=True,
            page_size=1,
            enable_lean=False,
            uneven_batch=uneven,
        )

    for dtype in dtypes():
        call(dtype)
    call(torch.bfloat16, dk=QWEN3_MOE_D, dv=QWEN3_MOE_D)
    call(torch.bfloat16, sinks=True)
    call(
        torch.bfloat16,
        hkv=1,
        dk=MLA_LORA + MLA_ROPE,
        dv=MLA_LORA,
        mla=True,
        buffers=mla_latent(torch.bfloat16),
    )


@case("fused-moe")
def fused_moe() -> None:
    """The Triton MoE runner's kernels (invoke_fused_moe_kernel twice, as
    _fused_moe_kernel_sequence does), its softmax top-k gate and its top-k sum (DeepSeek's routed
    scaling of 2.5 takes it at 32 tokens or fewer)."""
    import torch
    import triton.language as tl
    from sglang.kernels.ops.moe import fused_moe_triton_kernels as kernels
    from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate

    bf16 = torch.bfloat16
    for tokens in (4, 40):  # SGLang's default configs for M <= E and above
        x = torch.randn(tokens, HIDDEN, dtype=bf16)
        w1 = torch.randn(EXPERTS, 2 * EXPERT_WIDTH, HIDDEN, dtype=bf16)
        w2 = torch.randn(EXPERTS, HIDDEN, EXPERT_WIDTH, dtype=bf16)
        weights, _ = moe_fused_gate(
            torch.randn(tokens, EXPERTS, dtype=bf16), None, TOPK, scoring_func="softmax", renormalize=True
        )
        ids = torch.randint(0, EXPERTS, (tokens, TOPK), dtype=torch.int32)  # the gate only compiled
        small = tokens <= EXPERTS
        config = dict(
            BLOCK_SIZE_M=16 if small else 64,
            BLOCK_SIZE_N=32 if small else 64,
            BLOCK_SIZE_K=64 if small else 32,
            GROUP_SIZE_M=1 if small else 8,
        )
        sorted_ids, expert_ids, padded = align_block_size(ids, config["BLOCK_SIZE_M"], EXPERTS)
        quant = dict(
            compute_type=tl.bfloat16,
            use_fp8_w8a8=False,
            use_int8_w8a8=False,
            use_int8_w8a16=False,
            use_int4_w4a16=False,
            per_channel_quant=False,
            block_shape=None,
        )
        up = torch.empty(tokens * TOPK, 2 * EXPERT_WIDTH, dtype=bf16)
        kernels.invoke_fused_moe_kernel(
            x,
            w1,
            None,
            up,
            None,
            None,
            None,
            weights,
            ids,
            sorted_ids,
            expert_ids,
            padded,
            False,
            TOPK,
            config,
            c_sorted=False,
            b_use_tma=False,
            filter_expert=False,
            fuse_swiglu=False,
            **quant,
        )
        down = torch.empty(tokens, TOPK, HIDDEN, dtype=bf16)
        kernels.invoke_fused_moe_kernel(
            torch.randn(tokens * TOPK, EXPERT_WIDTH, dtype=bf16),
            w2,
            None,
            down,
            None,
            None,
            None,
            weights,
            ids,
            sorted_ids,
            expert_ids,
            padded,
            True,
            1,
            config,
            a_use_tma=False,
            b_use_tma=False,
            filter_expert=False,
            fuse_sum_all_reduce=False,
            router_topk=TOPK,
            **quant,
        )
        if tokens <= 32:
            kernels.moe_sum_reduce_triton(down, torch.empty(tokens, HIDDEN, dtype=bf16), 2.5)


def align_block_size(ids, block: int, experts: int):
    """moe_align_block_size's outputs for the MoE kernels' arguments, as SGLang's wrapper sizes
    them (triton_utils/moe_align_block_size.py; its Triton small-batch path does not apply to 4
    experts), from the sgl_kernel op the GPU machine serves: the kit's stand-in, loaded from its
    file (importing SGLang's wrapper would load the venv's sgl_kernel, which needs a driver)."""
    import importlib.util

    import torch

    path = os.path.join(REPO, "tests", "gpu_kit", "serve", "standin", "sgl_kernel", "moe.py")
    spec = importlib.util.spec_from_file_location("standin_moe", path)
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    n, buckets = ids.numel(), experts + 1  # SGLang's +1 bucket for experts filtered out
    size = n * block if n < buckets else n + buckets * (block - 1)
    size = (size + 3) // 4 * 4  # the kernel pads with int4 stores
    sorted_ids = torch.empty(size, dtype=torch.int32)
    expert_ids = torch.empty((size + block - 1) // block, dtype=torch.int32)
    padded = torch.empty(1, dtype=torch.int32)
    cumsum = torch.empty(experts + 2, dtype=torch.int32)
    standin.moe_align_block_size(ids, buckets, block, sorted_ids, expert_ids, padded, cumsum, True)
    return sorted_ids, expert_ids, padded


@case("gated-deltanet")
def gated_deltanet() -> None:
    """Qwen3.5 / Qwen3-Next's linear attention on CUDA (gdn_backend.py's Triton kernels): the
    prefill (convolution, split, gating, chunked delta rule), the decode (fused projection and
    convolution update, packed recurrent step) and the target verify (convolution update with
    intermediate windows, sigmoid-gated recurrent update with intermediate states)."""
    import torch
    from sglang.kernels.ops.attention import triton_gdn_fused_proj as proj
    from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule
    from sglang.kernels.ops.attention.fla.fused_recurrent import (
        fused_recurrent_gated_delta_rule_packed_decode,
    )
    from sglang.kernels.ops.attention.linear import fused_sigmoid_gating_recurrent as sigmoid_gating
    from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating
    from sglang.kernels.ops.mamba import causal_conv1d_triton as conv

    bf16, slots = torch.bfloat16, 8
    qkv_dim, z_dim = 2 * GDN_H * GDN_D + GDN_HV * GDN_D, GDN_HV * GDN_D
    conv_states = torch.zeros(slots + 1, qkv_dim, CONV - 1, dtype=bf16)
    conv_weight = torch.randn(qkv_dim, CONV, dtype=bf16)
    ssm = torch.zeros(slots + 1, GDN_HV, GDN_D, GDN_D, dtype=torch.float32)
    a_log, dt_bias = torch.randn(GDN_HV), torch.ones(GDN_HV, dtype=bf16)
    cache = torch.tensor([1, 2], dtype=torch.int32)
    # Prefill: two requests of 7 and 3 tokens.
    starts = torch.tensor([0, 7, 10], dtype=torch.int32)
    qkvz, ba = torch.randn(10, qkv_dim + z_dim, dtype=bf16), torch.randn(10, 2 * GDN_HV, dtype=bf16)
    mixed, _, b, a = proj.qwen3_5_gdn_prefill_projection_views(qkvz, ba, GDN_H, GDN_HV, GDN_D, GDN_D)
    x = conv.causal_conv1d_fn(
        mixed.transpose(0, 1),
        conv_weight,
        None,
        conv_states=conv_states,
        query_start_loc=starts,
        seq_lens_cpu=[7, 3],
        cache_indices=cache,
        has_initial_state=torch.tensor([True, False]),
        activation="silu",
    ).transpose(0, 1)
    q, k, v = proj.fused_qkv_split_gdn_prefill(x, GDN_H, GDN_H, GDN_HV, GDN_D, GDN_D, GDN_D)
    g, beta = fused_gdn_gating(a_log, a, b, dt_bias)
    chunk_gated_delta_rule(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=ssm,
        initial_state_indices=cache,
        cu_seqlens=starts,
        head_first=False,
        use_qk_l2norm_in_kernel=True,
        inplace_update=True,
    )
    # Decode: two requests. Its eligibility check asks for CUDA tensors (it chooses, on CUDA,
    # between this fused kernel and a split one): what is compiled here is the one CUDA takes.
    proj.can_use_fused_qkvzba_causal_conv1d_update_contiguous = lambda *args, **kwargs: (True, "eligible")
    qkvz, ba = torch.randn(2, qkv_dim + z_dim, dtype=bf16), torch.randn(2, 2 * GDN_HV, dtype=bf16)
    mixed, _, b, a = proj.fused_qkvzba_causal_conv1d_update_contiguous(
        qkvz,
        ba,
        conv_states,
        conv_weight,
        None,
        cache,
        qkv_dim=qkv_dim,
        v_dim=z_dim,
        num_v_heads=GDN_HV,
        head_v_dim=GDN_D,
        activation="silu",
    )
    fused_recurrent_gated_delta_rule_packed_decode(
        mixed_qkv=mixed,
        a=a,
        b=b,
        A_log=a_log,
        dt_bias=dt_bias,
        scale=GDN_D**-0.5,
        initial_state=ssm,
        out=mixed.new_empty(2, 1, GDN_HV, GDN_D),
        ssm_state_indices=cache,
        use_qk_l2norm_in_kernel=True,
    )
    # Target verify: two requests of a block of 4.
    block, tokens = 4, 8
    qkvz, ba = torch.randn(tokens, qkv_dim + z_dim, dtype=bf16), torch.randn(tokens, 2 * GDN_HV, dtype=bf16)
    mixed, _, b, a = proj.fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, GDN_H, GDN_HV, GDN_D, GDN_D)
    windows = torch.zeros(slots + 1, qkv_dim, block + CONV - 2, dtype=bf16)  # SGLang's shared window layout
    windows = windows.as_strided(
        (slots + 1, block, qkv_dim, CONV - 1), (windows.stride(0), 1, windows.stride(1), 1)
    )
    rows = torch.arange(2, dtype=torch.int32)
    y = conv.causal_conv1d_update(
        mixed.view(2, block, -1).transpose(1, 2),
        conv_states,
        conv_weight,
        None,
        "silu",
        conv_state_indices=cache,
        intermediate_conv_window=windows,
        intermediate_state_indices=rows,
    )
    mixed = y.transpose(1, 2).reshape(tokens, -1)
    qv, kv, vv = torch.split(mixed, [GDN_H * GDN_D, GDN_H * GDN_D, GDN_HV * GDN_D], dim=-1)
    sigmoid_gating.fused_sigmoid_gating_delta_rule_update(
        A_log=a_log,
        dt_bias=dt_bias,
        q=qv.reshape(1, tokens, GDN_H, GDN_D),
        k=kv.reshape(1, tokens, GDN_H, GDN_D),
        v=vv.reshape(1, tokens, GDN_HV, GDN_D),
        a=a,
        b=b,
        initial_state_source=ssm,
        initial_state_indices=cache,
        cu_seqlens=torch.arange(0, 3 * block, block, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0,
        softplus_threshold=20.0,
        is_kda=False,
        disable_state_update=True,
        intermediate_states_buffer=torch.zeros(slots + 1, block, GDN_HV, GDN_D, GDN_D),
        intermediate_state_indices=rows,
        cache_steps=block,
        retrieve_parent_token=None,
    )


@case("grammar-mask")
def grammar_mask() -> None:
    """A grammar's token bitmask applied to the logits on CUDA (SGLang's xgrammar backend takes
    its Triton kernel there), over the tiny vocabulary and a real one, in both dtypes."""
    import torch
    from sglang.kernels.ops.grammar.bitmask_ops import apply_token_bitmask_inplace_triton

    for vocab in (384, 151936):
        for dtype in dtypes():
            logits = torch.randn(3, vocab, dtype=dtype)
            bitmask = torch.zeros(3, (vocab + 31) // 32, dtype=torch.int32)
            apply_token_bitmask_inplace_triton(logits, bitmask)


@case("gemma-norms")
def gemma_norms() -> None:
    """Gemma-4's Triton norms (its fused q/k/v RMSNorm, per head and per row, and the residual
    norm with the layer scalar), and the logits' float32 cast."""
    import torch
    from sglang.kernels.ops.activation.softcap import cast_to_float32_logits, softcap_to_float32_logits
    from sglang.kernels.ops.layernorm import gemma4_fused_ops as gemma

    bf16 = torch.bfloat16
    for rows, by_head in ((5, True), (300, False)):  # the wrapper's two grids (M <= 256 per head)
        qkv = torch.randn(rows, (HQ + 2 * HKV) * D, dtype=bf16)
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        weight = torch.ones(D, dtype=bf16)
        grid = (rows, HQ + 2 * HKV) if by_head else (rows,)
        gemma._gemma_qkv_rmsnorm_kernel[grid](
            q,
            k,
            v,
            weight,
            weight,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            NUM_Q_HEADS=HQ,
            NUM_KV_HEADS=HKV,
            HEAD_DIM=D,
            eps=1e-6,
            HAS_KV=True,
            BY_HEAD=by_head,
            BLOCK=16,
        )
    x = torch.randn(5, HIDDEN, dtype=bf16)
    gemma.gemma_rmsnorm_residual_scalar(
        x, torch.ones(HIDDEN, dtype=bf16), torch.randn_like(x), torch.ones(1), 1e-6
    )
    logits = torch.randn(5, 384, dtype=bf16)
    cast_to_float32_logits(logits, torch.empty(5, 384))
    softcap_to_float32_logits(logits, 30.0, torch.empty(5, 384))


def run_case(name: str, compiled: Compiled) -> dict:
    """One case: {"status": "compiled" | "failed" | "not driven", "kernels", "seconds", ...}."""
    start, before = time.perf_counter(), len(compiled.kernels)
    try:
        CASES[name]()
        status, detail = "compiled", None
    except CompileError as error:
        status, detail = "failed", str(error)
    except Exception as error:  # the wrapper could not be driven on CPU: a limit of this harness
        where = traceback.extract_tb(error.__traceback__)[-1]
        status = "not driven"
        detail = (
            f"{type(error).__name__}: {str(error)[:300]} ({os.path.basename(where.filename)}:{where.lineno})"
        )
    kernels = sorted(set(compiled.kernels[before:]))
    out = {"status": status, "kernels": kernels, "seconds": round(time.perf_counter() - start, 1)}
    if detail:
        out["error"] = detail
    return out


def triton_version() -> str:
    import triton

    return triton.__version__


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="", help=f"comma-separated, from {','.join(CASES)} (default: all)")
    p.add_argument("--all-configs", action="store_true", help="every autotune config, not the first")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument(
        "--triton", default=TRITON_VERSION, help="the Triton expected ('any': the one imported, to compare)"
    )
    args = p.parse_args(argv)
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    pretend_h200()
    compiled = compile_only(args.all_configs, args.triton)
    without_device_contexts()
    results = {}
    for name in names:
        results[name] = found = run_case(name, compiled)
        line = f"{name}: {found['status']} ({found['seconds']} s) {', '.join(found['kernels'])}"
        print(line + (f"\n    {found['error']}" if "error" in found else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"triton": triton_version(), "target": list(TARGET), "cases": results}, f, indent=1)
    failed = [n for n, r in results.items() if r["status"] == "failed"]
    print(f"{len(results) - len(failed)}/{len(results)} cases without a compile failure", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Make SGLang's CPU engine run on hosts without sgl-kernel's CPU build.

Run at interpreter start by `sglang_dflash_cpu.pth`; the hooks act only while
SGLANG_USE_CPU_ENGINE=1, read when a module is imported.

* The first `import sgl_kernel` tries the real module once; if it cannot load, the stand-ins in
  `sgl_kernel_shim/` are served as the package `sgl_kernel`, and one log line says so.
* A few SGLang modules are patched right after they are imported (`PATCHES`): where SGLang's
  CPU branch is gated on AMX support that the stand-ins replace, where a step of the
  speculative path is Triton-only, where the CPU attention lacks a term a model needs
  (gpt-oss's sinks), and where a model relies on a CUDA kernel writing in place (Llama-4's RoPE).

See docs/serving.md ("CPU").
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys

logger = logging.getLogger("sglang_dflash")


class _AlreadyLoaded(importlib.abc.Loader):
    """Hands the import system a module that is already imported, keeping its own spec."""

    def __init__(self, module):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec


class SglKernelFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "sgl_kernel" or not _cpu_engine():
            return None
        sys.meta_path.remove(self)  # decide once, then get out of the way
        try:
            module = importlib.import_module("sgl_kernel")
            return importlib.machinery.ModuleSpec(name, _AlreadyLoaded(module))
        except (ImportError, OSError) as error:
            for key in [k for k in sys.modules if k == "sgl_kernel" or k.startswith("sgl_kernel.")]:
                del sys.modules[key]
            shim = os.path.join(os.path.dirname(__file__), "sgl_kernel_shim")
            logger.info(
                "sgl_kernel cannot load on this host (%s); sglang_dflash serves its pure-PyTorch "
                "stand-ins (sglang_dflash/cpu/sgl_kernel_shim/) as sgl_kernel",
                str(error).strip().splitlines()[-1][:160],
            )
            return importlib.util.spec_from_file_location(
                name, os.path.join(shim, "__init__.py"), submodule_search_locations=[shim]
            )


def _stand_ins_serve_sgl_kernel() -> bool:
    import sgl_kernel

    return getattr(sgl_kernel, "IS_STAND_IN", False)


def _gated_norm_on_cpu(module) -> None:
    """The gated RMSNorm after the linear attention takes its CPU branch only with AMX (the
    real CPU build); the stand-ins provide the op that branch calls."""
    if _stand_ins_serve_sgl_kernel():
        module._use_cpu = True


def _commit_after_verify_on_cpu(module) -> None:
    """SGLang's post-verify mamba state commit is a Triton kernel that refuses CPU tensors."""
    from sglang_dflash.cpu import triton_ops

    module.scatter_mamba_states_after_mtp_verify = triton_ops.scatter_mamba_states_after_mtp_verify


def _shared_expert_gate_on_cpu(module) -> None:
    """Qwen2-MoE-style blocks (Qwen3-Next) gate the shared expert with a Triton kernel unless
    the gate runs on the AMX backend."""
    from sglang_dflash.cpu import triton_ops

    module.fused_gate_sigmoid_mul_add = triton_ops.fused_gate_sigmoid_mul_add


def _qk_norm_on_cpu(module) -> None:
    """MiniMax-M2 normalises q and k over all heads with two Triton kernels that assert CUDA
    tensors, unless the host has AMX."""
    from sglang_dflash.cpu import triton_ops

    module.rms_sumsq_serial = triton_ops.rms_sumsq_serial
    module.rms_apply_serial = triton_ops.rms_apply_serial


def _gated_delta_net_built_on_cpu(module) -> None:
    """Qwen3-Next builds its gated norm on `torch.get_device_module().current_device()`, which
    names CUDA with a CUDA build of torch (and fails without a GPU); the CPU engine means CPU.
    Only while a layer is built: torch.compile relies on the real function elsewhere."""
    import torch

    build = module.Qwen3GatedDeltaNet.__init__

    def __init__(self, *args, **kwargs):
        original = torch.get_device_module
        torch.get_device_module = lambda device=None: torch.cpu if device is None else original(device)
        try:
            build(self, *args, **kwargs)
        finally:
            torch.get_device_module = original

    module.Qwen3GatedDeltaNet.__init__ = __init__


def _mamba_auto_strategy_on_cpu(module) -> None:
    """`--mamba-radix-cache-strategy auto` picks extra_buffer whenever overlap scheduling is on,
    and extra_buffer then refuses CPU (it needs GPU state snapshots), so hybrid targets failed
    with default flags. Here auto sees what the platform supports and resolves to no_buffer
    with overlap scheduling off, as SGLang does where extra_buffer does not apply."""
    from sglang.srt.arg_groups import mamba_hook

    original = module.supports_mamba_cache_extra_buffer

    def supports_mamba_cache_extra_buffer(view, hf_config):
        return mamba_hook._platform_supports_mamba_cache_extra_buffer() and original(view, hf_config)

    module.supports_mamba_cache_extra_buffer = supports_mamba_cache_extra_buffer


def _host_buffers_unpinned_on_cpu(module) -> None:
    """Host-side capture buffers (`--enable-return-routed-experts`) are pinned with
    cudaHostRegister, which fails without a GPU; on the CPU engine they need no pinning."""

    def alloc_unpinned(dims, dtype, device, pin_memory, allocator, **kwargs):
        return allocator.allocate(dims, dtype=dtype, device=device)

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned


def _no_pynccl_on_cpu(module) -> None:
    """Tensor parallelism on the CPU engine: SGLang's process groups default to a PyNccl
    communicator, which refuses a CPU device; gloo (the group's own backend) does the work."""
    original = module.init_model_parallel_group

    def init_model_parallel_group(*args, use_pynccl=None, **kwargs):
        return original(*args, use_pynccl=False, **kwargs)

    module.init_model_parallel_group = init_model_parallel_group
    logger.info("CPU engine: SGLang's parallel groups communicate through gloo, without PyNccl")


def _mooncake_sender_indices_on_host(module) -> None:
    """Mooncake's sender is handed the page indices as a pinned host tensor copied
    asynchronously behind a CUDA event; without a GPU, the prefill side computes them on the
    host directly (SGLang's path for senders that do not take host tensors)."""
    module.MooncakeKVSender.supports_host_tensor_indices = False


def _no_early_prefix_send_on_cpu(module) -> None:
    """A PD prefill engine sends a radix-cached prefix early, behind a CUDA event recorded on
    the forward stream under overlap scheduling; the CPU engine has neither. The prefix then
    goes with the request's final send (the flag's documented off state), unless the user set
    the flag."""
    os.environ.setdefault("SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", "0")


def _hicache_copies_on_cpu(module) -> None:
    """SGLang's host KV pool (`--enable-hierarchical-cache`) imports its copy ops from
    sgl_kernel's kvcacheio on CUDA and ROCm only; on the CPU engine it gets the stand-ins."""
    from sglang_dflash.cpu import kvcacheio

    module.transfer_kv_all_layer_lf_pf = kvcacheio.transfer_kv_all_layer_lf_pf
    module.transfer_kv_per_layer_pf_lf = kvcacheio.transfer_kv_per_layer_pf_lf


def _attention_sinks_on_cpu(module) -> None:
    """gpt-oss passes attention sinks, which the torch_native backend (the CPU engine's attention
    without AMX) does not take; `paged_attention` serves those layers."""
    from sglang_dflash.cpu import paged_attention

    paged_attention.install(module)


def _no_triton_kernels_moe_on_cpu(module) -> None:
    """gpt-oss picks the `triton_kernel` MoE runner whenever the triton_kernels package imports
    and the host lacks AMX, which on the CPU engine fails at weight load; the CPU engine's own
    MoE path (`--moe-runner-backend auto`) serves it. A user's explicit choice is kept."""
    module.is_triton_kernels_available = lambda: False


def _cpu_moe_runner_for_mobius(module) -> None:
    """InternS2-Mobius turns `--moe-runner-backend auto` into `triton_kernel`, the runner SGLang
    validated for its 2,560-expert banks. That runner is GPU-only, and for it FusedMoE lays the
    expert weights out transposed, which the CPU engine then fails to load (a shape error on the
    first bank). On the CPU engine `auto` stays the CPU engine's own MoE path, as for gpt-oss."""
    from sglang.srt.arg_groups import model_override_base as base

    name = "InternS2MobiusForConditionalGeneration"
    providers = base._MODEL_OVERRIDE_FNS.get(name, [])
    base._MODEL_OVERRIDE_FNS[name] = [
        f for f in providers if f is not module._interns2_mobius_baseline_overrides
    ]


def _absorbed_mla_on_torch_native(module) -> None:
    """MLA targets (DeepSeek-V2/V3, Kimi-K2.5, GLM-4-MoE-Lite) under torch_native, the CPU
    engine's attention without AMX. torch_native has no handler of its own, so SGLang takes
    Triton's: a prefill without a cached prefix runs MLA as plain multi-head attention, handing
    the expanded per-head K and V to the backend. torch_native ignores them and reads K and V
    from the cache, which holds the compressed latent: a shape error on real configs, wrong
    logits where the dimensions happen to agree. The absorbed form (`AttnForwardMethod.MLA`,
    what every decode and verify runs) attends over that latent, so it serves every batch."""
    module.AttentionBackendRegistry.register(
        "torch_native", lambda attn, forward_batch: module._dispatch_mla_subtype(attn, forward_batch)
    )


def _plain_rope_for_mla_on_cpu(module) -> None:
    """SGLang's CPU rotary factory (what MLA attention asks for on the CPU engine) builds only
    DeepSeek's YaRN rotary and asserts when a config has no RoPE scaling (GLM-4-MoE-Lite); such
    configs get the plain rotary that `get_rope` builds for them on every other device."""
    original = module.get_rope_cpu

    def get_rope_cpu(head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None,
                     dtype=None, partial_rotary_factor=1.0, device=None):  # fmt: skip
        if rope_scaling is None:
            return module.get_rope(
                head_size, rotary_dim, max_position, base, is_neox_style, None, dtype, partial_rotary_factor
            )
        return original(
            head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
            partial_rotary_factor, device,
        )  # fmt: skip

    module.get_rope_cpu = get_rope_cpu


def _llama4_rope_in_place_on_cpu(module) -> None:
    """SGLang's Llama-4 attention calls its rotary on views of the fused q/k buffer and drops the
    result, relying on the rotary writing into the views, as CUDA's kernel does (on NPU it
    rebuilds the buffer from the result). On the CPU engine the rotary returns new tensors, so
    the layers ran without RoPE. Here each rotary built for a Llama-4 layer also writes its
    result into the views it was given."""
    import torch

    class RopeInPlace(torch.nn.Module):
        def __init__(self, rotary):
            super().__init__()
            self.rotary = rotary

        def forward(self, positions, query, key):
            # query [T, heads * d] and key [T, kv_heads * d]: strided views of one buffer.
            rotated_query, rotated_key = self.rotary(positions, query, key)
            query.copy_(rotated_query.reshape(query.shape))
            key.copy_(rotated_key.reshape(key.shape))
            return query, key

    build = module.Llama4Attention.__init__

    def __init__(self, *args, **kwargs):
        build(self, *args, **kwargs)
        if self.rotary_emb is not None:  # the NoPE layers have none
            self.rotary_emb = RopeInPlace(self.rotary_emb)

    module.Llama4Attention.__init__ = __init__


PATCHES = {
    "sglang.srt.models.llama4": _llama4_rope_in_place_on_cpu,
    "sglang.srt.layers.rotary_embedding.factory": _plain_rope_for_mla_on_cpu,
    "sglang.srt.models.deepseek_common.attention_backend_handler": _absorbed_mla_on_torch_native,
    "sglang.srt.arg_groups.model_overrides.gpt_oss": _no_triton_kernels_moe_on_cpu,
    "sglang.srt.arg_groups.model_overrides.interns2_mobius": _cpu_moe_runner_for_mobius,
    "sglang.srt.layers.attention.torch_native_backend": _attention_sinks_on_cpu,
    "sglang.srt.arg_groups.overrides": _mamba_auto_strategy_on_cpu,
    "sglang.srt.models.qwen3_next": _gated_delta_net_built_on_cpu,
    "sglang.srt.models.qwen2_moe": _shared_expert_gate_on_cpu,
    "sglang.srt.models.minimax_m2": _qk_norm_on_cpu,
    "sglang.kernels.ops.attention.fla.fused_norm_gate": _gated_norm_on_cpu,
    "sglang.kernels.ops.attention.fla.layernorm_gated": _gated_norm_on_cpu,
    "sglang.srt.layers.attention.hybrid_linear_attn_backend": _commit_after_verify_on_cpu,
    "sglang.srt.mem_cache.pool_host.common": _host_buffers_unpinned_on_cpu,
    "sglang.srt.distributed.parallel_state": _no_pynccl_on_cpu,
    "sglang.srt.disaggregation.mooncake.conn": _mooncake_sender_indices_on_host,
    "sglang.srt.disaggregation.prefill": _no_early_prefix_send_on_cpu,
    "sglang.srt.mem_cache.pool_host.mha": _hicache_copies_on_cpu,
}


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs PATCHES[name](module) right after module `name` is first executed."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES or not _cpu_engine():
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


def _cpu_engine() -> bool:
    """SGLang's own test (utils.is_cpu), read when a module is imported, not at start-up: a
    script may set the variable itself before it imports sglang."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def install() -> None:
    """Put the finders in place (every interpreter start, from the .pth); they act only under
    SGLang's CPU engine."""
    if any(isinstance(f, PatchAfterImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, PatchAfterImport())
    if "sgl_kernel" not in sys.modules:
        sys.meta_path.insert(0, SglKernelFinder())
    if _cpu_engine():
        for name, patch in PATCHES.items():
            if name in sys.modules:  # imported before this ran: patch it now
                patch(sys.modules[name])

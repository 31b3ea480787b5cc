"""Targets that SGLang 0.5.23 cannot run here, each with its reason.

DFLASH refuses them by name at start-up (`server_args.py`), in the launching process, instead of
failing in the scheduler after the weights have loaded (where SGLang's child-failure handler
takes the whole launching process down). The README's targets table takes its notes for them from
here (`scripts/targets_table.py`).

A class is matched by its name or an ancestor's, so SGLang's subclasses of a named class are
refused too.
"""

from __future__ import annotations

from typing import Optional

# Nemotron-H's Mamba2 mixer: `layers/attention/mamba/mamba.py` binds its convolution
# (`causal_conv1d_fn_triton`) on CUDA, NPU and XPU only; its chunked scan is Triton too.
MAMBA2 = (
    "its Mamba2 layers need Triton kernels that SGLang binds on CUDA, NPU and XPU only "
    "(causal_conv1d_fn_triton, the chunked scan)"
)
# LFM2's short convolution: `models/lfm2.py` verifies a draft block with
# `causal_conv1d_update_triton`, and the plain engine fails on a Triton driver already.
SHORT_CONV = (
    "its short convolution runs as a Triton kernel (causal_conv1d_update_triton in the verify "
    "forward), which needs a GPU"
)

# Classes whose SGLang 0.5.23 text path needs CUDA and that get past SGLang's server-args checks on
# the CPU engine, to fail in the scheduler without naming why: Kimi-K3 makes CUDA streams when its
# model is built (`KimiK3LinearModel.__init__`), MiniMax-M3 runs its block-sparse prefill as a
# Triton kernel after the weights load. (DeepSeek-V3.2, GLM-MoE-DSA, GLM-5-Next and Inkling stop
# earlier, in SGLang's own server-args resolution: see the targets table.)
KIMI_K3 = "its model creates CUDA streams when it is built, and its KDA linear attention runs on Triton only"
CUDA_ONLY: dict[str, str] = {
    "KimiK3ForConditionalGeneration": KIMI_K3,
    "KimiK3LinearForCausalLM": KIMI_K3,
    "MiniMaxM3SparseForConditionalGeneration": (
        "its block-sparse attention and top-k indexer run on Triton kernels only (SM100's MSA otherwise)"
    ),
}

CPU_ENGINE_CANNOT_RUN: dict[str, str] = {
    **CUDA_ONLY,
    **dict.fromkeys(
        (
            "NemotronHForCausalLM",
            "NemotronHPuzzleForCausalLM",
            "NemotronH_Nano_VL_V2",
            "NemotronH_Nano_Omni_Reasoning_V3",
            "NemotronH_Omni_Reasoning_V3",
        ),
        MAMBA2,
    ),
    **dict.fromkeys(("Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm2VlForConditionalGeneration"), SHORT_CONV),
}

# SGLang's MiMo-V2 layers hand `config.rope_scaling` to `get_rope`, which keys a cache on it.
# transformers 5's own MiMo-V2-Flash config (what SGLang loads without --trust-remote-code)
# aliases `rope_scaling` to its per-layer-type `rope_parameters`, a dict of dicts that cannot be
# hashed: the model fails to build, on every device.
PER_LAYER_ROPE_CLASSES = ("MiMoV2ForCausalLM",)
PER_LAYER_ROPE = (
    "SGLang's layers pass its per-layer-type RoPE settings (config.rope_scaling = {layer type: "
    "settings}, as transformers' own config class writes them) to get_rope, which cannot take them; "
    "launch with --trust-remote-code, so that the checkpoint's own config class is read, with flat "
    "settings (rope_theta, swa_rope_theta, partial_rotary_factor)"
)


# Classes whose SGLang 0.5.23 model drops the captured layers on every device. Qwen4-Exp:
# `Qwen4ExpModel.forward` returns (hidden states, hyper-connection streams) on every batch that is
# not idle, never the aux hidden states it collected, and `Qwen4ExpVLModel` hands the wrapper a
# plain tensor; the draft would get no target features (and each layer's stream is
# `hc_count` x hidden wide).
NO_CAPTURE: dict[str, str] = {
    "Qwen4ExpForConditionalGeneration": (
        "SGLang's model returns its hyper-connection streams in place of the captured layers, so "
        "the draft would get no target features"
    ),
}


# Classes SGLang 0.5.23 cannot build, on any device. InternS1-Pro: `InternS1ProTextDecoderLayer`
# takes no `start_layer`, which `Qwen2MoeModel` passes to every decoder layer it makes; the model
# fails with a TypeError after the launch, SGLang's built-in DFLASH and the engine without
# speculation too.
NOT_BUILT: dict[str, str] = {
    "InternS1ProForConditionalGeneration": (
        "SGLang's text decoder layer does not take the start_layer argument its model passes it, so "
        "the model fails to build (a TypeError), without speculation too"
    ),
}
# What DFLASH refuses on every device.
ANY_DEVICE = {**NO_CAPTURE, **NOT_BUILT}


def _names(model_cls: type) -> list[str]:
    return [klass.__name__ for klass in model_cls.__mro__]


def _reason(table: dict[str, str], model_cls: type) -> Optional[str]:
    """The reason `table` gives for `model_cls` or its nearest ancestor in it, or None."""
    return next((table[n] for n in _names(model_cls) if n in table), None)


def cpu_engine_refusal(model_cls: type) -> Optional[str]:
    """Why SGLang's CPU engine cannot run `model_cls` (or an ancestor), or None."""
    return _reason(CPU_ENGINE_CANNOT_RUN, model_cls)


def refusal(model_cls: type, config, device: str) -> Optional[str]:
    """Why DFLASH cannot serve this target on `device` ("on ...: reason"), or None. `config` is
    the target's config as SGLang loads it (the text config of a multimodal wrapper)."""
    rope = getattr(config, "rope_scaling", None)
    if (
        any(n in PER_LAYER_ROPE_CLASSES for n in _names(model_cls))
        and isinstance(rope, dict)
        and any(isinstance(v, dict) for v in rope.values())
    ):
        return f"with this config on any device: {PER_LAYER_ROPE}"
    reason = _reason(ANY_DEVICE, model_cls)
    if reason is not None:
        return f"on any device: {reason}"
    reason = cpu_engine_refusal(model_cls) if device == "cpu" else None
    return None if reason is None else f"on SGLang's CPU engine: {reason}"

"""Target classes that SGLang's CPU engine cannot run, each with its reason.

DFLASH on the CPU engine refuses them by name at start-up (`sglang/server_args.py`), in the
launching process, instead of failing in the scheduler after the weights have loaded. The README's
targets table takes its notes for them from here (`scripts/targets_table.py`).

A class is matched by its name or an ancestor's, so SGLang's subclasses of a refused class are
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

CPU_ENGINE_CANNOT_RUN: dict[str, str] = {
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


def cpu_engine_refusal(model_cls: type) -> Optional[str]:
    """Why SGLang's CPU engine cannot run `model_cls` (or an ancestor), or None."""
    for klass in model_cls.__mro__:
        reason = CPU_ENGINE_CANNOT_RUN.get(klass.__name__)
        if reason is not None:
            return reason
    return None

"""`sgl_kernel.mamba`: the causal-conv and chunked gated-delta-rule stand-ins (see
sglang_dflash/cpu/linear_attention.py)."""

from sglang_dflash.cpu.linear_attention import (  # noqa: F401
    causal_conv1d_fn_cpu,
    causal_conv1d_update_cpu,
    chunk_gated_delta_rule_cpu,
)

"""`is_arch_support_pdl`, which SGLang's Triton attention backend imports and calls."""

import functools


@functools.cache
def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch: Hopper (sm90) and newer, as sgl-kernel decides it."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

"""SGLang's SamplingBatchInfo as a proposer reads it."""

from types import SimpleNamespace

import torch

from sglang_dflash.verify.sampling import TOP_K_ALL


def greedy_and_sampled() -> SimpleNamespace:
    """SGLang's `SamplingBatchInfo` as a proposer reads it, for two requests at temperature 1:
    request 0 greedy (top_k 1), request 1 sampled."""
    return SimpleNamespace(
        is_all_greedy=False,
        temperatures=torch.tensor([[1.0], [1.0]]),
        top_ks=torch.tensor([1, TOP_K_ALL]),
        top_ps=torch.ones(2),
        min_ps=torch.zeros(2),
        sampling_seed=None,
        need_top_k_sampling=True,
        need_top_p_sampling=False,
        need_min_p_sampling=False,
    )

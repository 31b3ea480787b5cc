"""Small tensor builders for hand-written test cases."""

import torch


def T(rows):
    """An int64 tensor of `rows` (token ids, lengths, slots)."""
    return torch.tensor(rows, dtype=torch.int64)

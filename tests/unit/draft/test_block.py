"""The draft block's layout (draft/block.py): block ids and positions, slot gathers, on hand-built tensors."""

import torch

from sglang_dflash.draft.block import extend_positions, gather_slots, prepare_draft_block
from tests.support.tensors import T


def test_prepare_draft_block():
    ids, positions = prepare_draft_block(T([7, 9]), T([3, 5]), mask_token_id=1, block_size=3)
    assert ids.tolist() == [[7, 1, 1], [9, 1, 1]]
    assert positions.tolist() == [[3, 4, 5], [5, 6, 7]]


def test_gather_slots():
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    assert gather_slots(table, T([2, 0]), T([3, 5]), 2).tolist() == [[23, 24], [5, 6]]
    assert gather_slots(table, T([1, 3]), 0, 3).tolist() == [[10, 11, 12], [30, 31, 32]]


def test_extend_positions():
    assert extend_positions([0, 4], [2, 3], "cpu").tolist() == [0, 1, 4, 5, 6]

"""The draft's tensor-parallel shard against the unsharded draft on the same weights, in a real
two-process gloo group, and the vocab-parallel argmax against `torch.argmax`, ties included."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.draft.tensor_parallel import TensorParallel, check_ranks_agree, vocab_parallel_argmax
from tests.support.thread_group import ThreadGroup
from tests.support.tiny import draft_config_dict


def _sharded_argmax(logits: torch.Tensor, size: int, width: int) -> list[torch.Tensor]:
    """Each of `size` ranks holds `width` columns of the vocab (the last ones padding)."""
    vocab = logits.shape[-1]
    padded = F.pad(logits, (0, size * width - vocab), value=123.0)  # padding must never win

    def rank_fn(tp):
        start = tp.rank * width
        num_valid = max(0, min(width, vocab - start))
        return vocab_parallel_argmax(padded[..., start : start + width], start, num_valid, tp)

    return ThreadGroup(size).run(rank_fn)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_vocab_parallel_argmax_equals_torch_argmax_with_planted_ties(size):
    gen = torch.Generator().manual_seed(size)
    vocab = 37
    width = -(-vocab // size)  # ceil: the last rank holds padding
    logits = torch.randint(0, 4, (64, vocab), generator=gen).float()  # many ties, within and across shards
    logits[0] = 0.0  # all tied: id 0
    logits[1, [5, width + 1, vocab - 1]] = 9.0  # tied across shards: the lowest id wins
    logits[2, vocab - 1] = 9.0  # the max in the last (padded) shard
    want = torch.argmax(logits, dim=-1)
    for got in _sharded_argmax(logits, size, width):
        assert torch.equal(got, want)
    assert want[1] == 5 and want[2] == vocab - 1


def test_check_ranks_agree_names_the_rank_that_differs():
    same = torch.tensor([3, 1, 4])
    ThreadGroup(3).run(lambda tp: check_ranks_agree(tp, tokens=same))  # no error

    def differ(tp):
        try:
            check_ranks_agree(tp, tokens=same + (tp.rank == 2))
        except RuntimeError as e:
            return str(e)

    for rank, message in enumerate(ThreadGroup(3).run(differ)):
        want = "DFLASH tensor-parallel ranks disagree on tokens: rank 2 holds 4 at (0,), rank 0 3"
        assert message.startswith(f"{want} (rank {rank} of 3: "), message


def test_split_names_both_numbers():
    with pytest.raises(ValueError, match=r"KV heads \(1\) do not divide by the tensor-parallel size \(2\)"):
        TensorParallel(rank=0, size=2).split(1, "KV heads")


# ---------------------------------------------------------------- the draft, in a gloo group

CONFIG = draft_config_dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)
N_CONTEXT, N_BLOCK, K = 11, 8, 3


def _inputs():
    gen = torch.Generator().manual_seed(7)
    hidden = CONFIG["hidden_size"]
    return dict(
        target_features=torch.randn(N_CONTEXT, K * hidden, generator=gen),
        context_positions=torch.arange(N_CONTEXT),
        block_embeds=torch.randn(N_BLOCK, hidden, generator=gen),
        block_positions=torch.arange(N_CONTEXT, N_CONTEXT + N_BLOCK),
        lm_head=torch.randn(45, hidden, generator=gen),  # 45 ids: rank 1 holds padding
    )


def _weights(config: DFlashDraftConfig) -> dict:
    torch.manual_seed(3)
    model = DFlashDraftModel(config, K)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "rotary" not in k}


@torch.no_grad()
def _run_draft(model: DFlashDraftModel, inputs: dict):
    """Context K/V injection, then a block forward attending to context + block (non-causal),
    as the worker does, on whatever heads this rank holds."""
    context = model.fuse_target_features(inputs["target_features"])
    ctx_k, ctx_v = model.context_kv(context, inputs["context_positions"])  # [L, N, kv_heads, d]

    def attend(layer_id, q, k, v):
        keys = torch.cat([ctx_k[layer_id], k]).transpose(0, 1)  # [kv_heads, N, d]
        values = torch.cat([ctx_v[layer_id], v]).transpose(0, 1)
        groups = q.shape[1] // keys.shape[0]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
        )
        return out.transpose(0, 1)

    hidden = model(inputs["block_embeds"], inputs["block_positions"], attend)
    return ctx_k, ctx_v, hidden


def _rank(rank: int, size: int, port: int, queue, received) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        tp = TensorParallel(
            rank=rank,
            size=size,
            all_reduce=lambda x: (dist.all_reduce(x), x)[1],
            all_gather=lambda x: _gather(x, size),
        )
        config = DFlashDraftConfig.from_dict(CONFIG)
        with torch.device("meta"):
            model = DFlashDraftModel(config, K, tp)
        model.load_checkpoint_state(_weights(config))
        model = model.to("cpu").float()
        inputs = _inputs()
        ctx_k, ctx_v, hidden = _run_draft(model, inputs)
        head = inputs["lm_head"]
        width = -(-head.shape[0] // size)
        local = hidden @ tp.shard(torch.cat([head, head.new_zeros(size * width - head.shape[0], 64)]), 0).T
        proposals = vocab_parallel_argmax(
            local, rank * width, max(0, min(width, head.shape[0] - rank * width)), tp
        )
        queue.put((rank, ctx_k, ctx_v, hidden, proposals))
        # The parent maps these tensors from this process's shared memory: stay until it has.
        received.wait(timeout=120)
    finally:
        dist.destroy_process_group()


def _gather(x: torch.Tensor, size: int) -> torch.Tensor:
    out = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(out, x.contiguous())
    return torch.stack(out)


def test_sharded_draft_equals_the_unsharded_draft_in_a_gloo_group():
    config = DFlashDraftConfig.from_dict(CONFIG)
    full = DFlashDraftModel(config, K)
    full.load_checkpoint_state(_weights(config))
    inputs = _inputs()
    want_k, want_v, want_hidden = _run_draft(full, inputs)
    want_proposals = torch.argmax(want_hidden @ inputs["lm_head"].T, dim=-1)

    size = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue, received = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rank, args=(r, size, port, queue, received)) for r in range(size)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=120) for _ in procs), key=lambda r: r[0])
    received.set()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    kv_heads = config.num_key_value_heads // size
    for rank, ctx_k, ctx_v, hidden, proposals in results:
        # Each rank injects exactly its KV heads of the unsharded draft's context K/V.
        heads = slice(rank * kv_heads, (rank + 1) * kv_heads)
        assert ctx_k.shape[2] == kv_heads
        torch.testing.assert_close(ctx_k, want_k[:, :, heads], rtol=0, atol=1e-6)
        torch.testing.assert_close(ctx_v, want_v[:, :, heads], rtol=0, atol=1e-6)
        # The block's hidden states are whole on every rank, equal to fp32 rounding.
        torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
        assert torch.equal(proposals, want_proposals)
    # Control: the shards did differ (a rank that ignored its slice would hold all the heads).
    assert not torch.allclose(results[0][1], results[1][1])

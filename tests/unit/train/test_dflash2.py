"""DFlash2 training (`--family dflash2`, `train/selector.py`), CPU only.

Oracles: a per-slot loop over the selector's formula (the loss, with the gold token inserted
where the top K miss it); the serving lattice and its greedy walk (`propose/selector.py`: the
training scores are its rows, and the walk's accepted runs are the ones logged); a draft trained
one step with and without the selector's stop-gradient; the serving path and SGLang's config
parser (the export). The grouped convolution's training forward is checked against serving in
`test_recipe.py` (`test_training_forward_matches_serving`).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from sglang_dflash.propose.selector import CandidateSelector, walk
from sglang_dflash.train.config import TrainConfig, TrainConfigError
from sglang_dflash.train.objective import Blocks, block_loss, loss_weights
from sglang_dflash.train.selector import SelectorLoss, insert_gold

VOCAB, HIDDEN, RANK, TOP_K = 48, 16, 4, 4
B, A = 5, 3  # block size, anchors per sequence


def _selector(seed: int = 0) -> CandidateSelector:
    gen = torch.Generator().manual_seed(seed)
    selector = CandidateSelector(HIDDEN, VOCAB, RANK, TOP_K)
    with torch.no_grad():
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
            p.requires_grad_(True)
    return selector


def _inputs(seed: int = 1):
    """Hidden states [2, A, B, H], an LM head [V, H], and blocks labelled with random tokens
    (the top K of a random head miss most of them, so the insertion is exercised)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, A, B, HIDDEN, generator=gen, requires_grad=True)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (2, A, B - 1), generator=gen)
    block_ids = torch.full((2, A, B), 1)
    block_ids[:, :, 0] = torch.randint(2, VOCAB, (2, A), generator=gen)
    valid = torch.ones(2, A, B - 1, dtype=torch.bool)
    valid[1, 2, 2:] = False  # an incomplete block: labelled slots 1..2 only
    blocks = Blocks(
        torch.zeros(2, A, dtype=torch.int64), block_ids, torch.zeros_like(block_ids), labels, valid
    )
    return hidden, head, blocks


def test_insert_gold_worked_example():
    candidates = torch.tensor([[5, 9, 2], [4, 7, 1]])
    inserted, index, in_top_k = insert_gold(candidates, torch.tensor([9, 3]))
    assert inserted.tolist() == [[5, 9, 2], [4, 7, 3]]
    assert index.tolist() == [1, 2] and in_top_k.tolist() == [True, False]


def _loop_selector_loss(selector, hidden, head, blocks, weights) -> torch.Tensor:
    """Slot by slot: the head's top K on the slot's hidden state, the gold token in place of the
    K-th if missing, the row given the previous slot's gold token (the anchor for slot 1)."""
    total = torch.zeros(())
    for i, j, k in blocks.label_valid.nonzero().tolist():
        h = hidden[i, j, k + 1]  # slot k + 1 of the block (position 0 holds the anchor)
        gold = int(blocks.labels[i, j, k])
        logits = head @ h
        candidates = logits.topk(TOP_K).indices.tolist()
        if gold not in candidates:
            candidates[-1] = gold
        pred = int(blocks.block_ids[i, j, 0]) if k == 0 else int(blocks.labels[i, j, k - 1])
        gate = selector.predecessor_codebook[pred] * (selector.hidden_projection.weight @ h)
        scores = torch.stack([logits[c] + gate @ selector.successor_codebook[c] for c in candidates])
        total = total + weights[k] * F.cross_entropy(scores[None], torch.tensor([candidates.index(gold)]))
    return total


@pytest.mark.parametrize("stop_gradient", [False, True])
def test_the_selector_loss_equals_a_loop_over_its_formula(stop_gradient):
    selector, (hidden, head, blocks) = _selector(), _inputs()
    weights = loss_weights(B, 2.0)
    plain, _ = block_loss(hidden, blocks, head, weights)
    loss = SelectorLoss(selector, TOP_K, 0.5, stop_gradient=stop_gradient)
    both, metrics = block_loss(hidden, blocks, head, weights, loss)
    want = _loop_selector_loss(selector, hidden, head, blocks, weights)
    torch.testing.assert_close(both - plain, 0.5 * want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics.selector_loss_sum.float(), want.detach(), rtol=1e-5, atol=1e-5)
    assert 0 < int(metrics.in_top_k) < int(metrics.selector_labels)  # misses were inserted
    assert int(metrics.selector_labels) == int(blocks.label_valid.sum())
    # The gradients reach the selector's three tensors, and the draft's hidden states unless stopped.
    grads = torch.autograd.grad(both - plain, [hidden, *selector.parameters()])
    assert all(bool(g.abs().sum() > 0) for g in grads[1:])
    assert bool(grads[0].abs().sum() > 0) != stop_gradient


@torch.no_grad()
def _serving_lattice(selector, hidden, head, blocks):
    """The serving lattice of every block (`CandidateSelector.lattice`): (rows [2, A, B-1, H],
    unary [2, A, B-1, K], candidates [2, A, B-1, K], scores [2*A, B-1, K, K])."""
    rows = hidden[:, :, 1:].detach()
    values, candidates = (rows @ head.T).topk(TOP_K, dim=-1)
    scores = selector.lattice(
        candidates.flatten(0, 1),
        values.flatten(0, 1),
        rows.flatten(0, 1),
        blocks.block_ids[:, :, 0].flatten(),
    )
    return rows, values, candidates, scores


def test_the_training_rows_are_the_serving_lattice_rows():
    """Where the previous slot's gold token is among its candidates, the serving lattice has the
    row training scores: the same scores."""
    selector, (hidden, head, blocks) = _selector(), _inputs()
    rows, values, candidates, lattice = _serving_lattice(selector, hidden, head, blocks)
    with torch.no_grad():
        pred = torch.cat([blocks.block_ids[..., :1], candidates[..., :-1, 0]], dim=-1).flatten()
        pair = selector.pair(pred[:, None], candidates.flatten(0, 2), rows.flatten(0, 2))[:, 0]
        trained = values.flatten(0, 2) + pair
    # Row 0 of every slot: the anchor for slot 1, the previous slot's best candidate after it.
    want = lattice.unflatten(0, (2, A))[..., 0, :]  # [2, A, B-1, K]
    torch.testing.assert_close(trained.view(2, A, B - 1, TOP_K), want, rtol=1e-5, atol=1e-5)


def test_the_walk_acceptance_is_the_serving_greedy_walk():
    """Labels that follow the serving greedy walk for r slots, then leave it: the logged walk
    acceptance is the sum of the r over the complete blocks."""
    selector, (hidden, head, blocks) = _selector(), _inputs()
    _, _, candidates, scores = _serving_lattice(selector, hidden, head, blocks)
    bs = scores.shape[0]
    greedy = (torch.zeros(bs, B - 1), torch.ones(bs), torch.ones(bs, dtype=torch.bool))
    picks, _ = walk(candidates.flatten(0, 1), scores, *greedy)
    picks = picks.view(2, A, B - 1)
    runs = torch.tensor([[0, 2, 4], [1, 3, 0]])  # r per block; block (1, 2) is incomplete
    follow = torch.arange(B - 1) < runs[..., None]
    off_walk = (picks + 1) % VOCAB  # a token the walk did not pick
    labels = torch.where(follow, picks, off_walk)
    blocks = Blocks(blocks.anchors, blocks.block_ids, blocks.positions, labels, blocks.label_valid)
    _, metrics = block_loss(hidden, blocks, head, loss_weights(B, 2.0), SelectorLoss(selector, TOP_K, 1.0))
    assert int(metrics.walk_accepted) == 0 + 2 + 4 + 1 + 3  # not the incomplete block's 0
    assert metrics.walk_acceptance_length == pytest.approx(1 + 10 / 5)


def test_dflash2_settings_need_the_family(tmp_path):
    base = dict(target="t", data="d", out=str(tmp_path))
    with pytest.raises(TrainConfigError, match="--selector-rank is a DFlash2 setting: pass --family dflash2"):
        TrainConfig(**base, selector_rank=8)
    with pytest.raises(TrainConfigError, match="--selector-stop-gradient is a DFlash2 setting"):
        TrainConfig(**base, selector_stop_gradient=True)
    with pytest.raises(TrainConfigError, match="--selector-top-k must be an integer >= 1"):
        TrainConfig(**base, family="dflash2", selector_top_k=0)
    cfg = TrainConfig(**base, family="dflash2", selector_rank=8)
    assert cfg.dflash2 == dict(
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=16, selector_loss_weight=1.0
    )


def test_a_dflash2_run_exports_a_checkpoint_that_serves(tmp_path):
    """Four steps of `--family dflash2` on a tiny target: the log carries the selector's metrics
    and the served tau (its greedy walk); the export parses with SGLang's parser and loads in the
    serving path as a DFlash2 draft, its trained selector and convolutions included."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from transformers import PretrainedConfig

    from sglang_dflash.checkpoint.config import DFlashDraftConfig
    from sglang_dflash.draft.model import DFlashDraftModel
    from sglang_dflash.propose.proposers import SelectorProposer, proposer_for
    from sglang_dflash.train.cli import config_from_args
    from sglang_dflash.train.loop import Trainer
    from sglang_dflash.train.served import HFHead
    from tests.support.tiny import make_target

    target = make_target(str(tmp_path / "target"))
    with open(os.path.join(os.path.dirname(os.__file__), "json", "decoder.py")) as f:
        (tmp_path / "train.txt").write_text(f.read())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": list(range(5, 25)), "loss_mask": [0] * 10 + [1] * 10}))
    out = tmp_path / "out"
    argv = ["--target", target, "--data", str(tmp_path / "train.txt"), "--out", str(out), "--device", "cpu"]
    argv += ["--max-length", "40", "--num-draft-layers", "1", "--block-size", "4", "--num-anchors", "4"]
    argv += ["--max-steps", "4", "--save-every", "0", "--no-progress", "--export-dtype", "float32"]
    argv += ["--eval-prompts", str(prompts), "--eval-max-new-tokens", "8", "--eval-every", "2"]
    argv += ["--family", "dflash2", "--selector-rank", "8", "--selector-top-k", "4"]
    Trainer(config_from_args(argv)).fit()
    with open(out / "train_log.jsonl") as f:
        records = [json.loads(line) for line in f]
    for r in records:
        assert 0 <= r["candidate_recall"] <= 1 and r["tau_walk"] >= 1 and r["selector_loss"] > 0
    assert all(1.0 <= r["tau_served"] <= 4.0 for r in records if "tau_served" in r)

    with open(out / "config.json") as f:
        raw = json.load(f)
    assert raw["architectures"] == ["DFlash2DraftModel"]
    parsed = parse_dflash_draft_config(draft_hf_config=PretrainedConfig(**raw))
    assert (parsed.selector_rank, parsed.selector_top_k) == (8, 4)
    assert (parsed.conv_kernel_size, parsed.conv_group_size) == (2, 16)
    config = DFlashDraftConfig.from_pretrained(str(out))
    draft = DFlashDraftModel.from_pretrained(str(out), config, len(config.target_layer_ids))
    from transformers import AutoModelForCausalLM

    assert isinstance(
        proposer_for(draft, HFHead(AutoModelForCausalLM.from_pretrained(target))), SelectorProposer
    )
    # Trained away from their initial values: the successor codebook (0) and the convolutions' deltas (0).
    assert bool(draft.candidate_selector.successor_codebook.abs().sum() > 0)
    assert bool(draft.layers[0].mlp_conv.kernel_projection.weight.abs().sum() > 0)


def test_a_gold_token_outside_the_top_k_is_never_a_walk_hit():
    """Even where its inserted row's score tops the others: the walk only picks among the top K."""
    selector, (hidden, head, _) = _selector(), _inputs()
    h = hidden[0, 0, 1].detach()[None]  # [1, H]
    candidates = (h @ head.T).topk(TOP_K, dim=-1).indices  # [1, K]
    gold = next(t for t in range(VOCAB) if t not in candidates[0].tolist())
    pred = torch.tensor([3])
    with torch.no_grad():  # the gold token's successor row makes its pair score dominate
        gate = selector.predecessor_codebook[3] * selector.hidden_projection(h)[0]
        selector.successor_codebook[gold] = 100.0 * gate.sign()
    terms = SelectorLoss(selector, TOP_K, 1.0)(h, torch.tensor([gold]), pred, candidates, torch.ones(1), head)
    assert terms.in_top_k.tolist() == [False] and terms.walk_hit.tolist() == [False]
    # The row's argmax is the inserted gold token: without the top-K condition it would count.
    inserted, index, _ = insert_gold(candidates, torch.tensor([gold]))
    unary = torch.einsum("mh,mkh->mk", h, head[inserted])
    scores = unary + selector.pair(pred[:, None], inserted, h)[:, 0]
    assert int(scores.argmax(-1)) == int(index)

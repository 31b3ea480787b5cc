"""Our draft network against the z-lab reference (`dflash.model.DFlashDraftModel`).

Both load the same random checkpoint. The reference runs its own forward over
`[context ; block]`; ours runs the serving path: `ops.inject_context_kv` into a `DraftKVStore`
at scattered slot ids, then `DFlashDraftModel.forward` with `SdpaDraftAttention` reading the
store. The final hidden states must agree in fp32, and so must greedy proposals through a
random LM head.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from sglang_dflash import ops
from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.attention import SdpaDraftAttention
from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.model import DFlashDraftModel
from tests.support.tiny import make_draft

reference = pytest.importorskip(
    "dflash.model",
    reason="the z-lab reference package is not installed: pip install --no-deps dflash",
)

NUM_TARGET_LAYERS = 6
HIDDEN = 64
VOCAB = 384
BLOCK = 8
NUM_SLOTS = 96
# fp32 on both sides; the two paths differ only in the order of float operations.
TOL = dict(rtol=2e-5, atol=2e-5)
LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)
# Top-2 logit gaps below this are near-ties: argmax may legitimately differ there.
TIE_GAP = 1e-3

# name -> (make_draft kwargs, config.json edits)
SHAPES = {
    "gqa4/2-hd16-1layer": (dict(num_heads=4, num_kv_heads=2, head_dim=16, num_layers=1), {}),
    "gqa4/1-hd32-3layers": (dict(num_heads=4, num_kv_heads=1, head_dim=32, num_layers=3), {}),
    "mha4/4-hd16-prefix-ids": (
        dict(num_heads=4, num_kv_heads=4, head_dim=16, num_layers=3, target_layer_ids=[4, 0, 2]),
        {"rope_theta": 500.0},
    ),
    "sliding-causal": (
        dict(num_heads=4, num_kv_heads=2, head_dim=32, num_layers=3, target_layer_ids=[1, 3]),
        {
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
            "use_sliding_window": True,
            "sliding_window": 5,
        },
    ),
    "sliding-noncausal": (
        dict(num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2),
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "use_sliding_window": True,
            "sliding_window": 6,
            "is_causal": False,
        },
    ),
    "linear-rope": (
        dict(num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2),
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
}
# NOTE: a non-default RoPE type fails to load in ours: `DFlashDraftModel.from_pretrained` builds
# the module under `torch.device("meta")`, and transformers' RoPE init then creates its
# frequency table on meta. Remove the mark once `RotaryEmbedding` builds its table on CPU.
SHAPE_PARAMS = list(SHAPES)
PREFIXED = {"mha4/4-hd16-prefix-ids"}


def _build(root, name: str) -> str:
    kwargs, edits = SHAPES[name]
    path = os.path.join(str(root), name.replace("/", "_"))
    make_draft(
        path,
        hidden_size=HIDDEN,
        block_size=BLOCK,
        num_target_layers=NUM_TARGET_LAYERS,
        vocab_size=VOCAB,
        prefix="model." if name in PREFIXED else "",
        **kwargs,
    )
    if edits:
        file = os.path.join(path, "config.json")
        with open(file) as f:
            raw = json.load(f)
        raw.update(edits)
        with open(file, "w") as f:
            json.dump(raw, f)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {name: _build(root, name) for name in SHAPES}


def _load_ours(path: str) -> DFlashDraftModel:
    config = DFlashDraftConfig.from_pretrained(path)
    num_features = len(config.resolve_target_layer_ids(NUM_TARGET_LAYERS))
    return DFlashDraftModel.from_pretrained(path, config, num_features)


def _load_reference(path: str):
    model = reference.DFlashDraftModel.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def _reference_block(ref, features: torch.Tensor, noise: torch.Tensor, start: int = 0) -> torch.Tensor:
    """One request: features [C, K*H], noise [B, H] at positions C..C+B-1 -> hidden [B, H].
    With `start`, the reference sees only the context from position `start` on."""
    c, b = features.shape[0], noise.shape[0]
    features = features[start:]
    position_ids = torch.arange(start, c + b)[None]
    out = ref(position_ids=position_ids, noise_embedding=noise[None], target_hidden=features[None])
    return out[0]


@torch.no_grad()
def _garbage_store(config: DFlashDraftConfig, gen: torch.Generator) -> DraftKVStore:
    """A float32 store of NUM_SLOTS slots holding large random values."""
    store = DraftKVStore(
        num_slots=NUM_SLOTS,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=torch.float32,
        device="cpu",
    )
    store.k.normal_(0, 100, generator=gen)
    store.v.normal_(0, 100, generator=gen)
    return store


def _serving_block(
    model: DFlashDraftModel,
    features: list[torch.Tensor],
    noise: torch.Tensor,
    *,
    seed: int = 0,
    block_offset: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Serving path for a batch: features[i] [C_i, K*H], noise [bs, B, H] -> hidden [bs, B, H].

    Context K/V are injected at scattered slot ids of a store whose other slots hold large
    garbage (slot 0 is the padding sink), so a read past a request's context cannot go unseen.
    `block_offset` moves the block's positions (a deliberate bug for the negative control);
    `window` is `--speculative-draft-window-size`.
    """
    config = model.config
    bs, b, _ = noise.shape
    gen = torch.Generator().manual_seed(seed)
    store = _garbage_store(config, gen)

    lens = torch.tensor([f.shape[0] for f in features])
    free = 1 + torch.randperm(NUM_SLOTS - 1, generator=gen)  # never the sink slot 0
    slot_rows = list(torch.split(free[: int(lens.sum())], lens.tolist()))
    # One injection for the whole batch, like an extend step.
    positions = torch.cat([torch.arange(n) for n in lens.tolist()])
    ops.inject_context_kv(model, store, torch.cat(features), positions, torch.cat(slot_rows))

    context_slots = torch.zeros(bs, int(lens.max()), dtype=torch.int64)  # padded with the sink
    for i, row in enumerate(slot_rows):
        context_slots[i, : row.shape[0]] = row
    # The host lengths given to bind are an upper bound, as in serving.
    attend = SdpaDraftAttention(config, store, window).bind(
        context_slots, torch.arange(bs), lens, lens + 3, b
    )
    block_positions = lens[:, None] + torch.arange(b) + block_offset  # [bs, B]
    hidden = model(noise.reshape(bs * b, -1), block_positions.reshape(-1), attend)
    return hidden.view(bs, b, -1)


def _random_inputs(model: DFlashDraftModel, context_lens: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    width = model.num_target_features * model.config.hidden_size
    features = [torch.randn(c, width, generator=gen) for c in context_lens]
    noise = torch.randn(len(context_lens), BLOCK, model.config.hidden_size, generator=gen)
    return features, noise


def _assert_same_proposals(ours: torch.Tensor, ref: torch.Tensor, seed: int) -> None:
    """Logits through a random LM head agree; argmax agrees wherever it is not a near-tie."""
    lm_head = torch.randn(VOCAB, ours.shape[-1], generator=torch.Generator().manual_seed(seed)) * 0.3
    ours_logits, ref_logits = ours @ lm_head.T, ref @ lm_head.T
    torch.testing.assert_close(ours_logits, ref_logits, **LOGIT_TOL)
    top2 = ref_logits.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > TIE_GAP
    # The check must mean something: near-ties are rare with these weights.
    assert decided.float().mean() > 0.9, f"too many near-ties: {(~decided).sum()} of {decided.numel()}"
    same = ours_logits.argmax(-1) == ref_logits.argmax(-1)
    assert bool(same[decided].all()), f"argmax differs at {(~same & decided).nonzero().tolist()}"


@pytest.mark.parametrize("name", SHAPE_PARAMS)
def test_single_request_matches_reference(checkpoints, name):
    path = checkpoints[name]
    ours, ref = _load_ours(path), _load_reference(path)
    features, noise = _random_inputs(ours, [13], seed=3)

    got = _serving_block(ours, features, noise)[0]
    want = _reference_block(ref, features[0], noise[0])
    torch.testing.assert_close(got, want, **TOL)
    _assert_same_proposals(got, want, seed=4)


@pytest.mark.parametrize("name", ["gqa4/1-hd32-3layers", "sliding-causal"])
def test_padded_batch_matches_per_request_reference(checkpoints, name):
    path = checkpoints[name]
    ours, ref = _load_ours(path), _load_reference(path)
    context_lens = [5, 17, 9]
    features, noise = _random_inputs(ours, context_lens, seed=5)

    got = _serving_block(ours, features, noise, seed=6)
    for i in range(len(context_lens)):
        want = _reference_block(ref, features[i], noise[i])
        torch.testing.assert_close(got[i], want, **TOL, msg=lambda m, i=i: f"request {i}: {m}")
        _assert_same_proposals(got[i], want, seed=7)


@pytest.mark.parametrize("name", ["gqa4/2-hd16-1layer", "sliding-causal"])
def test_comparison_detects_off_by_one_block_position(checkpoints, name):
    """Negative control: a block placed one position late must fail the comparison above."""
    path = checkpoints[name]
    ours, ref = _load_ours(path), _load_reference(path)
    features, noise = _random_inputs(ours, [13], seed=3)

    got = _serving_block(ours, features, noise, block_offset=1)[0]
    want = _reference_block(ref, features[0], noise[0])
    assert (got - want).abs().max() > 100 * TOL["atol"]


def test_prefixed_weights_load_in_both(checkpoints):
    """The `model.` prefixed checkpoint really is prefixed, and both loaders strip it."""
    from safetensors.torch import load_file

    path = checkpoints["mha4/4-hd16-prefix-ids"]
    names = list(load_file(os.path.join(path, "model.safetensors")))
    assert names and all(n.startswith("model.") for n in names)
    ours, ref = _load_ours(path), _load_reference(path)
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, ref_params[name]), name
    assert list(ref.target_layer_ids) == [4, 0, 2]
    assert ours.num_target_features == 3


@pytest.mark.parametrize("name", ["gqa4/1-hd32-3layers", "sliding-causal", "sliding-noncausal"])
def test_context_window_matches_reference_on_the_last_w_tokens(checkpoints, name):
    """--speculative-draft-window-size W: each block sees its request's last W committed tokens
    (at their absolute positions) and its own block, as the reference does when given only
    those tokens; requests shorter than W see all of theirs."""
    path = checkpoints[name]
    ours, ref = _load_ours(path), _load_reference(path)
    window, context_lens = 10, [25, 6, 10, 11]
    features, noise = _random_inputs(ours, context_lens, seed=8)

    got = _serving_block(ours, features, noise, seed=9, window=window)
    full = _serving_block(ours, features, noise, seed=9)
    for i, c in enumerate(context_lens):
        want = _reference_block(ref, features[i], noise[i], start=max(0, c - window))
        torch.testing.assert_close(got[i], want, **TOL, msg=lambda m, i=i: f"request {i}: {m}")
        if c > window:  # the window hides context: the proposals change (so this test can fail)
            lm_head = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
            assert not torch.equal((got[i] @ lm_head.T).argmax(-1), (full[i] @ lm_head.T).argmax(-1))
        else:
            torch.testing.assert_close(got[i], full[i], **TOL)


@pytest.mark.sglang  # the worker module imports SGLang
@pytest.mark.parametrize("name", ["gqa4/1-hd32-3layers", "sliding-noncausal"])
def test_start_up_warm_up_writes_only_the_sink_slot(checkpoints, name):
    """`DraftRuntime.warm_up` runs a whole draft step (injection, every layer kind's attention,
    the LM head) before serving; it must leave every committed slot as it was."""
    from types import SimpleNamespace

    from sglang_dflash.draft.step import DraftStep
    from sglang_dflash.propose.proposers import ArgmaxProposer
    from sglang_dflash.runtime import DraftRuntime

    model = _load_ours(checkpoints[name])
    config = model.config
    store = _garbage_store(config, torch.Generator().manual_seed(0))
    before_k, before_v = store.k.clone(), store.v.clone()
    embedding = torch.nn.Embedding(VOCAB, HIDDEN)
    argmaxes = []
    runtime = SimpleNamespace(
        device="cpu",
        dtype=torch.float32,
        draft_model=model,
        store=store,
        attention_name="torch-sdpa",
        step=DraftStep(
            model,
            embedding,
            SdpaDraftAttention(config, store),
            block_size=config.block_size,
            mask_token_id=config.mask_token_id,
        ),
        proposer=ArgmaxProposer(SimpleNamespace(argmax=lambda hidden: argmaxes.append(hidden.shape))),
    )
    DraftRuntime.warm_up(runtime, torch.arange(64, dtype=torch.int32).view(2, 32))
    assert argmaxes == [(1, config.block_size - 1, HIDDEN)]
    assert not torch.equal(store.k[:, 0], before_k[:, 0])  # the injection ran, into the sink
    assert torch.equal(store.k[:, 1:], before_k[:, 1:]) and torch.equal(store.v[:, 1:], before_v[:, 1:])

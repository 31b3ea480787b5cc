"""The DFlash training objective: many anchored blocks per sequence, one draft forward.

For an anchor `a` in a sequence x, the block is `[x_a, MASK x (B-1)]` at positions a..a+B-1,
embedded with the target's input embeddings. Its queries see the context K/V of x_0..x_{a-1}
(the fused target features through `DFlashDraftModel.context_kv`) and their own block, exactly
as a serving step whose committed context ends just before the bonus token `x_a`.

Block position k = 1..B-1 is trained to predict the token at a+k:
  * `labels="target"`: the target's own greedy choice there, argmax of its logits at a+k-1;
  * `labels="data"`: the data token x_{a+k}.
The cross-entropy goes through the frozen target LM head and is weighted by
w_k = exp(-(k-1)/gamma): an early miss ends the accepted run, so early positions matter more.
A DFlash2 draft adds its candidate selector's loss over the same labels (`selector.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from sglang_dflash.draft.attention import attend_with_context
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.train import flex_attention, split_attention
from sglang_dflash.train.config import TrainConfigError
from sglang_dflash.train.data import Batch
from sglang_dflash.train.mask import block_attention_mask
from sglang_dflash.train.selector import SelectorLoss
from sglang_dflash.train.target import FrozenTarget, TargetOutput


def loss_weights(block_size: int, gamma: float, device: Optional[torch.device] = None) -> torch.Tensor:
    """[B-1] weights of block positions k = 1..B-1: exp(-(k-1)/gamma).

    E.g., B=4, gamma=1 -> [1, e^-1, e^-2].
    """
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def valid_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[b, S] bool: may position a anchor a block?

    It needs at least one context token (a >= 1, as in serving), and its first prediction
    a+1 must be a label inside the sequence.
    E.g., lengths=[5], loss_mask=[[0, 0, 1, 1, 1]] -> [[0, 1, 1, 1, 0]].
    """
    pos = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    next_is_label = torch.zeros_like(loss_mask)
    next_is_label[:, :-1] = loss_mask[:, 1:]
    return (pos >= 1) & (pos[None, :] + 1 < lengths[:, None]) & next_is_label


def sample_anchors(
    valid: torch.Tensor, num_anchors: int, keys: list[int], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` distinct valid positions per sequence, uniformly at random.

    valid [b, S] -> anchors [b, A] (ascending), anchor_valid [b, A], with A = min(num_anchors, S).
    Sequences with fewer valid positions fill up with invalid anchors, which are still run (their
    rows see only their own block and earlier context) but carry no loss.
    Row i's random numbers are the first S of `width` (>= S, the longest sequence a run takes)
    drawn on the CPU from seed `keys[i]` (`data.anchor_key`): they depend on neither the batch's
    padding nor the device.
    """
    b, s = valid.shape
    rows = [torch.rand(width, generator=torch.Generator().manual_seed(key))[:s] for key in keys]
    scores = torch.stack(rows).to(valid.device)  # [b, S]
    scores = scores.masked_fill(~valid, -1.0)  # invalid positions lose to every valid one
    top = scores.topk(min(num_anchors, s), dim=1).indices
    anchors = top.sort(dim=1).values
    return anchors, valid.gather(1, anchors)


@dataclass
class Blocks:
    """A batch's anchored blocks. A = anchors per sequence, B = block size."""

    anchors: torch.Tensor  # [b, A] position of each block's first token
    block_ids: torch.Tensor  # [b, A, B] [x_a, MASK, ..., MASK]
    positions: torch.Tensor  # [b, A, B] a, a+1, ..., a+B-1
    labels: torch.Tensor  # [b, A, B-1] the token block position k=1..B-1 should propose
    label_valid: torch.Tensor  # [b, A, B-1] bool: inside the sequence, a label, valid anchor


def make_blocks(
    batch: Batch,
    predictions: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    labels: str,
) -> Blocks:
    """predictions [b, S]: the target's argmax at each position (its guess for the next token).

    E.g., x=[7, 8, 9, 5, 6], anchor 1, B=3 -> block_ids [8, M, M] at positions [1, 2, 3];
    labels="data" -> [9, 5]; labels="target" -> predictions at [1, 2].
    """
    ids = batch.input_ids
    s = ids.shape[1]
    offsets = torch.arange(block_size, device=ids.device)
    positions = anchors[:, :, None] + offsets  # [b, A, B]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, :, 0] = ids.gather(1, anchors)

    label_pos = positions[:, :, 1:]  # [b, A, B-1] positions a+1 .. a+B-1
    inside = label_pos < batch.lengths[:, None, None]
    at = label_pos.clamp(max=s - 1).flatten(1)  # [b, A*(B-1)], safe to gather
    if labels == "target":
        wanted = predictions.gather(1, at - 1)  # the target's guess for a+k, made at a+k-1
    else:
        wanted = ids.gather(1, at)
    is_label = batch.loss_mask.gather(1, at).view_as(label_pos)
    return Blocks(
        anchors=anchors,
        block_ids=block_ids,
        positions=positions,
        labels=wanted.view_as(label_pos),
        label_valid=anchor_valid[:, :, None] & inside & is_label,
    )


class BlockAttention:
    """`attend(layer_id, q, k, v)` for `DFlashDraftModel.forward` over a batch of blocks.

    Per layer, block queries see the context K/V of the tokens before their anchor and their
    own block (`mask.py`). `mode` (`--block-attention`, chosen once by `resolve_block_attention`):
      * "split": `split_attention`, a fused kernel over the context and each block's own keys
        by hand, merged by log-sum-exp: the masked cross-block region is never computed;
      * "flex": `flex_attention`, FlexAttention over the padded `flex_shapes` (the batch's own
        sizes, to a tile, when None): only the tiles the mask keeps are computed;
      * "dense": SDPA over `[context ; every block]` with the dense mask.
    Shapes: b sequences, Q = A*B block tokens each. Masks are built once per layer kind.
    """

    def __init__(
        self, k_ctx: torch.Tensor, v_ctx: torch.Tensor, anchors: torch.Tensor, block_size: int,
        kinds: list[tuple[bool, Optional[int]]], scale: float, mode: str,
        flex_shapes: Optional[flex_attention.FlexShapes] = None,
    ):  # fmt: skip
        self.k_ctx = k_ctx  # [L, b, S, kv_heads, d]
        self.v_ctx = v_ctx  # [L, b, S, kv_heads, d]
        self.anchors = anchors  # [b, A]
        self.block_size = block_size
        self.kinds = kinds  # per layer (causal, window)
        self.scale = scale
        self.mode = mode
        if mode == "flex" and flex_shapes is None:
            b, a = anchors.shape
            flex_shapes = flex_attention.FlexShapes.for_run(b, k_ctx.shape[2], a, block_size)
        self.flex_shapes = flex_shapes
        self._masks: dict = {}

    def _mask(self, kind: tuple[bool, Optional[int]], dtype: torch.dtype):
        if kind in self._masks:
            return self._masks[kind]
        causal, window = kind
        s, block = self.k_ctx.shape[2], self.block_size
        if self.mode == "split":
            mask = (
                split_attention.context_bias(
                    self.anchors, s, block, causal=causal, window=window, dtype=dtype
                ),
                split_attention.own_block_mask(
                    block, causal=causal, window=window, device=self.anchors.device
                ),
            )  # [b, 1, Q, S + 1], [B, B]
        elif self.mode == "flex":
            mask = flex_attention.block_mask(self.anchors, self.flex_shapes, causal=causal, window=window)
        else:
            mask = block_attention_mask(self.anchors, s, block, causal=causal, window=window)[:, None]
        self._masks[kind] = mask  # dense: [b, 1, Q, S + Q]
        return mask

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [b*Q, heads, d], k/v [b*Q, kv_heads, d] -> [b*Q, heads, d]
        b = self.k_ctx.shape[1]
        q, k, v = (x.unflatten(0, (b, -1)) for x in (q, k, v))
        k_ctx, v_ctx = self.k_ctx[layer_id], self.v_ctx[layer_id]
        mask = self._mask(self.kinds[layer_id], q.dtype)
        if self.mode == "split":
            bias, own = mask
            out = split_attention.split_block_attention(
                q, k_ctx, v_ctx, k, v, bias, own, self.scale, self.block_size
            )
        elif self.mode == "flex":
            out = flex_attention.flex_block_attention(
                q, k_ctx, v_ctx, k, v, mask, self.flex_shapes, self.scale
            )
        else:
            out = attend_with_context(q, k_ctx, v_ctx, k, v, mask, self.scale)
        return out.flatten(0, 1)


# docs/training.md#block-attention: on CPU the split is faster and smaller than dense (and
# FlexAttention has no backward there); on an H100, one layer's forward + backward at the
# Qwen3-8B draft's shape took 3.2 ms by FlexAttention against 15.7 dense and 14.6 split.
AUTO_BLOCK_ATTENTION = {"cpu": "split", "cuda": "flex"}
_SUPPORTED = {"split": split_attention.supported, "flex": flex_attention.supported}


def resolve_block_attention(mode: str, device: torch.device) -> tuple[str, str]:
    """`--block-attention` -> (the mode used, why). "auto": split on CPU, flex on CUDA (the
    fastest as measured on each), dense where that one cannot run (the reason is logged); a
    mode the device cannot run is refused."""
    if mode == "auto":
        chosen = AUTO_BLOCK_ATTENTION.get(device.type, "dense")
        if (reason := _SUPPORTED[chosen](device) if chosen in _SUPPORTED else None) is not None:
            return "dense", f"auto on {device.type}: {chosen} cannot run ({reason})"
        return chosen, f"auto on {device.type}: the fastest there (docs/training.md#block-attention)"
    if mode in _SUPPORTED and (reason := _SUPPORTED[mode](device)) is not None:
        raise TrainConfigError(f"--block-attention {mode}: {reason}")
    return mode, "chosen by --block-attention"


def draft_hidden(
    draft: DFlashDraftModel,
    target: FrozenTarget,
    target_out: TargetOutput,
    blocks: Blocks,
    *,
    mode: str = "split",
    flex_shapes: Optional[flex_attention.FlexShapes] = None,
) -> torch.Tensor:
    """The draft's final hidden states for every block token, [b, A, B, H]. `mode`: the block
    attention, "split", "flex" (padded to `flex_shapes`) or "dense" (`BlockAttention`)."""
    config = draft.config
    b, s, _ = target_out.features.shape
    num_anchors, block_size = blocks.block_ids.shape[1:]
    context = draft.fuse_target_features(target_out.features.flatten(0, 1))  # [b*S, H]
    ctx_positions = torch.arange(s, device=context.device).repeat(b)  # [b*S]: 0..S-1, 0..S-1, ...
    k_ctx, v_ctx = draft.context_kv(context, ctx_positions)  # [L, b*S, kv_heads, d]
    kinds = [
        (config.layer_is_causal(layer_id), config.layer_window(layer_id))
        for layer_id in range(config.num_hidden_layers)
    ]
    attend = BlockAttention(
        k_ctx.unflatten(1, (b, s)), v_ctx.unflatten(1, (b, s)), blocks.anchors, block_size, kinds,
        config.head_dim**-0.5, mode, flex_shapes,
    )  # fmt: skip
    embeds = target.embed(blocks.block_ids).flatten(0, 2)  # [b*A*B, H]
    hidden = draft(embeds, blocks.positions.flatten(), attend)  # [b*A*B, H]
    return hidden.view(b, num_anchors, block_size, -1)


@dataclass
class Metrics:
    """Sums over the labels seen; `merge` them across micro-batches and steps."""

    loss_sum: torch.Tensor  # [] sum of w_k * CE
    weight_sum: torch.Tensor  # [] sum of w_k
    correct: torch.Tensor  # [B-1] argmax == label, per block position k
    count: torch.Tensor  # [B-1] labels per block position k
    accepted: torch.Tensor  # [] sum over complete blocks of the accepted run length
    blocks: torch.Tensor  # [] complete blocks (every position labelled)
    anchors: torch.Tensor  # [] valid anchors (blocks with at least their first label)
    # DFlash2's selector (`selector.py`); zeros for a plain draft.
    selector_labels: torch.Tensor  # [] labels the selector's loss saw
    selector_loss_sum: torch.Tensor  # [] sum of w_k * its CE
    in_top_k: torch.Tensor  # [] labels among the target head's top K candidates
    walk_accepted: torch.Tensor  # [] sum over complete blocks of the greedy walk's accepted run

    def merge(self, other: "Metrics") -> "Metrics":
        return Metrics(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))

    @property
    def loss(self) -> float:
        return float(self.loss_sum / self.weight_sum.clamp_min(1e-12))

    @property
    def accuracy(self) -> list[float]:
        """Per block position k = 1..B-1."""
        return (self.correct.float() / self.count.clamp_min(1)).tolist()

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per step if serving verified these blocks: accepted run + bonus."""
        return float(self.accepted.float() / self.blocks.clamp_min(1)) + 1.0

    def as_vector(self) -> torch.Tensor:
        """Every sum in one float64 vector, on their device (to reduce across ranks: NCCL reduces
        CUDA tensors); `from_vector` inverts it."""
        return torch.cat([t.detach().double().reshape(-1) for t in vars(self).values()])

    def from_vector(self, vector: torch.Tensor) -> "Metrics":
        parts, offset = [], 0
        for t in vars(self).values():
            parts.append(vector[offset : offset + t.numel()].view(t.shape).to(t.dtype))
            offset += t.numel()
        return Metrics(*parts)

    @classmethod
    def empty(cls, num_positions: int, device: torch.device) -> "Metrics":
        """No labels (a rank's empty share of a micro-batch), on the device the metrics are."""
        zero = torch.zeros((), dtype=torch.float64, device=device)
        counts = torch.zeros(num_positions, dtype=torch.int64, device=device)
        return cls(zero, zero, counts.double(), counts, *[counts[0]] * 4, zero, counts[0], counts[0])

    @property
    def candidate_recall(self) -> float:
        """The share of labels among the top K candidates the selector chooses from."""
        return float(self.in_top_k.float() / self.selector_labels.clamp_min(1))

    @property
    def walk_acceptance_length(self) -> float:
        """As `acceptance_length`, for the proposals of the selector's greedy walk (served)."""
        return float(self.walk_accepted.float() / self.blocks.clamp_min(1)) + 1.0

    def summary(self) -> dict:
        out = {"loss": self.loss, "tau": self.acceptance_length, "acc": self.accuracy}
        if int(self.selector_labels):
            out.update(
                selector_loss=float(self.selector_loss_sum / self.weight_sum.clamp_min(1e-12)),
                candidate_recall=self.candidate_recall,
                tau_walk=self.walk_acceptance_length,
            )
        return out


# The LM-head loss runs over rows of at most this many fp32 logits at once (`head_loss`).
LOSS_CHUNK_BYTES = 128 * 2**20


def head_loss(
    rows: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, lm_head_weight: torch.Tensor, top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """rows [M, H], labels [M], weights w [M] -> (sum of w * CE through the LM head, argmax hits
    [M] bool, and with `top_k` the head's top-k token ids [M, k], best first: DFlash2's
    candidates), in chunks of rows whose fp32 logits fit `LOSS_CHUNK_BYTES`. Each chunk is
    checkpointed: its [C, V] logits are freed after the forward and recomputed in the backward,
    so [M, V] never exists whole (at 512 anchors, B = 16 and a 152K vocabulary it would be about
    4.7 GB per sequence, plus its gradient)."""
    from torch.utils.checkpoint import checkpoint

    def chunk(x: torch.Tensor, y: torch.Tensor, wy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = F.linear(x, lm_head_weight).float()  # [C, V]
        out = ((wy * F.cross_entropy(logits, y, reduction="none")).sum(), logits.argmax(-1) == y)
        return out + (logits.topk(top_k, dim=-1).indices,) if top_k else out

    size = max(1, LOSS_CHUNK_BYTES // (4 * lm_head_weight.shape[0]))
    total, hits, candidates = rows.sum() * 0.0, [], []
    for lo in range(0, rows.shape[0], size):
        part = slice(lo, lo + size)
        loss, hit, *top = checkpoint(chunk, rows[part], labels[part], w[part], use_reentrant=False)
        total, hits, candidates = total + loss, hits + [hit], candidates + top
    if not hits:
        hits = [labels.new_zeros(0, dtype=torch.bool)]
        candidates = [labels.new_zeros(0, top_k)] if top_k else []
    return total, torch.cat(hits), torch.cat(candidates) if top_k else None


def block_loss(
    hidden: torch.Tensor,
    blocks: Blocks,
    lm_head_weight: torch.Tensor,
    weights: torch.Tensor,
    selector: Optional[SelectorLoss] = None,
) -> tuple[torch.Tensor, Metrics]:
    """hidden [b, A, B, H] -> the weighted CE summed over the labelled positions (the caller
    divides by the sum of the weights over the whole optimizer step: `metrics.weight_sum`
    summed), and metrics. With `selector` (DFlash2), plus its weighted loss over the same labels.

    Only labelled positions go through the LM head (M <= b*A*(B-1) rows, in chunks: `head_loss`).
    """
    proposals = hidden[:, :, 1:]  # [b, A, B-1, H]: position 0 holds the given token
    valid = blocks.label_valid
    k_index = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)[valid]  # [M]
    labels = blocks.labels[valid]  # [M]
    w = weights[k_index]
    rows = proposals[valid]  # [M, H]
    top_k = selector.top_k if selector is not None else 0
    loss_sum, hit, candidates = head_loss(rows, labels, w, lm_head_weight, top_k)  # [], [M], [M, K]
    weight_sum = w.sum()
    terms = None
    if selector is not None:
        # Slot k's predecessor: the gold token of slot k-1; for slot 1, the anchor (block position 0).
        predecessors = torch.cat([blocks.block_ids[..., :1], blocks.labels[..., :-1]], dim=-1)[valid]
        terms = selector(rows, labels, predecessors, candidates, w, lm_head_weight)
        loss_sum = loss_sum + selector.weight * terms.loss_sum

    with torch.no_grad():
        num_pos = valid.shape[-1]
        correct = torch.bincount(k_index, weights=hit.float(), minlength=num_pos)
        count = torch.bincount(k_index, minlength=num_pos)
        complete = valid.all(-1)  # [b, A]

        def accepted(hits: torch.Tensor) -> torch.Tensor:
            # Accepted run per complete block: E.g., hits [1, 1, 0, 1] -> cumprod [1, 1, 0, 0] -> 2.
            dense = torch.zeros_like(valid)
            dense[valid] = hits
            return dense.long().cumprod(-1).sum(-1)[complete].sum()

        zero = torch.zeros((), dtype=torch.int64, device=valid.device)
        metrics = Metrics(
            loss_sum=loss_sum.detach(),
            weight_sum=weight_sum.detach(),
            correct=correct,
            count=count,
            accepted=accepted(hit),
            blocks=complete.sum(),
            anchors=valid[..., 0].sum(),
            selector_labels=zero if terms is None else count.sum(),
            selector_loss_sum=zero.double() if terms is None else terms.loss_sum.detach().double(),
            in_top_k=zero if terms is None else terms.in_top_k.sum(),
            walk_accepted=zero if terms is None else accepted(terms.walk_hit),
        )
    return loss_sum, metrics


class DFlashObjective:
    """Anchors + blocks + draft forward + loss for one batch."""

    def __init__(
        self,
        *,
        block_size: int,
        mask_token_id: int,
        num_anchors: int,
        labels: str,
        gamma: float,
        max_length: int,
        block_attention: str = "split",
        batch_size: int = 1,
        selector_weight: float = 1.0,
        selector_stop_gradient: bool = False,
    ):
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.num_anchors = num_anchors
        self.labels = labels
        self.gamma = gamma
        self.max_length = max_length  # the anchors' random rows are this long (`sample_anchors`)
        self.block_attention = block_attention  # resolved: "split", "flex" or "dense"
        self.flex_shapes = None  # "flex": every batch padded to the run's largest, one compile
        if block_attention == "flex":
            self.flex_shapes = flex_attention.FlexShapes.for_run(
                batch_size, max_length, num_anchors, block_size
            )
        self.selector_weight = selector_weight  # DFlash2: its selector's loss beside the head's
        self.selector_stop_gradient = selector_stop_gradient

    def __call__(
        self,
        draft: DFlashDraftModel,
        target: FrozenTarget,
        batch: Batch,
        anchor_keys: list[int],
        target_out: Optional[TargetOutput] = None,
    ) -> tuple[torch.Tensor, Metrics]:
        """-> the weighted CE summed over the batch's labels (with its graph), and metrics.
        `anchor_keys`: per sequence, the seed of its anchors (`data.anchor_key`); `target_out`:
        the target's features and predictions when stored (`features.py`), else computed."""
        if target_out is None:
            target_out = target.forward(batch.input_ids, batch.attention_mask)
        anchors, anchor_valid = sample_anchors(
            valid_anchors(batch.loss_mask, batch.lengths), self.num_anchors, anchor_keys, self.max_length
        )
        blocks = make_blocks(
            batch,
            target_out.predictions,
            anchors,
            anchor_valid,
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            labels=self.labels,
        )
        hidden = draft_hidden(
            draft, target, target_out, blocks, mode=self.block_attention, flex_shapes=self.flex_shapes
        )
        weights = loss_weights(self.block_size, self.gamma, hidden.device)
        selector = None
        if getattr(draft, "candidate_selector", None) is not None:
            selector = SelectorLoss.of(draft, self.selector_weight, self.selector_stop_gradient)
        return block_loss(hidden, blocks, target.lm_head_weight, weights, selector)

"""Served acceptance while training: greedy speculative decoding with the live draft.

The teacher-forced tau the loop logs scores every block against the target's features of the
*true* context. Serving drafts from its own committed tokens, one block per step, so the two
can drift apart ("good training metrics, poor served acceptance"). `speculative_generate` runs
the serving loop with the reference's semantics (z-lab's `dflash_generate`, greedy): prefill the
target, then per step draft a block `[bonus, MASK x (B-1)]` (the bonus: the last committed
token) over the context K/V of every committed token, verify it in one target forward, commit
the accepted run plus the target's next token, and extend the draft's context with the committed
tokens' features. `tau_served` is the mean number of tokens committed per step. The proposals
are read out by the serving proposer of the draft's family (`propose/proposers.proposer_for`):
the target head's argmax, or DFlash2's greedy walk over its selector's lattice.

Python loop per decoding step: this is an evaluation on a few prompts, not the serving path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang_dflash.draft.attention import attend_with_context, visibility
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.propose.proposers import ProposalInputs, proposer_for


@dataclass
class Served:
    output_ids: list[int]  # the prompt's continuation
    committed: list[int]  # tokens committed per verify step (accepted run + the target's token)

    @property
    def tau(self) -> float:
        return sum(self.committed) / max(1, len(self.committed))


@torch.no_grad()
def speculative_generate(
    draft: DFlashDraftModel,
    target,
    layer_ids: tuple[int, ...],
    prompt: list[int],
    max_new_tokens: int,
    mask_token_id: int,
    *,
    verify_width: Optional[int] = None,
    full_block: bool = False,
) -> Served:
    """Greedy DFlash decoding of `prompt` with `draft` and the HF causal LM `target`: the
    reference's tokens and steps (blocks of the draft's block size, shortened at the end).

    `verify_width` W (default the block size B): verify windows of W tokens. The draft then
    runs over the W rows it proposes for, or with `full_block` over its whole block of B (as
    serving does at every width), the window being its first W rows."""
    from transformers import DynamicCache

    device = target.get_input_embeddings().weight.device
    block_size = draft.config.block_size
    window = verify_width or block_size
    propose = proposer_for(draft, HFHead(target))
    limit = len(prompt) + max_new_tokens
    ids = torch.tensor([prompt], device=device)
    cache = DynamicCache(config=target.config)
    out = target(ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    tokens = list(prompt) + [int(out.logits[0, -1].argmax())]
    features = _features(out.hidden_states, layer_ids)  # [n, K*H] of the committed tokens
    k_ctx, v_ctx = _context_kv(draft, features, 0)  # [L, n, kv_heads, d]
    committed = []
    start = len(prompt)  # position of the last committed token, the block's first
    while start + 1 < limit:
        width = min(window, limit - start)
        block = torch.tensor(tokens[start : start + 1] + [mask_token_id] * (width - 1), device=device)
        positions = torch.arange(start, start + width, device=device)
        if width > 1:
            # A convolution runs over whole blocks (`GroupedConv`): such a draft runs its block
            # of B, as serving does, and the window is its first `width` rows.
            drafted = block_size if draft.config.conv_kernel_size or full_block else width
            drafted_ids = torch.cat([block, block.new_full((drafted - width,), mask_token_id)])
            rows = torch.arange(start, start + drafted, device=device)
            embeds = target.get_input_embeddings()(drafted_ids)
            hidden = draft(embeds, rows, _attend(draft, k_ctx, v_ctx, rows))
            inputs = ProposalInputs(bonus=block[:1], positions=positions[None])
            block[1:] = propose(hidden[None, :width], inputs).tokens[0]
        out = target(block[None], past_key_values=cache, use_cache=True, output_hidden_states=True)
        posterior = out.logits[0].argmax(-1)  # [width]
        accepted = int((block[1:] == posterior[:-1]).long().cumprod(0).sum())
        produced = min(accepted + 1, limit - start - 1)
        tokens[start + 1 :] = block[1 : accepted + 1].tolist() + [int(posterior[accepted])]
        start += produced
        tokens = tokens[: start + 1]
        committed.append(produced)
        cache.crop(start)  # the target keeps K/V of the committed tokens only
        new = _features(out.hidden_states, layer_ids)[:produced]
        k_new, v_new = _context_kv(draft, new, start - produced)
        k_ctx, v_ctx = torch.cat([k_ctx, k_new], 1), torch.cat([v_ctx, v_new], 1)
    return Served(tokens[len(prompt) : limit], committed)


class HFHead:
    """The LM head of an HF causal LM as the serving proposers read a target's head
    (`draft/target_head.TargetHead`: logits, argmax, top-k), in one process."""

    def __init__(self, model):
        self.head = model.get_output_embeddings()
        self.vocab_size = self.head.weight.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden.to(self.head.weight.dtype))

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden).argmax(-1)

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = self.logits(hidden).float().topk(k, dim=-1)
        return values, ids


def _features(hidden_states, layer_ids) -> torch.Tensor:
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def _context_kv(draft: DFlashDraftModel, features: torch.Tensor, first: int):
    positions = torch.arange(first, first + features.shape[0], device=features.device)
    return draft.context_kv(draft.fuse_target_features(features.to(draft.fc.weight.dtype)), positions)


def _attend(draft: DFlashDraftModel, k_ctx, v_ctx, positions):
    """The block's attention over every committed token's context K/V and the block, by each
    layer's visibility rule (non-causal full layers; sliding windows)."""
    config = draft.config
    k_pos = torch.cat([torch.arange(k_ctx.shape[1], device=positions.device), positions])

    def attend(layer_id, q, k, v):
        mask = visibility(
            positions,
            k_pos,
            torch.ones_like(k_pos, dtype=torch.bool),
            causal=config.layer_is_causal(layer_id),
            window=config.layer_window(layer_id),
        )[None, None]  # [1, 1, W, n + W]
        out = attend_with_context(
            q[None],
            k_ctx[layer_id][None],
            v_ctx[layer_id][None],
            k[None],
            v[None],
            mask,
            config.head_dim**-0.5,
        )
        return out[0]

    return attend

"""LiLiCorr's lattice correction head: the draft's proposals rescored jointly, then walked.

A LiLiCorr draft (`LiLiCorrDraftModel`) runs the plain backbone, then, for the proposal slots
e = 1..W-1 of the window:

  candidates[e]   the top-K tokens of log_softmax(target head(h_e)) over the whole vocabulary,
                  with their log-probabilities lp [K] (sorted, so lp[0] is the largest);
  x[e, c]         one vector per candidate (width h):
                    token_proj(embed(candidate))          (the target's embedding; no token_proj
                                                           when h is the draft's width)
                  + pass_hidden_proj(h_e)
                  + feature_mlp(LayerNorm([lp, exp(lp), lp - lp[0], c / (K-1), c == 0]))
                  + slot_embedding[e] + rank_embedding[c];
  then `num_layers` pre-norm transformer layers over all (W-1)*K vectors of a request at once,
  their attention biased by a learned bias per head and relative slot offset (plus one for the
  same slot), and `output_norm`;
  a               anchor_norm(context_proj(f)), f the context feature of the request's last
                  committed token (`LastTokenStore`; zero when unknown; SGLang, as the weights'
                  names, calls it the anchor);
  g[e, c]         silu(factor_input_proj([x, a, x * a])), then unit vectors
                  out[e, c] = normalize(out_head(g)), in[e, c] = normalize(in_head(g));
  scores          start[c]        = s * < normalize(anchor_out_head(a)), in[1, c] >,
                  pair[e, p, c]   = s * < out[e-1, p], in[e, c] >     (s = logit_scale).

The walk is DFlash2's (`selector.walk`, `selector.py`): slot 1 from `start`, each next slot from
the pair row of the candidate picked before, greedily for greedy requests, by sampling at the
request's temperature for the others, with q, the distribution each pick was drawn from, handed to
the exact q-aware verify. There is no log-probability prior in the scores: the head was trained
without one.

This is SGLang 0.5.23's maths (models/lilicorr.py `LiLiCorrHead`, speculative/lilicorr_utils.py,
kernels/ops/speculative/lilicorr.py), as `tests/unit/propose/test_lilicorr.py` checks against its own modules.
The weights keep SGLang's names (`lilicorr.*`; the attention in `nn.MultiheadAttention`'s layout)
and are replicated on every tensor-parallel rank, as there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NUM_FEATURES = 5  # per candidate: lp, exp(lp), lp - lp[0], rank / (K-1), rank == 0


class _RMSNorm(nn.Module):
    """SGLang's RMSNorm (`forward_native`): normalise and scale in fp32, back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class _MLP(nn.Module):
    def __init__(self, inputs: int, middle: int, outputs: int):
        super().__init__()
        self.up_proj = nn.Linear(inputs, middle)
        self.down_proj = nn.Linear(middle, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class _Attention(nn.Module):
    """`nn.MultiheadAttention`'s weights, run through SDPA with an additive bias."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.zeros(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # x [bs, N, h], bias [heads, N, N] -> [bs, N, h]
        bs, n, width = x.shape
        q, k, v = (
            t.view(bs, n, self.heads, -1).transpose(1, 2)
            for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(bs, n, width))


class _Layer(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = _RMSNorm(width, eps)
        self.attn = _Attention(width, heads)
        self.mlp_norm = _RMSNorm(width, eps)
        self.mlp = _MLP(width, int(width * mlp_ratio), width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    """The head's weights (names as in the checkpoint, under `lilicorr.`) and `lattice`."""

    def __init__(self, draft_hidden_size: int, block_size: int, eps: float, shape):
        """`shape`: the checkpoint's `fields.LiLiCorrShape`; `block_size`: the trained block."""
        super().__init__()
        width = shape.width(draft_hidden_size)
        k = shape.candidate_topk
        self.top_k, self.block_size = k, block_size
        self.vector_eps, self.logit_scale = shape.vector_eps, shape.logit_scale
        if width != draft_hidden_size:
            self.token_proj = nn.Linear(draft_hidden_size, width)
        self.pass_hidden_proj = nn.Linear(draft_hidden_size, width)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = _MLP(NUM_FEATURES, width, width)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, block_size - 1, 1, width))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, k, width))
        self.relative_slot_bias = nn.Parameter(torch.zeros(shape.num_heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(shape.num_heads))
        self.context_proj = nn.Linear(draft_hidden_size, width)
        self.layers = nn.ModuleList(
            _Layer(width, shape.num_heads, shape.mlp_ratio, eps) for _ in range(shape.num_layers)
        )
        self.output_norm = _RMSNorm(width, eps)
        self.anchor_norm = _RMSNorm(width, eps)
        self.factor_input_proj = nn.Linear(3 * width, width)
        self.out_head = nn.Linear(width, shape.factor_dim)
        self.in_head = nn.Linear(width, shape.factor_dim)
        self.anchor_out_head = nn.Linear(width, shape.factor_dim)

    def attention_bias(self, slots: int) -> torch.Tensor:
        """[heads, E*K, E*K] for E = `slots` proposal slots (E <= block_size - 1: a narrower
        window is a prefix of the trained slots). Row i is candidate i % K of slot i // K;
        e.g., K = 2, E = 2: slots [0, 0, 1, 1], so entry (0, 2) takes relative_slot_bias at
        offset 0 - 1 = -1 (column -1 + block_size - 1)."""
        slot = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(self.top_k)
        offset = slot[:, None] - slot[None, :]  # in (-(E-1), E-1), within the trained offsets
        same = (offset == 0).to(self.same_slot_bias.dtype)
        return (
            self.relative_slot_bias[:, offset + self.block_size - 1]
            + same * self.same_slot_bias[:, None, None]
        )

    def lattice(
        self,
        token_embeddings: torch.Tensor,
        log_probs: torch.Tensor,
        hidden: torch.Tensor,
        last_feature: torch.Tensor,
        last_known: torch.Tensor,
    ) -> torch.Tensor:
        """token_embeddings [bs, E, K, H] (the target's embedding of the candidates), log_probs
        [bs, E, K] (sorted descending), hidden [bs, E, H] (the draft's at slots 1..E),
        last_feature [bs, H] (the context feature of each request's last committed token),
        last_known [bs] bool -> scores [bs, E, K, K] float32: slot
        1's row 0 holds the start scores (every row, as `selector.walk` reads row 0 there), slot
        e > 1's row p the pair scores after candidate p of slot e-1."""
        bs, slots, k, _ = token_embeddings.shape
        dtype = self.slot_embedding.dtype
        tokens = token_embeddings.to(dtype)
        if hasattr(self, "token_proj"):
            tokens = self.token_proj(tokens)
        lp = log_probs.float()
        rank = torch.arange(k, device=lp.device, dtype=torch.float32).expand_as(lp)
        features = torch.stack(
            [
                lp,
                lp.exp(),
                lp - lp.max(dim=-1, keepdim=True).values,
                rank / max(k - 1, 1),
                (rank == 0).float(),
            ],
            dim=-1,
        )  # [bs, E, K, 5]
        x = tokens + self.pass_hidden_proj(hidden.to(dtype))[:, :, None]
        x = x + self.feature_mlp(self.feature_norm(features.to(dtype)))
        x = x + self.slot_embedding[0, 0, :slots] + self.rank_embedding[0, 0]  # [bs, E, K, h]
        x = x.reshape(bs, slots * k, -1)
        bias = self.attention_bias(slots)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).reshape(bs, slots, k, -1)

        a = self.context_proj(last_feature.to(dtype)) * last_known[:, None].to(dtype)  # zero if unknown
        a = self.anchor_norm(a)[:, None, None]  # [bs, 1, 1, h]
        w = self.factor_input_proj.weight  # [h, 3h] over [x, a, x * a]
        width = x.shape[-1]
        pre = F.linear(x, w[:, :width], self.factor_input_proj.bias)
        pre = pre + F.linear(a, w[:, width : 2 * width]) + F.linear(x * a, w[:, 2 * width :])
        g = F.silu(pre)
        out_vec = F.normalize(self.out_head(g), dim=-1, eps=self.vector_eps)  # [bs, E, K, r]
        in_vec = F.normalize(self.in_head(g), dim=-1, eps=self.vector_eps)
        start_vec = F.normalize(self.anchor_out_head(a[:, 0, 0]), dim=-1, eps=self.vector_eps)  # [bs, r]

        start = (start_vec[:, None] * in_vec[:, 0]).sum(-1)  # [bs, K]
        pair = out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2)  # [bs, E-1, K, K]
        scores = torch.cat([start[:, None, None].expand(bs, 1, k, k), pair], dim=1)
        return self.logit_scale * scores.float()


class LastTokenStore:
    """Per request slot (`req_pool_idx`): the context feature of the request's last committed
    token, and the target KV slot that token occupies. The one owner of LiLiCorr's state across
    steps.

    Written by every injection (prefill, extend chunks, verify commits) for each request in it;
    read at the draft step for the token just before the block. A row counts only if the KV slot
    recorded with it is the one that token occupies now: a row left by the request slot's
    previous owner, or a request whose context arrived without its features (a PD decode
    engine's first step), reads as unknown (zeros, as SGLang scores a request without one).
    The feature is a function of the prefix up to that slot, so an equal slot is the same token.
    """

    def __init__(self, max_requests: int, hidden_size: int, dtype: torch.dtype, device):
        self.features = torch.zeros(max_requests, hidden_size, dtype=dtype, device=device)  # [R, H]
        self.slots = torch.full((max_requests,), -1, dtype=torch.int64, device=device)  # [R]
        # [known, unknown] features read so far, on the device (read by `describe`, not per step):
        # an unknown one costs acceptance, silently otherwise.
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)

    def write(self, req_pool_indices: torch.Tensor, features: torch.Tensor, slots: torch.Tensor) -> None:
        """req_pool_indices [n], features [n, H], slots [n]: each request's last committed token."""
        rows = req_pool_indices.to(torch.int64)
        self.features[rows] = features.to(self.features.dtype)
        self.slots[rows] = slots.to(torch.int64)

    def read(self, req_pool_indices: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> features [bs, H] and valid [bs] bool, for the requests' tokens at KV `slots` [bs]."""
        rows = req_pool_indices.to(torch.int64)
        valid = self.slots[rows] == slots.to(torch.int64)
        known = valid.sum()
        self.counts += torch.stack([known, valid.numel() - known])
        return self.features[rows], valid

    def describe(self) -> str:
        """How many drafted requests had their last token's feature (host sync: for server info only)."""
        known, unknown = self.counts.tolist()
        return f"{known} of {known + unknown} draft steps' requests had their last token's feature"

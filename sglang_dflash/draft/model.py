"""The DFlash draft network: one definition, used by serving and by training.

Terminology (used the same way everywhere in this package):
  * target features: the target's hidden states after the layers in `target_layer_ids`,
    concatenated per token, `[N, K*H]`.
  * context feature: `hidden_norm(fc(target features))`, `[N, H]`; every draft layer projects
    it through its own `k_proj`/`v_proj` (no `input_layernorm`) into context K/V. Laguna's
    drafts norm each layer's slice of the features first, and project K/V from each layer's
    `input_layernorm` of the context feature.
  * block: `[bonus, MASK x (B-1)]`, embedded with the target's embeddings; the block's queries
    attend to the committed context K/V and to the whole block, non-causally.

Under tensor parallelism each rank holds its shard of the draft (`tensor_parallel.py`): its
attention and KV heads and its MLP columns, with the row-parallel outputs summed across ranks.

The module holds weights and layer maths only. Where context K/V live, and which keys a query
may see, is the caller's business: `forward` takes an `attend(layer_id, q, k, v)` callable that
receives the block's own projections and returns the attention output.

See docs/architecture.md ("How it works") and docs/training.md.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.checkpoint import contract, quantization
from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.checkpoint.mask_token import load_mask_embedding
from sglang_dflash.draft.tensor_parallel import TensorParallel
from sglang_dflash.propose.domino import PrefixGRU, embed_projector
from sglang_dflash.propose.lilicorr import LiLiCorrHead
from sglang_dflash.propose.selector import CandidateSelector

# attend(layer_id, q [N, heads, head_dim], k [N, kv_heads, head_dim], v) -> [N, heads, head_dim]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in fp32, scale in the input dtype. With `gemma`, Gemma's:
    scale by (1 + w), in fp32 (SGLang's `GemmaRMSNorm.forward_native`)."""

    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def _norm(config: DFlashDraftConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, gemma=config.use_gemma_norm)


class RotaryEmbedding(nn.Module):
    """RoPE at absolute positions, with transformers' frequency tables, on the first
    `rope_width` dims of each head (the rest pass through). Neox style rotates the two halves
    of those dims against each other; GPT-J style (`rope_is_neox_style: false`) rotates
    interleaved pairs (SGLang's `apply_rotary_emb`)."""

    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        # Kept in fp32 and out of the module's buffers, so `.to(bfloat16)` cannot round it; built
        # on the CPU even when the module is constructed on the meta device.
        with torch.device("cpu"):
            self.inv_freq, self.attention_scaling = _rope_inv_freq(config)
        self.width = config.rope_width
        self.neox = config.rope_is_neox_style

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [N] -> cos, sin [N, rope_width]: the frequencies twice, [f_0..f_{w/2-1}, f_0..]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [N, heads, head_dim]; cos, sin [N, rope_width]
        if self.width == x.shape[-1] and self.neox:
            return _rotate_neox(x, cos, sin)
        rot, rest = x[..., : self.width], x[..., self.width :]
        if self.neox:
            rot = _rotate_neox(rot, cos, sin)
        else:
            # Pair (x_2i, x_2i+1) turns by f_i: E.g. width 4: (x0, x1) by f_0, (x2, x3) by f_1.
            half = self.width // 2
            c, s = cos[:, None, :half], sin[:, None, :half]
            even, odd = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
        return torch.cat((rot, rest), dim=-1)


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, d]; cos, sin [N, d]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _rope_inv_freq(config: DFlashDraftConfig) -> tuple[torch.Tensor, float]:
    rope = config.rope
    if rope["rope_type"] == "default":
        dim = config.rope_width
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (float(rope["rope_theta"]) ** exponent), 1.0
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise CheckpointError(f"draft config rope type {rope['rope_type']!r} is not supported")
    hf = PretrainedConfig(
        rope_parameters=dict(rope),
        head_dim=config.head_dim,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    return inv_freq.float(), float(scaling)


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashDraftConfig, layer_id: int, tp: TensorParallel, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.rope = rotary.apply  # a bound method: the module is shared, not a child of each layer
        self.num_heads = tp.split(config.num_attention_heads, "attention heads")  # on this rank
        self.num_kv_heads = tp.split(config.num_key_value_heads, "KV heads")
        self.head_dim = config.head_dim
        bias = config.attention_bias
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        # Row-parallel: the partial outputs are summed across ranks, so one rank adds the bias.
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bias and tp.rank == 0)
        self.q_norm = _norm(config, config.head_dim)
        self.k_norm = _norm(config, config.head_dim)
        self.value_scale = config.attention_value_scale  # None: V as projected
        # MiMo: one sink logit per head (this rank's heads), read by the attention (`attend`).
        self.attention_sink_bias = (
            nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sink_bias else None
        )
        # Laguna: the output scaled by softplus(g_proj(x)), one gate per head or per element.
        self.gate_width = {"per-head": 1, "per-element": self.head_dim}.get(config.gating, 0)
        if self.gate_width:
            self.g_proj = nn.Linear(config.hidden_size, self.num_heads * self.gate_width, bias=False)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> k, v [N, kv_heads, head_dim]; k is k_norm'ed and rotated."""
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        if self.value_scale is not None:  # the block's V and the context's alike, as in SGLang
            v = v * self.value_scale
        return self.rope(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        q = self.rope(q, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        out = attend(self.layer_id, q, k, v)  # [N, heads, head_dim]
        if self.gate_width:  # gate [N, heads, 1 or head_dim], softplus in fp32 (as SGLang)
            gate = F.softplus(self.g_proj(x).float()).to(out.dtype)
            out = out * gate.view(x.shape[0], self.num_heads, self.gate_width)
        return self.tp.all_reduce(self.o_proj(out.reshape(x.shape[0], -1)))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashDraftConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.act = config.hidden_act
        self.swiglu_alpha, self.swiglu_limit = config.swiglu_alpha, config.swiglu_limit
        columns = tp.split(config.intermediate_size, "MLP columns (intermediate_size)")
        self.gate_proj = nn.Linear(config.hidden_size, columns, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, columns, bias=False)
        self.down_proj = nn.Linear(columns, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act == "swigluoai":
            # gpt-oss's clamped SwiGLU (SGLang: swiglu_no_interleaved_with_alpha_and_limit).
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            hidden = gate * torch.sigmoid(gate * self.swiglu_alpha) * (up + 1)
        else:
            hidden = F.silu(gate) * up
        return self.tp.all_reduce(self.down_proj(hidden))


# Checkpoint weights split across tensor-parallel ranks: name suffix -> the dimension split.
# Everything else (fc, the norms, o_proj's bias) is replicated.
SHARDED_DIMS = {
    "q_proj.weight": 0,
    "q_proj.bias": 0,
    "k_proj.weight": 0,
    "k_proj.bias": 0,
    "v_proj.weight": 0,
    "v_proj.bias": 0,
    "o_proj.weight": 1,
    "gate_proj.weight": 0,
    "up_proj.weight": 0,
    "down_proj.weight": 1,
    "self_attn.attention_sink_bias": 0,
    "g_proj.weight": 0,  # Laguna's gate: rows per head (times head_dim per element)
}
# Proposal heads whose own layers' names would match SHARDED_DIMS (LiLiCorr's `mlp.up_proj`).
REPLICATED_HEADS = ("lilicorr.",)


def shard_checkpoint_tensor(name: str, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of the checkpoint tensor `name` (the whole tensor if replicated; so is
    every tensor of a proposal head, which every rank runs whole: `REPLICATED_HEADS`)."""
    if name.startswith(REPLICATED_HEADS):
        return tensor
    dim = SHARDED_DIMS.get(".".join(name.split(".")[-2:]))
    return tensor if dim is None else tp.shard(tensor, dim)


class GroupedConv(nn.Module):
    """Grouped dynamic convolution over each block, wrapped around one sublayer (SGLang's
    `DFlashGroupedConv`): `prepare` convolves the sublayer's input and returns the per-token
    coefficients that `finish` convolves its output with; both come from one projection of the
    input. For token n of a block, channel c of group g (`group_size` channels each):

        out[n, c] = sum_{t < taps} (base[side, t, c] + delta[n, t, g]) * x[n - t, c]

    with x[n - t] = 0 where n - t falls before the block's first token. The block is the one the
    draft runs (`block_size` rows per request, requests contiguous). It convolves the hidden
    states, which are whole on every rank under tensor parallelism, so its weights are
    replicated.
    """

    def __init__(self, hidden_size: int, block_size: int, taps: int, group_size: int):
        super().__init__()
        self.block_size, self.taps, self.group_size = block_size, taps, group_size
        self.num_groups = hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)  # [input/output side, tap, channel]
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [N, H] -> (convolved x [N, H], the output side's delta [N, taps, groups])
        delta = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.num_groups)
        return self._convolve(x, delta[:, 0], side=0), delta[:, 1]

    def finish(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, delta, side=1)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        # x [N, H], delta [N, taps, G] -> [N, H]; N = R requests x B block rows.
        b, taps, g = self.block_size, self.taps, self.num_groups
        x = x.reshape(-1, b, g, self.group_size)  # [R, B, G, S]
        weights = self.base_kernel[side].view(taps, g, self.group_size) + delta.reshape(-1, b, taps, g, 1)
        # taps-1 zero rows before each request's block: row n - t of the block is row
        # n + taps-1 - t of `padded`. E.g. taps 2, block [a, b, c]: padded [0, a, b, c]; tap 1 of
        # token c reads b, of token a reads 0.
        padded = F.pad(x, (0, 0, 0, 0, taps - 1, 0))  # [R, taps-1+B, G, S]
        out = weights[:, :, 0] * x
        for t in range(1, taps):  # over the kernel's taps (a handful), never over tokens
            out = out + weights[:, :, t] * padded[:, taps - 1 - t : taps - 1 - t + b]
        return out.flatten(-2).flatten(0, 1)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashDraftConfig, layer_id: int, tp: TensorParallel, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_id, tp, rotary)
        self.mlp = DFlashMLP(config, tp)
        self.input_layernorm = _norm(config, config.hidden_size)
        self.post_attention_layernorm = _norm(config, config.hidden_size)
        self.attention_conv = self.mlp_conv = None
        if config.conv_kernel_size:
            shape = (config.hidden_size, config.block_size, config.conv_kernel_size, config.conv_group_size)
            self.attention_conv, self.mlp_conv = GroupedConv(*shape), GroupedConv(*shape)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        attention = self._convolved(self.attention_conv, lambda h: self.self_attn(h, cos, sin, attend))
        x = x + attention(self.input_layernorm(x))
        return x + self._convolved(self.mlp_conv, self.mlp)(self.post_attention_layernorm(x))

    @staticmethod
    def _convolved(conv: Optional[GroupedConv], sublayer: Callable) -> Callable:
        """`sublayer`, or with `conv`: its input convolved, and its output with the kernel
        projected from that input."""
        if conv is None:
            return sublayer

        def run(h: torch.Tensor) -> torch.Tensor:
            h, delta = conv.prepare(h)
            return conv.finish(sublayer(h), delta)

        return run


class DFlashDraftModel(nn.Module):
    """Draft layers plus the feature fusion (`fc`, `hidden_norm`); no embedding, no LM head."""

    def __init__(
        self, config: DFlashDraftConfig, num_target_features: int, tp: TensorParallel = TensorParallel()
    ):
        super().__init__()
        self.config = config
        self.tp = tp
        self.num_target_features = num_target_features  # K, the number of captured layers
        self.dequantized_numel = 0  # fp8 weight elements dequantised at load (`from_pretrained`)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i, tp, self.rotary_emb) for i in range(config.num_hidden_layers)
        )
        self.norm = _norm(config, config.hidden_size)
        self.fc = nn.Linear(num_target_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = _norm(config, config.hidden_size)
        if config.is_laguna:  # one plain RMSNorm per captured feature slice, before fc (as SGLang)
            self.aux_hidden_norms = nn.ModuleList(
                RMSNorm(config.hidden_size, config.rms_norm_eps) for _ in range(num_target_features)
            )
        if config.selector_rank:  # DFlash2: the proposals' head (`propose/selector.py`), run by the proposer
            if config.vocab_size is None:
                raise ValueError("a selector draft's vocab_size must be resolved (`with_target_vocab`)")
            self.candidate_selector = CandidateSelector(
                config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k
            )
        if config.own_embedding:  # Nemotron-3.5: the draft embeds its block itself (`runtime.py`)
            if config.vocab_size is None:
                raise ValueError(
                    "a draft's own embedding needs its vocab_size resolved (`with_target_vocab`)"
                )
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.lilicorr is not None:  # LiLiCorr: the proposals' head (`propose/lilicorr.py`)
            self.lilicorr = LiLiCorrHead(
                config.hidden_size, config.block_size, config.rms_norm_eps, config.lilicorr
            )
        if config.projector_type:  # Domino: the proposals' rollout (`propose/domino.py`), run by the proposer
            if config.vocab_size is None:
                raise ValueError("a Domino draft's vocab_size must be resolved (`with_target_vocab`)")
            self.prefix_gru = PrefixGRU(config.hidden_size, config.gru_hidden_dim)
            self.embed_proj = embed_projector(
                config.hidden_size, config.gru_hidden_dim, config.emb_dim, config.vocab_size
            )

    def attention_sinks(self) -> Optional[list[torch.Tensor]]:
        """Per layer, the sink logits [heads on this rank] of MiMo drafts; None without sinks."""
        if not self.config.attention_sink_bias:
            return None
        return [layer.self_attn.attention_sink_bias for layer in self.layers]

    # ------------------------------------------------------------ layer maths

    def fuse_target_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """[N, K*H] -> context feature [N, H]."""
        if self.config.is_laguna:  # slice j [N, H] through aux_hidden_norms[j]
            slices = target_features.unflatten(-1, (self.num_target_features, -1)).unbind(-2)
            target_features = torch.cat([norm(s) for norm, s in zip(self.aux_hidden_norms, slices)], -1)
        return self.hidden_norm(self.fc(target_features))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context feature [N, H] at `positions` [N] -> k, v [L, N, kv_heads, head_dim]."""
        cos, sin = self.rotary_emb.cos_sin(positions, context.dtype)
        ks, vs = zip(
            *(layer.self_attn.project_kv(self._kv_input(layer, context), cos, sin) for layer in self.layers)
        )
        return torch.stack(ks), torch.stack(vs)

    def _kv_input(self, layer: "DFlashDecoderLayer", context: torch.Tensor) -> torch.Tensor:
        """What a layer projects its context K/V from: the context feature, or for Laguna its
        `input_layernorm` of it (SGLang's `prepare_context_hidden_for_kv`)."""
        return layer.input_layernorm(context) if self.config.is_laguna else context

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """Block embeddings [N, H] at `positions` [N] -> final hidden states [N, H]."""
        x = block_embeds
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attend)
        return self.norm(x)

    # --------------------------------------------------------------- weights

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        config: DFlashDraftConfig,
        num_target_features: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TensorParallel = TensorParallel(),
        init_weights: Optional[Callable[[nn.Module], None]] = None,
    ) -> "DFlashDraftModel":
        """The draft from `path`'s safetensors; with `init_weights`, from nothing but the config:
        `init_weights(model)` fills the weights (SGLang's dummy loader, for benchmarks)."""
        with torch.device("meta"):
            model = cls(config, num_target_features, tp)
        if init_weights is not None:
            model = model.to(dtype=dtype).to_empty(device=device)  # cast on meta: no fp32 copy
            init_weights(model)
            return model.eval()
        state = _read_safetensors(path)
        if config.quantization is not None:  # fp8 -> float32 once, then cast as any checkpoint
            state, model.dequantized_numel = quantization.dequantize_state(state, config.quantization)
        model.load_checkpoint_state(state)
        return model.to(device=device, dtype=dtype).eval()

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load z-lab weight names (optionally `model.`-prefixed, or the vendor aliases of
        `checkpoint/contract.py`); missing, misshapen or unknown -> error. Under tensor parallelism
        each rank keeps its slice of the sharded weights."""
        state = {contract.canonical_name(k): v for k, v in state.items()}
        full = self
        if self.tp.size > 1:  # the checkpoint holds the whole draft: check against that
            with torch.device("meta"):
                full = type(self)(self.config, self.num_target_features)
        check_weight_shapes(
            {k: tuple(p.shape) for k, p in full.named_parameters()},
            {k: tuple(v.shape) for k, v in state.items()},
            (self.num_target_features, self.config.hidden_size),
            dtypes={k: str(v.dtype) for k, v in state.items()},
        )
        expected = dict(self.named_parameters())
        self.load_state_dict(
            {k: shard_checkpoint_tensor(k, state[k], self.tp).contiguous() for k in expected},
            strict=False,
            assign=True,
        )

    @classmethod
    def check_checkpoint(cls, path: str, config: DFlashDraftConfig, num_target_features: int) -> None:
        """The checkpoint's weights against the network the config describes, from the
        safetensors headers only (no tensor is read): for the launching process, so a bad
        checkpoint fails there with one line, not inside the scheduler."""
        load_mask_embedding(path, config)
        with torch.device("meta"):
            model = cls(config, num_target_features)
        header = read_weight_header(path)
        if config.quantization is not None:
            header = quantization.dequantize_header(header, config.quantization)
        header = {contract.canonical_name(k): v for k, v in header.items()}
        check_weight_shapes(
            {k: tuple(p.shape) for k, p in model.named_parameters()},
            {k: shape for k, (shape, _) in header.items()},
            (num_target_features, config.hidden_size),
            dtypes={k: dtype for k, (_, dtype) in header.items()},
        )

    def save_pretrained(self, path: str, raw_config: dict, dtype: Optional[torch.dtype] = None) -> None:
        """Write `config.json` and `model.safetensors` in the z-lab format."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw_config, f, indent=2, sort_keys=True)
        tensors = {
            name: (p.detach().to(dtype) if dtype else p.detach()).contiguous().cpu()
            for name, p in self.named_parameters()
        }
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _fc_mismatch(found: tuple, num_target_features: int, hidden_size: int) -> str:
    """fc.weight's input width against the features it reads, both numbers named: its mismatch is
    the common one, a draft trained on another target's hidden states (another width or another
    number of captured layers)."""
    width = num_target_features * hidden_size
    return (
        f"draft weight 'fc.weight' has shape {found}: its input width {found[-1]} is not "
        f"{num_target_features} target layer(s) (target_layer_ids) x the target's hidden_size {hidden_size} "
        f"= {width}; the draft was made for another target or other target_layer_ids"
    )


def check_weight_shapes(
    expected: dict[str, tuple], found: dict[str, tuple], fc_features: tuple[int, int], dtypes: dict[str, str]
) -> None:
    """Every tensor is a draft weight or refused by `checkpoint/contract.py` (which names its
    family); every expected weight is present with its shape, the error naming the tensor and
    both shapes. `fc_features`: the number of target features fc reads and the target's hidden
    size, to explain an fc.weight of another input width (`_fc_mismatch`)."""
    contract.check_tensors(found, expected, dtypes)
    for name, want in expected.items():
        if name not in found:
            raise CheckpointError(f"draft checkpoint is missing the weight {name!r} (expected shape {want})")
        if found[name] == want:
            continue
        if name == "fc.weight" and len(found[name]) == 2 and found[name][0] == want[0]:
            raise CheckpointError(_fc_mismatch(found[name], *fc_features))
        raise CheckpointError(f"draft weight {name!r} has shape {found[name]}, expected {want}")


def read_weight_header(path: str) -> dict[str, tuple[tuple, str]]:
    """Tensor name -> (shape, safetensors dtype such as "BF16"), from the checkpoint's
    safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    header: dict[str, tuple[tuple, str]] = {}
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for k in f.keys():
                tensor = f.get_slice(k)
                header[k] = (tuple(tensor.get_shape()), tensor.get_dtype())
    return header


def _safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"draft checkpoint {path!r} has no *.safetensors files")
    return files


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        state.update(load_file(file))
    return state

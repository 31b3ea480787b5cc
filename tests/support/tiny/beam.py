"""Beam (`make_beam_target`, SGLang's `BeamForCausalLM`), written straight in SGLang's checkpoint
names, and its plain-PyTorch oracle (`BeamReference`), as transformers has no Beam class."""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from tests.support.tiny.qwen3 import TEXT_SHAPE_A, _favour
from tests.support.tiny.tokenizer import EOS_ID, make_tokenizer

# Beam's tiny shape: target "a"'s, three sliding layers of window 8 (RoPE) then a full one (no
# RoPE, SSMax), two dense MLP layers then two MoE ones (4 experts in 2 groups, top 2).
BEAM_SHAPE = dict(
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    mlp_layer_types=["dense"] * 2 + ["sparse"] * 2,
    sliding_window=8,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=2,
    routed_scaling_factor=2.5,
    final_logit_softcapping=30.0,
)


def make_beam_target(path: str, *, seed: int = 0, favour: float = 0.0) -> str:
    """A tiny Beam target (SGLang's `BeamForCausalLM`; transformers has no Beam class), written
    straight in the checkpoint names SGLang's loader reads: per layer q/k/v/gate/o projections, a
    per-head gate bias, q/k norms, four sandwich norms, and a dense MLP or experts with a
    sigmoid router and its correction bias. Random weights as `_save_peaked` draws them (normal
    0.15 for matrices, norms near 1), `favour` as in `make_hybrid_target`."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    a, b = TEXT_SHAPE_A, BEAM_SHAPE
    hidden, head_dim = a["hidden_size"], a["head_dim"]
    q, kv = a["num_attention_heads"] * head_dim, a["num_key_value_heads"] * head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * 0.15

    def norm(width: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(width, generator=gen)

    tensors = {
        "model.embed_tokens.weight": matrix(a["vocab_size"], hidden),
        "lm_head.weight": matrix(a["vocab_size"], hidden),
    }
    for i in range(a["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("gate_proj", q)):
            tensors[f"{layer}self_attn.{name}.weight"] = matrix(rows, hidden)
        tensors[f"{layer}self_attn.o_proj.weight"] = matrix(hidden, q)
        tensors[f"{layer}self_attn.gate_bias"] = 0.5 * torch.randn(a["num_attention_heads"], generator=gen)
        tensors[f"{layer}self_attn.q_norm.weight"] = norm(head_dim)
        tensors[f"{layer}self_attn.k_norm.weight"] = norm(head_dim)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            tensors[f"{layer}{name}_layernorm.weight"] = norm(hidden)
        if b["mlp_layer_types"][i] == "dense":
            experts = {"mlp.": b["intermediate_size"]}
        else:
            tensors[f"{layer}mlp.gate.weight"] = matrix(b["num_experts"], hidden)
            tensors[f"{layer}mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(
                b["num_experts"], generator=gen
            )
            experts = {f"mlp.experts.{e}.": b["moe_intermediate_size"] for e in range(b["num_experts"])}
        for prefix, width in experts.items():
            tensors[f"{layer}{prefix}gate_proj.weight"] = matrix(width, hidden)
            tensors[f"{layer}{prefix}up_proj.weight"] = matrix(width, hidden)
            tensors[f"{layer}{prefix}down_proj.weight"] = matrix(hidden, width)
    tensors["model.norm.weight"] = norm(hidden)
    _favour(tensors["model.embed_tokens.weight"], tensors["lm_head.weight"], favour)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = dict(a, **BEAM_SHAPE)
    config.update(
        architectures=["BeamForCausalLM"],
        model_type="beam",
        torch_dtype="float32",
        hidden_act="silu",
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
        attention_bias=False,
        pad_token_id=EOS_ID,
        # RoPE on the sliding layers only, as BeamConfig requires.
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": None,
        },
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    make_tokenizer(path)
    return path


class BeamReference:
    """Beam's forward in plain PyTorch over a `make_beam_target` checkpoint, the oracle for
    SGLang's `BeamForCausalLM` (transformers has none), from SGLang 0.5.23's `beam.py`:

    * attention: q/k RMS-normed per head; on sliding layers NeoX RoPE and a window of
      `sliding_window` keys (the query's own included); on full layers no RoPE, and SSMax, the
      queries scaled by exp(0.1 log1p((position + 1) / 2048)); the output gated per head by
      sigmoid(gate_proj(x) + gate_bias);
    * sandwich norms with depth-scaled residuals: after sublayer d (2(i+1) for layer i's
      attention, 2(i+1)+1 for its MLP), h = norm(branch) / sqrt(d) + h sqrt(d-1) / sqrt(d);
    * MoE: sigmoid router, top-k by score + correction bias within the best groups, weights
      renormalized, times `routed_scaling_factor`;
    * the LM head in bf16 (SGLang keeps Beam's head bf16 in any engine dtype), logits soft-capped.
    """

    def __init__(self, path: str):
        from safetensors.torch import load_file

        with open(os.path.join(path, "config.json")) as f:
            self.config = json.load(f)
        self.w = load_file(os.path.join(path, "model.safetensors"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config["rms_norm_eps"]) * self.w[name]

    def _attention(self, x: torch.Tensor, i: int) -> torch.Tensor:
        c, w, p = self.config, self.w, f"model.layers.{i}.self_attn."
        n, heads, kv_heads, d = x.shape[0], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q = self._norm((x @ w[p + "q_proj.weight"].T).view(n, heads, d), p + "q_norm.weight")
        k = self._norm((x @ w[p + "k_proj.weight"].T).view(n, kv_heads, d), p + "k_norm.weight")
        v = (x @ w[p + "v_proj.weight"].T).view(n, kv_heads, d)
        pos = torch.arange(n)
        allowed = pos[None, :] <= pos[:, None]  # [query, key]
        if c["layer_types"][i] == "sliding_attention":
            theta = c["rope_parameters"]["sliding_attention"]["rope_theta"]
            angle = pos[:, None].float() * theta ** (-torch.arange(0, d, 2).float() / d)  # [n, d/2]
            cos, sin = angle.cos()[:, None].repeat(1, 1, 2), angle.sin()[:, None].repeat(1, 1, 2)

            def rotate(t):  # NeoX: the two halves of each head
                return t * cos + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * sin

            q, k = rotate(q), rotate(k)
            allowed &= pos[:, None] - pos[None, :] < c["sliding_window"]
        else:
            q = q * torch.exp(0.1 * torch.log1p((pos.float() + 1) / 2048))[:, None, None]
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
        out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
        gate = (x @ w[p + "gate_proj.weight"].T).view(n, heads, d) + w[p + "gate_bias"][None, :, None]
        return (out * torch.sigmoid(gate)).reshape(n, heads * d) @ w[p + "o_proj.weight"].T

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        w = self.w
        return (F.silu(x @ w[prefix + "gate_proj.weight"].T) * (x @ w[prefix + "up_proj.weight"].T)) @ w[
            prefix + "down_proj.weight"
        ].T

    def _moe(self, x: torch.Tensor, i: int) -> torch.Tensor:
        c, p = self.config, f"model.layers.{i}.mlp."
        scores = torch.sigmoid(x @ self.w[p + "gate.weight"].T)  # [n, E]
        choice = (scores + self.w[p + "gate.e_score_correction_bias"]).view(x.shape[0], c["n_group"], -1)
        groups = (
            choice.topk(2, dim=-1).values.sum(-1).topk(c["topk_group"], dim=-1).indices
        )  # [n, topk_group]
        in_group = torch.zeros(choice.shape[:2], dtype=torch.bool).scatter(1, groups, True)
        choice = choice.masked_fill(~in_group[..., None], float("-inf")).flatten(1)
        ids = choice.topk(c["num_experts_per_tok"], dim=-1).indices  # [n, k]
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * c["routed_scaling_factor"]
        outputs = torch.stack(
            [self._mlp(x, f"{p}experts.{e}.") for e in range(c["num_experts"])], 1
        )  # [n, E, H]
        return (outputs.gather(1, ids[..., None].expand(-1, -1, x.shape[-1])) * weights[..., None]).sum(1)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> logits [n, V] float32."""
        c, w = self.config, self.w
        h = w["model.embed_tokens.weight"][ids]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            for depth, branch in ((2 * (i + 1), "attention"), (2 * (i + 1) + 1, "mlp")):
                if branch == "attention":
                    out = self._attention(self._norm(h, p + "input_layernorm.weight"), i)
                    post = p + "post_attention_layernorm.weight"
                else:
                    x = self._norm(h, p + "pre_feedforward_layernorm.weight")
                    out = self._mlp(x, p + "mlp.") if c["mlp_layer_types"][i] == "dense" else self._moe(x, i)
                    post = p + "post_feedforward_layernorm.weight"
                h = self._norm(out, post) / depth**0.5 + h * ((depth - 1) / depth) ** 0.5
        h = self._norm(h, "model.norm.weight")
        logits = F.linear(h.to(torch.bfloat16), w["lm_head.weight"].to(torch.bfloat16)).float()
        cap = c["final_logit_softcapping"]
        return torch.tanh(logits / cap) * cap

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **_greedy) -> torch.Tensor:
        """Greedy, as transformers' `generate(..., do_sample=False)` returns: [1, prompt + new]."""
        ids = input_ids[0]
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, self.logits(ids)[-1].argmax()[None]])
        return ids[None]

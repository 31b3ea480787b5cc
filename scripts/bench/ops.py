"""Context-KV injection (feature fusion + KV injection) on one GPU: three implementations.

    python scripts/bench/ops.py [--shape qwen3-8b|small] [--tokens 1,7,64,513,4096]
                                [--dtype bfloat16] [--iters 50] [--graph]

  ours      torch.ops.sglang_dflash.inject_context_kv: 2 cuBLAS GEMMs + 1 fused epilogue
            (hidden_norm scale, k_norm, RoPE, paged store of every layer).
  torch     sglang_dflash.ops.reference: the draft's module-by-module maths in PyTorch.
  builtin   SGLang 0.5.23's DFLASH path, built as its worker builds it: fc + hidden_norm
            (SGLang's RMSNorm if it runs standalone, else F.rms_norm), FusedKVMaterializeHelper
            (one stacked GEMM + Triton norm/RoPE into K/V workspaces), then one store per layer
            through the KV pool's `_set_kv_buffer_impl` (the body of `set_kv_buffer`, without
            its Python checks: a conservative, i.e. faster, stand-in).
  gemm      the two GEMMs alone (x @ fc^T, then @ W_kv^T): the floor any implementation pays.

Each path is warmed up and then timed with CUDA events over --iters back-to-back calls (eager:
launch overhead included, as in serving; --graph: replayed from a CUDA graph). GB/s counts the
minimum traffic: features in, both weights, K/V out. All paths are checked against each other
before timing. Random weights and inputs (seeded); positions up to 40k; distinct slots.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from sglang_dflash.checkpoint.config import DFlashDraftConfig  # noqa: E402
from sglang_dflash.draft.kv_store import DraftKVStore  # noqa: E402
from sglang_dflash.draft.model import DFlashDraftModel  # noqa: E402
from sglang_dflash.ops import _cuda, reference  # noqa: E402

# name -> (hidden, K captured layers, draft layers, heads, kv heads, head_dim)
SHAPES = {"qwen3-8b": (4096, 5, 5, 32, 8, 128), "small": (1024, 3, 3, 16, 4, 128)}
MAX_POSITION = 40960


def build_model(shape: str, dtype: torch.dtype) -> DFlashDraftModel:
    hidden, k, layers, heads, kv_heads, head_dim = SHAPES[shape]
    config = DFlashDraftConfig.from_dict(
        {
            "architectures": ["DFlashDraftModel"],
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "intermediate_size": 3 * hidden,
            "rms_norm_eps": 1e-6,
            "block_size": 16,
            "mask_token_id": 1,
            "rope_theta": 1000000.0,
            "max_position_embeddings": MAX_POSITION,
        }
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DFlashDraftModel(config, k)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.to(dtype).eval().requires_grad_(False)


def new_store(model: DFlashDraftModel, num_slots: int) -> DraftKVStore:
    c = model.config
    return DraftKVStore(
        num_slots=num_slots,
        num_layers=c.num_hidden_layers,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        dtype=model.fc.weight.dtype,
        device="cuda",
    )


class BuiltinPath:
    """SGLang's DFLASH injection path over the same weights and store."""

    def __init__(self, model: DFlashDraftModel, store: DraftKVStore):
        from sglang.kernels.ops.speculative.fused_kv_materialize import FusedKVMaterializeHelper
        from sglang.srt.mem_cache import memory_pool

        c = model.config
        self.model, self.store = model, store
        self.norm, self.norm_name = self._hidden_norm(model)
        inv_freq = model.rotary_emb.inv_freq.to("cuda", torch.float32)
        freqs = torch.arange(MAX_POSITION, device="cuda", dtype=torch.float32)[:, None] * inv_freq[None, :]
        rotary_emb = SimpleNamespace(
            cos_sin_cache=torch.cat([freqs.cos(), freqs.sin()], dim=-1),
            rotary_dim=c.head_dim,
            is_neox_style=True,
        )
        layers = []
        for layer in model.layers:
            a = layer.self_attn
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            layers.append(
                SimpleNamespace(
                    self_attn=SimpleNamespace(
                        num_kv_heads=c.num_key_value_heads,
                        head_dim=c.head_dim,
                        rotary_emb=rotary_emb,
                        qkv_proj=SimpleNamespace(weight=qkv),
                        q_size=c.q_size,
                        kv_size=c.kv_size,
                        k_norm=SimpleNamespace(weight=a.k_norm.weight, variance_epsilon=a.k_norm.eps),
                    )
                )
            )
        self.helper = FusedKVMaterializeHelper(
            layers, rotary_emb, c.num_key_value_heads, c.head_dim, torch.device("cuda"), MAX_POSITION
        )
        self.set_kv = memory_pool._set_kv_buffer_impl
        self.row_dim = c.kv_size

    @staticmethod
    def _hidden_norm(model: DFlashDraftModel) -> tuple[Callable, str]:
        w, eps = model.hidden_norm.weight, model.hidden_norm.eps
        try:
            from sglang.srt.layers.layernorm import RMSNorm

            norm = RMSNorm(w.shape[0], eps=eps).to("cuda", w.dtype)
            norm.weight.data.copy_(w)
            norm(torch.zeros(1, w.shape[0], device="cuda", dtype=w.dtype))
            return norm, "sglang RMSNorm"
        except Exception as error:  # standalone use of SGLang's layer may need server state
            print(
                f"[builtin] SGLang RMSNorm unavailable standalone ({type(error).__name__}); using F.rms_norm"
            )
            return (lambda x: torch.nn.functional.rms_norm(x, (w.shape[0],), w, eps)), "F.rms_norm"

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        ctx = self.norm(torch.nn.functional.linear(x, self.model.fc.weight))
        k_cache, v_cache = self.store.k, self.store.v

        def write_layer_kv(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.set_kv(
                k,
                v,
                k_cache[layer],
                v_cache[layer],
                slots,
                row_dim=self.row_dim,
                store_dtype=k_cache.dtype,
                device_module=torch.cuda,
                size_limit=k_cache.shape[1],
            )

        self.helper.materialize(ctx, positions, write_layer_kv)


def device_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean device time of `fn` over back-to-back calls (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def time_us(fn: Callable[[], None], iters: int, graph: bool) -> Optional[float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                fn()
        except Exception as error:
            print(f"  graph capture failed: {type(error).__name__}: {error}")
            return None
        fn = g.replay
        for _ in range(3):
            fn()
    return device_ms(fn, iters) * 1000


def check_same(stores: dict, slots: torch.Tensor, dtype: torch.dtype) -> None:
    base = stores["torch"]
    eps = {torch.bfloat16: 2**-6, torch.float16: 2**-9}.get(dtype, 1e-5)
    for name, store in stores.items():
        for kind in ("k", "v"):
            got, want = getattr(store, kind)[:, slots].float(), getattr(base, kind)[:, slots].float()
            atol = eps * float(want.abs().max())
            torch.testing.assert_close(got, want, rtol=eps, atol=atol, msg=lambda m: f"{name}.{kind}: {m}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    parser.add_argument("--tokens", default="1,7,64,513,4096")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    parser.add_argument("--no-builtin", action="store_true", help="skip SGLang's path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("scripts/bench/ops.py needs a CUDA GPU")
    error = _cuda.load_error()
    if error is not None:
        sys.exit(error)

    dtype = getattr(torch, args.dtype)
    model = build_model(args.shape, dtype)
    c = model.config
    weights = _cuda.fused_weights(model)
    weight_bytes = (weights.fc_weight.numel() + weights.kv_weight.numel()) * weights.fc_weight.element_size()
    print(
        f"# {torch.cuda.get_device_name()} | shape {args.shape}: "
        f"H={c.hidden_size} K={model.num_target_features} "
        f"L={c.num_hidden_layers} kv_heads={c.num_key_value_heads} head_dim={c.head_dim} | {args.dtype} | "
        f"{'graph replay' if args.graph else 'eager'} | {args.iters} iters"
    )
    header = f"{'tokens':>7} {'ours us':>9} {'torch us':>9} {'builtin us':>10} {'gemm us':>8} "
    print(header + f"{'vs torch':>9} {'vs builtin':>10} {'ours GB/s':>10}")
    for n in [int(t) for t in args.tokens.split(",")]:
        num_slots = n + 1024
        g = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(n, c.hidden_size * model.num_target_features, device="cuda", generator=g).to(dtype)
        positions = torch.randint(0, MAX_POSITION - 1, (n,), device="cuda", generator=g)
        slots = torch.randperm(num_slots - 1, device="cuda", generator=g)[:n] + 1
        stores = {name: new_store(model, num_slots) for name in ("ours", "torch", "builtin")}
        paths = {
            "ours": lambda s=stores["ours"]: _cuda.inject_context_kv(model, s, x, positions, slots),
            "torch": lambda s=stores["torch"]: reference.inject_context_kv(model, s, x, positions, slots),
        }
        if not args.no_builtin:
            builtin = BuiltinPath(model, stores["builtin"])
            paths["builtin"] = lambda b=builtin: b(x, positions, slots)
        else:
            del stores["builtin"]
        paths["gemm"] = lambda: (x @ weights.fc_weight.T) @ weights.kv_weight.T
        for name, fn in paths.items():
            if name != "gemm":
                fn()
        check_same(stores, slots, dtype)
        t = {name: time_us(fn, args.iters, args.graph) for name, fn in paths.items()}
        moved = x.numel() * x.element_size() + weight_bytes + 2 * n * c.num_hidden_layers * c.kv_size * 2
        ours = t["ours"]
        gbps = moved / (ours * 1e-6) / 1e9 if ours else 0.0

        def fmt(v: Optional[float], width: int) -> str:
            return f"{v:>{width}.1f}" if v is not None else f"{'n/a':>{width}}"

        def ratio(other: Optional[float]) -> str:
            return f"{other / ours:>8.2f}x" if other and ours else f"{'n/a':>9}"

        print(
            f"{n:>7} {fmt(ours, 9)} {fmt(t['torch'], 9)} {fmt(t.get('builtin'), 10)} {fmt(t['gemm'], 8)} "
            f"{ratio(t['torch'])} {ratio(t.get('builtin')):>10} {gbps:>10.0f}"
        )


if __name__ == "__main__":
    main()

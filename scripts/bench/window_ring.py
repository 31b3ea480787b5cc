"""Draft K/V per request and draft-step time against the context, the store of every token
against the window ring (SGLANG_DFLASH_DRAFT_WINDOW_POOL=1), on CPU.

    python scripts/bench/window_ring.py [--window 2048] [--contexts 1024,2048,...,32768]
                                        [--batch-size 1] [--iters 10] [--json PATH] [--plot PNG]

The shipped tiny pair's draft shape (2 layers, hidden 256, 2 KV heads x 64, block 8), every
layer sliding with window --window, random weights, fp32. For each context L, `--batch-size`
requests hold L committed tokens each; one draft step is the attention plan (`bind`) and the
draft layers over the block (SDPA over the store, as on the CPU engine), median of --iters
after one warm-up. K/V per request: the bytes the store keeps for one request's context, every
layer's K and V: L rows today, window + block rows in the ring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from sglang_dflash.checkpoint.config import DFlashDraftConfig  # noqa: E402
from sglang_dflash.draft.attention import SdpaDraftAttention  # noqa: E402
from sglang_dflash.draft.kv_store import DraftKVStore  # noqa: E402
from sglang_dflash.draft.model import DFlashDraftModel  # noqa: E402
from sglang_dflash.draft.window_ring import WindowRing  # noqa: E402

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


def draft_config(window: int, max_position: int) -> DFlashDraftConfig:
    from sglang_dflash.assets import tiny_pair

    with open(os.path.join(tiny_pair()[1], "config.json")) as f:
        raw = json.load(f)
    raw.update(
        layer_types=["sliding_attention"] * raw["num_hidden_layers"],
        sliding_window=window,
        use_sliding_window=True,
        max_position_embeddings=max_position,
    )
    return DFlashDraftConfig.from_dict(raw)


def store_for(config: DFlashDraftConfig, num_slots: int, ring) -> DraftKVStore:
    layers = config.num_hidden_layers
    return DraftKVStore(
        num_slots=num_slots, num_layers=layers, num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, dtype=torch.float32, device="cpu", ring=ring,
        windowed_layers=range(layers) if ring is not None else (),
    )  # fmt: skip


def step_ms(model, attention, req_to_token, bs: int, context: int, iters: int) -> float:
    """Median ms of one draft step: bind, then the layers over the block of every request."""
    block = model.config.block_size
    lens = torch.full((bs,), context, dtype=torch.int64)
    reqs = torch.arange(1, bs + 1)
    embeds = torch.randn(bs * block, model.config.hidden_size)
    positions = (lens[:, None] + torch.arange(block)).reshape(-1)
    times = []
    with torch.no_grad():
        for i in range(iters + 1):
            start = time.perf_counter()
            attend = attention.bind(req_to_token, reqs, lens, lens, block)
            model(embeds, positions, attend)
            if i:  # the first is a warm-up
                times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def plot(rows: list[dict], path: str, window: int, bs: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kv, step) = plt.subplots(1, 2, figsize=(10, 3.8))
    contexts = [r["context"] for r in rows]
    for key, label in (("every_token", "K/V for every token"), ("ring", "window ring")):
        kv.plot(contexts, [r[f"{key}_kv_mib"] for r in rows], marker="o", label=label)
        step.plot(contexts, [r[f"{key}_step_ms"] for r in rows], marker="o", label=label)
    for ax, ylabel in ((kv, "draft K/V per request (MiB)"), (step, f"draft step, batch {bs} (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"All-sliding draft (window {window}) on CPU: the store of every token against the ring")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--plot", help="a PNG of both against the context (needs matplotlib)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    config = draft_config(args.window, max(contexts) + 64)
    torch.manual_seed(0)
    model = DFlashDraftModel(config, len(config.resolve_target_layer_ids(4)))  # the pair's 4-layer target
    bs, block = args.batch_size, config.block_size
    ring = WindowRing.for_reach(args.window, block, bs + 1)
    per_row = 2 * config.num_key_value_heads * config.head_dim * 4 * config.num_hidden_layers  # K, V, fp32
    rows = []
    for context in contexts:
        num_slots = bs * (context + block) + 1
        req_to_token = torch.zeros(bs + 1, context + block, dtype=torch.int64)
        req_to_token[1:] = torch.arange(1, num_slots).view(bs, context + block)
        row = dict(context=context)
        for key, r in (("every_token", None), ("ring", ring)):
            store = store_for(config, num_slots if r is None else 1, r)
            attention = SdpaDraftAttention(config, store)
            row[f"{key}_step_ms"] = step_ms(model, attention, req_to_token, bs, context, args.iters)
            kept = context if r is None else r.rows_per_request
            row[f"{key}_kv_mib"] = kept * per_row / 2**20
        rows.append(row)
        print(
            f"context {context:6d}: K/V {row['every_token_kv_mib']:7.2f} -> {row['ring_kv_mib']:5.2f} MiB, "
            f"step {row['every_token_step_ms']:6.2f} -> {row['ring_step_ms']:5.2f} ms",
            flush=True,
        )
    print(f"\nwindow {args.window}, block {block}, batch {bs}, fp32, one core\n")
    print("| Context | Draft K/V per request: every token | ring | Draft step: every token | ring |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['context']:,} | {r['every_token_kv_mib']:.2f} MiB | {r['ring_kv_mib']:.2f} MiB "
            f"| {r['every_token_step_ms']:.2f} ms | {r['ring_step_ms']:.2f} ms |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(window=args.window, batch_size=bs, rows=rows), f, indent=2)
    if args.plot:
        plot(rows, args.plot, args.window, bs)


if __name__ == "__main__":
    main()

"""The target's KV pool with DFLASH against without, at the same memory settings, on CPU engines.

    python scripts/bench/target_pool_share.py [--drafts published,all-sliding,mixed]
                                              [--window 32] [--mem-fraction 0.1] [--json PATH]
                                              [--target DIR --draft DIR] [--engine-args JSON]

SGLang sizes the target's pool from the memory it measures, and charges the draft's K/V per
target token from that budget (`mem_cache/draft_kv_budget.py`): each target slot costs the
target's bytes per token plus the draft's. This starts, one after the other, the engine without
speculation and a DFLASH engine per draft variant on the shipped tiny pair (sglang_dflash/assets),
or on --target and --draft, with nothing capping the pool (no --max-total-tokens), and reads
`max_total_num_tokens` and the draft's K/V plan from server info (--engine-args: more engine
arguments for every engine, a JSON object):

  published     the shipped draft as it is (full-attention layers).
  all-sliding   the same weights, every layer re-declared sliding with window --window.
  mixed         the first layer sliding (window --window), the others full.

`x plain` is the DFLASH engine's pool over the plain engine's, measured in this run. The draft's
bytes per token (full and sliding layers apart) are server info's. For a draft with sliding
layers, one more DFLASH engine runs with SGLANG_DFLASH_DRAFT_WINDOW_POOL=1 (`with the window
ring`), next to the estimate of what it should give: the budget the plain engine spent,
M = its tokens x t, less the sliding layers' rows per request slot (window + block, for
--max-running-requests 32), over t + the full layers' bytes. t, the target's bytes per token, is
read off the measured ratio r = t / (t + d): t = d r / (1 - r).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

VARIANTS = ("published", "all-sliding", "mixed")
WINDOW_POOL = "SGLANG_DFLASH_DRAFT_WINDOW_POOL"
MAX_RUNNING_REQUESTS = 32


def draft_variant(draft: str, variant: str, window: int, root: str) -> str:
    """A copy of `draft` whose config declares the variant's layer types (the weights are shared)."""
    if variant == "published":
        return draft
    path = os.path.join(root, f"draft-{variant}")
    shutil.copytree(draft, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    layers = config["num_hidden_layers"]
    kinds = ["sliding_attention"] * layers if variant == "all-sliding" else ["sliding_attention"]
    config["layer_types"] = kinds + ["full_attention"] * (layers - len(kinds))
    config["sliding_window"] = window
    config["use_sliding_window"] = True  # transformers' Qwen3Config drops the window otherwise
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def measure(
    target: str, draft: str | None, mem_fraction: float, extra: dict, window_pool: bool = False
) -> dict:
    """One engine's pool and draft K/V plan; `window_pool`: SGLANG_DFLASH_DRAFT_WINDOW_POOL=1."""
    import sglang as sgl

    args = dict(
        model_path=target,
        device="cpu",
        attention_backend="torch_native",
        mem_fraction_static=mem_fraction,
        max_running_requests=MAX_RUNNING_REQUESTS,
        log_level="error",
        **extra,
    )
    if draft is not None:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=draft)
    started = time.time()
    # The scheduler reads the switch when it starts, from the environment it inherits.
    os.environ[WINDOW_POOL] = "1" if window_pool else "0"
    engine = sgl.Engine(**args)
    try:
        info = engine.get_server_info()
        return {
            "max_total_num_tokens": int(info["max_total_num_tokens"]),
            "draft_kv": info["internal_states"][0].get("dflash_draft_kv"),
            "start_s": time.time() - started,
        }
    finally:
        engine.shutdown()


def windowed_estimate(plain_tokens: int, ratio: float, full: int, sliding: int, rows: int) -> int:
    """Target tokens with the sliding layers holding `rows` K/V rows per request slot (see above)."""
    target = (full + sliding) * ratio / (1 - ratio)  # t, bytes per token
    budget = plain_tokens * target - rows * MAX_RUNNING_REQUESTS * sliding
    return int(budget / (target + full))


def table(rows: list[dict]) -> str:
    out = [
        "| Engine | Draft layers | Draft B/token (full + sliding) | Target tokens | x plain "
        "| With the window ring | x plain | Estimate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ring = "- | - | - |"
        if "ring" in r:
            ring = f"{r['ring']:,} | {r['ring_ratio']:.2f} | {r['windowed']:,} |"
        out.append(
            f"| {r['engine']} | {r['layers']} | {r['draft_bytes']} | {r['tokens']:,} | {r['ratio']:.2f} | "
            + ring
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafts", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}")
    parser.add_argument("--window", type=int, default=32, help="the sliding layers' window")
    parser.add_argument("--mem-fraction", type=float, default=0.1, help="--mem-fraction-static, every engine")
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--target", help="a target checkpoint (default: the shipped tiny pair's)")
    parser.add_argument("--draft", help="its DFlash draft (with --target)")
    parser.add_argument("--engine-args", default="{}", help="more sgl.Engine arguments, a JSON object")
    args = parser.parse_args()
    variants = [v for v in args.drafts.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown drafts {sorted(unknown)}; choose from {list(VARIANTS)}")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

    from sglang_dflash.assets import tiny_pair
    from sglang_dflash.checkpoint.config import DFlashDraftConfig

    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together")
    target, draft = (args.target, args.draft) if args.target else tiny_pair()
    extra = json.loads(args.engine_args)
    block_size = DFlashDraftConfig.from_pretrained(draft).block_size
    with tempfile.TemporaryDirectory() as root:
        print("plain engine ...", flush=True)
        plain = measure(target, None, args.mem_fraction, extra)
        print(f"  {plain['max_total_num_tokens']:,} tokens ({plain['start_s']:.0f} s)", flush=True)
        rows = [
            dict(engine="no speculation", layers="-", tokens=plain["max_total_num_tokens"], ratio=1.0,
                 draft_bytes="-", start_s=plain["start_s"])
        ]  # fmt: skip
        for variant in variants:
            print(f"DFLASH, {variant} draft ...", flush=True)
            path = draft_variant(draft, variant, args.window, root)
            got = measure(target, path, args.mem_fraction, extra)
            kv = got["draft_kv"]
            full, sliding = kv["bytes_per_token_full"], kv["bytes_per_token_sliding"]
            windows = sorted(set(kv["sliding_windows"]))
            layers = f"{len(kv['full_layers'])} full + {len(kv['sliding_layers'])} sliding"
            if windows:
                layers += f" (window {'/'.join(map(str, windows))})"
            ratio = got["max_total_num_tokens"] / plain["max_total_num_tokens"]
            rows.append(
                dict(
                    engine=f"DFLASH, {variant}",
                    layers=layers,
                    tokens=got["max_total_num_tokens"],
                    ratio=ratio,
                    draft_bytes=f"{full} + {sliding}",
                    start_s=got["start_s"],
                )
            )
            print(
                f"  {got['max_total_num_tokens']:,} tokens, x{ratio:.2f} ({got['start_s']:.0f} s)", flush=True
            )
            if sliding:
                ring = max(windows) + block_size
                est = windowed_estimate(plain["max_total_num_tokens"], ratio, full, sliding, ring)
                print(f"DFLASH, {variant} draft, {WINDOW_POOL}=1 ...", flush=True)
                with_ring = measure(target, path, args.mem_fraction, extra, True)["max_total_num_tokens"]
                ring_ratio = with_ring / plain["max_total_num_tokens"]
                rows[-1].update(windowed=est, ring=with_ring, ring_ratio=ring_ratio)
                print(f"  {with_ring:,} tokens, x{ring_ratio:.2f} (estimate {est:,})", flush=True)
    print(f"\n--mem-fraction-static {args.mem_fraction}, --max-running-requests {MAX_RUNNING_REQUESTS}\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(mem_fraction=args.mem_fraction, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()

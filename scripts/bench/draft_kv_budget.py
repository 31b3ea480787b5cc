"""What each published draft's K/V costs per request, today and with its sliding layers windowed.

    python scripts/bench/draft_kv_budget.py [--contexts 8192,32768,131072] [--tp 1]
                                            [--kv-bytes 2] [--drafts DIR] [--json PATH]

For every published draft config in `--drafts` (default: the copies under
tests/data/published_drafts that we serve), `DraftKVPlan` (sglang_dflash/draft/kv_plan.py) splits
its layers into full ones and windowed ones, with their K/V bytes per token on one rank
(--tp splits the KV heads, --kv-bytes is the K/V element size: 2 for bf16). Then, per request of
each context length L:

  today     L x (full + sliding bytes/token): the store keeps every layer's K/V at every slot.
  windowed  L x full + min(L, w + block) x sliding: a sliding layer only needs the rows its next
            step can read (the window w counted back from the block, plus the block accepted).
  saved     today - windowed, and the share of the draft's K/V it is.

A computation from the configs, not a measurement: no engine starts. It is the upper bound a window
pool (issue: draft K/V that does not grow with the context) can give back to the target's pool; the
target's own bytes per token decide what that is worth in target tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig  # noqa: E402
from sglang_dflash.draft.kv_plan import DraftKVPlan  # noqa: E402

DEFAULT_DRAFTS = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "published_drafts")


def rows(name: str, config: DFlashDraftConfig, contexts: list[int], tp: int, kv_bytes: int) -> list[dict]:
    heads = max(1, config.num_key_value_heads // tp)  # GQA heads replicate below one per rank
    plan = DraftKVPlan.for_draft(
        config, context_window=None, num_kv_heads=heads, itemsize=kv_bytes, store_slots=0
    )
    out = []
    for length in contexts:
        today = length * (plan.full_bytes_per_token + plan.sliding_bytes_per_token)
        windowed = length * plan.full_bytes_per_token + sum(
            min(length, plan.reach[i] + config.block_size) * plan.bytes_per_layer_token
            for i in plan.sliding_layers
        )
        out.append(
            dict(
                draft=name,
                layers=f"{len(plan.full_layers)} full + {len(plan.sliding_layers)} sliding",
                windows="/".join(str(w) for w in sorted({plan.reach[i] for i in plan.sliding_layers})) or "-",
                full_kib=plan.full_bytes_per_token / 1024,
                sliding_kib=plan.sliding_bytes_per_token / 1024,
                context=length,
                today_mib=today / 2**20,
                windowed_mib=windowed / 2**20,
                saved_share=(today - windowed) / today if today else 0.0,
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--kv-bytes", type=int, default=2)
    parser.add_argument("--drafts", default=DEFAULT_DRAFTS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    table = []
    for file in sorted(f for f in os.listdir(args.drafts) if f.endswith(".json")):
        with open(os.path.join(args.drafts, file)) as f:
            raw = json.load(f)
        try:
            config = DFlashDraftConfig.from_dict(raw, default_block_size=16)
        except CheckpointError as e:  # refused by name at start-up too: not ours to cost
            print(f"# {file[:-5]}: not served ({str(e).splitlines()[0][:80]})", file=sys.stderr)
            continue
        table += rows(file[:-5], config, contexts, args.tp, args.kv_bytes)

    print(
        "| Draft | Layers | Window | KiB/token full / sliding | Context | Today MiB | Windowed MiB | Saved |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for r in table:
        print(
            f"| {r['draft']} | {r['layers']} | {r['windows']} | {r['full_kib']:.0f} / {r['sliding_kib']:.0f} "
            f"| {r['context']} | {r['today_mib']:.0f} | {r['windowed_mib']:.0f} | {r['saved_share']:.0%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tp=args.tp, kv_bytes=args.kv_bytes, rows=table), f, indent=1)


if __name__ == "__main__":
    main()

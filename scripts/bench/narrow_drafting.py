"""Acceptance at narrow verify widths: drafting only the W rows that are verified, against drafting
the whole trained block and verifying its first W (what serving does at every width).

    python scripts/bench/narrow_drafting.py [--pair DIR] [--widths 2,3,4,6,8] [--prompts 31]
        [--prompt-tokens 48] [--new-tokens 64] [--out F.json]

For each width W, greedy speculative decoding (`sglang_dflash.train.served.speculative_generate`,
the serving loop's semantics) of the pair's held-out prompts (`prompts.json`), both ways. Both
must give the target's greedy continuation (checked); the table gives tau, the mean tokens
committed per verify, each way, and their ratio. Truncated drafting would be worth serving at
a width only if it kept tau within 2% of the full block's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from sglang_dflash.checkpoint.config import DFlashDraftConfig  # noqa: E402
from sglang_dflash.draft.model import DFlashDraftModel  # noqa: E402
from sglang_dflash.train.served import speculative_generate  # noqa: E402

PAIR = os.path.join(ROOT, "sglang_dflash", "assets", "tiny_pair")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default=PAIR, help="a folder with target/, draft/ and prompts.json")
    p.add_argument("--draft", default=None, help="the draft folder (default PAIR/draft)")
    p.add_argument("--widths", default="2,3,4,6,8")
    p.add_argument("--prompts", type=int, default=31, help="the first N held-out prompts")
    p.add_argument("--prompt-tokens", type=int, default=48, help="each prompt's last N tokens")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    target_dir = os.path.join(args.pair, "target")
    draft_dir = args.draft or os.path.join(args.pair, "draft")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    config = DFlashDraftConfig.from_pretrained(draft_dir)
    draft = DFlashDraftModel.from_pretrained(draft_dir, config, len(config.target_layer_ids)).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    with open(os.path.join(args.pair, "prompts.json")) as f:
        texts = [record["text"] for record in json.load(f)][: args.prompts]
    prompts = [tokenizer(text).input_ids[-args.prompt_tokens :] for text in texts]
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        if not 2 <= width <= config.block_size:
            p.error(f"--widths: each in 2..{config.block_size} (the draft's block size)")
        runs = {}
        start = time.perf_counter()
        for full_block in (True, False):
            runs[full_block] = [
                speculative_generate(
                    draft,
                    target,
                    tuple(config.target_layer_ids),
                    prompt,
                    args.new_tokens,
                    config.mask_token_id,
                    verify_width=width,
                    full_block=full_block,
                )
                for prompt in prompts
            ]
        same = all(a.output_ids == b.output_ids for a, b in zip(runs[True], runs[False]))
        tau = {
            full: sum(sum(r.committed) for r in served) / sum(len(r.committed) for r in served)
            for full, served in runs.items()
        }
        row = {
            "width": width,
            "tau_full_block": round(tau[True], 3),
            "tau_truncated": round(tau[False], 3),
            "truncated_over_full": round(tau[False] / tau[True], 4),
            "outputs_equal": same,
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    report = {"draft": os.path.relpath(draft_dir, ROOT), "args": vars(args) | {"pair": None}, "rows": rows}
    print("| W | tau, full block | tau, W rows drafted | ratio |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['width']} | {r['tau_full_block']} | {r['tau_truncated']} | {r['truncated_over_full']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if not all(r["outputs_equal"] for r in rows):
        raise SystemExit("outputs differ between the two ways of drafting: one is not lossless")
    return report


if __name__ == "__main__":
    main()

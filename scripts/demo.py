"""Serve a tiny model with DFLASH through SGLang and print what it did.

    python scripts/demo.py [--target DIR --draft DIR] [--num-draft-tokens B] [--prompts N]

Without --target/--draft it builds a tiny random-weight Qwen3 target and DFlash draft (the
draft proposes mostly wrong tokens, so acceptance stays near 1; the output is still exactly
the target's). Runs on CUDA if available, otherwise on SGLang's CPU engine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def engine_args(device: str) -> dict:
    if device == "cpu":
        return dict(device="cpu", attention_backend="torch_native", dtype="float32", max_total_tokens=8192)
    return dict(device="cuda", mem_fraction_static=0.5)


def run(label, target, draft, num_draft_tokens, prompts, sampling, device):
    import sglang as sgl

    spec = {}
    if draft:
        spec = dict(
            speculative_algorithm="DFLASH",
            speculative_draft_model_path=draft,
            speculative_num_draft_tokens=num_draft_tokens,
        )
    print(f"\n== {label}: starting SGLang ({device}) ...", flush=True)
    engine = sgl.Engine(model_path=target, log_level="error", **engine_args(device), **spec)
    try:
        engine.generate(prompts[:1], dict(sampling, max_new_tokens=4))  # warm-up
        start = time.perf_counter()
        outputs = engine.generate(prompts, sampling)
        elapsed = time.perf_counter() - start
        state = engine.get_server_info()["internal_states"][0]
    finally:
        engine.shutdown()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    print(f"   {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tokens/s")
    if draft:
        print(f"   served by: {state.get('dflash_implementation')}")
        verify_steps = sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
        print(f"   mean acceptance length: {tokens / verify_steps:.2f} tokens per verify step")
        histogram = Counter()
        for o in outputs:
            for accepted, count in enumerate(o["meta_info"].get("spec_correct_drafts_histogram") or []):
                histogram[accepted + 1] += count
        if histogram:
            width = max(histogram.values())
            for length in sorted(histogram):
                bar = "#" * max(1, round(40 * histogram[length] / width))
                print(f"   {length:3d} tokens/step {histogram[length]:6d} {bar}")
    return outputs, tokens / elapsed


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, draft = args.target, args.draft
    if not target:
        from tests.tiny_models import make_draft, make_target

        root = tempfile.mkdtemp(prefix="dflash-demo-")
        print(f"building a tiny random target and draft in {root}")
        target = make_target(os.path.join(root, "target"))
        draft = make_draft(os.path.join(root, "draft"))
    prompts = ["def parse(", "import json\n", "class Encoder(", "    return "][: args.prompts]
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}

    spec_out, spec_tps = run("DFLASH", target, draft, args.num_draft_tokens, prompts, sampling, device)
    base_out, base_tps = run("no speculation", target, None, None, prompts, sampling, device)
    print()
    for prompt, o in zip(prompts, spec_out):
        print(f"--- {prompt!r}\n{o['text']}")
    same = all(a["output_ids"] == b["output_ids"] for a, b in zip(spec_out, base_out))
    print(f"\noutputs identical to no speculation: {same}; speedup {spec_tps / base_tps:.2f}x")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()

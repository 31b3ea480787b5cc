"""Serve a tiny model with DFLASH through SGLang and print what it did.

    python scripts/demo.py [--target DIR --draft DIR] [--num-draft-tokens B] [--prompts N] [--show K]

Without --target/--draft it serves the pair shipped in the package
(`sglang_dflash.assets.tiny_pair()`): a 4-layer Qwen3 code model trained on CPU on Python
standard-library sources, and its DFlash draft trained by this repo's recipe
(`scripts/build_tiny_pair.py`). The prompts come from standard-library files held out of that
training. Each prompt is generated alone (concurrency 1), greedily, first with DFLASH and then
without speculation; the outputs must be identical. Tokens/s is the best of three passes. Runs
on CUDA if available, otherwise on SGLang's CPU engine (it then sets SGLANG_USE_CPU_ENGINE=1
and OMP_NUM_THREADS=1 itself).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


REPEATS = 3


def choose_device() -> str:
    """CUDA when torch sees a GPU; otherwise SGLang's CPU engine, set up before sglang is imported."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    # One intra-op thread per process: several threads on few cores make each step far slower.
    # Engine subprocesses inherit both variables; the package's .pth file installs the
    # sgl_kernel stand-ins there, and this process gets them here.
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from sglang_dflash.cpu import bootstrap

    bootstrap.install()
    return "cpu"


def engine_args(device: str) -> dict:
    if device == "cpu":
        return dict(device="cpu", attention_backend="torch_native", dtype="float32", max_total_tokens=8192)
    return dict(device="cuda", mem_fraction_static=0.5)


def run(label, target, draft, num_draft_tokens, prompts, sampling, device):
    """Generate each prompt alone; print throughput (and acceptance with a draft)."""
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
        engine.generate(prompts[0], dict(sampling, max_new_tokens=8))  # warm-up
        # The same pass REPEATS times; the fastest one counts (short CPU timings are noisy).
        elapsed = float("inf")
        for _ in range(REPEATS):
            engine.flush_cache()  # every pass prefills its prompts from scratch
            start = time.perf_counter()
            outputs = [engine.generate(p, sampling) for p in prompts]
            elapsed = min(elapsed, time.perf_counter() - start)
        state = engine.get_server_info()["internal_states"][0]
    finally:
        engine.shutdown()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    best = f"best of {REPEATS} passes"
    print(f"   {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tokens/s ({best})")
    if draft:
        print(f"   served by: {state.get('dflash_implementation')}")
        print_acceptance(outputs)
    return outputs, tokens / elapsed


def print_acceptance(outputs) -> None:
    """Mean tokens committed per verify step, and the histogram of steps by that number."""
    histogram = Counter()
    for o in outputs:
        for accepted, count in enumerate(o["meta_info"].get("spec_correct_drafts_histogram") or []):
            histogram[accepted + 1] += count
    steps = sum(histogram.values())
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    print(
        f"   mean acceptance length: {sum(k * n for k, n in histogram.items()) / steps:.2f} tokens "
        f"per verify step ({steps} steps, {tokens} tokens)"
    )
    width = max(histogram.values())
    for length in range(1, max(histogram) + 1):
        bar = "#" * round(40 * histogram[length] / width)
        print(f"   {length:3d} tokens/step {histogram[length]:5d} {bar}")


def add_pair_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model directory (default: the shipped tiny pair)")
    parser.add_argument("--draft", help="DFlash draft directory (with --target)")


def pair_from_args(parser: argparse.ArgumentParser, args) -> tuple[str, str]:
    """(target, draft): the given pair, or the shipped tiny pair when neither is given."""
    if bool(args.target) != bool(args.draft):
        parser.error("give both --target and --draft, or neither")
    if args.target:
        return args.target, args.draft
    from sglang_dflash.assets import tiny_pair

    return tiny_pair()


def quiet_warnings() -> None:
    """SGLang's import-time warnings about GPU-only features, here and in every process it starts."""
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.simplefilter("ignore")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_args(parser)
    parser.add_argument("--num-draft-tokens", type=int, default=8, help="verify width B")
    parser.add_argument("--prompts", type=int, default=8, help="prompts generated and timed")
    parser.add_argument("--show", type=int, default=2, help="continuations printed")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, draft = pair_from_args(parser, args)
    quiet_warnings()

    device = choose_device()
    from sglang_dflash.assets import tiny_pair_prompts

    if args.target:
        print(f"target: {target}\ndraft:  {draft}")
    else:
        print("models: the tiny pair shipped in sglang_dflash/assets/tiny_pair")
    prompts = tiny_pair_prompts()[: args.prompts]
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}

    spec_out, spec_tps = run("DFLASH", target, draft, args.num_draft_tokens, prompts, sampling, device)
    base_out, base_tps = run("no speculation", target, None, None, prompts, sampling, device)
    print()
    for prompt, o in zip(prompts[: args.show], spec_out):
        print(f"--- prompt:\n{prompt}\n--- DFLASH continuation:{o['text']}\n")
    same = all(a["output_ids"] == b["output_ids"] for a, b in zip(spec_out, base_out))
    print(f"outputs identical to no speculation ({len(prompts)} prompts): {same}")
    print(f"DFLASH {spec_tps:.1f} tokens/s vs {base_tps:.1f} without speculation: {spec_tps / base_tps:.2f}x")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()

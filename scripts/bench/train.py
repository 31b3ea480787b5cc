"""Training throughput and peak memory at a real model's shape, random weights.

    python scripts/bench/train.py --work DIR [--shape qwen3-8b] [--block-attention flex,dense]
        [--max-length 2048] [--num-anchors 512] [--block-size 16] [--num-draft-layers 5]
        [--batch-size 1] [--steps 8] [--device cuda]

1. DIR/<shape>/: a Hugging Face target of that shape with random bf16 weights (normal, std
   0.02) and the shipped tiny pair's tokenizer (2048 entries; the target's vocabulary is the
   real one, so the LM head is full size). Written once, reused.
2. DIR/data.txt: the standard library's `asyncio` and `email` sources, enough for the steps.
3. For each `--block-attention` mode: `python -m sglang_dflash.train` for `--steps` steps, then
   the median of `train_log.jsonl`'s throughput over steps 3.., its peak (`cuda_peak_mib`) and,
   for flex, the graphs compiled in the run (`compiled_graphs`; one per layer kind if fixed).

A summary line per mode is printed and written to DIR/bench_train.json. The labels are a
random target's argmax, so the loss says nothing; the time and memory are the real shape's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_TARGET = os.path.join(REPO, "sglang_dflash", "assets", "tiny_pair", "target")

SHAPES = {  # the targets' config.json fields that set the compute (Qwen3ForCausalLM)
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
}  # fmt: skip


def build_target(path: str, shape: str, device: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return
    start = time.perf_counter()
    config = Qwen3Config(
        **SHAPES[shape], max_position_embeddings=40960, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of an 8B model
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="4GB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TINY_TARGET, name), tmp)
    os.replace(tmp, path)
    print(f"[bench_train] {shape} target written in {time.perf_counter() - start:.0f} s", flush=True)


def write_data(path: str, chars: int) -> None:
    lib = os.path.dirname(os.__file__)
    files = sorted(
        glob.glob(os.path.join(lib, "asyncio", "*.py")) + glob.glob(os.path.join(lib, "email", "*.py"))
    )
    text = ""
    while len(text) < chars:
        for name in files:
            with open(name) as f:
                text += f.read() + "\n"
    with open(path, "w") as f:
        f.write(text)


def run_mode(args, target: str, data: str, mode: str) -> dict:
    out = os.path.join(args.work, f"run-{mode}")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "sglang_dflash.train", "--target", target, "--data", data, "--out", out,
        "--device", args.device, "--max-length", str(args.max_length), "--num-anchors", str(args.num_anchors),
        "--block-size", str(args.block_size), "--num-draft-layers", str(args.num_draft_layers),
        "--batch-size", str(args.batch_size), "--max-steps", str(args.steps), "--save-every", "0",
        "--no-progress", "--block-attention", mode,
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    with open(os.path.join(args.work, f"run-{mode}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"mode": mode, "error": proc.stderr[-1500:], "wall_s": round(wall)}
    with open(os.path.join(out, "train_log.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    timed = [s for s in steps if s["step"] >= 3] or steps

    def median(key):
        return round(statistics.median(s["throughput"][key] for s in timed), 1)

    tokens = median("tokens_per_s")
    return {
        "mode": mode,
        "tokens_per_s": tokens,
        "sequences_per_s": round(tokens / args.max_length, 2),
        "anchors_per_s": median("anchors_per_s"),
        "labels_per_s": median("labels_per_s"),
        "cuda_peak_mib": max(s.get("cuda_peak_mib", 0) for s in steps),
        "compiled_graphs": steps[-1].get("compiled_graphs"),  # flex: the whole run's compiles
        "steps": len(steps),
        "wall_s": round(wall),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True)
    p.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    p.add_argument("--block-attention", default="flex,dense", help="comma-separated modes")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--num-anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-draft-layers", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    target = os.path.join(args.work, args.shape)
    build_target(target, args.shape, args.device)
    data = os.path.join(args.work, "data.txt")
    write_data(data, chars=args.steps * args.batch_size * args.max_length * 8)
    results = []
    for mode in args.block_attention.split(","):
        result = {"shape": args.shape, **run_mode(args, target, data, mode)}
        print(json.dumps(result), flush=True)
        results.append(result)
        with open(os.path.join(args.work, "bench_train.json"), "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

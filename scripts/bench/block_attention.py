"""Training's block attention, forward + backward: the dense mask against the split and, on
CUDA, FlexAttention (`sglang_dflash/train/flex_attention.py`), time and peak memory per layer
call, with full attention (the default draft layers).

    python scripts/bench/block_attention.py [--device cpu|cuda] [--seq-len 2048] [--anchors 512]
        [--block-size 16] [--heads 32] [--kv-heads 8] [--head-dim 128] [--dtype bf16] [--out F.json]

First it checks the split (and on CUDA FlexAttention) against the dense path at a small fp32
shape (output and the five gradients, max abs difference), then times each mode at the given
shape (median of 5 after one warm-up). Peak: on CUDA the caching allocator's peak above the
inputs; on CPU the peak resident size above the inputs (/proc/self/clear_refs resets it), each
mode in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from sglang_dflash.draft.attention import attend_with_context  # noqa: E402
from sglang_dflash.train import flex_attention, split_attention  # noqa: E402
from sglang_dflash.train.mask import block_attention_mask  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_inputs(args, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    s, a, bsz = args.seq_len, args.anchors, args.block_size
    anchors = torch.sort(torch.randperm(s - bsz, generator=g)[:a]).values[None].to(device)  # [1, A]
    q_len = a * bsz

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    q = rand(1, q_len, args.heads, args.head_dim)
    kv = [rand(1, n, args.kv_heads, args.head_dim) for n in (s, s, q_len, q_len)]
    return anchors, q, kv


def runner(mode, args, anchors, device, dtype):
    """A function of (q, k_ctx, v_ctx, k, v) -> out, with its mask built once (as training does)."""
    s, bsz, scale = args.seq_len, args.block_size, args.head_dim**-0.5
    if mode == "dense":
        mask = block_attention_mask(anchors, s, bsz, causal=False, window=None)[:, None]
        return lambda q, kc, vc, k, v: attend_with_context(q, kc, vc, k, v, mask, scale)
    if mode == "split":
        bias = split_attention.context_bias(anchors, s, bsz, causal=False, window=None, dtype=dtype)
        own = split_attention.own_block_mask(bsz, causal=False, window=None, device=device)
        return lambda q, kc, vc, k, v: split_attention.split_block_attention(
            q, kc, vc, k, v, bias, own, scale, bsz
        )
    if mode == "flex":
        shapes = flex_attention.FlexShapes.for_run(anchors.shape[0], s, anchors.shape[1], bsz)
        mask = flex_attention.block_mask(anchors, shapes, causal=False, window=None)
        return lambda q, kc, vc, k, v: flex_attention.flex_block_attention(
            q, kc, vc, k, v, mask, shapes, scale
        )
    raise ValueError(mode)


def check(device) -> dict:
    """Max abs difference of the split (and flex, on CUDA) from the dense path, fp32, output and
    gradients."""
    small = argparse.Namespace(
        seq_len=96, anchors=12, block_size=6, heads=4, kv_heads=2, head_dim=64
    )  # Q = 72
    anchors, q, kv = make_inputs(small, device, torch.float32, seed=1)
    anchors[0, 0] = 0  # a row with no context
    ins = (q, *kv)
    modes = ("dense", "split", "flex") if device == "cuda" else ("dense", "split")
    outs = {m: runner(m, small, anchors, device, torch.float32)(*ins) for m in modes}
    grad = torch.randn_like(outs["dense"])
    grads = {m: torch.autograd.grad(o, ins, grad) for m, o in outs.items()}
    report = {}
    for m in modes[1:]:
        diffs = [(outs["dense"] - outs[m]).abs().max().item()]
        diffs += [(a - b).abs().max().item() for a, b in zip(grads["dense"], grads[m])]
        report[m] = dict(zip(("out", "dq", "dk_ctx", "dv_ctx", "dk", "dv"), diffs))
    return report


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def measure(mode, args, device, dtype) -> dict:
    anchors, q, kv = make_inputs(args, device, dtype)
    ins = (q, *kv)
    fn = runner(mode, args, anchors, device, dtype)
    grad = torch.randn_like(q)

    def step():
        out = fn(*ins)
        torch.autograd.grad(out, ins, grad)

    step()  # warm-up (compiles FlexAttention)
    compiled = flex_attention.compiled_graphs()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _rss("VmRSS:")
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else _rss("VmHWM:")
    result = {"ms": round(statistics.median(times) * 1e3, 2), "peak_mib": round((peak - base) / 2**20, 1)}
    if mode == "flex":  # compiles while timed: 0, or the times include a compile
        result["timed_compiles"] = flex_attention.compiled_graphs() - compiled
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--modes", default=None, help="comma-separated; default dense,split (+flex on CUDA)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a CPU measurement in a fresh process
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    if args.one:
        print(json.dumps(measure(args.one, args, args.device, dtype)))
        return
    modes = (args.modes or ("dense,split,flex" if args.device == "cuda" else "dense,split")).split(",")
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "shape": {k: v for k, v in vars(args).items() if k not in ("out", "one", "modes")},
              "check_fp32": check(args.device)}  # fmt: skip
    print(json.dumps(report), flush=True)
    for mode in modes:
        try:
            if args.device == "cuda":
                result = measure(mode, args, args.device, dtype)
            else:
                proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", mode],
                                      capture_output=True, text=True, check=True)  # fmt: skip
                result = json.loads(proc.stdout.strip().splitlines()[-1])
        except Exception as e:  # a benchmark reports a mode that cannot run and goes on
            result = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        report[mode] = result
        print(json.dumps({mode: result}), flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""Peak transient memory of sampled verification (`sglang_dflash.verify.sampling`), per logit.

    python scripts/bench/sampling_memory.py [--device cpu|cuda] [--rows 64] [--vocab 151936]
                                            [--memory-mb 1024]

For each path of `sample_target_tokens` (unseeded without filters, unseeded with top-k/top-p,
seeded with filters: the largest) it draws `--rows` rows at once and reports the peak memory the
draw adds over its inputs, in bytes per logit (`sampling.BYTES_PER_LOGIT` is the largest, rounded
up), then the same rows drawn in chunks of `rows_per_draw(vocab, --memory-mb)`. On CUDA the peak
is the caching allocator's; on CPU each measurement runs in a fresh process and reads its peak
resident set (ru_maxrss), which large allocations return to the system between draws.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from sglang_dflash.verify.sampling import (  # noqa: E402
    BYTES_PER_LOGIT,
    TOP_K_ALL,
    SamplingRows,
    rows_per_draw,
    sample_target_tokens,
)

PATHS = ("unseeded", "unseeded-filtered", "seeded-filtered")


def inputs(path: str, rows: int, vocab: int, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g, device=device)
    filtered = path.endswith("filtered")
    sampling = SamplingRows(
        temperatures=torch.full((rows,), 0.8, device=device),
        top_ks=torch.full((rows,), 50 if filtered else TOP_K_ALL, device=device),
        top_ps=torch.full((rows,), 0.9 if filtered else 1.0, device=device),
        min_ps=torch.zeros(rows, device=device),
        seeds=torch.arange(rows, device=device) if path.startswith("seeded") else None,
        need_filter=filtered,
    )
    positions = torch.arange(rows, device=device)
    return logits, sampling, positions


def peak_bytes(path: str, rows: int, vocab: int, device: str, max_rows: int) -> int:
    """Peak memory a draw adds over its inputs, in bytes."""
    warm = inputs(path, 2, vocab, device)
    sample_target_tokens(*warm, max_rows=2)  # library set-up, outside the measurement
    logits, sampling, positions = inputs(path, rows, vocab, device)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        sample_target_tokens(logits, sampling, positions, max_rows=max_rows)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sample_target_tokens(logits, sampling, positions, max_rows=max_rows)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024  # KiB on Linux


def measure(path: str, rows: int, vocab: int, device: str, max_rows: int) -> int:
    if device == "cuda":
        return peak_bytes(path, rows, vocab, device, max_rows)
    # A fresh process per CPU measurement: ru_maxrss is a high-water mark.
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); from scripts.bench import sampling_memory as b; "
        "print(json.dumps(b.peak_bytes(sys.argv[2], *map(int, sys.argv[3:5]), 'cpu', int(sys.argv[5]))))"
    )
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    args = [sys.executable, "-c", code, root, path, str(rows), str(vocab), str(max_rows)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--memory-mb", type=int, default=1024)
    args = parser.parse_args()
    chunk = rows_per_draw(args.vocab, args.memory_mb)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {' '.join(sys.argv)}")
    print(f"# device {name}; {args.rows} rows x {args.vocab} logits; chunks of {chunk} rows (--memory-mb)")
    print(f"# sampling.BYTES_PER_LOGIT = {BYTES_PER_LOGIT}")
    print("path                 all rows at once: MB, B/logit   chunked: MB")
    logits = args.rows * args.vocab
    for path in PATHS:
        whole = measure(path, args.rows, args.vocab, args.device, args.rows)
        chunked = measure(path, args.rows, args.vocab, args.device, chunk)
        print(f"{path:20} {whole / 2**20:10.0f} {whole / logits:10.1f}   {chunked / 2**20:10.0f}")


if __name__ == "__main__":
    main()

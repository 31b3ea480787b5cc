"""`python -m sglang_dflash.train --target PATH --data FILE --out DIR [...]`.

Defaults come from `TrainConfig`. A bad setting, data file, target or checkpoint exits with
its message (exit status 2), not a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from typing import Optional

from sglang_dflash.checkpoint.config import CheckpointError
from sglang_dflash.train.config import (
    AUTOCAST,
    BLOCK_ATTENTION,
    DFLASH2_DEFAULTS,
    EXPORT_DTYPES,
    FAMILIES,
    LABELS,
    LAYER_TYPE_ALIASES,
    REGEN_BACKENDS,
    REGENERATE,
    TrainConfig,
    TrainConfigError,
)

_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_dflash.train",
        description="Train a DFlash draft for a local Hugging Face causal-LM target.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def add(group, name: str, help: str, **kwargs) -> None:
        dest = name.lstrip("-").replace("-", "_")
        group.add_argument(name, dest=dest, help=help, default=_DEFAULTS[dest], **kwargs)

    g = p.add_argument_group("inputs and outputs")
    g.add_argument("--target", required=True, help="local HF causal-LM directory (frozen)")
    g.add_argument("--data", required=True, help=".txt, or .jsonl with text / messages / input_ids")
    g.add_argument("--out", required=True, help="export directory; checkpoints go to OUT/checkpoints")
    add(g, "--eval-data", "held-out data file, evaluated every --eval-every steps and at the end")
    add(g, "--max-length", "tokens per training sequence", type=int)
    add(g, "--resume", "a checkpoint directory, or 'latest' under OUT/checkpoints")
    add(g, "--save-every", "checkpoint every N steps (0: never)", type=int)
    add(g, "--eval-every", "evaluate --eval-data every N steps (0: only at the end)", type=int)
    add(
        g,
        "--features",
        "captured target features (python -m sglang_dflash.train.features): no target decoder",
    )
    add(g, "--eval-prompts", "prompts decoded greedily with the live draft at each evaluation: tau_served")
    add(g, "--eval-max-new-tokens", "tokens generated per --eval-prompts prompt", type=int)
    add(g, "--export-dtype", "dtype of the exported weights", choices=EXPORT_DTYPES)
    add(g, "--device", "cuda or cpu; None: cuda if available")
    add(
        g,
        "--autocast",
        "forward precision; auto: bf16 autocast on CUDA, fp32 on CPU (weights and optimizer stay fp32)",
        choices=AUTOCAST,
    )
    add(
        g,
        "--block-attention",
        "split: the context by a fused kernel and each block's own keys, merged by log-sum-exp "
        "(never computes the masked cross-block scores); flex: FlexAttention, which visits only the "
        "tiles the mask keeps (CUDA: it has no backward on CPU); dense: SDPA over every block with "
        "a mask; auto: split on CPU, flex on CUDA (the fastest on each, as measured)",
        choices=BLOCK_ATTENTION,
    )
    p.set_defaults(progress=True)
    g.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=argparse.SUPPRESS,
        help="no progress bars",
    )

    g = p.add_argument_group("regeneration (learn the target's own outputs)")
    add(g, "--regenerate", "rewrite responses with the target", choices=REGENERATE)
    add(g, "--regen-temperature", "sampling temperature for --regenerate sample", type=float)
    add(g, "--regen-max-new-tokens", "longest regenerated response", type=int)
    add(g, "--regen-prompt-tokens", "plain text: prefix length whose continuation is regenerated", type=int)
    add(g, "--regen-batch-size", "prompts per generate call", type=int)
    add(
        g,
        "--regen-backend",
        "hf: generate on the training device; sglang: sglang.Engine",
        choices=REGEN_BACKENDS,
    )

    g = p.add_argument_group("draft shape (unset: from the target)")
    add(g, "--num-draft-layers", "draft decoder layers", type=int)
    add(g, "--block-size", "block size B (1 given token + B-1 proposals)", type=int)
    add(g, "--intermediate-size", "MLP width", type=int)
    add(g, "--num-attention-heads", "query heads", type=int)
    add(g, "--num-key-value-heads", "KV heads", type=int)
    add(g, "--head-dim", "head dimension", type=int)
    add(g, "--layer-types", f"one per draft layer: {sorted(LAYER_TYPE_ALIASES)}", nargs="+")
    add(g, "--sliding-window", "window of sliding layers", type=int)
    add(g, "--target-layer-ids", "target layers whose outputs condition the draft", type=int, nargs="+")
    add(g, "--mask-token", "MASK token (must be in the vocabulary); default: tokenizer.mask_token")
    add(g, "--mask-token-id", "MASK token id (e.g. an unused embedding row)", type=int)

    g = p.add_argument_group("family")
    add(
        g,
        "--family",
        "dflash; dflash2: a grouped convolution around every sublayer and a candidate selector",
        choices=FAMILIES,
    )
    d = DFLASH2_DEFAULTS
    add(
        g,
        "--conv-kernel-size",
        f"dflash2: the convolution's taps over the block; None: {d['conv_kernel_size']}",
        type=int,
    )
    add(
        g,
        "--conv-group-size",
        f"dflash2: channels per convolution group; None: {d['conv_group_size']}",
        type=int,
    )
    add(
        g,
        "--selector-rank",
        f"dflash2: rank of the selector's lattice; None: {d['selector_rank']}",
        type=int,
    )
    add(
        g,
        "--selector-top-k",
        f"dflash2: candidates per slot from the target's head; None: {d['selector_top_k']}",
        type=int,
    )
    add(
        g,
        "--selector-loss-weight",
        f"dflash2: weight of the selector's loss beside the head's; None: {d['selector_loss_weight']}",
        type=float,
    )
    g.add_argument(
        "--selector-stop-gradient",
        action="store_true",
        default=False,
        help="dflash2: the selector's loss trains the selector only, not the draft's layers",
    )

    g = p.add_argument_group("objective")
    add(g, "--labels", "target: the target's argmax; data: the data tokens", choices=LABELS)
    add(g, "--num-anchors", "blocks per sequence", type=int)
    add(g, "--loss-gamma", "loss weights exp(-(k-1)/gamma); None: (B-2)/2, i.e. 7 at B=16", type=float)

    g = p.add_argument_group("optimisation")
    add(g, "--batch-size", "sequences per micro-batch", type=int)
    add(g, "--grad-accum", "micro-batches per optimizer step", type=int)
    add(g, "--lr", "peak learning rate", type=float)
    add(g, "--min-lr-ratio", "final LR as a fraction of --lr", type=float)
    add(g, "--weight-decay", "AdamW weight decay", type=float)
    add(g, "--warmup-ratio", "fraction of steps of linear warm-up", type=float)
    add(g, "--max-grad-norm", "gradient clipping", type=float)
    add(g, "--epochs", "passes over the data", type=int)
    add(g, "--max-steps", "optimizer steps (overrides --epochs)", type=int)
    add(g, "--seed", "seed of initialisation, data order and anchors", type=int)
    return p


def config_from_args(argv: Optional[list[str]] = None) -> TrainConfig:
    args = vars(build_parser().parse_args(argv))
    for name in ("layer_types", "target_layer_ids"):
        if args[name] is not None:
            args[name] = tuple(args[name])
    return TrainConfig(**args)


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        from sglang_dflash.train.loop import Trainer

        Trainer(config_from_args(argv)).fit()
    except (TrainConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

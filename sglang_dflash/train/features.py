"""Offline target features: capture them once, train from them without the target's decoder.

`python -m sglang_dflash.train.features --target T --data D --out DIR` (or under
`torchrun --nproc_per_node N`) runs the target over every example of `--data` (as the trainer
reads it: same tokenizer, same `--max-length`) and stores, per example, the target's features
at `target_layer_ids` (the concatenated outputs of those layers, [S, K*H] in the target's dtype)
and its argmax predictions [S]. The examples are cut into shards of `--shard-size`; rank r
captures the shards k with k % ranks == r, each written atomically (`shard-000007.pt`), and a
shard already on disk is skipped, so an interrupted capture resumes shard by shard.
`manifest.json` records the target, the data, the layer ids and a hash of the examples' tokens.

`python -m sglang_dflash.train ... --data D --features DIR` then trains from them: the examples
are read from `--data` again and checked against the manifest, the features and predictions come
from the shards, and of the target only the input embedding and the LM head are read from its
safetensors (`HeadOnlyTarget`): no decoder is built.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from sglang_dflash.train import atomic, data
from sglang_dflash.train.config import TrainConfigError
from sglang_dflash.train.target import FrozenTarget, TargetOutput, inspect_target, load_tokenizer

MANIFEST = "manifest.json"


def examples_hash(examples: list[data.Example]) -> str:
    """A hash of the examples' tokens and label masks, in order."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(e.to_json().encode())
    return digest.hexdigest()[:16]


def shard_path(root: str, k: int) -> str:
    return os.path.join(root, f"shard-{k:06d}.pt")


@torch.no_grad()
def capture(
    target_path: str,
    data_path: str,
    out: str,
    *,
    max_length: int,
    num_draft_layers: int,
    target_layer_ids: Optional[tuple[int, ...]],
    shard_size: int,
    batch_size: int,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
) -> dict:
    """Capture this rank's shards under `out`; returns {tokens, bytes} of the shards it wrote."""
    tokenizer = load_tokenizer(target_path)
    spec = inspect_target(
        target_path, tokenizer, num_draft_layers=num_draft_layers, target_layer_ids=target_layer_ids
    )
    examples = data.load_examples(data_path, tokenizer, max_length, "--data")
    manifest = {
        "target": os.path.abspath(target_path),
        "data": os.path.abspath(data_path),
        "num_examples": len(examples),
        "examples_hash": examples_hash(examples),
        "layer_ids": list(spec.layer_ids),
        "max_length": max_length,
        "shard_size": shard_size,
    }
    os.makedirs(out, exist_ok=True)
    if rank == 0:
        atomic.write_json(os.path.join(out, MANIFEST), manifest)
    target = FrozenTarget.load(target_path, spec.layer_ids, device)
    written = {"tokens": 0, "bytes": 0}
    for k in range(rank, -(-len(examples) // shard_size), world):
        if os.path.isfile(shard_path(out, k)):
            continue  # captured before an interruption
        first = k * shard_size
        part = examples[first : first + shard_size]
        features, predictions = [], []
        for lo in range(0, len(part), batch_size):
            chunk = part[lo : lo + batch_size]
            batch = data.collate(chunk, tokenizer.pad_token_id).to(device)
            got = target.forward(batch.input_ids, batch.attention_mask)
            for i, e in enumerate(chunk):
                n = len(e.input_ids)
                features.append(got.features[i, :n].cpu().clone())
                predictions.append(got.predictions[i, :n].cpu().clone())
        shard = {"first": first, "features": features, "predictions": predictions}
        with atomic.replacing(shard_path(out, k)) as tmp:
            torch.save(shard, tmp)
        written["tokens"] += sum(len(e.input_ids) for e in part)
        written["bytes"] += sum(
            f.numel() * f.element_size() + p.numel() * p.element_size() for f, p in zip(features, predictions)
        )
    return written


class FeatureStore:
    """The captured shards of a features directory, checked against the run's examples."""

    def __init__(self, root: str, examples: list[data.Example], layer_ids: tuple[int, ...]):
        path = os.path.join(root, MANIFEST)
        if not os.path.isfile(path):
            raise TrainConfigError(f"--features {root!r} has no {MANIFEST}: capture it first")
        with open(path) as f:
            manifest = json.load(f)
        if manifest["num_examples"] != len(examples) or manifest["examples_hash"] != examples_hash(examples):
            raise TrainConfigError(
                f"--features {root!r} was captured from {manifest['data']!r} ({manifest['num_examples']} "
                f"examples); --data and --max-length here give other examples ({len(examples)})"
            )
        if tuple(manifest["layer_ids"]) != tuple(layer_ids):
            raise TrainConfigError(
                f"--features {root!r} holds target layers {manifest['layer_ids']}, this run's draft reads "
                f"{list(layer_ids)}"
            )
        self.shard_size = manifest["shard_size"]
        shards = -(-len(examples) // self.shard_size)
        missing = [k for k in range(shards) if not os.path.isfile(shard_path(root, k))]
        if missing:
            raise TrainConfigError(
                f"--features {root!r} lacks shards {missing[:5]}{'...' if len(missing) > 5 else ''}: "
                "rerun the capture, which resumes"
            )
        # Memory-mapped: a shard's tensors are read from disk as batches touch them.
        self.shards = [torch.load(shard_path(root, k), mmap=True, weights_only=True) for k in range(shards)]

    def outputs(self, indices: list[int], seq_len: int, device: torch.device) -> TargetOutput:
        """The stored features [b, S, K*H] and predictions [b, S] of examples `indices`, padded
        to `seq_len` as `data.collate` pads their tokens."""
        rows = [divmod(i, self.shard_size) for i in indices]
        feats = [self.shards[k]["features"][j] for k, j in rows]
        preds = [self.shards[k]["predictions"][j] for k, j in rows]
        features = torch.stack([F.pad(f, (0, 0, 0, seq_len - f.shape[0])) for f in feats])
        predictions = torch.stack([F.pad(p, (0, seq_len - p.shape[0])) for p in preds])
        return TargetOutput(features.to(device), predictions.to(device))


class HeadOnlyTarget:
    """The target's input embedding and LM head, read from its safetensors by their names in the
    model (found on a meta-device copy): what training from stored features needs of it."""

    def __init__(self, embedding: torch.Tensor, lm_head: torch.Tensor):
        self.embedding = embedding  # [V, H]
        self.lm_head_weight = lm_head  # [V, H]

    @classmethod
    def load(cls, path: str, device: torch.device) -> "HeadOnlyTarget":
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        embedding_module = model.get_input_embeddings()
        if type(embedding_module) is not torch.nn.Embedding:
            raise TrainConfigError(
                f"--features: the target's input embedding is {type(embedding_module).__name__}, not a plain "
                "table (it may scale or transform its rows); train this target online, without --features"
            )
        names = {id(p): n for n, p in model.named_parameters()}
        wanted = {
            "embedding": names[id(embedding_module.weight)],
            "lm_head": names[id(model.get_output_embeddings().weight)],
        }
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as FrozenTarget.load
        found = {}
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, framework="pt") as f:
                for role, name in wanted.items():
                    if name in f.keys():
                        found[role] = f.get_tensor(name).to(device=device, dtype=dtype)
        if "embedding" not in found or "lm_head" not in found:
            raise TrainConfigError(f"--target {path!r}: no {sorted(set(wanted.values()))} in its safetensors")
        return cls(found["embedding"], found["lm_head"])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embedding)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sglang_dflash.train.features", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, help="the features directory")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--num-draft-layers", type=int, default=5, help="for the default --target-layer-ids")
    p.add_argument("--target-layer-ids", type=int, nargs="+")
    p.add_argument("--shard-size", type=int, default=256, help="examples per shard file")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device")
    args = p.parse_args(argv)
    from sglang_dflash.train.ranks import Ranks

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ranks = Ranks.from_env(device.type)
    if device.type == "cuda" and ranks.world > 1 and device.index is None:
        device = torch.device("cuda", ranks.local_rank)
    try:
        written = capture(
            args.target,
            args.data,
            args.out,
            max_length=args.max_length,
            num_draft_layers=args.num_draft_layers,
            target_layer_ids=tuple(args.target_layer_ids) if args.target_layer_ids else None,
            shard_size=args.shard_size,
            batch_size=args.batch_size,
            device=device,
            rank=ranks.rank,
            world=ranks.world,
        )
    except TrainConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    per_token = written["bytes"] / max(1, written["tokens"])
    print(
        f"rank {ranks.rank}: {written['tokens']} tokens captured, {per_token:.0f} bytes per token", flush=True
    )
    ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

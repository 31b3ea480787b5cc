"""`Trainer`: set-up, the optimisation loop, evaluation, checkpoints and the final export.

AdamW on the draft only (the target is frozen), linear warm-up then cosine decay, bf16 autocast
on CUDA and fp32 on CPU, optional gradient accumulation. One step = one optimizer update.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
from typing import Optional

import torch
from torch import nn

from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.draft_model import DFlashDraftModel
from sglang_dflash.train import checkpoint, data
from sglang_dflash.train.config import TrainConfig, TrainConfigError
from sglang_dflash.train.export import draft_config_dict, export_draft
from sglang_dflash.train.objective import DFlashObjective, Metrics
from sglang_dflash.train.regenerate import regenerate
from sglang_dflash.train.target import FrozenTarget, inspect_target, load_tokenizer

logger = logging.getLogger(__name__)


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float):
    """LR factor per step: linear warm-up to 1, then cosine down to `min_ratio` at the end.

    E.g., total 10, warm-up 2 -> 0.5, 1.0, then 1.0 ... min_ratio along a half cosine.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def init_draft(draft: DFlashDraftModel, std: float) -> None:
    """Linear weights ~ N(0, std), as transformers initialises Qwen3; norms stay at 1."""
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def format_metrics(m: Metrics) -> str:
    """E.g., 'loss=2.310 tau=1.42 acc%=41 22 13 9'."""
    acc = " ".join(f"{round(100 * a)}" for a in m.accuracy)
    return f"loss={m.loss:.3f} tau={m.acceptance_length:.2f} acc%={acc}"


class Trainer:
    """Everything one training run holds. `fit()` runs to the end and exports."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if cfg.resume is None and checkpoint.latest_checkpoint(cfg.out) is not None:
            raise TrainConfigError(
                f"--out {cfg.out!r} already holds checkpoints; pass --resume latest to continue "
                f"that run, or choose another --out"
            )
        os.makedirs(cfg.out, exist_ok=True)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)

        self.tokenizer = load_tokenizer(cfg.target)
        spec = inspect_target(
            cfg.target,
            self.tokenizer,
            num_draft_layers=cfg.num_draft_layers,
            target_layer_ids=cfg.target_layer_ids,
            mask_token=cfg.mask_token,
            mask_token_id=cfg.mask_token_id,
        )
        # Data before weights: bad data fails fast, and SGLang regeneration runs before the HF
        # copy of the target takes device memory.
        self.examples = self._prepare(cfg.data, "--data", "regenerated.jsonl", None)
        self.target = FrozenTarget.load(cfg.target, spec.layer_ids, self.device)
        if self.examples is None:
            self.examples = self._prepare(cfg.data, "--data", "regenerated.jsonl", self.target)
        self.eval_examples = None
        if cfg.eval_data is not None:
            self.eval_examples = self._prepare(
                cfg.eval_data, "--eval-data", "regenerated-eval.jsonl", self.target
            )

        self.raw_config = draft_config_dict(
            spec.config, cfg, layer_ids=spec.layer_ids, mask_token_id=spec.mask_token_id
        )
        torch.manual_seed(cfg.seed)
        self.draft = DFlashDraftModel(DFlashDraftConfig.from_dict(self.raw_config), len(spec.layer_ids))
        init_draft(self.draft, self.raw_config["initializer_range"])
        self.draft.to(self.device)
        self.objective = DFlashObjective(
            block_size=cfg.block_size,
            mask_token_id=spec.mask_token_id,
            num_anchors=cfg.num_anchors,
            labels=cfg.labels,
            gamma=cfg.resolved_loss_gamma,
        )
        self._build_optimizer()
        if cfg.resume is not None:
            self.load(checkpoint.resolve_resume(cfg.resume, cfg.out))
        with open(os.path.join(cfg.out, "train_config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        self.order = data.BatchOrder(len(self.examples), cfg.batch_size, cfg.seed)
        per_epoch = self.order.batches_per_epoch // cfg.grad_accum
        self.total_steps = cfg.max_steps or max(1, cfg.epochs * per_epoch)
        self.optimizer = torch.optim.AdamW(
            self.draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        warmup = round(cfg.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(self.total_steps, warmup, cfg.min_lr_ratio)
        )
        self.generator = torch.Generator().manual_seed(cfg.seed)  # anchor sampling
        self.step = 0

    # ------------------------------------------------------------------------- data

    def _prepare(
        self, path: str, flag: str, cache_name: str, target: Optional[FrozenTarget]
    ) -> Optional[list[data.Example]]:
        """Examples from `path`, regenerated by the target if asked.

        Returns None when regeneration must wait for `target` (the HF backend). A resumed run
        reuses the regenerated examples saved by the interrupted one.
        """
        cfg = self.cfg
        if cfg.regenerate is None:
            return data.load_examples(path, self.tokenizer, cfg.max_length, flag)
        cache = os.path.join(cfg.out, cache_name)
        if cfg.resume is not None and os.path.isfile(cache):
            return data.load_examples(cache, self.tokenizer, cfg.max_length, flag)
        prompts = data.load_prompts(
            path, self.tokenizer, max_length=cfg.max_length, prompt_tokens=cfg.regen_prompt_tokens, flag=flag
        )
        if cfg.regen_backend == "hf" and target is None:
            return None
        model = None if target is None else target.model
        examples = regenerate(cfg, prompts, model=model, tokenizer=self.tokenizer)
        data.write_examples(cache, examples)
        return data.load_examples(cache, self.tokenizer, cfg.max_length, flag)

    def _autocast(self):
        """bf16 autocast for the forward passes (`--autocast`); master weights stay fp32."""
        mode = self.cfg.autocast
        if mode == "bf16" or (mode == "auto" and self.device.type == "cuda"):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------------- steps

    def train_step(self) -> Metrics:
        """One optimizer update over `grad_accum` micro-batches."""
        cfg = self.cfg
        self.draft.train()
        merged: Optional[Metrics] = None
        for _ in range(cfg.grad_accum):
            picked = [self.examples[i] for i in self.order.next()]
            batch = data.collate(picked, self.tokenizer.pad_token_id).to(self.device)
            with self._autocast():
                loss, metrics = self.objective(self.draft, self.target, batch, self.generator)
            (loss / cfg.grad_accum).backward()
            merged = metrics if merged is None else merged.merge(metrics)
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return merged

    @torch.no_grad()
    def evaluate(self, examples: list[data.Example], seed: int = 1234) -> Metrics:
        """Metrics over `examples` in order, with anchors fixed by `seed` (comparable across calls)."""
        self.draft.eval()
        generator = torch.Generator().manual_seed(seed)
        merged: Optional[Metrics] = None
        for batch in data.iter_batches(examples, self.cfg.batch_size, self.tokenizer.pad_token_id):
            with self._autocast():
                _, metrics = self.objective(self.draft, self.target, batch.to(self.device), generator)
            merged = metrics if merged is None else merged.merge(metrics)
        return merged

    def fit(self) -> None:
        from tqdm.auto import tqdm

        cfg = self.cfg
        # A resumed run appends; its first records redo the steps after the checkpoint.
        log = open(os.path.join(cfg.out, "train_log.jsonl"), "a" if cfg.resume else "w")
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", disable=not cfg.progress)
        try:
            while self.step < self.total_steps:
                lr = self.scheduler.get_last_lr()[0]
                metrics = self.train_step()
                bar.update(1)
                bar.set_postfix_str(format_metrics(metrics))
                record = {"step": self.step, "lr": lr, **metrics.summary()}
                if cfg.eval_every and self.eval_examples and self.step % cfg.eval_every == 0:
                    record["eval"] = self.evaluate(self.eval_examples).summary()
                log.write(json.dumps(record) + "\n")
                log.flush()
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save(checkpoint.checkpoint_dir(cfg.out, self.step))
        finally:
            bar.close()
            log.close()
        self.export(cfg.out)
        if self.eval_examples:
            logger.info("eval: %s", format_metrics(self.evaluate(self.eval_examples)))

    # --------------------------------------------------------------------- persistence

    def export(self, path: str) -> None:
        export_draft(self.draft, self.raw_config, path)

    def save(self, path: str) -> None:
        state = {
            "step": self.step,
            "model": self.draft.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "order": self.order.state_dict(),
            "rng": checkpoint.rng_state(self.generator),
        }
        checkpoint.save_checkpoint(path, state, self.export)

    def load(self, path: str) -> None:
        state = checkpoint.load_checkpoint(path, self.raw_config)
        self.draft.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.order.load_state_dict(state["order"])
        checkpoint.set_rng_state(state["rng"], self.generator)
        self.step = int(state["step"])
        logger.info("resumed from %s at step %d", path, self.step)

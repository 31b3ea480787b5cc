"""`Trainer`: set-up, the optimisation loop, evaluation, checkpoints and the final export.

AdamW on the draft only (the target is frozen), linear warm-up then cosine decay, bf16 autocast
on CUDA and fp32 on CPU, optional gradient accumulation, data parallel under torchrun
(`ranks.py`). One step = one optimizer update over `world x grad_accum x batch_size` examples;
its loss is the weighted CE summed over all of them, divided by the sum of the weights, so 2
ranks x batch b, 1 rank x 2b and 1 rank x b with accumulation 2 take the same step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from typing import Optional

import torch
from torch import nn

from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.model import DFlashDraftModel, GroupedConv
from sglang_dflash.train import atomic, checkpoint, data, flex_attention
from sglang_dflash.train.config import TrainConfig, TrainConfigError
from sglang_dflash.train.export import draft_config_dict, export_draft
from sglang_dflash.train.objective import DFlashObjective, Metrics, resolve_block_attention
from sglang_dflash.train.ranks import Ranks
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
    """Linear weights ~ N(0, std), as transformers initialises Qwen3; norms stay at 1. DFlash2's
    parts start as SpecForge's and NeMo Automodel's recipes start them: each convolution as the
    identity (its base kernel's first tap 1, `GroupedConv`, and no per-token delta), and the
    selector's pair term at 0 (the successor codebook 0, the predecessor's ~ N(0, std)), so the
    walk starts as the head's argmax over the candidates."""
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        if isinstance(module, GroupedConv):
            nn.init.zeros_(module.kernel_projection.weight)
    selector = getattr(draft, "candidate_selector", None)
    if selector is not None:  # served, its codebooks are frozen lookup tables; trained here
        nn.init.normal_(selector.predecessor_codebook, 0.0, std)
        nn.init.zeros_(selector.successor_codebook)
        for p in selector.parameters():
            p.requires_grad_(True)


# A served tau below this fraction of the teacher-forced one is warned about.
SERVED_GAP = 0.75


def format_metrics(m: Metrics) -> str:
    """E.g., 'loss=2.310 tau=1.42 acc%=41 22 13 9'; a DFlash2 draft's adds its selector's greedy
    walk and the candidates' recall: '... tau_walk=1.51 recall%=88'."""
    acc = " ".join(f"{round(100 * a)}" for a in m.accuracy)
    out = f"loss={m.loss:.3f} tau={m.acceptance_length:.2f} acc%={acc}"
    if int(m.selector_labels):
        out += f" tau_walk={m.walk_acceptance_length:.2f} recall%={round(100 * m.candidate_recall)}"
    return out


class Trainer:
    """Everything one training run holds. `fit()` runs to the end and exports."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.ranks = Ranks.from_env(device.type)
        if device.type == "cuda" and self.ranks.world > 1 and device.index is None:
            device = torch.device("cuda", self.ranks.local_rank)  # one GPU per process
        self.device = device
        self.block_attention, why = resolve_block_attention(cfg.block_attention, device)
        logger.info("block attention: %s (%s)", self.block_attention, why)
        if self.ranks.world > 1 and cfg.regenerate is not None:
            raise TrainConfigError(
                "--regenerate runs in one process: regenerate first without torchrun (its examples "
                "are written to OUT/regenerated.jsonl), then train on that file with --data"
            )
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
        self.store = None  # with --features: the captured features, and only the target's head
        if cfg.features is not None:
            from sglang_dflash.train.features import FeatureStore, HeadOnlyTarget

            self.store = FeatureStore(cfg.features, self.examples, spec.layer_ids)
            self.target = HeadOnlyTarget.load(cfg.target, self.device)
        else:
            self.target = FrozenTarget.load(cfg.target, spec.layer_ids, self.device)
        if self.examples is None:
            self.examples = self._prepare(cfg.data, "--data", "regenerated.jsonl", self.target)
        self.eval_prompts = None
        if cfg.eval_prompts is not None:
            self.eval_prompts = data.load_prompts(
                cfg.eval_prompts,
                self.tokenizer,
                max_length=cfg.max_length,
                prompt_tokens=cfg.regen_prompt_tokens,
                flag="--eval-prompts",
            )
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
            max_length=cfg.max_length,
            block_attention=self.block_attention,
            batch_size=cfg.batch_size,
            selector_weight=cfg.dflash2["selector_loss_weight"],
            selector_stop_gradient=cfg.selector_stop_gradient,
        )
        if cfg.family == "dflash2":
            logger.info("family dflash2: %s", ", ".join(f"{k} {v}" for k, v in cfg.dflash2.items()))
        self._build_optimizer()
        if cfg.resume is not None:
            self.load(checkpoint.resolve_resume(cfg.resume, cfg.out))
        if self.ranks.is_main:
            settings = {**cfg.to_dict(), "ranks": self.ranks.world}
            atomic.write_json(os.path.join(cfg.out, "train_config.json"), settings)

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        self.stream = data.ExampleStream(len(self.examples), cfg.seed)
        # Examples per optimizer step, over all ranks.
        self.step_size = self.ranks.world * cfg.grad_accum * cfg.batch_size
        self.total_steps = cfg.max_steps or max(1, cfg.epochs * self.stream.steps_per_epoch(self.step_size))
        self.optimizer = torch.optim.AdamW(
            self.draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        warmup = round(cfg.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(self.total_steps, warmup, cfg.min_lr_ratio)
        )
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

    def train_step(self) -> tuple[Metrics, dict]:
        """One optimizer update over this rank's micro-batches of the step -> the step's metrics
        over every rank, and its throughput (`_throughput`)."""
        cfg = self.cfg
        start = time.perf_counter()
        self.draft.train()
        epoch, step = self.stream.next_step(self.step_size)
        micro = data.shard(step, self.ranks.rank, self.ranks.world, cfg.grad_accum, cfg.batch_size)
        merged = Metrics.empty(cfg.block_size - 1, self.device)
        tokens = 0
        for picked in micro:
            if not picked:  # this rank's share ran out: it adds nothing (and makes no collective)
                continue
            batch = data.collate([self.examples[i] for i in picked], self.tokenizer.pad_token_id)
            keys = [data.anchor_key(cfg.seed, epoch, i) for i in picked]
            stored = (
                None
                if self.store is None
                else self.store.outputs(picked, batch.input_ids.shape[1], self.device)
            )
            with self._autocast():
                loss_sum, metrics = self.objective(
                    self.draft, self.target, batch.to(self.device), keys, stored
                )
            loss_sum.backward()
            merged = merged.merge(metrics)
            tokens += int(batch.lengths.sum())
        counts = (tokens, int(merged.anchors), int(merged.count.sum()))  # this rank's
        # Every rank's gradients of its summed loss, summed; then divided by the step's weight.
        self.ranks.sum_gradients(self.draft.parameters())
        merged = merged.from_vector(self.ranks.sum_(merged.as_vector()))
        weight = float(merged.weight_sum)
        if weight > 0:
            for p in self.draft.parameters():
                p.grad.div_(weight)
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return merged, self._throughput(time.perf_counter() - start, counts)

    def _throughput(self, seconds: float, counts: tuple[int, int, int]) -> dict:
        """Tokens, valid anchors and labelled positions per second (`counts`: this rank's), per
        rank and in total over the slowest rank's time. Each rank fills its row of a [ranks, 4]
        table, which is then summed over the ranks."""
        table = torch.zeros(self.ranks.world, 4, dtype=torch.float64, device=self.device)  # NCCL: CUDA
        table[self.ranks.rank] = torch.tensor([seconds, *counts], dtype=torch.float64)
        table = self.ranks.sum_(table)
        rates = table[:, 1:] / table[:, :1].clamp_min(1e-9)  # [ranks, 3]
        total = table[:, 1:].sum(0) / table[:, 0].max().clamp_min(1e-9)
        names = ("tokens_per_s", "anchors_per_s", "labels_per_s")
        return {
            **{name: round(float(v), 1) for name, v in zip(names, total)},
            "per_rank": [{name: round(float(v), 1) for name, v in zip(names, row)} for row in rates],
        }

    @torch.no_grad()
    def evaluate(self, examples: list[data.Example], seed: int = 1234) -> Metrics:
        """Metrics over `examples` in order, with anchors fixed by `seed` (comparable across calls).

        Shared by the ranks, every rank calling it: rank r takes batches r, r + world, ... and
        one all-reduce sums their metrics. So no rank waits in a collective through another's
        long evaluation (NCCL's default timeout is 10 minutes). Each example's anchors are keyed
        by its index, so the result is the same whatever the number of ranks."""
        self.draft.eval()
        size = self.cfg.batch_size
        merged = Metrics.empty(self.cfg.block_size - 1, self.device)
        starts = range(self.ranks.rank * size, len(examples), self.ranks.world * size)
        for lo in starts:
            batch = data.collate(examples[lo : lo + size], self.tokenizer.pad_token_id)
            keys = [data.anchor_key(seed, 0, i) for i in range(lo, lo + len(batch.lengths))]
            with self._autocast():
                _, metrics = self.objective(self.draft, self.target, batch.to(self.device), keys)
            merged = merged.merge(metrics)
        return merged.from_vector(self.ranks.sum_(merged.as_vector()))

    def fit(self) -> None:
        from tqdm.auto import tqdm

        cfg = self.cfg
        main = self.ranks.is_main  # rank 0 logs, saves and exports
        # A resumed run appends; its first records redo the steps after the checkpoint.
        log = open(os.path.join(cfg.out, "train_log.jsonl"), "a" if cfg.resume else "w") if main else None
        bar = tqdm(
            total=self.total_steps, initial=self.step, desc="train", disable=not (cfg.progress and main)
        )
        metrics = None
        try:
            while self.step < self.total_steps:
                lr = self.scheduler.get_last_lr()[0]
                metrics, throughput = self.train_step()
                bar.update(1)
                bar.set_postfix_str(format_metrics(metrics))
                evaluated = {}  # every rank evaluates its share
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    evaluated = self._evaluations(metrics)
                if not main:
                    continue
                record = {"step": self.step, "lr": lr, **metrics.summary(), "throughput": throughput}
                if self.block_attention == "flex":  # one per layer kind and grad mode, if fixed
                    record["compiled_graphs"] = flex_attention.compiled_graphs()
                if self.device.type == "cuda":  # the allocator's peak so far, this process
                    record["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20)
                record.update(evaluated)
                log.write(json.dumps(record) + "\n")
                log.flush()
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save(checkpoint.checkpoint_dir(cfg.out, self.step))
        finally:
            bar.close()
            if log is not None:
                log.close()
        final = self._evaluations(metrics)  # every rank evaluates its share
        if main:
            self.export(cfg.out)
            if "eval" in final:
                logger.info("eval: loss=%.3f tau=%.2f", final["eval"]["loss"], final["eval"]["tau"])
            if "tau_served" in final:
                logger.info("eval: tau_served=%.2f", final["tau_served"])
        self.ranks.close()

    def _evaluations(self, train_metrics: Optional[Metrics]) -> dict:
        """The held-out metrics (`--eval-data`) and the served acceptance (`--eval-prompts`),
        with a warning when the served tau falls well below the teacher-forced one."""
        record: dict = {}
        if self.eval_examples:
            record["eval"] = self.evaluate(self.eval_examples).summary()
        if self.eval_prompts:
            record["tau_served"] = self.served_tau()
            forced = record["eval"]["tau"] if "eval" in record else None
            if forced is None and train_metrics is not None:
                forced = train_metrics.acceptance_length
            low = forced is not None and record["tau_served"] < SERVED_GAP * forced
            if low and self.ranks.is_main:
                logger.warning(
                    "step %d: served acceptance %.2f is below %.0f%% of the teacher-forced %.2f: the "
                    "draft scores well on the true context but not on its own (check the chat "
                    "template and data against what is served)",
                    self.step,
                    record["tau_served"],
                    100 * SERVED_GAP,
                    forced,
                )
        return record

    @torch.no_grad()
    def served_tau(self) -> float:
        """Mean tokens committed per step over `--eval-prompts`, greedy, with the live draft;
        shared by the ranks as `evaluate` is (rank r takes prompts r, r + world, ...)."""
        from sglang_dflash.train.served import speculative_generate

        self.draft.eval()
        committed = []
        for prompt in self.eval_prompts[self.ranks.rank :: self.ranks.world]:
            with self._autocast():
                served = speculative_generate(
                    self.draft,
                    self.target.model,
                    self.target.layer_ids,
                    prompt.input_ids,
                    self.cfg.eval_max_new_tokens,
                    self.raw_config["dflash_config"]["mask_token_id"],
                )
            committed += served.committed
        # [tokens, steps] summed over the ranks (float64 on the training device: NCCL's)
        total = torch.tensor([sum(committed), len(committed)], dtype=torch.float64, device=self.device)
        tokens, steps = self.ranks.sum_(total).tolist()
        return tokens / max(1.0, steps)

    # --------------------------------------------------------------------- persistence

    def export(self, path: str) -> None:
        export_draft(self.draft, self.raw_config, path)
        # What the draft was trained on, for serving it the same way: chats were rendered with
        # this template, with its default thinking mode (no template arguments).
        info = {"chat_template": getattr(self.tokenizer, "chat_template", None), "chat_template_kwargs": {}}
        atomic.write_json(os.path.join(path, "training_info.json"), info)

    def save(self, path: str) -> None:
        state = {
            "step": self.step,
            "model": self.draft.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "stream": self.stream.state_dict(),
            "rng": checkpoint.rng_state(),
        }
        checkpoint.save_checkpoint(path, state, self.export)

    def load(self, path: str) -> None:
        state = checkpoint.load_checkpoint(path, self.raw_config)
        self.draft.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.stream.load_state_dict(state["stream"])
        checkpoint.set_rng_state(state["rng"])
        self.step = int(state["step"])
        logger.info("resumed from %s at step %d", path, self.step)

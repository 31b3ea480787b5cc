"""`TrainConfig`: every setting of the training recipe, validated once.

The command line (`cli.py`) reads its defaults from this dataclass, so there is one source for
them. Problems raise `TrainConfigError` naming the setting and the value.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Optional

LABELS = ("target", "data")
REGENERATE = ("greedy", "sample")
REGEN_BACKENDS = ("hf", "sglang")
LAYER_TYPE_ALIASES = {
    "full": "full_attention",
    "full_attention": "full_attention",
    "sliding": "sliding_attention",
    "sliding_attention": "sliding_attention",
}
EXPORT_DTYPES = ("bfloat16", "float16", "float32")
AUTOCAST = ("auto", "bf16", "off")  # auto: bf16 on CUDA, none (fp32) on CPU
BLOCK_ATTENTION = ("auto", "split", "flex", "dense")  # `objective.BlockAttention`
FAMILIES = ("dflash", "dflash2")
# DFlash2's settings (`--family dflash2`) and their defaults, NeMo Automodel's `TrainDFlash2Recipe`
# values: a convolution of 2 taps over groups of 16 channels around every sublayer, and a
# rank-256 selector over the target's top 16 candidates whose loss weighs as much as the head's.
DFLASH2_DEFAULTS = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
    "selector_loss_weight": 1.0,
}


class TrainConfigError(ValueError):
    """A training setting, input file or target is unusable; the message names which."""


def default_loss_gamma(block_size: int) -> float:
    """The decay of the loss weights exp(-(k-1)/gamma), scaled with the block size.

    gamma = 7 at B=16 (the DFlash paper's value). Other block sizes keep B=16's ratio between the
    last and the first weight, e^-2: gamma = (B-2)/2 (at least 1).
    E.g., B=16 -> 7.0, B=10 -> 4.0, B=8 -> 3.0. (NVIDIA ModelOpt uses 5 for B=10, 4 for B=8.)
    """
    return max(1.0, (block_size - 2) / 2)


@dataclass(frozen=True)
class TrainConfig:
    target: str
    data: str
    out: str

    # Data.
    max_length: int = 2048
    eval_data: Optional[str] = None
    regenerate: Optional[str] = None  # None, "greedy" or "sample"
    regen_temperature: float = 1.0
    regen_max_new_tokens: int = 256
    regen_prompt_tokens: int = 64  # plain text: the prefix whose continuation is regenerated
    regen_batch_size: int = 16
    regen_backend: str = "hf"

    # Draft shape; None means "from the target".
    num_draft_layers: int = 5  # the DFlash paper's drafts
    block_size: int = 16
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    layer_types: Optional[tuple[str, ...]] = None
    sliding_window: Optional[int] = None
    target_layer_ids: Optional[tuple[int, ...]] = None
    mask_token: Optional[str] = None
    mask_token_id: Optional[int] = None

    # Family: "dflash", or "dflash2" (the grouped convolution and the candidate selector). The
    # DFlash2 settings are None unless set: DFLASH2_DEFAULTS with --family dflash2, refused without.
    family: str = "dflash"
    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None
    selector_rank: Optional[int] = None
    selector_top_k: Optional[int] = None
    selector_loss_weight: Optional[float] = None
    selector_stop_gradient: bool = False  # the selector's loss trains the selector only

    # Objective.
    labels: str = "target"
    num_anchors: int = 512
    loss_gamma: Optional[float] = None  # None: default_loss_gamma(block_size)

    # Optimisation.
    batch_size: int = 1
    grad_accum: int = 1
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    max_grad_norm: float = 1.0
    epochs: int = 1
    max_steps: Optional[int] = None  # overrides epochs
    seed: int = 0

    # Bookkeeping.
    save_every: int = 500
    eval_every: int = 0
    eval_prompts: Optional[str] = None  # prompts decoded with the live draft: tau_served
    features: Optional[str] = None  # captured target features (`features.py`): no target decoder
    eval_max_new_tokens: int = 64
    resume: Optional[str] = None  # a checkpoint directory, or "latest"
    device: Optional[str] = None  # None: cuda if available, else cpu
    export_dtype: str = "bfloat16"
    autocast: str = "auto"  # "auto": bf16 on CUDA, fp32 on CPU; "bf16" also on a CPU with bf16 units
    block_attention: str = "auto"  # auto: split on CPU, flex on CUDA (`objective.resolve_block_attention`)
    progress: bool = True

    def __post_init__(self) -> None:
        def positive(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise TrainConfigError(f"--{_flag(name)} must be an integer >= {minimum}, got {value!r}")

        for name in ("max_length", "regen_max_new_tokens", "regen_prompt_tokens", "regen_batch_size"):
            positive(name)
        positive("eval_max_new_tokens")
        for name in ("num_draft_layers", "num_anchors", "batch_size", "grad_accum", "epochs"):
            positive(name)
        positive("block_size", 2)
        positive("save_every", 0)
        positive("eval_every", 0)
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) is not None:
                positive(name)
        if self.max_steps is not None:
            positive("max_steps")
        if self.sliding_window is not None:
            positive("sliding_window")
        if self.mask_token_id is not None:
            positive("mask_token_id", 0)
        if self.max_length < self.block_size:
            raise TrainConfigError(
                f"--max-length {self.max_length} must be at least --block-size {self.block_size}"
            )
        for name, choices in (
            ("labels", LABELS),
            ("regen_backend", REGEN_BACKENDS),
            ("export_dtype", EXPORT_DTYPES),
            ("autocast", AUTOCAST),
            ("block_attention", BLOCK_ATTENTION),
            ("family", FAMILIES),
        ):
            if getattr(self, name) not in choices:
                raise TrainConfigError(
                    f"--{_flag(name)} must be one of {choices}, got {getattr(self, name)!r}"
                )
        if self.regenerate is not None and self.regenerate not in REGENERATE:
            raise TrainConfigError(f"--regenerate must be one of {REGENERATE}, got {self.regenerate!r}")
        if self.regenerate == "sample" and not self.regen_temperature > 0:
            raise TrainConfigError(
                f"--regen-temperature must be > 0 with --regenerate sample, got {self.regen_temperature!r}"
            )
        for name in ("lr", "max_grad_norm"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0):
                raise TrainConfigError(f"--{_flag(name)} must be > 0, got {getattr(self, name)!r}")
        for name in ("min_lr_ratio", "warmup_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise TrainConfigError(f"--{_flag(name)} must be in [0, 1], got {getattr(self, name)!r}")
        if self.weight_decay < 0:
            raise TrainConfigError(f"--weight-decay must be >= 0, got {self.weight_decay!r}")
        if self.loss_gamma is not None and not (math.isfinite(self.loss_gamma) and self.loss_gamma > 0):
            raise TrainConfigError(f"--loss-gamma must be a positive number, got {self.loss_gamma!r}")
        if self.layer_types is not None:
            bad = [t for t in self.layer_types if t not in LAYER_TYPE_ALIASES]
            if bad or len(self.layer_types) != self.num_draft_layers:
                raise TrainConfigError(
                    f"--layer-types must give one of {sorted(LAYER_TYPE_ALIASES)} for each of the "
                    f"{self.num_draft_layers} draft layers, got {list(self.layer_types)!r}"
                )
        if "sliding_attention" in self.resolved_layer_types and self.sliding_window is None:
            raise TrainConfigError("--layer-types has a sliding layer, so --sliding-window is required")
        if self.features is not None:
            for name in ("regenerate", "eval_data", "eval_prompts"):
                if getattr(self, name) is not None:
                    raise TrainConfigError(
                        f"--{_flag(name)} runs the target's decoder, which --features training does not build"
                    )
        self._check_dflash2()
        if self.target_layer_ids is not None and not self.target_layer_ids:
            raise TrainConfigError("--target-layer-ids must name at least one layer")

    def _check_dflash2(self) -> None:
        given = [n for n in DFLASH2_DEFAULTS if getattr(self, n) is not None]
        if self.selector_stop_gradient:
            given.append("selector_stop_gradient")
        if self.family != "dflash2":
            if given:
                raise TrainConfigError(f"--{_flag(given[0])} is a DFlash2 setting: pass --family dflash2")
            return
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = self.dflash2[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TrainConfigError(f"--{_flag(name)} must be an integer >= 1, got {value!r}")
        weight = self.dflash2["selector_loss_weight"]
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise TrainConfigError(f"--selector-loss-weight must be a number >= 0, got {weight!r}")

    @property
    def dflash2(self) -> dict:
        """DFlash2's settings, defaults filled in (meaningful with --family dflash2)."""
        return {n: d if getattr(self, n) is None else getattr(self, n) for n, d in DFLASH2_DEFAULTS.items()}

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        if self.layer_types is None:
            return ("full_attention",) * self.num_draft_layers
        return tuple(LAYER_TYPE_ALIASES[t] for t in self.layer_types)

    @property
    def resolved_loss_gamma(self) -> float:
        return self.loss_gamma if self.loss_gamma is not None else default_loss_gamma(self.block_size)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _flag(name: str) -> str:
    return name.replace("_", "-")

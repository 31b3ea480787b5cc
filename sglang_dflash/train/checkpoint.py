"""Training checkpoints: a servable draft export plus the state needed to resume exactly.

Layout of `<out>/checkpoints/step-000500/`:
  config.json, model.safetensors   the draft at this step (z-lab format, `--export-dtype`)
  trainer_state.pt                 fp32 weights, optimizer, scheduler, step, data position,
                                   RNG states (torch, CUDA, python; the anchors are keyed
                                   by example, `data.anchor_key`)
"""

from __future__ import annotations

import glob
import json
import os
import random
from typing import Optional

import torch

from sglang_dflash.train import atomic
from sglang_dflash.train.config import TrainConfigError

STATE_FILE = "trainer_state.pt"


def checkpoint_dir(out: str, step: int) -> str:
    return os.path.join(out, "checkpoints", f"step-{step:06d}")


def latest_checkpoint(out: str) -> Optional[str]:
    found = sorted(glob.glob(os.path.join(out, "checkpoints", "step-*", STATE_FILE)))
    return os.path.dirname(found[-1]) if found else None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str, state: dict, export) -> None:
    """Write atomically (`atomic.replacing`). `export(dir)` writes the draft files."""
    with atomic.replacing(path) as tmp:
        os.makedirs(tmp)
        export(tmp)
        torch.save(state, os.path.join(tmp, STATE_FILE))


def resolve_resume(resume: str, out: str) -> str:
    """`--resume latest` or a checkpoint directory -> the checkpoint directory."""
    path = latest_checkpoint(out) if resume == "latest" else resume
    if path is None:
        raise TrainConfigError(f"--resume latest: no checkpoint under {os.path.join(out, 'checkpoints')!r}")
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise TrainConfigError(f"--resume {resume!r}: {path!r} has no {STATE_FILE}")
    return path


def load_checkpoint(path: str, raw_config: dict) -> dict:
    """The saved state; its draft must have the shape this run builds."""
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    for key in sorted(set(saved) | set(raw_config)):
        if key != "dtype" and saved.get(key) != raw_config.get(key):
            raise TrainConfigError(
                f"--resume {path!r}: the checkpoint's draft field {key!r} is {saved.get(key)!r}, "
                f"this run's is {raw_config.get(key)!r}"
            )
    return torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=False)

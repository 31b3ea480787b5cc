"""What the targets written from another checkpoint share (Mistral Large 3, Cosmos 3, Kimi-K2.5,
InternS2-Mobius): the transformers copy of the weights kept beside a converted checkpoint and its
oracle (`transformers_copy`), and copying a checkpoint's files but its weights. Builds no target."""

from __future__ import annotations

import os

import torch

# Targets written in another checkpoint format keep the same weights in transformers' format in
# this sub-folder, for their oracle (`transformers_copy`).
TRANSFORMERS_COPY = "transformers"


def transformers_copy(path: str, cls: str):
    """Transformers' class `cls` on the copy of the weights kept in `path`/transformers."""
    import transformers

    model = getattr(transformers, cls).from_pretrained(
        os.path.join(path, TRANSFORMERS_COPY), dtype=torch.float32
    )
    return model.eval()


def _copy_all_but_weights(source: str, path: str) -> None:
    """Copy the config, tokenizer and processor files of the checkpoint at `source` into `path`."""
    import shutil

    for name in os.listdir(source):
        if os.path.isfile(os.path.join(source, name)) and not name.endswith(".safetensors"):
            shutil.copy(os.path.join(source, name), path)

"""Training recipe for DFlash drafts: `python -m sglang_dflash.train --target T --data F --out D`.

Trains a draft (DFlash, or DFlash2 with `--family dflash2`) for a local Hugging Face causal-LM
target on CPU or CUDA and exports it in the z-lab `DFlashDraftModel` checkpoint format (or as a
`DFlash2DraftModel`). Nothing here imports SGLang, except the optional
`--regen-backend sglang` data step, which imports it when used.

Modules, one noun each:
  * `config`     : `TrainConfig`, the recipe's settings, validated.
  * `target`     : `FrozenTarget`, the frozen target: features, predictions, embeddings, LM head.
  * `data`       : `Example`s from .txt / .jsonl files, and padded batches.
  * `regenerate` : the optional step that rewrites responses with the target itself.
  * `mask`       : the block-wise attention mask over many anchored blocks.
  * `split_attention`, `flex_attention` : that attention without the masked cross-block
                   scores: split by log-sum-exp (CPU), or FlexAttention's skipped tiles (CUDA).
  * `objective`  : anchors, the draft forward over all blocks, the decayed loss, `Metrics`.
  * `selector`   : DFlash2's selector loss, its gold insertion and walk metrics.
  * `checkpoint` : save / resume of the training state.
  * `atomic`     : files and directories written whole or not at all (tmp, then rename).
  * `export`     : the draft's `config.json` and the z-lab format export.
  * `loop`       : `Trainer`, the optimisation loop.
  * `cli`        : the command line.

See docs/training.md.
"""

__all__: list[str] = []

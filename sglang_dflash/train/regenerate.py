"""`--regenerate`: rewrite the responses with the target itself.

A draft is judged by how often it guesses what the *target* will emit, so it should learn the
target's own distribution rather than the data's. Each prompt (a chat without its last
assistant turn, or a document's first tokens) is continued by the target, greedily or by
sampling at `--regen-temperature`; the continuation becomes the labelled part of the example.

Backends: `hf` runs `generate` on the training device; `sglang` runs an `sglang.Engine`
(imported only here, only when chosen).
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_dflash.train.config import TrainConfig, TrainConfigError
from sglang_dflash.train.data import Example, Prompt


def regenerate(cfg: TrainConfig, prompts: list[Prompt], *, model=None, tokenizer=None) -> list[Example]:
    """Prompt + the target's continuation, as examples labelled on the continuation only."""
    greedy = cfg.regenerate == "greedy"
    if cfg.regen_backend == "sglang":
        outputs = _generate_sglang(cfg, prompts, greedy=greedy)
    else:
        outputs = _generate_hf(cfg, prompts, model, tokenizer, greedy=greedy)
    examples = []
    for prompt, out in zip(prompts, outputs):
        ids = (prompt.input_ids + out)[: cfg.max_length]
        mask = ([False] * len(prompt.input_ids) + [True] * len(out))[: cfg.max_length]
        examples.append(Example(ids, mask))
    return examples


def _stop_ids(model, tokenizer) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


@torch.no_grad()
def _generate_hf(
    cfg: TrainConfig, prompts: list[Prompt], model, tokenizer, *, greedy: bool
) -> list[list[int]]:
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    stop = _stop_ids(model, tokenizer)
    gen_config = GenerationConfig(
        max_new_tokens=cfg.regen_max_new_tokens,
        do_sample=not greedy,
        temperature=None if greedy else cfg.regen_temperature,
        top_k=None if greedy else 0,  # plain temperature sampling: the target's distribution
        top_p=None if greedy else 1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stop or None,
    )
    device = model.get_input_embeddings().weight.device
    torch.manual_seed(cfg.seed)
    outputs: list[list[int]] = []
    starts = range(0, len(prompts), cfg.regen_batch_size)
    for lo in tqdm(starts, desc="regenerate", disable=not cfg.progress):
        chunk = [p.input_ids for p in prompts[lo : lo + cfg.regen_batch_size]]
        width = max(len(p) for p in chunk)
        # Left-padded: E.g., [[5, 6], [7]] -> ids [[5, 6], [pad, 7]], mask [[1, 1], [0, 1]].
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(chunk), width), dtype=torch.int64)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_config
        )
        outputs.extend(_until_stop(row, stop) for row in out[:, width:].tolist())
    return outputs


def _until_stop(tokens: list[int], stop: list[int]) -> list[int]:
    """Cut after the first stop token (kept: the draft should learn to propose it)."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def _generate_sglang(cfg: TrainConfig, prompts: list[Prompt], *, greedy: bool) -> list[list[int]]:
    try:
        import sglang
    except ModuleNotFoundError as e:
        raise TrainConfigError(
            "--regen-backend sglang needs SGLang: pip install 'sglang==0.5.23' (or use --regen-backend hf)"
        ) from e
    sampling: dict[str, Optional[float]] = {
        "max_new_tokens": cfg.regen_max_new_tokens,
        "temperature": 0.0 if greedy else cfg.regen_temperature,
    }
    engine = sglang.Engine(model_path=cfg.target, random_seed=cfg.seed, log_level="error")
    try:
        results = engine.generate(input_ids=[p.input_ids for p in prompts], sampling_params=sampling)
    finally:
        engine.shutdown()
    return [list(r["output_ids"]) for r in results]

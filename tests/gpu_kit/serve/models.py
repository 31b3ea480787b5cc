"""The kit's models, built on the GPU machine (nothing travels but this code).

    python -m tests.gpu_kit.serve.models OUT

* `OUT/tiny-target`, `OUT/tiny-draft`: seeded random weights (tests/support/tiny/) with
  head_dim 128 in bf16, the attention shape of the race's models, so the lossless step also
  JIT-compiles FlashInfer's kernels for the race. The draft has 2 layers on a 4-layer target
  and no target_layer_ids, so it takes z-lab's default [1, 1]: a repeated layer.
* `OUT/qwen3-8b`, `OUT/qwen3-8b-dflash`: config.json only, Qwen3-8B's and its DFlash draft's
  shapes (5 layers, block 16, z-lab's layout), for `--load-format dummy`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}
# GQA group 4, as Qwen3-8B: SGLang decodes it with FlashInfer's tensor-core (batch prefill)
# kernels, the ones the race uses, instead of a CUDA-core decode module nothing else needs.
TINY = dict(
    hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=128, intermediate_size=512, vocab_size=1024
)
TINY_TARGET_LAYERS, TINY_DRAFT_LAYERS = 4, 2


REPO = os.path.join(os.path.dirname(__file__), "..", "..", "..")
TRAINED_PAIR = os.path.join(REPO, "sglang_dflash", "assets", "tiny_pair")


def trained_pair_configs() -> tuple[dict, dict]:
    """The shipped trained pair's (target, draft) config.json: head_dim 64, GQA 2, block 8."""
    pair = os.path.normpath(TRAINED_PAIR)
    configs = []
    for name in ("target", "draft"):
        with open(os.path.join(pair, name, "config.json")) as f:
            configs.append(json.load(f))
    return configs[0], configs[1]


def tiny_target_config() -> dict:
    """The attention-relevant fields of the tiny target's config.json (HF names)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": TINY["hidden_size"],
        "num_attention_heads": TINY["num_heads"],
        "num_key_value_heads": TINY["num_kv_heads"],
        "head_dim": TINY["head_dim"],
        "num_hidden_layers": TINY_TARGET_LAYERS,
    }


def tiny_draft_config() -> dict:
    from tests.support.tiny import draft_config_dict

    return draft_config_dict(
        num_layers=TINY_DRAFT_LAYERS, block_size=16, num_target_layers=TINY_TARGET_LAYERS, **TINY
    )


def qwen3_8b_dflash() -> dict:
    """The DFlash draft for Qwen3-8B, block 16 (z-lab's config layout)."""
    from tests.support.tiny import draft_config_dict

    config = draft_config_dict(
        hidden_size=4096,
        num_layers=5,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        block_size=16,
        target_layer_ids=[1, 9, 17, 25, 33],
        num_target_layers=36,
        mask_token_id=151669,
        vocab_size=151936,
    )
    config.update(rope_theta=1000000, max_position_embeddings=40960, torch_dtype="bfloat16")
    return config


def write_config(path: str, config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def build(out: str) -> dict:
    from tests.support.tiny import make_draft, make_target

    paths = {
        name: os.path.join(out, name) for name in ("tiny-target", "tiny-draft", "qwen3-8b", "qwen3-8b-dflash")
    }
    builds = {
        "tiny-target": lambda path: make_target(path, num_layers=TINY_TARGET_LAYERS, tokenizer=False, **TINY),
        "tiny-draft": lambda path: make_draft(
            path, num_layers=TINY_DRAFT_LAYERS, block_size=16, num_target_layers=TINY_TARGET_LAYERS, **TINY
        ),
    }
    for name, make in builds.items():
        if not os.path.isdir(paths[name]):  # built beside, then renamed: never half a model
            partial = paths[name] + ".partial"
            shutil.rmtree(partial, ignore_errors=True)
            make(partial)
            os.rename(partial, paths[name])
    write_config(paths["qwen3-8b"], QWEN3_8B)
    write_config(paths["qwen3-8b-dflash"], qwen3_8b_dflash())
    return paths


if __name__ == "__main__":
    for name, path in build(sys.argv[1]).items():
        print(f"{name}: {path}")

"""Tiny seeded random-weight models for tests: a Qwen3 target (HF format, with a small BPE
tokenizer) and a DFlash draft in the z-lab checkpoint format, targets of many SGLang families and
drafts of several, each built by one module here:

* `tokenizer`: the tokenizer and its special ids; `qwen3`: the base target (`make_target`) and the
  helpers the other targets share;
* `families`: `make_family_target` (with the conversions of `teleflm`, `nanbeige`, `llama4`,
  `mimo`, `muse_glimmer` and the multimodal pieces of `vl`); `hybrid`: the linear-attention
  targets; `beam`: Beam and its oracle;
* checkpoints written from another one (`converted`): `mistral` (Mistral Large 3), `cosmos3`,
  `kimi` (Kimi-K2.5), `mobius` (InternS2-Mobius);
* `drafts`: the draft and its families' edits; `quantized`: fp8, NVFP4 and Nemotron-3.5 drafts.

This package holds the named shapes (TARGETS, DRAFTS, HYBRID_TARGETS) and `TinyModels`, the session
fixture's builder (tests/conftest.py's `tiny`), and re-exports every module's public names.
`python -m tests.support.tiny OUT` writes target "a"'s defaults and a draft under OUT."""

from __future__ import annotations

import json
import os

from tests.support.tiny.beam import BEAM_SHAPE, BeamReference, make_beam_target
from tests.support.tiny.converted import TRANSFORMERS_COPY, transformers_copy
from tests.support.tiny.cosmos3 import COSMOS3_ATTENTION, make_cosmos3_target
from tests.support.tiny.drafts import (
    LILICORR_FIELDS,
    add_domino,
    add_laguna,
    add_lilicorr,
    add_selector,
    as_gemma4_published,
    draft_config_dict,
    lilicorr_weights,
    make_draft,
)
from tests.support.tiny.families import (
    GEMMA4_NO_SPECIAL_TOKENS,
    MINISTRAL3_ROPE,
    MLA_SHAPE,
    YARN,
    make_family_target,
)
from tests.support.tiny.hybrid import make_hybrid_target
from tests.support.tiny.kimi import KIMI_K25_VISION, make_kimi_k25_target
from tests.support.tiny.llama4 import LLAMA4_DENSE, llama4_interleaved
from tests.support.tiny.mimo import (
    MIMO_V2_CONFIG_CODE,
    MIMO_V2_LAYERS,
    MIMO_V2_TRANSFORMERS_CONFIG,
    mimo_v2_transformers,
)
from tests.support.tiny.mistral import (
    MISTRAL_LARGE_3_SCALING,
    MISTRAL_NATIVE_NAMES,
    make_mistral_large_3_target,
)
from tests.support.tiny.mobius import MOBIUS_BLOCKS, make_interns2_mobius_target
from tests.support.tiny.muse_glimmer import MUSE_GLIMMER_NAMES
from tests.support.tiny.nanbeige import NANBEIGE_LOOPS, nanbeige_unrolled
from tests.support.tiny.quantized import make_nemotron_35, quantize_fp8, quantize_nvfp4
from tests.support.tiny.qwen3 import FAVOURED_ID, TEXT_SHAPE_A, make_target
from tests.support.tiny.teleflm import TELEFLM_MUP, teleflm_folded
from tests.support.tiny.tokenizer import CHAT_TEMPLATE, EOS_ID, MASK_ID, make_tokenizer
from tests.support.tiny.vl import VL_TOKENS, VL_VISION

__all__ = [
    "BEAM_SHAPE",
    "BeamReference",
    "CHAT_TEMPLATE",
    "COSMOS3_ATTENTION",
    "DRAFTS",
    "EOS_ID",
    "FAVOURED_ID",
    "GEMMA4_NO_SPECIAL_TOKENS",
    "HYBRID_TARGETS",
    "KIMI_K25_VISION",
    "LILICORR_FIELDS",
    "LLAMA4_DENSE",
    "MASK_ID",
    "MIMO_V2_CONFIG_CODE",
    "MIMO_V2_LAYERS",
    "MIMO_V2_TRANSFORMERS_CONFIG",
    "MINISTRAL3_ROPE",
    "MISTRAL_LARGE_3_SCALING",
    "MISTRAL_NATIVE_NAMES",
    "MLA_SHAPE",
    "MOBIUS_BLOCKS",
    "MUSE_GLIMMER_NAMES",
    "NANBEIGE_LOOPS",
    "TARGETS",
    "TELEFLM_MUP",
    "TEXT_SHAPE_A",
    "TRANSFORMERS_COPY",
    "TinyModels",
    "VL_TOKENS",
    "VL_VISION",
    "YARN",
    "add_domino",
    "add_laguna",
    "add_lilicorr",
    "add_selector",
    "as_gemma4_published",
    "draft_config_dict",
    "lilicorr_weights",
    "llama4_interleaved",
    "make_beam_target",
    "make_cosmos3_target",
    "make_draft",
    "make_family_target",
    "make_hybrid_target",
    "make_interns2_mobius_target",
    "make_kimi_k25_target",
    "make_mistral_large_3_target",
    "make_nemotron_35",
    "make_target",
    "make_tokenizer",
    "mimo_v2_transformers",
    "nanbeige_unrolled",
    "quantize_fp8",
    "quantize_nvfp4",
    "teleflm_folded",
    "transformers_copy",
]

# Named shapes used across the tests. Targets differ in width, depth, GQA ratio and head_dim;
# drafts in depth, block size, KV heads and target_layer_ids.
TARGETS = {
    "a": dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, seed=0),
    "b": dict(hidden_size=96, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=32, seed=10),
    # Target "a" with a small LM head: flat, high-entropy next-token distributions, for
    # statistical tests of sampling (pairs with draft "a").
    "flat": dict(
        hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, seed=0, lm_head_std=0.01
    ),
}
DRAFTS = {
    "a": dict(target="a", hidden_size=64, num_layers=1, block_size=16, num_target_layers=4, seed=1),
    "b": dict(
        target="b",
        hidden_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        block_size=8,
        num_target_layers=6,
        target_layer_ids=[0, 2, 4],
        seed=11,
        prefix="model.",
    ),
}
# Draft "b" with 2 KV heads: it splits across two tensor-parallel ranks ("b" has 1, which does not).
DRAFTS["b-tp"] = dict(DRAFTS["b"], num_kv_heads=2, seed=12)


# Hybrid linear-attention targets (make_hybrid_target): family and favour, set so the favoured
# token is about half of the greedy choices. They pair with draft "a".
HYBRID_TARGETS = {
    "next": ("qwen3_next", 4.0),
    "q35": ("qwen3_5", 10.0),
    "q35moe": ("qwen3_5_moe", 4.0),
    "q35vl": ("qwen3_5_vl", 10.0),
    "q35moevl": ("qwen3_5_moe_vl", 4.0),
}


class TinyModels:
    """Builds each named checkpoint on first use under `root`."""

    def __init__(self, root):
        self.root = str(root)

    def target(self, name: str) -> str:
        path = os.path.join(self.root, f"target-{name}")
        if not os.path.isdir(path):
            make_target(path, **TARGETS[name])
        return path

    def draft(self, name: str) -> str:
        path = os.path.join(self.root, f"draft-{name}")
        if not os.path.isdir(path):
            spec = dict(DRAFTS[name])
            spec.pop("target")
            make_draft(path, **spec)
        return path

    def hybrid_target(self, name: str) -> str:
        path = os.path.join(self.root, f"hybrid-{name}")
        if not os.path.isdir(path):
            family, favour = HYBRID_TARGETS[name]
            make_hybrid_target(path, family=family, favour=favour)
        return path

    def pair(self, name: str) -> tuple[str, str]:
        return self.target(DRAFTS[name]["target"]), self.draft(name)

    def edited_draft(self, name: str, tag: str, edit) -> str:
        """A copy of draft `name` whose config.json dict is passed through `edit(dict)`."""
        import shutil

        path = os.path.join(self.root, f"draft-{name}-{tag}")
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(self.draft(name), path)
        file = os.path.join(path, "config.json")
        with open(file) as f:
            data = json.load(f)
        edit(data)
        with open(file, "w") as f:
            json.dump(data, f)
        return path

"""The target families of `make gpu-matrix`, in priority order, and their tiny checkpoints.

    python -m tests.gpu_kit.serve.families build OUT [NAME ...]   # build them (all by default)
    python -m tests.gpu_kit.serve.families run NAME --models OUT --out F.json [--device cuda]
                                          [--prompts 6] [--new-tokens 32] [--samples 1000]
    python -m tests.gpu_kit.serve.families nearties OUT [NAME ...]   # near-tie rate, CPU

The rows after the target families are the draft families on the dense (Llama) target:
DFlash2's candidate selector, Domino's rollout, a Laguna draft's module path, and MiMo's
attention sinks (which our FlashInfer draft attention refuses: SDPA applies them), each draft
"a" given that family's fields and weights as tests/engine/test_target_shapes.py gives them.

`run` builds the family's pair (if not built) and runs `lossless.py` on it: the plain engine
against our DFLASH, greedy, at batch 1, all prompts together, then a prefix-cache round, with
the family's engine arguments; for the draft families and the float32 one, with `--samples`,
then sampled requests (a chi-square against the plain engine's) and requests under a grammar.

Each family is a tiny seeded target of that SGLang class (`tests/support/tiny/families.py`: shaped like
target "a", hidden 64, 4 layers, vocab 384) whose embedding and LM head favour one token, so the
untrained draft "a" (one layer, block 16) proposes it and is often right: its proposals are
accepted (about 1.5 to 3 tokens a step on CPU), so the comparison runs the multi-token accept
path, and the target is peaked, so its greedy choices are far from ties. The seeds are those
`tests/engine/test_target_classes.py`, `test_target_shapes.py` and `test_hybrid_targets.py` serve on
CPU; the favours are those too where they give an acceptance above 1.5 on the matrix's prompts,
else raised until they did (the favoured token then takes half to 85% of the greedy choices;
the table in tests/gpu_kit/README.md, "Every target family", was measured on CPU with these).

`nearties` measures, before any GPU, how often a family's greedy choices on the matrix's prompts
are near-ties in bf16 (`near_ties`): where they are, the plain engine and DFLASH may part by
rounding, and the comparison can only excuse and resync, not check.

Engine arguments per device: on CUDA every family runs on SGLang's Triton attention backend
(gpt-oss's sinks and Gemma-4's sliding windows need it; the MLA and hybrid targets take it; the
kit's FlashInfer is compiled for the shapes of the other pairs), in bf16 except one family in
float32, which our FlashInfer draft attention refuses (SDPA then serves the draft; it also
serves draft "a", whose head_dim 16 FlashInfer is not built for). On CPU, the CPU engine's
defaults, and SGLang's own attention backend for the sliding-window families.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

REPO = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, REPO)


DRAFT = "a"  # tests/support/tiny/__init__.py DRAFTS: every family pairs with it


@dataclass(frozen=True)
class Family:
    """One row of the matrix: how to build its target, and what its engines take."""

    name: str
    builder: str  # "family" (make_family_target) or "hybrid" (make_hybrid_target)
    cls: str  # the builder's family name
    seed: int
    favour: float
    cuda_args: dict = field(default_factory=dict)  # on top of lossless.py's CUDA_ARGS
    what: str = ""
    cpu_args: dict = field(default_factory=dict)  # on top of its CPU_ARGS
    draft: str = DRAFT  # draft "a", or a variant built from it (`draft_variant`)
    dflash_args: dict = field(default_factory=dict)  # the DFLASH engine's only
    sampled: bool = False  # `run --samples` adds lossless.py's sampled and grammar requests
    mla: Optional[dict] = None  # the MLA targets' ranks, over tests/support/tiny/families.py's MLA_SHAPE
    head_dim: Optional[int] = None  # over target "a"'s 16

    def engine_args(self, device: str) -> dict:
        return dict(self.cuda_args if device == "cuda" else self.cpu_args)


TRITON = {"attention_backend": "triton"}
# The MLA targets' latent as published (DeepSeek-V3, Kimi-K2.5, GLM-4.7-Flash): a KV LoRA of 512
# and RoPE of 64, 576 a token. SGLang's Triton MLA decode takes a value that is the key's own
# first columns (`tl.trans(k)`), so its key block must equal its value block: 576 is special-cased
# (512 + 64); MLA_SHAPE's 32 + 16 (blocks of 64 and 32) does not compile
# (tests/gpu_kit/triton_preflight.py found it).
MLA_AS_PUBLISHED = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
# On CPU, SGLang's own choice for the sliding-window pool (torch_native without AMX), as
# tests/engine/test_target_classes.py serves them.
CPU_SWA = {"attention_backend": None}
# Priority order (the issue's): the families whose published drafts have never run on a GPU first.
FAMILIES = (
    Family("gpt_oss", "family", "gpt_oss", 0, 3.0, TRITON, "sinks, sliding and full layers, MoE", CPU_SWA),
    Family("gemma4", "family", "gemma4", 0, 6.0, TRITON, "sliding-window layers, then a full one", CPU_SWA),
    # Head size 64: at 16, SGLang's RoPE takes its fallback kernel, which refuses the KV write
    # Qwen3-MoE fuses into it on CUDA (rotary_embedding/base.py); published ones have 128.
    Family("qwen3_moe", "family", "qwen3_moe", 3, 12.0, TRITON, "MoE", head_dim=64),
    Family("qwen3_5", "hybrid", "qwen3_5", 0, 10.0, TRITON, "Gated DeltaNet layers, then full attention"),
    # At the published latent, seed 0's greedy choices are another token whatever the favour;
    # seed 3's are the favoured one 72% of the time at a favour of 3.
    Family(
        "deepseek_v3",
        "family",
        "deepseek_v3",
        3,
        3.0,
        TRITON,
        "MLA, dense then MoE, YaRN",
        mla=MLA_AS_PUBLISHED,
    ),
    Family(
        "llama_fp32",
        "family",
        "llama",
        3,
        6.0,
        dict(TRITON, dtype="float32"),
        "float32 on Triton",
        sampled=True,
    ),
    # As time allows.
    Family("qwen3_next", "hybrid", "qwen3_next", 0, 6.0, TRITON, "Gated DeltaNet, MoE"),
    Family("qwen3_5_moe", "hybrid", "qwen3_5_moe", 0, 6.0, TRITON, "Gated DeltaNet, MoE"),
    Family(
        "glm4_moe_lite",
        "family",
        "glm4_moe_lite",
        0,
        5.0,
        TRITON,
        "MLA with query LoRA, MoE",
        mla=MLA_AS_PUBLISHED,
    ),
)
# The draft families, on the dense target, after the target families (the second list).
DENSE = dict(builder="family", cls="llama", seed=3, favour=6.0, cuda_args=TRITON, sampled=True)
DRAFT_FAMILIES = (
    Family("dflash2", **DENSE, what="DFlash2's candidate selector", draft="dflash2"),
    Family(
        "domino",
        **DENSE,
        what="Domino's rollout over a candidate pool of 16",
        draft="domino",
        dflash_args={"speculative_domino_candidate_pool_size": 16},
    ),
    Family("laguna_draft", **DENSE, what="a Laguna draft's module path", draft="laguna"),
    Family("mimo_sinks", **DENSE, what="MiMo's attention sinks (SDPA)", draft="mimo_sinks"),
)
BY_NAME = {f.name: f for f in FAMILIES + DRAFT_FAMILIES}


def builders() -> dict[str, Callable]:
    from tests.support.tiny import make_family_target, make_hybrid_target

    return {"family": make_family_target, "hybrid": make_hybrid_target}


def draft_spec() -> dict:
    from tests.support.tiny import DRAFTS

    spec = dict(DRAFTS[DRAFT])
    spec.pop("target")
    return spec


def draft_variant(path: str, variant: str) -> None:
    """Draft "a" at `path` made a draft of family `variant`, in place (tests/support/tiny/drafts.py)."""
    from tests.support.tiny import add_domino, add_laguna, add_selector

    if variant == "dflash2":
        add_selector(path)
    elif variant == "domino":
        add_domino(path, scale=1.0)
    elif variant == "laguna":
        add_laguna(path, gate_scale=1.0)
    elif variant == "mimo_sinks":
        add_sinks(path)
    elif variant != DRAFT:
        raise ValueError(f"unknown draft variant {variant!r}")


def add_sinks(path: str, seed: int = 1) -> None:
    """MiMo's attention sinks on every layer of the draft at `path`: `attention_sink_bias` in
    its dflash_config and a per-head sink logit per layer."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["dflash_config"]["attention_sink_bias"] = True
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(seed)
    for i in range(config["num_hidden_layers"]):
        tensors[f"layers.{i}.self_attn.attention_sink_bias"] = torch.randn(
            config["num_attention_heads"], generator=gen
        )
    save_file(tensors, file)


def build_draft(path: str, variant: str) -> None:
    """Draft "a" at `path`, made a draft of family `variant`."""
    from tests.support.tiny import make_draft

    make_draft(path, **draft_spec())
    draft_variant(path, variant)


def build(out: str, family: Family) -> tuple[str, str]:
    """The family's target and draft under OUT, each built once (targets shared by their class,
    seed and favour), beside and renamed, so a cut build never leaves half a model.
    Returns (target, draft)."""
    shape = {"mla": family.mla} if family.mla else {}
    shape.update({"head_dim": family.head_dim} if family.head_dim else {})
    tag = (f"-lora{family.mla['kv_lora_rank']}" if family.mla else "") + (
        f"-hd{family.head_dim}" if family.head_dim else ""
    )
    target = os.path.join(out, f"target-{family.cls}-s{family.seed}-f{family.favour:g}{tag}")
    draft = os.path.join(out, f"draft-{family.draft}")
    make_target = builders()[family.builder]

    for path, make in (
        (draft, lambda p: build_draft(p, family.draft)),
        (
            target,
            lambda p: make_target(p, family=family.cls, seed=family.seed, favour=family.favour, **shape),
        ),
    ):
        if not os.path.isdir(path):
            partial = path + ".partial"
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(os.path.dirname(partial), exist_ok=True)
            make(partial)
            os.rename(partial, path)
    return target, draft


def select(names: Optional[str]) -> list[Family]:
    """The families named (comma-separated, in the order given), or all in priority order: the
    target families, then the draft families."""
    if not names:
        return list(FAMILIES + DRAFT_FAMILIES)
    unknown = [n for n in names.split(",") if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in names.split(",")]


MATRIX_PROMPTS, MATRIX_NEW_TOKENS = 6, 32  # what `make gpu-matrix` serves per family on CUDA


def margin_steps(logits, dtype: str) -> tuple[int, float]:
    """(greedy token, its margin over the runner-up in `dtype` rounding steps at the logits'
    magnitude), for one position's float32 logits [vocab]. E.g., logits [9.95, 10.0, 3.0] in
    bfloat16 (a step of 1/16 in [8, 16)): (1, 0.8), a near-tie (lossless.TIE_STEPS is 2)."""
    from tests.gpu_kit.serve.lossless import rounding_step

    top = logits.topk(2)
    margin = float(top.values[0] - top.values[1])
    return int(top.indices[0]), margin / rounding_step(float(logits.abs().max()), dtype)


def near_ties(target: str, prompts: list, new_tokens: int, dtype: str = "bfloat16") -> dict:
    """The target's greedy continuation of each prompt (transformers, float32, CPU), with at
    every position the greedy margin in `dtype` rounding steps (`margin_steps`): {"positions",
    "near_ties" (within lossless.TIE_STEPS), "smallest_steps"}."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.gpu_kit.serve.lossless import TIE_STEPS

    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    steps = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):  # tiny models: a whole forward per token is fast enough
                token, margin = margin_steps(model(torch.tensor([ids])).logits[0, -1], dtype)
                steps.append(margin)
                ids.append(token)
    return {
        "positions": len(steps),
        "near_ties": sum(s <= TIE_STEPS for s in steps),
        "smallest_steps": round(min(steps), 2),
    }


def nearties(argv: list) -> int:
    """Each family's near-tie rate in bf16 on the matrix's prompts, a line each."""
    import json

    from tests.gpu_kit.serve.lossless import random_prompts

    out, names = argv[0], argv[1:]
    print("family | near-ties in bf16 | positions | smallest margin (bf16 steps)")
    seen = {}
    for family in select(",".join(names)):
        target, _ = build(out, family)
        if target not in seen:
            with open(os.path.join(target, "config.json")) as f:
                prompts = random_prompts(json.load(f)["vocab_size"], MATRIX_PROMPTS)
            seen[target] = near_ties(target, prompts, MATRIX_NEW_TOKENS)
        found = seen[target]
        row = (family.name, found["near_ties"], found["positions"], found["smallest_steps"])
        print(" | ".join(str(x) for x in row), flush=True)
    return 0


def run(argv=None) -> int:
    import argparse
    import json

    from tests.gpu_kit.serve import lossless

    p = argparse.ArgumentParser(description="one family: build its pair, then lossless.py on it")
    p.add_argument("name", choices=list(BY_NAME))
    p.add_argument("--models", required=True, help="where the pairs are built (and kept)")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--samples", type=int, default=0, help="sampled requests per engine, if the family samples"
    )
    args = p.parse_args(argv)
    family = BY_NAME[args.name]
    print(f"== build {family.name} ({family.what})", flush=True)
    target, draft = build(args.models, family)
    argv = [target, draft, "--device", args.device, "--runs", "overlap", "--out", args.out]
    argv += ["--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--prefix-round"]
    argv += ["--engine-args", json.dumps(family.engine_args(args.device))]
    argv += ["--dflash-args", json.dumps(family.dflash_args)]
    if family.sampled and args.samples:
        argv += ["--samples", str(args.samples)]
    return lossless.main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        sys.exit(run(sys.argv[2:]))
    if sys.argv[1:2] == ["nearties"] and len(sys.argv) > 2:
        sys.exit(nearties(sys.argv[2:]))
    if sys.argv[1:2] != ["build"] or len(sys.argv) < 3:
        sys.exit(__doc__)
    for family in select(",".join(sys.argv[3:])):
        print(family.name, *build(sys.argv[2], family))

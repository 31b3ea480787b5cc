"""More SGLang target classes on the CPU engine, tiny and random (`make_family_target`), each
served by DFLASH with untrained draft "a":

* Gemma-4 (`Gemma4ForCausalLM`): sliding-window layers on SGLang's SWA pool, which SGLang's CPU
  engine serves with `torch_native` on hosts without AMX;
* gpt-oss (`GptOssForCausalLM`): attention sinks, which SGLang's `torch_native` lacks and
  `cpu/paged_attention.py` gives it, sliding windows, MoE;
* Qwen3-VL (`Qwen3VLForConditionalGeneration`) serving text and images: its SGLang class calls a
  capture method its inner model lacks (`draft/target_capture.complete_capture`). Image
  requests (IMAGE_CLASSES) are checked against transformers at batch 1 and 4, with an image as a
  cached prefix, and the draft's first block over an image against the z-lab reference draft on
  transformers' hidden states;
* MLA targets on SGLang's MLA pool, MoE after a dense first layer: DeepSeek-V3
  (`DeepseekV3ForCausalLM`, YaRN RoPE past the prompts' length, no query LoRA) and GLM-4-MoE-Lite
  (`Glm4MoeLiteForCausalLM`, query LoRA, plain RoPE), which the CPU engine serves through two
  patches in `cpu/bootstrap.py` (tested below, before the engines);
* Laguna (`LagunaForCausalLM`) as a target: sliding and full layers, per-head attention gates,
  partial RoPE on the full layers, sigmoid-routed MoE;
* Muse Glimmer as a target, both of SGLang's classes: the multimodal
  `MuseGlimmerForConditionalGeneration` on transformers' checkpoint, serving text, and the
  text-only `MuseGlimmerForCausalLM` on the same weights converted to SGLang's names and flat
  config. Sliding layers, a full layer without RoPE, attention output gates, sandwich norms,
  scaled and soft-capped logits;
* Beam (`BeamForCausalLM`): three sliding layers with RoPE then a full one without (SSMax
  queries), per-head attention gates, sandwich norms with depth-scaled residuals, dense MLPs then
  group-routed sigmoid MoE, a bf16 LM head in the float32 engine, soft-capped logits. Transformers
  has no Beam class: the checkpoint is written in SGLang's names (`make_beam_target`) and the
  oracle is a plain PyTorch forward (`BeamReference`);
* MiMo-V2-Flash (`MiMoV2FlashForCausalLM`) as its published checkpoints are served, with their
  own flat config class (`--trust-remote-code`): full and sliding layers, the sliding ones with
  twice the KV heads and attention sinks, a V head smaller than Q/K's, partial RoPE with a theta
  per layer type, sigmoid-routed MoE; served with a draft reading the last layer (L-1), as
  MiMo's published drafts do. The oracle is transformers' class on the same weights;
* Nanbeige (`NanbeigeForCausalLM`) as a loop model: its 4 layers run twice, and the draft's layer
  ids count the 8 unrolled steps, as SGLang counts them (draft "a" reads step 4, the second
  run's first layer). Transformers has no Nanbeige class: the oracle is its Llama with the
  layers repeated (`nanbeige_unrolled`), which is the same forward without a norm between runs;
* Mistral Large 3 (`MistralLarge3ForCausalLM`) as published: a Mistral-native checkpoint
  (`params.json`, `consolidated.safetensors`, in a folder whose name SGLang recognises) of
  DeepSeek-V3's MLA with softmax-routed MoE, YaRN and queries scaled by position
  (`llama_4_scaling`), served in bf16 (SGLang overrides --dtype for the class). The oracle is
  transformers' Mistral-4 class on the same weights in its own format;
* ten classes one step from a class above: TeleFLM (`TeleFLMForCausalLM`), Llama with muP
  multipliers on the embeddings and the logits (oracle: Llama with them folded in,
  `teleflm_folded`); Mellum (`MellumForCausalLM`), Qwen3-MoE's
  layers with sliding and full attention, a RoPE theta each, a dense layer then MoE; Ministral 3
  (`Ministral3ForCausalLM`), Llama with YaRN and queries scaled by position past a period of 16;
  Llama-4 (`Llama4ForCausalLM`), dense layers (SGLang's class alone loads no experts), every
  fourth without RoPE and with its queries scaled by position, the checkpoint's q/k rows in the
  NeoX order SGLang's RoPE reads (oracle: transformers' class with them put back in its
  interleaved order, `llama4_interleaved`). On the CPU engine it needs the rotary patch in
  `cpu/bootstrap.py`: without it SGLang's layers run without RoPE and differ on 4 of 4 prompts;
  Cosmos 3 (`Cosmos3ForConditionalGeneration`), serving text: Qwen3-VL's weights in Cosmos 3's
  layout (`transformer/`, `vision_encoder/`, diffusers-style attention names) with two tensors of
  its generation tower that SGLang drops (oracle: transformers' Qwen3-VL on the source weights);
  Gemma-4-Unified (`Gemma4UnifiedForConditionalGeneration`), serving text with a draft reading
  L-1: Gemma-4's text model (three sliding layers, a full one) with a tied head behind an
  encoder-free image embedder, started with --enable-multimodal false (the tiny checkpoint has no
  processor); InternS2-Mobius (`InternS2MobiusForConditionalGeneration`), serving text: Qwen3.5-MoE's
  hybrid layers (three Gated DeltaNet, one full attention) whose routed experts live in two fused
  banks, layer i using bank i % 2 (oracle: transformers' Qwen3.5-MoE with the banks' weights
  repeated per layer); on the CPU engine it needs the MoE-runner patch in `cpu/bootstrap.py`;
  Gemma-4's multimodal class (`Gemma4ForConditionalGeneration`), serving text with a draft reading
  L-1, Gemma-4's text model behind a one-layer vision tower; Qwen3-VL-MoE
  (`Qwen3VLMoeForConditionalGeneration`), text and images, Qwen3-MoE's layers with the fused
  expert tensors in the published layout SGLang reads (`_transpose_fused_experts`); Kimi-K2.5
  (`KimiK25ForConditionalGeneration`), serving text: DeepSeek-V3's weights under
  `language_model.` beside a vision config (oracle: transformers' DeepSeek-V3 on the source).

For each: the engine without speculation against Hugging Face transformers' greedy ids, or the
PyTorch forwards above (an oracle for SGLang's class, for our attention sinks, and for a
checkpoint written by hand); DFLASH (on the Gemma-4 classes, gpt-oss, Laguna and MiMo-V2 with a
draft reading the last layer) against that engine, greedy
token-identical at batch 1 and 4, with acceptance above 1 (the targets favour one token); then a
prefix-cache round. One plain engine and one DFLASH engine per class, one at a time; seven
classes in `make test` (`FAST`), the others with --run-slow. Gemma-4 and
gpt-oss start as a user starts them (no attention backend named: SGLang picks intel_amx, then
torch_native without AMX).
"""

from __future__ import annotations

import os
from functools import partial
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support import engines
from tests.support.tiny import (
    TEXT_SHAPE_A,
    VL_TOKENS,
    BeamReference,
    as_gemma4_published,
    llama4_interleaved,
    make_beam_target,
    make_cosmos3_target,
    make_family_target,
    make_interns2_mobius_target,
    make_kimi_k25_target,
    make_mistral_large_3_target,
    make_tokenizer,
    mimo_v2_transformers,
    nanbeige_unrolled,
    teleflm_folded,
    transformers_copy,
)
from tests.support.tiny.qwen3 import _edit_json

pytestmark = pytest.mark.sglang

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PROMPTS = engines.prompts(8, seed=40, min_len=20, max_len=40)  # longer than gpt-oss/Gemma-4's window (8)
SHARED_PREFIX = engines.prompts(1, seed=7, min_len=40, max_len=40)[0]
PREFIXED = [SHARED_PREFIX + p for p in engines.prompts(2, seed=6, min_len=3, max_len=8)]

# name -> (family, seed, favour, engine flags for both engines, minimum acceptance). Seed and
# favour are chosen so that the favoured token is a fair share of the greedy choices, not all.
CLASSES = {
    "gemma4": ("gemma4", 0, 6.0, {"attention_backend": None}, 2.0),
    "gpt_oss": ("gpt_oss", 0, 3.0, {"attention_backend": None}, 1.2),
    "qwen3_vl": ("qwen3_vl", 2, 2.5, {}, 1.2),
    "deepseek_v3": ("deepseek_v3", 0, 3.0, {}, 1.5),
    "glm4_moe_lite": ("glm4_moe_lite", 0, 2.5, {}, 1.2),
    "laguna": ("laguna", 1, 9.0, {}, 1.05),
    "muse_glimmer": ("muse_glimmer", 0, 4.0, {}, 1.05),
    "muse_glimmer_lm": ("muse_glimmer_lm", 0, 4.0, {}, 1.05),
    "nanbeige": ("nanbeige", 0, 10.0, {}, 1.05),
    "beam": ("beam", 3, 6.0, {}, 1.5),
    # As the published checkpoints are served: their own config class, with --trust-remote-code.
    "mimo_v2": ("mimo_v2", 3, 6.0, {"trust_remote_code": True}, 1.2),
    "teleflm": ("teleflm", 0, 8.0, {}, 1.1),
    "mellum": ("mellum", 2, 6.0, {}, 1.1),
    "ministral3": ("ministral3", 0, 16.0, {}, 1.2),
    "llama4": ("llama4", 1, 8.0, {}, 1.2),
    # Served in bf16 whatever --dtype says (SGLang's MODEL_OVERRIDES), both engines (`BF16`).
    "mistral_large_3": ("mistral_large_3", 0, 3.0, {}, 1.5),
    "cosmos3": ("cosmos3", 2, 2.5, {}, 1.2),  # Qwen3-VL's weights (CONVERTED_FROM), seed and favour
    # Without a processor in the tiny checkpoint: text only, as --enable-multimodal false serves.
    "gemma4_unified": (
        "gemma4_unified",
        0,
        2.2,
        {"attention_backend": None, "enable_multimodal": False},
        1.5,
    ),
    # A hybrid target: its Mamba state pool sized as in test_hybrid_targets.py.
    "interns2_mobius": ("interns2_mobius", 0, 8.0, {"enable_multimodal": False, **engines.MAMBA_CACHE}, 1.1),
    "qwen3_vl_moe": ("qwen3_vl_moe", 2, 2.5, {}, 2.0),
    # DeepSeek-V3's weights (CONVERTED_FROM), seed and favour; no vision weights: text only.
    "kimi_k25": ("deepseek_v3", 0, 3.0, {"enable_multimodal": False}, 1.5),
    "gemma4_mm": ("gemma4_mm", 0, 2.2, {"attention_backend": None, "enable_multimodal": False}, 1.2),
}
# Environment the engines of a class start with: the hybrid targets keep their conv state in fp32,
# as transformers does (see test_hybrid_targets.py).
ENV = {"interns2_mobius": {"SGLANG_MAMBA_CONV_DTYPE": "float32"}}
SLIDING = {
    "gemma4", "gemma4_mm", "gemma4_unified", "gpt_oss", "laguna", "muse_glimmer", "muse_glimmer_lm", "beam",
    "mimo_v2", "mellum",
}  # fmt: skip
# Targets whose prefix cache keeps part of a shared prefix: SGLang's SWA radix cache on the
# sliding ones, its mamba radix cache (no_buffer on CPU) on the hybrid linear-attention one.
PARTIAL_PREFIX = SLIDING | {"interns2_mobius"}
# Classes whose SGLang model captures after its layer loop: their DFLASH engines serve draft "a"
# reading the last layer, id L-1 = 3 (MiMo's published drafts end there), which SGLang maps to
# that capture. Draft "a" reads layer 2 on the others.
LAST_LAYER_DRAFT = {"gemma4", "gemma4_mm", "gemma4_unified", "gpt_oss", "laguna", "mimo_v2"}
ARCHITECTURES = {
    "gemma4": "Gemma4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "laguna": "LagunaForCausalLM",
    "muse_glimmer": "MuseGlimmerForConditionalGeneration",
    "muse_glimmer_lm": "MuseGlimmerForCausalLM",
    "nanbeige": "NanbeigeForCausalLM",
    "beam": "BeamForCausalLM",
    "mimo_v2": "MiMoV2FlashForCausalLM",
    "teleflm": "TeleFLMForCausalLM",
    "mellum": "MellumForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "llama4": "Llama4ForCausalLM",
    "mistral_large_3": "MistralLarge3ForCausalLM",
    "cosmos3": "Cosmos3ForConditionalGeneration",
    "gemma4_unified": "Gemma4UnifiedForConditionalGeneration",
    "interns2_mobius": "InternS2MobiusForConditionalGeneration",
    "gemma4_mm": "Gemma4ForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "kimi_k25": "KimiK25ForConditionalGeneration",
}
# The transformers class of each oracle where AutoModelForCausalLM does not load it, and the class
# whose transformers checkpoint a converted one was made from (the same weights).
TRANSFORMERS_CLASSES = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "muse_glimmer": "MuseGlimmerForConditionalGeneration",
    "muse_glimmer_lm": "MuseGlimmerForConditionalGeneration",
    "cosmos3": "Qwen3VLForConditionalGeneration",
    "gemma4_unified": "Gemma4UnifiedForConditionalGeneration",
    "gemma4_mm": "Gemma4ForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}
CONVERTED_FROM = {"muse_glimmer_lm": "muse_glimmer", "cosmos3": "qwen3_vl", "kimi_k25": "deepseek_v3"}
# Checkpoints written from their CONVERTED_FROM checkpoint: name -> f(path, source path).
CONVERTERS = {"cosmos3": make_cosmos3_target, "kimi_k25": make_kimi_k25_target}


def test_torch_native_runs_mla_in_its_absorbed_form():
    """SGLang hands torch_native Triton's MLA choice, which runs a prefill without a cached prefix
    as multi-head attention over K and V that torch_native does not read (it reads the cache,
    which holds the latent). Under the CPU engine it is the absorbed form for every batch."""
    from sglang.srt.models.deepseek_common import attention_backend_handler as handlers
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    prefill = SimpleNamespace(
        forward_mode=SimpleNamespace(is_extend_without_speculative=lambda: True), extend_prefix_lens_cpu=[0]
    )
    handler = handlers.AttentionBackendRegistry.get_handler("torch_native")
    assert handler is not handlers.handle_attention_triton
    assert handler(SimpleNamespace(), prefill) == AttnForwardMethod.MLA


def test_mla_rope_without_scaling_is_plain_rope_on_cpu():
    """SGLang's CPU rotary factory asserts on an MLA config without RoPE scaling (GLM-4-MoE-Lite);
    under the CPU engine it builds the rotary `get_rope` builds on every other device."""
    from sglang.srt.layers.rotary_embedding import factory

    cpu = factory.get_rope_cpu(48, 16, 4096, 10000, False, None, torch.float32, device="cpu")
    plain = factory.get_rope(48, 16, 4096, 10000, False, None, torch.float32)
    assert type(cpu) is type(plain)
    torch.testing.assert_close(cpu.cos_sin_cache, plain.cos_sin_cache)


def _unserved_target(path, name: str) -> str:
    """A tiny config of a target DFLASH refuses (no weights: the refusal comes first)."""
    import transformers

    if name == "nemotron_h":
        config = transformers.NemotronHConfig(**TEXT_SHAPE_A, architectures=["NemotronHForCausalLM"])
    else:  # transformers' own MiMo-V2-Flash config, as SGLang loads it without --trust-remote-code
        architectures = ["MiMoV2FlashForCausalLM"]
        config = transformers.MiMoV2FlashConfig(**TEXT_SHAPE_A, v_head_dim=16, architectures=architectures)
    config.save_pretrained(path)
    # The layer types as SGLang reads them (the published configs' fields).
    file = os.path.join(path, "config.json")
    if name == "nemotron_h":
        _edit_json(file, layers_block_type=["mamba", "attention", "mlp", "mamba"])
    else:
        _edit_json(file, hybrid_layer_pattern=[0, 1, 1, 0])
    make_tokenizer(str(path))
    return str(path)


@pytest.mark.parametrize(
    "name, refusal",
    [
        ("nemotron_h", "'NemotronHForCausalLM' on SGLang's CPU engine: its Mamba2 layers need Triton"),
        ("mimo_v2", "'MiMoV2FlashForCausalLM' with this config on any device: SGLang's layers pass"),
    ],
)
def test_a_target_sglang_cannot_run_is_refused_by_name(tiny, tmp_path, name, refusal):
    """Refused with DFLASH at start-up, in the launching process, naming the class and why:
    Nemotron-H on the CPU engine (Mamba2 layers that need Triton), and MiMo-V2 with
    transformers' config (per-layer RoPE settings SGLang's layers cannot read), where SGLang's
    scheduler failed and took the launching process down."""
    with pytest.raises(ValueError, match=f"cannot serve target {refusal}"):
        engines.start(_unserved_target(tmp_path, name), tiny.draft("a"))


def test_refusals_follow_the_class_ancestry():
    from sglang_dflash.integration.unserved_targets import MAMBA2, cpu_engine_refusal, refusal

    # SGLang's subclasses of a refused class are refused too.
    assert cpu_engine_refusal(type("Puzzle", (type("NemotronHForCausalLM", (), {}),), {})) == MAMBA2
    assert cpu_engine_refusal(type("Qwen3ForCausalLM", (), {})) is None
    nemotron = type("NemotronHForCausalLM", (), {})
    assert refusal(nemotron, SimpleNamespace(), "cuda") is None  # the CPU reasons hold on CPU only
    # A class whose SGLang text path needs CUDA: refused on the CPU engine, named.
    k3 = type("KimiK3ForConditionalGeneration", (), {})
    assert refusal(k3, SimpleNamespace(), "cpu").startswith("on SGLang's CPU engine: its model creates CUDA")
    assert refusal(k3, SimpleNamespace(), "cuda") is None
    flash = type("MiMoV2FlashForCausalLM", (type("MiMoV2ForCausalLM", (), {}),), {})
    flat = SimpleNamespace(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    assert refusal(flash, flat, "cuda") is None  # flat settings are what SGLang reads
    per_layer = SimpleNamespace(rope_scaling={"full_attention": {"rope_type": "default"}})
    assert refusal(flash, per_layer, "cuda").startswith("with this config on any device")
    # A class whose SGLang model drops the captured layers, on every device.
    qwen4 = type("Qwen4ExpForConditionalGeneration", (), {})
    assert refusal(qwen4, SimpleNamespace(), "cuda").startswith("on any device: SGLang's model returns")
    # A class whose SGLang model cannot be built, on every device.
    interns1pro = type("InternS1ProForConditionalGeneration", (), {})
    assert refusal(interns1pro, SimpleNamespace(), "cpu").startswith("on any device: SGLang's text decoder")


def test_interns1pro_cannot_be_built_by_sglang():
    """The reason InternS1-Pro is refused: its decoder layer rejects what SGLang's model passes it."""
    from sglang.srt.models.interns1pro import InternS1ProTextDecoderLayer

    with pytest.raises(TypeError, match="start_layer"):
        InternS1ProTextDecoderLayer(layer_id=0, start_layer=0, config=None, quant_config=None, prefix="")


# Image requests, on the classes that serve them: token-id prompts with one placeholder (vision
# start, image, vision end) per image, which SGLang's processor expands to the image's merged
# patches (54 for 16x24 pixels, resized to SGLang's minimum of 3136). The text of the four
# requests is PROMPTS' without the vision ids. Request 1 is text only, request 2 has two images,
# and request 3 shares request 0's text and image up to the image's end: a cached prefix.
IMAGE_CLASSES = {"qwen3_vl", "qwen3_vl_moe"}
IMAGE_ID = VL_TOKENS["image_token_id"]
IMAGE = [VL_TOKENS["vision_start_token_id"], IMAGE_ID, VL_TOKENS["vision_end_token_id"]]
IMAGE_PREFIX = 5 + len(IMAGE)  # request 3's prefix shared with request 0, before expansion


def _image_requests() -> list:
    """[(input ids, images or None)] for the four image requests."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    a, b, c = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in [(16, 24), (24, 16), (8, 8)]
    ]
    text = [[t for t in p if t not in VL_TOKENS.values()] for p in PROMPTS[:4]]
    return [
        (text[0][:5] + IMAGE + text[0][5:], [a]),
        (text[1], None),
        (text[2][:3] + IMAGE + text[2][3:10] + IMAGE + text[2][10:], [b, c]),
        (text[0][:5] + IMAGE + text[3], [a]),
    ]


def _serve(engine, name: str) -> dict:
    # Batch 1 over the four prompts transformers checks, batch 4 over all eight.
    out = {1: engines.generate(engine, PROMPTS[:4], GREEDY, 1)}
    out[4] = engines.generate(engine, PROMPTS, GREEDY, 4)
    out["prefixed"] = [engines.generate(engine, [p], GREEDY, 1)[0] for p in PREFIXED]
    if name in IMAGE_CLASSES:  # one at a time, then the four together
        requests = _image_requests()
        one = [engine.generate(input_ids=i, image_data=m, sampling_params=GREEDY) for i, m in requests]
        together = engine.generate(
            input_ids=[i for i, _ in requests], image_data=[m for _, m in requests], sampling_params=GREEDY
        )
        out["images"] = {1: one, 4: together}
    return out


def _ids(outputs) -> list:
    return [o["output_ids"] for o in outputs]


# Checkpoints not built by `make_family_target`, and the folder each needs: SGLang recognises a
# Mistral-native checkpoint by its name.
BUILDERS = {
    "beam": make_beam_target,
    "mistral_large_3": make_mistral_large_3_target,
    "interns2_mobius": make_interns2_mobius_target,
}
FOLDERS = {"mistral_large_3": "class-Mistral-Large-3"}


def _target(tiny, name: str) -> str:
    family, seed, favour, _, _ = CLASSES[name]
    target = os.path.join(tiny.root, FOLDERS.get(name, f"class-{name}"))
    if os.path.isdir(target):
        return target
    if name in CONVERTERS:
        CONVERTERS[name](target, _target(tiny, CONVERTED_FROM[name]))
    else:
        make = BUILDERS.get(family, partial(make_family_target, family=family))
        make(target, seed=seed, favour=favour)
    return target


# Oracles that are not transformers' own class on the target's checkpoint: name -> f(target path).
ORACLES = {
    "nanbeige": nanbeige_unrolled,  # no transformers class: Llama with the loops unrolled
    "beam": BeamReference,  # no transformers class: a plain PyTorch forward
    "mimo_v2": mimo_v2_transformers,  # the same weights under transformers' own config
    "teleflm": teleflm_folded,  # no transformers class: Llama with the muP multipliers folded in
    "llama4": llama4_interleaved,  # transformers' class, on the q/k rows in its own RoPE's order
    # Transformers' class on the same weights, kept in its format beside the checkpoint.
    "mistral_large_3": partial(transformers_copy, cls="Mistral4ForCausalLM"),
    "interns2_mobius": partial(transformers_copy, cls="Qwen3_5MoeForConditionalGeneration"),  # banks repeated
}


def _oracle(tiny, name: str, target: str):
    """The reference forward of class `name`, with a greedy `generate`."""
    import transformers

    if name in ORACLES:
        return ORACLES[name](target)
    source = _target(tiny, CONVERTED_FROM[name]) if name in CONVERTED_FROM else target
    cls = getattr(transformers, TRANSFORMERS_CLASSES.get(name, "AutoModelForCausalLM"))
    return cls.from_pretrained(source, dtype=torch.float32).eval()


def _greedy(model, ids: torch.Tensor, **inputs) -> list:
    """The oracle's greedy ids after prompt `ids` [1, T]; `inputs` are its other model inputs."""
    with torch.no_grad():
        out = model.generate(
            ids,
            **inputs,
            max_new_tokens=GREEDY["max_new_tokens"],
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()


def _greedy_ids(model, prompts) -> list:
    return [_greedy(model, torch.tensor([prompt])) for prompt in prompts]


# `make test` serves the classes of the targets DFlash drafts are published for and the paths no
# other class takes: Gemma-4 (text and multimodal classes, sliding layers, the published draft
# config), gpt-oss (sinks), Qwen3-VL (images, the capture method its inner model lacks),
# Kimi-K2.5 (DeepSeek-V3's MLA and YaRN behind a multimodal wrapper), GLM-4-MoE-Lite (MLA with
# query LoRA) and MiMo-V2-Flash (a remote-code config class). The other classes run with
# --run-slow only (suite time: about a minute each on 2 cores).
FAST = {"gemma4", "gemma4_mm", "gpt_oss", "qwen3_vl", "kimi_k25", "glm4_moe_lite", "mimo_v2"}
SLOW = set(CLASSES) - FAST


def _params(names) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


@pytest.fixture(scope="module", params=_params(CLASSES))
def served(request, tiny):
    """(name, target path, plain outputs, DFLASH outputs, DFLASH server state), one class at a time."""
    name = request.param
    flags = CLASSES[name][3]
    target = _target(tiny, name)
    env = mock.patch.dict(os.environ, ENV.get(name, {}))
    with env:
        engine = engines.start(target, **flags)
    try:
        plain = _serve(engine, name)
    finally:
        engines.shutdown(engine)
    draft = tiny.draft("a")
    if name == "nanbeige":  # a loop model: the draft's depth is its 8 unrolled steps
        draft = tiny.edited_draft("a", "depth8", lambda c: c.update(num_target_layers=8))
    if name in LAST_LAYER_DRAFT:
        ids = {"target_layer_ids": [TEXT_SHAPE_A["num_hidden_layers"] - 1]}
        draft = tiny.edited_draft("a", "last-layer", lambda d: d["dflash_config"].update(ids))
    if name == "gemma4":  # as z-lab's Gemma-4 drafts are published: the head's soft-cap, window switches

        def gemma4_published(config):
            config["dflash_config"].update(ids)  # still reading layer L-1
            as_gemma4_published(config)

        draft = tiny.edited_draft("a", "gemma4-published", gemma4_published)
    # The draft's proposals per step, for the image requests' check against the reference draft.
    trace = os.path.join(tiny.root, f"proposals-{name}.jsonl")
    if name in IMAGE_CLASSES:
        if os.path.exists(trace):  # the worker appends
            os.remove(trace)
        env = mock.patch.dict(os.environ, {**ENV.get(name, {}), "SGLANG_DFLASH_TRACE_PROPOSALS": trace})
    with env:
        engine = engines.start(target, draft, fixed_width=True, **flags)
    try:
        engines.flush_cache(engine)
        dflash = _serve(engine, name)
        state = engines.server_state(engine)
    finally:
        engines.shutdown(engine)
    if name in IMAGE_CLASSES:
        dflash["proposals"] = engines.proposal_steps(trace)
    return name, target, plain, dflash, state


# Classes SGLang serves in bf16 whatever --dtype says: their tiny targets' top two logits are often
# closer than bf16's rounding (margins of 0.002 at logits of 3.3, where a bf16 step is 1/64), so
# which of the two an engine picks depends on the CPU's kernels. Their greedy ids are checked
# against the float32 oracle instead, token by token on their own prefix (`_unexplained`).
BF16 = {"mistral_large_3"}


def _unexplained(oracle, prompts, outputs) -> list[str]:
    """Each output's tokens, teacher-forced through the float32 oracle (one forward over prompt +
    output): a token that is neither the oracle's argmax after that output's own prefix nor within
    bf16 rounding of it (`lossless.is_near_tie`: two steps at the top logit's magnitude) is named."""
    from tests.gpu_kit.serve.lossless import is_near_tie

    found = []
    for i, (prompt, ids) in enumerate(zip(prompts, outputs)):
        with torch.no_grad():
            logits = oracle(torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1 :]  # [n, V]
        top = logits.max(-1).values  # [n]
        chosen = logits.gather(-1, torch.tensor(ids)[:, None])[:, 0]  # [n]
        for j in range(len(ids)):
            if not is_near_tie(float(top[j] - chosen[j]), abs(float(top[j])), "bfloat16"):
                found.append(f"prompt {i} token {j}: {ids[j]}, {float(top[j] - chosen[j]):.3f} below the top")
    return found


def test_the_plain_engine_matches_transformers(served, tiny):
    from sglang.srt.utils.hf_transformers.config import get_config

    name, target, plain, _, _ = served
    assert get_config(target, trust_remote_code=True).architectures == [ARCHITECTURES[name]]
    if name in BF16:
        assert not _unexplained(_oracle(tiny, name, target), PROMPTS[:4], _ids(plain[1])), name
        return
    for i, ids in enumerate(_greedy_ids(_oracle(tiny, name, target), PROMPTS[:4])):
        assert ids == plain[1][i]["output_ids"], f"{name}: prompt {i}"


@pytest.mark.parametrize("batch_size", [1, 4])
def test_dflash_is_greedy_lossless_and_accepts(served, batch_size, tiny):
    name, target, plain, dflash, state = served
    assert state["dflash_implementation"].startswith("sglang-dflash")
    got, want = _ids(dflash[batch_size]), _ids(plain[batch_size])
    if name in BF16:  # DFLASH's own tokens, each the target's up to bf16 rounding
        prompts = PROMPTS[: len(got)]
        assert not _unexplained(_oracle(tiny, name, target), prompts, got), name
    else:
        mismatches = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not mismatches, f"{name}: prompts {mismatches} differ"
    if batch_size == 4:  # the acceptance over all eight prompts
        meta = [o["meta_info"] for o in dflash[4]]
        accepted = sum(m["completion_tokens"] for m in meta) / sum(m["spec_verify_ct"] for m in meta)
        assert accepted > CLASSES[name][4], f"{name}: {accepted:.2f} tokens per verify"


def test_a_prefix_cache_round(served, tiny):
    name, target, plain, dflash, _ = served
    if name in BF16:
        assert not _unexplained(_oracle(tiny, name, target), PREFIXED, _ids(dflash["prefixed"])), name
    else:
        assert _ids(dflash["prefixed"]) == _ids(plain["prefixed"]), name
    # The second request reuses what the engine without speculation reuses: the shared prefix, or
    # on PARTIAL_PREFIX targets what SGLang's SWA or mamba radix cache keeps of it (nothing, on
    # these prompts, for some).
    cached = [o["meta_info"]["cached_tokens"] for o in dflash["prefixed"]]
    assert cached == [o["meta_info"]["cached_tokens"] for o in plain["prefixed"]], name
    if name not in PARTIAL_PREFIX:
        assert cached[1] >= len(SHARED_PREFIX) - 1


def _with_pixels(target: str, ids: list, images) -> tuple:
    """Transformers' inputs for an image request: (input ids [1, T] with each image placeholder
    expanded to its merged patches, generate's image kwargs), from the checkpoint's processor."""
    import transformers

    if images is None:
        return torch.tensor([ids]), {}
    processor = transformers.AutoProcessor.from_pretrained(target).image_processor
    pixels = processor(images=images, return_tensors="pt")
    merged = (pixels["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist()  # tokens per image
    expanded = []
    for t in ids:
        expanded += [t] * (merged.pop(0) if t == IMAGE_ID else 1)
    expanded = torch.tensor([expanded])
    mm_types = (expanded == IMAGE_ID).int()  # M-RoPE's text (0) and image (1) runs
    return expanded, dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                          mm_token_type_ids=mm_types)  # fmt: skip


@pytest.mark.parametrize("served", _params(sorted(IMAGE_CLASSES)), indirect=True)
def test_image_requests(served, tiny):
    """Qwen3-VL's image requests: the engine without speculation and DFLASH, one at a time and four
    together, equal transformers' greedy ids; the repeated image is a cached prefix in both; and
    DFLASH's draft proposes over the image what the reference draft proposes over transformers'
    hidden states (a wrong context of image features would lower acceptance, not change ids)."""
    name, target, plain, dflash, _ = served
    reference = pytest.importorskip(
        "dflash.model", reason="the z-lab reference: pip install --no-deps dflash"
    )
    model = _oracle(tiny, name, target)
    inputs = [_with_pixels(target, ids, images) for ids, images in _image_requests()]
    want = [_greedy(model, ids, **kw) for ids, kw in inputs]
    for engine, out in (("plain", plain), ("dflash", dflash)):
        for batch_size in (1, 4):
            got = _ids(out["images"][batch_size])
            assert got == want, (
                f"{engine} at batch {batch_size}: requests {[i for i in range(4) if got[i] != want[i]]}"
            )
    # Request 3 reuses request 0's text and image (the expanded image's tokens too).
    cached = [o["meta_info"]["cached_tokens"] for o in dflash["images"][1]]
    assert cached == [o["meta_info"]["cached_tokens"] for o in plain["images"][1]]
    expanded_prefix = IMAGE_PREFIX - 1 + int(inputs[0][1]["mm_token_type_ids"].sum())
    assert cached[3] >= expanded_prefix, cached

    # The draft's first block after request 0's prefill, against the reference draft.
    draft = reference.DFlashDraftModel.from_pretrained(tiny.draft("a"), dtype=torch.float32).eval()
    ids, kw = inputs[0]
    first = dflash["images"][1][0]
    block = torch.tensor([[first["output_ids"][0]] + [draft.mask_token_id] * (draft.block_size - 1)])
    with torch.no_grad():
        states = model(ids, **kw, output_hidden_states=True).hidden_states
        hidden = draft(
            position_ids=torch.arange(ids.shape[1] + draft.block_size)[None],
            noise_embedding=model.get_input_embeddings()(block),
            target_hidden=reference.extract_context_feature(states, draft.target_layer_ids),
        )
        proposals = model.lm_head(hidden)[0, 1:].argmax(-1).tolist()
    steps = dict(dflash["proposals"][first["meta_info"]["id"]])
    assert steps[ids.shape[1]] == proposals

"""docs/targets.md's table of every SGLang target class that captures DFlash features, generated from
SGLang's own model files so that it cannot drift.

A class is listed when SGLang can build it as a model (it is in a model file's `EntryClass`) and
it captures hidden states for a draft: it has `set_dflash_layers_to_capture`, defined or inherited
from another class of those files (what SGLang's built-in asks of a target), or only EAGLE-3's or
DSpark's capture method, which the built-in refuses and the plugin serves through on the classes
it has checked (`sglang_dflash/draft/target_capture.py`). The files are read with `ast`, not
imported (many need a GPU to import).

Each class's status is one of `STATUSES`, kept in `STATUS` below; a class SGLang adds and
`STATUS` lacks fails `tests/repo/test_targets_table.py`, as does a docs/targets.md whose table is
not this script's output.

    python scripts/targets_table.py           # print the table
    python scripts/targets_table.py --write   # rewrite it in docs/targets.md, between its markers
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import pathlib
from dataclasses import dataclass
from typing import Optional

from sglang_dflash.integration.unserved_targets import ANY_DEVICE, CPU_ENGINE_CANNOT_RUN

METHOD = "set_dflash_layers_to_capture"
# The other capture methods, by the name the table gives them.
OTHER_HOOKS = {"EAGLE-3": "set_eagle3_layers_to_capture", "DSpark": "set_dspark_layers_to_capture"}
BEGIN, END = "<!-- targets-table:begin -->", "<!-- targets-table:end -->"
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "targets.md"

STATUSES = {
    # tiny random targets on SGLang's CPU engine, against the engine without DFLASH or an oracle
    "cpu": "CPU-tested",
    "reasoned": "reasoned",  # its pool mapped and checked against SGLang's objects; not run
    "untested": "not run yet",  # should serve (it captures); no test has run it
    "refused": "refused on CPU",  # DFLASH on the CPU engine refuses it at start-up, naming why
    "refused-any": "refused",  # DFLASH refuses it at start-up on every device, naming why
    # no DFlash capture of its own, which SGLang's built-in refuses: the plugin's hook, CPU-tested
    "plugin": "CPU-tested, beyond the built-in",
    # no DFlash capture of its own: refused at start-up, naming why, as the built-in refuses it
    "no-capture": "refused (no DFlash capture)",
    "other": "not a target",  # a draft module (MTP, NextN, EAGLE) or an embedding model
}


def _rows(status: str, note: str, names: str) -> dict[str, tuple[str, str]]:
    """The same (status, note) for each whitespace-separated class name."""
    return dict.fromkeys(names.split(), (status, note))


# class -> (status, note). Notes name the test or the reason.
STATUS: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("cpu", "greedy, sampling, grammars, logprobs, serving paths"),
    "Qwen3MoeForCausalLM": ("cpu", "greedy; routed experts (`test_target_shapes.py`)"),
    "LlamaForCausalLM": ("cpu", "greedy; page size 16; draft window (`test_target_shapes.py`)"),
    "MistralForCausalLM": ("reasoned", "`LlamaForCausalLM` with no code of its own"),
    "Qwen3NextForCausalLM": ("cpu", "hybrid GDN: greedy, prefix cache, abort (`test_hybrid_targets.py`)"),
    "Qwen3_5ForCausalLM": ("cpu", "hybrid GDN: greedy, sampling, prefix cache (`test_hybrid_targets.py`)"),
    "Qwen3_5MoeForCausalLM": ("cpu", "hybrid GDN: greedy, prefix cache (`test_hybrid_targets.py`)"),
    "Qwen3_5ForConditionalGeneration": ("cpu", "text requests (`test_hybrid_targets.py`)"),
    "Qwen3_5MoeForConditionalGeneration": ("cpu", "text requests (`test_hybrid_targets.py`)"),
    "GptOssForCausalLM": (
        "cpu",
        "sinks (`cpu/paged_attention.py`), SWA pool, MoE; greedy, prefix cache (`test_target_classes.py`)",
    ),
    "Gemma4ForCausalLM": ("cpu", "SWA pool; greedy, prefix cache (`test_target_classes.py`)"),
    "Gemma4ForConditionalGeneration": (
        "cpu",
        "`Gemma4ForCausalLM`'s text model behind a vision tower, tied head; text requests with a draft "
        "reading L-1, greedy, prefix cache (`test_target_classes.py`)",
    ),
    "Qwen3VLForConditionalGeneration": (
        "cpu",
        "text and image requests (M-RoPE positions, an image as a cached prefix); SGLang's capture method "
        "completed (`test_target_classes.py`)",
    ),
    "Qwen3VLMoeForConditionalGeneration": (
        "cpu",
        "a subclass of `Qwen3VLForConditionalGeneration` (the same capture fix) with Qwen3-MoE's layers, "
        "fused expert tensors as published; text and image requests (`test_target_classes.py`)",
    ),
    **_rows(
        "reasoned",
        "a `LlamaForCausalLM` subclass with no code of its own (Phi-3 served lossless in a one-off CPU run)",
        "Phi3ForCausalLM InternLM3ForCausalLM IQuestCoderForCausalLM",
    ),
    "DeepseekV3ForCausalLM": (
        "cpu",
        "MLA pool (absorbed on torch_native, `cpu/bootstrap.py`), YaRN RoPE, MoE; greedy, prefix cache "
        "(`test_target_classes.py`)",
    ),
    "Glm4MoeLiteForCausalLM": (
        "cpu",
        "MLA pool, query LoRA, plain RoPE (`cpu/bootstrap.py`), MoE; greedy, prefix cache "
        "(`test_target_classes.py`)",
    ),
    "DeepseekV2ForCausalLM": ("reasoned", "`DeepseekV3ForCausalLM` is this class with no code of its own"),
    "KimiK25ForConditionalGeneration": (
        "cpu",
        "captures through its text model, SGLang's `DeepseekV3ForCausalLM` (MLA pool); text requests, the "
        "weights under `language_model.`, greedy (the plain engine against transformers' DeepSeek-V3), "
        "prefix cache (`test_target_classes.py`)",
    ),
    "NanbeigeForCausalLM": (
        "cpu",
        "a loop model: its layers run twice, the draft's ids count the unrolled steps as SGLang counts "
        "them; greedy, prefix cache (`test_target_classes.py`)",
    ),
    "LagunaForCausalLM": (
        "cpu",
        "SWA pool, attention gates, partial RoPE, MoE; greedy, prefix cache (`test_target_classes.py`)",
    ),
    "MuseGlimmerForConditionalGeneration": (
        "cpu",
        "SWA pool, a full layer without RoPE, attention gates, soft-capped logits; text requests on "
        "transformers' checkpoint: greedy, prefix cache (`test_target_classes.py`)",
    ),
    "MuseGlimmerForCausalLM": (
        "cpu",
        "SWA pool; the same weights in SGLang's names and flat config: greedy, prefix cache "
        "(`test_target_classes.py`, with `--run-slow`: its subclass above runs by default)",
    ),
    "BeamForCausalLM": (
        "cpu",
        "SWA pool, a full layer without RoPE (SSMax), attention gates, sandwich norms, grouped MoE, a bf16 "
        "LM head; a checkpoint in SGLang's names against a PyTorch forward: greedy, prefix cache "
        "(`test_target_classes.py`)",
    ),
    # Refused on the CPU engine (`integration/unserved_targets.py`), with its reason; not run on a GPU yet.
    **{name: ("refused", reason) for name, reason in CPU_ENGINE_CANNOT_RUN.items()},
    **{name: ("refused-any", reason) for name, reason in ANY_DEVICE.items()},
    "InternS2PreviewForConditionalGeneration": (
        "reasoned",
        "`Qwen3_5MoeForConditionalGeneration` with no code of its own (SGLang's config class of its own)",
    ),
    "Cosmos3ForConditionalGeneration": (
        "cpu",
        "a `Qwen3VLForConditionalGeneration` subclass (its capture completed the same way) whose weights "
        "load from `transformer/` and `vision_encoder/` folders in Cosmos 3's names; text requests, "
        "greedy (the plain engine against transformers' Qwen3-VL), prefix cache (`test_target_classes.py`)",
    ),
    "InternS2MobiusForConditionalGeneration": (
        "cpu",
        "Qwen3.5-MoE's hybrid layers with routed-expert banks shared across layers, a strict loader; on "
        "CPU its MoE runner kept at `auto` (`cpu/bootstrap.py`); text requests, greedy (the plain "
        "engine against transformers' Qwen3.5-MoE), prefix cache (`test_target_classes.py`)",
    ),
    "Gemma4UnifiedForConditionalGeneration": (
        "cpu",
        "`Gemma4TextModel` (as `Gemma4ForCausalLM`) behind an encoder-free image embedder, tied head; text "
        "requests with a draft reading L-1, greedy, prefix cache "
        "(`test_target_classes.py`)",
    ),
    "MiMoV2FlashForCausalLM": (
        "cpu",
        "with the checkpoint's own config class (`--trust-remote-code`): SWA pool with sinks, a smaller V "
        "head, partial RoPE, MoE; a draft reading L-1; greedy, prefix cache (`test_target_classes.py`). "
        "Refused on every device with transformers' own config class, whose per-layer RoPE settings "
        "SGLang's layers cannot read (`integration/unserved_targets.py`)",
    ),
    "MiMoV2ForCausalLM": ("reasoned", "`MiMoV2FlashForCausalLM` is this class with no code of its own"),
    **_rows(
        "untested", "its fp8 KV cache needs AMX on SGLang's CPU engine", "MuseSparkForConditionalGeneration"
    ),
    **_rows(
        "untested",
        "CUDA-only in SGLang: on the CPU engine SGLang's own server-args resolution stops it, without naming "
        "why (`model_hook.py` queries the CUDA device for its DSA sparse attention, whose indexer runs on "
        "deep_gemm and flashmla)",
        "DeepseekV32ForCausalLM GlmMoeDsaForCausalLM Glm5NextForConditionalGeneration",
    ),
    "InklingForConditionalGeneration": (
        "untested",
        "CUDA-only in SGLang: on the CPU engine SGLang's own server-args resolution stops it, without naming "
        "why (it pins the extra-buffer mamba cache, which the CPU platform lacks; its attention runs on fa4 "
        "or Triton only)",
    ),
    "Llama4ForCausalLM": (
        "cpu",
        "dense layers only (Llama's loader reads no fused experts; SGLang loads them in the multimodal "
        "wrapper, `mllama4.py`), NoPE layers with position-scaled queries, NeoX RoPE: a checkpoint's q/k "
        "rows in NeoX order, where transformers' Llama-4 rotates interleaved pairs; on CPU its RoPE made "
        "to write in place (`cpu/bootstrap.py`); greedy, prefix cache "
        "(`test_target_classes.py`)",
    ),
    "MellumForCausalLM": (
        "cpu",
        "a `Qwen3MoeForCausalLM` subclass: SWA pool, RoPE per layer type, dense then MoE layers; greedy, "
        "prefix cache (`test_target_classes.py`)",
    ),
    "Ministral3ForCausalLM": (
        "cpu",
        "a `LlamaForCausalLM` subclass: queries scaled by position (`llama_4_scaling_beta`, with the period "
        "SGLang reads from the flat `original_max_position_embeddings`), YaRN; greedy, "
        "prefix cache (`test_target_classes.py`)",
    ),
    "MistralLarge3ForCausalLM": (
        "cpu",
        "`DeepseekV3ForCausalLM` (MLA) read from a Mistral-native checkpoint (`params.json`, "
        "`consolidated.safetensors`, recognised by the folder's name), softmax-routed MoE, YaRN, queries "
        "scaled by position (`llama_4_scaling`); served in bf16 whatever `--dtype` says; greedy, prefix "
        "cache (`test_target_classes.py`)",
    ),
    "TeleFLMForCausalLM": (
        "cpu",
        "a `LlamaForCausalLM` subclass with muP (`input_mult`, `output_mult / mup_scale_factor`); greedy "
        "against Llama with the multipliers folded in, prefix cache (`test_target_classes.py`)",
    ),
    "Lfm2BidirectionalModel": ("other", "an embedding model (bidirectional): nothing to decode"),
    # Classes with only an EAGLE-3 or DSpark capture (`sglang_dflash/draft/target_capture.py`).
    "Qwen2ForCausalLM": (
        "plugin",
        "its EAGLE-3 capture; greedy, prefix cache, features = transformers' (`test_captured_targets.py`)",
    ),
    "Qwen2MoeForCausalLM": (
        "plugin",
        "its EAGLE-3 capture; shared-expert gate on CPU (`cpu/triton_ops.py`); "
        "greedy, prefix cache, features (`test_captured_targets.py`)",
    ),
    "Glm4MoeForCausalLM": (
        "plugin",
        "GLM-4.5/4.6/4.7: its EAGLE-3 capture; partial RoPE, grouped MoE; greedy, "
        "prefix cache, features (`test_captured_targets.py`)",
    ),
    "MiniMaxM2ForCausalLM": (
        "plugin",
        "MiniMax-M2/M2.5/M2.7: its EAGLE-3 capture; the q/k norm's PyTorch "
        "stand-in on CPU (`cpu/triton_ops.py`); greedy, prefix cache, features "
        "(`test_captured_targets.py`)",
    ),
    "Gemma3ForCausalLM": (
        "plugin",
        "its own capture records the MLP branch without the residual: the plugin "
        "records the residual stream; SWA pool; greedy, features "
        "(`test_captured_targets.py`)",
    ),
    **_rows(
        "no-capture",
        "an EAGLE-3 capture of the same residual stream by reading (`capture-hooks` study); no test has "
        "checked it against transformers, so it is refused until one does",
        "ApertusForCausalLM BailingMoEForCausalLM BailingMoeForCausalLM BailingMoeV2ForCausalLM "
        "ExaoneMoEForCausalLM ExaoneMoeForCausalLM LongcatFlashForCausalLM MiniMaxM3SparseForCausalLM "
        "Qwen2_5_VLForConditionalGeneration SarvamMoEForCausalLM",
    ),
    "Llama4ForConditionalGeneration": (
        "no-capture",
        "its EAGLE-3 capture calls its `Llama4ForCausalLM`'s, which has DFlash's; not delegated yet",
    ),
    "Gemma3ForConditionalGeneration": (
        "no-capture",
        "`Gemma3ForCausalLM`'s wrong capture, behind a vision "
        "tower; the plugin's residual-stream hook is not delegated to it yet",
    ),
    **_rows(
        "no-capture",
        "a DSpark capture of the layer outputs, on Kimi Delta Attention (Triton, GPU-only), whose state "
        "rollback after a verify the plugin has not checked",
        "BailingMoeV3ForCausalLM KimiLinearForCausalLM",
    ),
    "DeepseekV4ForCausalLM": (
        "no-capture",
        "its DSpark capture records the mean of the four hyper-connection "
        "streams; the published DFlash draft (Speculators format) reads all four",
    ),
    "MindSporeForCausalLM": ("no-capture", "its model runs in MindSpore, outside SGLang (NPU)"),
    "EmbeddingGemmaModel": ("other", "an embedding model: nothing to decode"),
    **_rows(
        "other",
        "a draft module (MTP, NextN, EAGLE)",
        "DeepseekV4ForCausalLMNextN ExaoneMoEForCausalLMMTP Glm4MoeForCausalLMNextN "
        "LongcatFlashForCausalLMNextN Qwen2ForCausalLMEagle",
    ),
    **_rows(
        "other",
        "a draft module (MTP, NextN, EAGLE) that inherits its target's method",
        "DeepseekV3ForCausalLMNextN Gemma4AssistantForCausalLM Gemma4UnifiedAssistantForCausalLM "
        "GlmMoeDsaForCausalLMNextN Glm4MoeLiteForCausalLMNextN Glm5NextForConditionalGenerationNextN "
        "LlamaForCausalLMEagle LlamaForCausalLMEagle3 MiMoV2MTP MistralForCausalLMEagle "
        "MistralLarge3ForCausalLMEagle NemotronHForCausalLMMTP Qwen3MoeForCausalLMMTP "
        "Qwen3NextForCausalLMMTP",
    ),
}


@dataclass(frozen=True)
class TargetClass:
    name: str
    module: str  # the file under sglang/srt/models, without .py
    defines: Optional[str]  # the class that defines the method (itself or an ancestor)
    hook: str = "DFlash"  # the capture method it has: DFlash's, or else EAGLE-3's or DSpark's


def models_dir() -> pathlib.Path:
    return pathlib.Path(importlib.util.find_spec("sglang.srt.models").submodule_search_locations[0])


def _entry_names(node: ast.Assign) -> list[str]:
    value = node.value
    items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    return [item.id for item in items if isinstance(item, ast.Name)]


def _base_name(base: ast.expr) -> Optional[str]:
    if isinstance(base, ast.Name):
        return base.id
    return base.attr if isinstance(base, ast.Attribute) else None


def capturing_classes(root: Optional[pathlib.Path] = None) -> list[TargetClass]:
    """SGLang's entry classes with a capture method, defined or inherited (by base-class name
    across the model files): DFlash's, or else EAGLE-3's or DSpark's; sorted by module then name."""
    classes: dict[str, tuple[str, list[str], set]] = {}  # name -> (module, bases, methods defined)
    entries: dict[str, str] = {}  # entry class -> module
    for file in sorted((root or models_dir()).glob("*.py")):
        tree = ast.parse(file.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                bases = [name for name in map(_base_name, node.bases) if name]
                classes.setdefault(node.name, (file.stem, bases, methods))
            elif isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "EntryClass" for t in node.targets
            ):
                entries.update(dict.fromkeys(_entry_names(node), file.stem))

    def definer(name: str, method: str, seen: frozenset = frozenset()) -> Optional[str]:
        if name not in classes or name in seen:
            return None
        _, bases, methods = classes[name]
        if method in methods:
            return name
        return next((d for d in (definer(b, method, seen | {name}) for b in bases) if d), None)

    def found(name: str, module: str) -> Optional[TargetClass]:
        for hook, method in {"DFlash": METHOD, **OTHER_HOOKS}.items():
            defines = definer(name, method)
            if defines:
                return TargetClass(name, module, defines, hook)
        return None

    listed = [found(name, module) for name, module in entries.items()]
    return sorted((c for c in listed if c), key=lambda c: (c.module, c.name))


def table(classes: list[TargetClass]) -> str:
    """The markdown table (every class must have a `STATUS`)."""
    lines = ["| SGLang class | Model file | Capture | Status | Notes |", "| --- | --- | --- | --- | --- |"]
    for c in classes:
        status, note = STATUS[c.name]
        lines.append(f"| `{c.name}` | `{c.module}.py` | {c.hook} | {STATUSES[status]} | {note} |")
    counts = {label: sum(STATUS[c.name][0] == key for c in classes) for key, label in STATUSES.items()}
    summary = ", ".join(f"{n} {label}" for label, n in counts.items())
    return "\n".join([f"{len(classes)} classes: {summary}.", "", *lines])


def marked_block(text: str) -> str:
    """What `text` holds between the table's markers."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/targets.md")
    args = parser.parse_args()
    generated = table(capturing_classes())
    if not args.write:
        print(generated)
        return
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + generated + "\n" + text[end:])
    print(f"{DOC.name}: {len(generated.splitlines()) - 4} classes")


if __name__ == "__main__":
    main()

"""DFLASH server-argument resolution for this package's worker.

Replaces SGLang's `_handle_dflash` while sglang-dflash serves DFLASH. It keeps what that
function decides (one draft step, top-k 1, the verify width B, 48 running requests by default),
drops its device check (CPU is supported here), and validates the draft checkpoint against the
target in the launching process, so a bad checkpoint fails before any subprocess starts, with
an error that names the field and the value.

See docs/serving.md.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from sglang_dflash import knobs
from sglang_dflash.checkpoint.config import (
    ALLOW_OTHER_TARGET,
    CheckpointError,
    DFlashDraftConfig,
    resolve_checkpoint_dir,
)
from sglang_dflash.checkpoint.mask_token import resolve_mask_token_id
from sglang_dflash.integration import unserved_targets
from sglang_dflash.knobs import Knobs

logger = logging.getLogger(__name__)

SOURCE = "sglang_dflash.handle_dflash_server_args"
# The draft block of a checkpoint without `block_size` and without --speculative-num-draft-tokens
# (SGLang 0.5.23: arg_groups/speculative_hook.py).
DEFAULT_BLOCK_SIZE = 16


def handle_dflash_server_args(server_args) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.runtime_context import attn_dp_enabled_of

    # Every environment variable, parsed and checked here in the launching process, whatever the
    # device: a bad value fails the launch (`knobs.py`; the schedulers inherit this environment).
    Knobs.from_env()
    cfg = resolving_view(server_args)
    if not (cfg.device.startswith("cuda") or cfg.device == "cpu"):
        raise ValueError(
            f"sglang-dflash serves DFLASH on 'cuda' and 'cpu', not on device {cfg.device!r}; "
            "set SGLANG_DFLASH_IMPL=builtin to use SGLang's built-in DFLASH"
        )
    # Tensor parallelism is served (the draft is sharded like the target); these are not.
    attn_cp_size = int(getattr(cfg, "attn_cp_size", 1) or 1)
    for setting, ok, why in (
        (f"pp_size={cfg.pp_size}", cfg.pp_size == 1, "SGLang's DFLASH is pp_size 1 only"),
        (
            "enable_dp_attention",
            not attn_dp_enabled_of(cfg),
            "the draft is sharded over the whole TP group; DP attention is not built here "
            "(SGLang 0.5.23 allows it for DFLASH on CUDA with --enable-dp-lm-head only)",
        ),
        (f"attn_cp_size={attn_cp_size}", attn_cp_size == 1, "context parallelism is not built here"),
        ("enable_watermark", not cfg.enable_watermark, "SGLang refuses it with DFLASH too"),
        # Prefill/decode disaggregation and HiCache carry the draft's K/V
        # (`draft_pool.DraftKVPool`); these offloads do not: drafts after a reload would see
        # stale context, and acceptance would drop without a word.
        *(
            (
                flag,
                not getattr(cfg, flag),
                "it offloads and reloads the target's K/V but not this package's draft K/V, so "
                "drafts after a reload would see stale context",
            )
            for flag in (
                "enable_lmcache",
                "disaggregation_decode_enable_offload_kvcache",
            )
        ),
    ):
        if not ok:
            raise ValueError(
                f"sglang-dflash does not support {setting} with DFLASH: {why}; "
                "set SGLANG_DFLASH_IMPL=builtin to use SGLang's built-in DFLASH"
            )
    if cfg.speculative_draft_model_path is None:
        raise ValueError("DFLASH speculative decoding requires --speculative-draft-model-path")

    for field in ("speculative_num_steps", "speculative_eagle_topk"):
        value = getattr(cfg, field)
        if value is not None and int(value) != 1:
            logger.warning("DFLASH uses %s=1; overriding %s", field, value)
        declare_resolution(server_args, SOURCE, **{field: 1})

    num_draft_tokens = cfg.speculative_num_draft_tokens
    alias = cfg.speculative_dflash_block_size
    if alias is not None:
        if num_draft_tokens is not None and int(num_draft_tokens) != int(alias):
            raise ValueError(
                f"--speculative-num-draft-tokens {num_draft_tokens} and --speculative-dflash-block-size "
                f"{alias} must agree"
            )
        num_draft_tokens = alias

    path = resolve_checkpoint_dir(cfg.speculative_draft_model_path, cfg.speculative_draft_model_revision)
    # A checkpoint without block_size drafts blocks of B, else of 16, as SGLang's built-in does.
    default_block = int(num_draft_tokens) if num_draft_tokens is not None else DEFAULT_BLOCK_SIZE
    draft = DFlashDraftConfig.from_pretrained(path, default_block_size=default_block)
    if not draft.declares_block_size:
        logger.info("DFLASH draft config has no block_size: drafting blocks of %d tokens", default_block)
    _check_tensor_parallel(int(cfg.tp_size), draft)
    _check_draft_window(cfg.speculative_draft_window_size, cfg.speculative_draft_sink_size, draft.block_size)

    if num_draft_tokens is None:
        num_draft_tokens = draft.block_size
    draft.check_num_draft_tokens(int(num_draft_tokens))
    declare_resolution(server_args, SOURCE, speculative_num_draft_tokens=int(num_draft_tokens))

    _check_target(cfg, draft, path)
    _check_grammar_backend(cfg.grammar_backend, cfg.reasoning_parser)

    if cfg.max_running_requests is None:
        declare_resolution(server_args, SOURCE, max_running_requests=48)


def _check_tensor_parallel(tp_size: int, draft: DFlashDraftConfig) -> None:
    """The draft is sharded like the target (`draft/tensor_parallel.py`): its heads, KV heads and MLP
    columns must divide by the TP size; the error names both numbers."""
    from sglang_dflash.draft.tensor_parallel import TensorParallel

    tp = TensorParallel(size=tp_size)
    tp.split(draft.num_attention_heads, "attention heads")
    tp.split(draft.num_key_value_heads, "KV heads")
    tp.split(draft.intermediate_size, "MLP columns (intermediate_size)")


def _check_draft_window(window, sink, block_size: int) -> None:
    """`--speculative-draft-window-size W`: the draft attends to the last W committed tokens
    plus its block (`block.context_window`). A window shorter than the draft's block would hide
    context that the block itself spans, so, as SGLang's built-in DFLASH does, it is refused."""
    if window is not None and int(window) < block_size:
        raise ValueError(
            f"--speculative-draft-window-size {window} is below the DFLASH draft's block size "
            f"{block_size}; use a window of at least {block_size} tokens"
        )
    if sink is not None:
        raise ValueError(
            "--speculative-draft-sink-size is not supported with DFLASH (the draft keeps no attention "
            "sink); use --speculative-draft-window-size alone"
        )


def draft_load_format(speculative_draft_load_format: Optional[str], load_format: str) -> str:
    """The draft's load format, resolved as SGLang resolves its built-in draft's:
    --speculative-draft-load-format, else --load-format. "dummy" builds random weights from the
    draft's config.json alone (benchmarks), as for the target."""
    return speculative_draft_load_format or load_format


def _check_target(cfg, draft: DFlashDraftConfig, path: str) -> None:
    """The pairing checks that need the target's config and model class, and the draft's
    weights against the network its config and the target describe."""
    from sglang.srt.utils.hf_transformers_utils import get_config

    from sglang_dflash.draft import target_capture
    from sglang_dflash.draft.model import DFlashDraftModel
    from sglang_dflash.draft.target_features import captures_after_last_layer, target_depth

    target = get_config(
        cfg.model_path,
        trust_remote_code=cfg.trust_remote_code,
        revision=cfg.revision,
        model_override_args=json.loads(cfg.json_model_override_args),
    )
    text = target.get_text_config() if hasattr(target, "get_text_config") else target
    if draft.mask_token_id is None:  # resolved here too, so a bad one fails before any subprocess
        draft = resolve_mask_token_id(draft, _target_tokenizer(cfg), int(text.vocab_size))
    draft = draft.with_target_vocab(int(text.vocab_size))
    arch, model_cls = _target_model_class(target)
    depth = target_depth(text)
    layer_ids = draft.check_target(
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        num_layers=depth,
        after_last_layer=captures_after_last_layer(model_cls),
    )
    _check_made_for(draft, depth, text)
    dummy = draft_load_format(cfg.speculative_draft_load_format, cfg.load_format) == "dummy"
    if not dummy:  # dummy weights come from config.json alone: no weights to check
        DFlashDraftModel.check_checkpoint(path, draft, len(layer_ids))

    capture = target_capture.refusal(model_cls, bool(cfg.enable_two_batch_overlap))
    if capture is not None:
        raise CheckpointError(f"target architecture {arch!r} {capture}")
    reason = unserved_targets.refusal(model_cls, text, cfg.device)
    if reason is not None:
        raise ValueError(f"sglang-dflash cannot serve target {arch!r} {reason}")


def _check_made_for(draft: DFlashDraftConfig, depth: int, text) -> None:
    """A draft whose config names another target (its depth, or a plain draft's vocabulary) is
    refused, where SGLang's built-in only warns: it would serve, proposing from features it was
    not trained on. SGLANG_DFLASH_ALLOW_OTHER_TARGET=1 serves it with that warning."""
    allow = knobs.value(ALLOW_OTHER_TARGET)
    loops = depth // int(text.num_hidden_layers)
    found = draft.check_made_for(
        num_layers=depth, vocab_size=int(text.vocab_size), loops=loops, allow_other_target=allow
    )
    if found:
        logger.warning(
            "DFLASH draft made for another target, served (%s=1): %s", ALLOW_OTHER_TARGET, "; ".join(found)
        )


# SGLang's grammar backends and the package each imports (constrained/base_grammar_backend.py).
GRAMMAR_BACKEND_PACKAGES = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines": "outlines"}


def _check_grammar_backend(name, reasoning_parser) -> None:
    """A backend whose package is missing fails here, in one line, instead of as an import error
    in the scheduler process after the model has loaded. So does outlines under a reasoning
    parser: DFLASH walks each verify window through the matcher and undoes the walk, and
    SGLang's reasoning wrapper undoes it with the inner grammar's rollback, which outlines lacks
    (`propose/grammar.py` restores a bare outlines matcher by saving its state instead)."""
    import importlib.util

    package = GRAMMAR_BACKEND_PACKAGES.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(
            f"--grammar-backend {name}: the {package!r} package is not installed "
            f"(pip install {package}, or choose another backend; SGLang's default is xgrammar)"
        )
    if name == "outlines" and reasoning_parser:
        raise ValueError(
            f"--grammar-backend outlines with --reasoning-parser {reasoning_parser} is not supported "
            "with DFLASH (its grammars cannot be rolled back inside the reasoning wrapper); "
            "use --grammar-backend xgrammar or llguidance"
        )


def _target_tokenizer(cfg):
    """The target's tokenizer as SGLang's workers load it (None under --skip-tokenizer-init)."""
    if cfg.skip_tokenizer_init:
        return None
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    return get_tokenizer(
        cfg.tokenizer_path,
        tokenizer_mode=cfg.tokenizer_mode,
        trust_remote_code=cfg.trust_remote_code,
        revision=cfg.revision,
        tokenizer_backend=cfg.tokenizer_backend,
    )


def _target_model_class(target) -> tuple[str, type]:
    """The SGLang model class for the target, importing as little as possible: SGLang names
    most model modules after the config's model_type; only otherwise load the whole registry."""
    import importlib

    architectures = list(getattr(target, "architectures", None) or [])
    arch = architectures[0] if architectures else None
    try:
        module = importlib.import_module(f"sglang.srt.models.{target.model_type}")
    except ImportError:
        module = None
    if arch is not None and isinstance(getattr(module, arch, None), type):
        return arch, getattr(module, arch)
    from sglang.srt.models.registry import ModelRegistry

    model_cls, arch = ModelRegistry.resolve_model_cls(architectures)
    return arch, model_cls

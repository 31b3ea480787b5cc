"""The SGLang plugin entry point (group `sglang.srt.plugins`).

SGLang calls `register()` in every process it starts, and swallows any error it raises, so
`register()` only records hooks (cheap, idempotent) and everything heavy happens inside them:

* AROUND `SpeculativeAlgorithm.create_worker`: DFLASH gets `DFlashWorker`. Because the
  algorithm keeps its built-in name, SGLang still does its DFLASH-specific set-up: capturing the
  target's hidden states, budgeting the draft KV per token, reserving verify slots.
* AROUND `_handle_dflash`: DFLASH argument resolution that accepts CPU and validates the draft
  checkpoint early (`server_args.py`).

Hooks that only matter inside the scheduler are installed by `install_scheduler_hooks()`, from
the `create_worker` hook, so the other processes never import their targets.

`SGLANG_DFLASH_IMPL=builtin` hands DFLASH back to SGLang's built-in worker.
"""

from __future__ import annotations

import logging
import os

from sglang_dflash import IMPL_NAME

logger = logging.getLogger(__name__)

IMPL_ENV = "SGLANG_DFLASH_IMPL"
BUILTIN = "builtin"
_registered = False
_scheduler_hooks_installed = False


def use_builtin() -> bool:
    value = os.environ.get(IMPL_ENV, IMPL_NAME).strip().lower()
    if value not in (IMPL_NAME, BUILTIN):
        raise ValueError(f"{IMPL_ENV} must be {IMPL_NAME!r} or {BUILTIN!r}, got {value!r}")
    return value == BUILTIN


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker", _create_worker, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.arg_groups.speculative_hook._handle_dflash", _handle_dflash, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias",
        _resolve_algorithm_alias,
        HookType.AROUND,
    )
    _install_excepthook()


def _create_worker(original, self, server_args):
    if not self.is_dflash():
        return original(self, server_args)
    install_scheduler_hooks()
    if use_builtin():
        logger.info("DFLASH is served by SGLang's built-in worker (%s=%s)", IMPL_ENV, BUILTIN)
        return original(self, server_args)
    from sglang_dflash.worker import DFlashWorker

    return DFlashWorker


def _resolve_algorithm_alias(original, algorithm, *args, **kwargs):
    # SGLang reads the draft's config here to detect Gemma-4 drafts, which never concern
    # DFLASH; skipping it lets `handle_dflash_server_args` report checkpoint problems itself.
    if algorithm == "DFLASH" and not use_builtin():
        return algorithm
    return original(algorithm, *args, **kwargs)


def _handle_dflash(original, server_args):
    if use_builtin():
        return original(server_args)
    from sglang_dflash.server_args import handle_dflash_server_args

    return handle_dflash_server_args(server_args)


def _install_excepthook() -> None:
    """`python -m sglang.launch_server` with a bad draft checkpoint prints our one-line error
    instead of a traceback through SGLang's argument resolution."""
    import sys

    from sglang_dflash.config import CheckpointError

    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if issubclass(kind, CheckpointError):
            print(f"error: {value}", file=sys.stderr)
        else:
            previous(kind, value, traceback)

    sys.excepthook = excepthook


def install_scheduler_hooks() -> None:
    """Hooks whose targets live in the scheduler process; applied on first call."""
    global _scheduler_hooks_installed
    if _scheduler_hooks_installed:
        return
    _scheduler_hooks_installed = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_dflash import metrics
    from sglang_dflash.cpu import verify_attention

    HookRegistry.register(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        verify_attention.forward_extend,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
        verify_attention.run_sdpa_forward_extend,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_speculative",
        _add_speculative_state,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.speculative.dflash_utils.validate_dflash_request", _validate_request, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
        _keep_stateful_requests_unmixed,
        HookType.AROUND,
    )
    # Acceptance metrics, counted where SGLang settles each step (see metrics.py).
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.batch_result_processor."
        "SchedulerBatchResultProcessor._resolve_spec_v2_tokens",
        metrics.resolve_spec_tokens_hook,
        HookType.AROUND,
    )
    HookRegistry.apply_hooks()


def _validate_request(original, req, *args, **kwargs):
    if use_builtin():
        return original(req, *args, **kwargs)
    # Ours replaces the built-in's check, which refuses what this worker serves (hidden states
    # under overlap scheduling).
    from sglang_dflash.admission import disarm, unsupported_feature

    reason = unsupported_feature(req)
    if reason is not None:
        disarm(req)
    return reason


def _keep_stateful_requests_unmixed(original, self, *args, **kwargs):
    """With --enable-mixed-chunk, SGLang mixes running decode requests into a prefill batch,
    where its own sampler draws their next token. For requests whose sampling depends on state
    only our worker keeps (penalties, custom logit processors: `admission.needs_own_sampling`)
    that token would be wrong, so while such a request runs, prefill batches are not mixed, the
    way SGLang itself never mixes requests that return logprobs."""
    from sglang_dflash.admission import needs_own_sampling

    running = kwargs.get("running_batch", args[-1] if args else None)
    if (
        not self.is_mixed_chunk
        or not self.spec_algorithm.is_dflash()
        or use_builtin()
        or not any(needs_own_sampling(req) for req in running.reqs)
    ):
        return original(self, *args, **kwargs)
    self.is_mixed_chunk = False
    try:
        return original(self, *args, **kwargs)
    finally:
        self.is_mixed_chunk = True


def _add_speculative_state(original, self, state):
    """Server info (`/server_info`, `Engine.get_server_info()`) names the DFLASH implementation."""
    original(self, state)
    scheduler = self.scheduler
    if scheduler.spec_algorithm.is_dflash():
        worker = scheduler.draft_worker
        info = getattr(worker, "server_info", None)
        state["dflash_implementation"] = info() if info is not None else BUILTIN

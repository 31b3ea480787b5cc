"""The SGLang plugin entry point (group `sglang.srt.plugins`).

SGLang calls `register()` in every process it starts, and swallows any error it raises, so
`register()` only records hooks (cheap, idempotent) and everything heavy happens inside them:

* AROUND `SpeculativeAlgorithm.create_worker`: DFLASH gets `DFlashWorker`. Because the
  algorithm keeps its built-in name, SGLang still does its DFLASH-specific set-up: capturing the
  target's hidden states, budgeting the draft KV per token, reserving verify slots.
* AROUND `_handle_dflash`: DFLASH argument resolution that accepts CPU and validates the draft
  checkpoint early (`integration/server_args.py`).

Hooks that only matter inside the scheduler (`integration/scheduler_hooks.py`) are installed from the
`create_worker` hook, so the other processes never import their targets.

`SGLANG_DFLASH_IMPL=builtin` hands DFLASH back to SGLang's built-in worker.

See README.md ("Install and use").
"""

from __future__ import annotations

import logging

from sglang_dflash.knobs import BUILTIN, KnobError, use_builtin

IMPL_ENV = "SGLANG_DFLASH_IMPL"

logger = logging.getLogger(__name__)

__all__ = ["register", "use_builtin", "IMPL_ENV"]
_registered = False


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
    from sglang_dflash.integration.scheduler_hooks import install_scheduler_hooks

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
    from sglang_dflash.integration.server_args import handle_dflash_server_args

    return handle_dflash_server_args(server_args)


def _install_excepthook() -> None:
    """`python -m sglang.launch_server` with a bad draft checkpoint or a bad environment variable
    (`knobs.py`) prints our one-line error instead of a traceback through SGLang's argument
    resolution."""
    import sys

    from sglang_dflash.checkpoint.config import CheckpointError

    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if issubclass(kind, (CheckpointError, KnobError)):
            print(f"error: {value}", file=sys.stderr)
        else:
            previous(kind, value, traceback)

    sys.excepthook = excepthook

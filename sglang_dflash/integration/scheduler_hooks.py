"""The hooks whose targets live in SGLang's scheduler process, installed once by the plugin's
`create_worker` hook (`plugin.py`) before the worker is built:

* TARGET_VERIFY on the CPU engine's `torch_native` attention (`cpu/verify_attention.py`).
* The target's hidden-state capture on the classes whose SGLang model lacks DFlash's hook
  (`draft/target_capture.complete_capture`: Qwen3-VL, Qwen2, Qwen2-MoE, GLM-4-MoE, MiniMax-M2,
  Gemma-3).
* Request admission: ours replaces the built-in's DFLASH checks (`admission.py`,
  `verify/sampling_mask.py`), and keeps requests whose sampling state only the worker holds out of
  mixed prefill batches.
* Acceptance metrics and the width policy's acceptance, where SGLang settles each step
  (`metrics.py`).
* Prefill/decode disaggregation: draft K/V arrival checked on the decode side
  (`draft_context.py`), and prefill peers of another attention-TP size refused.
* The draft's window ring in the target's pool budget (`draft_budget.py`): with a ring
  (SGLANG_DFLASH_DRAFT_WINDOW_POOL, `auto` where the target's pool gains), SGLang charges the
  full draft layers per token and sets the ring aside, and a radix-cache hit re-prefills the
  window's tokens.
* Server info names the DFLASH implementation.

Each hook hands the call back unchanged when the built-in serves DFLASH
(`SGLANG_DFLASH_IMPL=builtin`) or the server does not run DFLASH.
"""

from __future__ import annotations

import logging

from sglang_dflash.knobs import BUILTIN, use_builtin
from sglang_dflash.propose.grammar import describe_choices

logger = logging.getLogger(__name__)
_installed = False


def install_scheduler_hooks() -> None:
    """Hooks whose targets live in the scheduler process; applied on first call."""
    global _installed
    if _installed:
        return
    _installed = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_dflash.cpu import verify_attention
    from sglang_dflash.integration import draft_budget, metrics

    srt = "sglang.srt."
    hooks = {
        # TARGET_VERIFY on the CPU engine's attention.
        "layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend": (
            verify_attention.forward_extend
        ),
        "layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend": (
            verify_attention.run_sdpa_forward_extend
        ),
        # The target's capture, where SGLang's own model class cannot set it up.
        "model_executor.model_runner.ModelRunner.init_attention_backends": _complete_target_capture,
        "managers.scheduler_components.internal_state.SchedulerInternalStateController._add_speculative": (
            _add_speculative_state
        ),
        # Admission.
        "speculative.dflash_utils.validate_dflash_request": _validate_request,
        "speculative.spec_sampling_mask.validate_spec_sampling_mask_request": _validate_sampling_mask_request,
        "managers.scheduler.Scheduler._get_new_batch_prefill_raw": _keep_stateful_requests_unmixed,
        # Acceptance metrics, counted where SGLang settles each step (see metrics.py).
        "managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
        "._resolve_spec_v2_tokens": metrics.resolve_spec_tokens_hook,
        # The draft's window ring in the target's pool budget (draft_budget.py).
        "mem_cache.draft_kv_budget.resolve_dflash_draft_cell_size": draft_budget.cell_size_hook,
        "mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes": (
            draft_budget.available_bytes_hook
        ),
        **{
            f"mem_cache.{cache}.swa_reprefill_tail_tokens": draft_budget.reprefill_hook
            for cache in ("base_prefix_cache.BasePrefixCache", "unified_radix_cache.UnifiedRadixCache")
        },
        # Prefill/decode disaggregation.
        "disaggregation.decode.DecodePreallocQueue._pre_alloc": _stamp_transfer_slots,
        "disaggregation.decode.DecodeTransferQueue.pop_transferred": _check_transferred_context,
        "disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info": (
            _refuse_prefill_peer_of_another_tp_size
        ),
    }
    for target, hook in hooks.items():
        HookRegistry.register(srt + target, hook, HookType.AROUND)
    HookRegistry.apply_hooks()


# How each route of `target_capture` captures, for the start-up line.
CAPTURE_ROUTES = {
    "inner": "its inner text model's layers_to_capture",
    "eagle3": "its EAGLE-3 hook, which records the same residual stream",
    "residual_stream": "hooks recording the residual stream entering each listed layer",
}


def _complete_target_capture(original, self, *args, **kwargs):
    """Before SGLang configures the target's hidden-state capture: a class whose model lacks the
    DFlash hook SGLang calls gets one (`draft/target_capture.complete_capture`)."""
    if self.spec_aux_config.dflash_use_aux_hidden_state and not use_builtin():
        from sglang_dflash.draft.target_capture import complete_capture

        route = complete_capture(self.model)
        if route is not None:
            logger.info(
                "DFLASH: %s lacks set_dflash_layers_to_capture in this SGLang; its layers are captured "
                "through %s",
                type(self.model).__name__,
                CAPTURE_ROUTES[route],
            )
    return original(self, *args, **kwargs)


def _stamp_transfer_slots(original, self, req, *args, **kwargs):
    """PD decode side: the slots SGLang allocates for a request's transfer get the sentinel that
    its draft K/V, if sent, overwrites (`draft_context.py`)."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer

    kv_loc = original(self, req, *args, **kwargs)
    check = getattr(self.scheduler.draft_worker, "context_check", None)
    # Not for warm-up and health-check requests, which nothing is transferred for; hisparse
    # returns host indices.
    if check is not None and not _is_fake_transfer(req) and not self.scheduler.enable_hisparse:
        check.stamp(kv_loc)
    return kv_loc


def _check_transferred_context(original, self, *args, **kwargs):
    """PD decode side: requests whose transfer completed are checked for their draft K/V."""
    reqs = original(self, *args, **kwargs)
    check = getattr(self.scheduler.draft_worker, "context_check", None)
    if check is None:
        return reqs
    from sglang.srt.disaggregation.utils import _is_fake_transfer

    # Warm-up and health-check requests have no prefill engine: nothing is transferred for them.
    real = [req for req in reqs if not _is_fake_transfer(req)]
    if real:
        import torch

        # The first transferred slot: `_pre_alloc` writes its allocation from `prefix_len`
        # (0 with DFLASH, which keeps the decode side's radix cache off).
        table = self.scheduler.req_to_token_pool.req_to_token
        rows = torch.tensor([req.kv.req_pool_idx for req in real], device=table.device)
        cols = torch.tensor([req.prefix_len for req in real], device=table.device)
        check.check(table[rows, cols], [req.rid for req in real])
    return reqs


def _refuse_prefill_peer_of_another_tp_size(original, self, bootstrap_addr, *args, **kwargs):
    """A decode engine whose draft K/V is registered for transfer refuses a prefill peer of
    another attention-TP size: SGLang slices transferred K/V by the target's head count, which
    is not the draft's, so the draft would receive garbage. Raised where SGLang refuses other
    peers it cannot pair with (`CommonKVManager.try_ensure_parallel_info`)."""
    ready = original(self, bootstrap_addr, *args, **kwargs)
    info = self.prefill_info_table.get(bootstrap_addr) if ready else None
    if (
        info is not None
        and getattr(self.kv_args, "num_draft_entries", 0)
        and info.attn_tp_size != self.attn_tp_size
    ):
        raise RuntimeError(
            "sglang-dflash's DFLASH under prefill/decode disaggregation needs the same attention TP size "
            f"on both engines: the prefill engine at {bootstrap_addr} has {info.attn_tp_size}, this decode "
            f"engine {self.attn_tp_size}; the draft's K/V cannot be resliced across TP sizes"
        )
    return ready


def _validate_request(original, req, *args, **kwargs):
    if use_builtin():
        return original(req, *args, **kwargs)
    # Ours replaces the built-in's check, which refuses what this worker serves (hidden states
    # under overlap scheduling).
    from sglang_dflash.integration.admission import disarm, unsupported_feature

    reason = unsupported_feature(req)
    if reason is not None:
        disarm(req)
    return reason


def _validate_sampling_mask_request(original, req, spec_algorithm, *args, **kwargs):
    """`return_sampling_mask` with DFLASH: ours replaces the built-in's check, which refuses
    sampled requests wherever SGLang's CUDA verify kernel is missing (the CPU engine)."""
    if use_builtin() or not spec_algorithm.is_dflash():
        return original(req, spec_algorithm, *args, **kwargs)
    from sglang.srt.environ import envs

    from sglang_dflash.verify.sampling_mask import unsupported_reason

    return unsupported_reason(req, simulated_acceptance=envs.SGLANG_SIMULATE_ACC_LEN.get() > 0)


def _keep_stateful_requests_unmixed(original, self, *args, **kwargs):
    """With --enable-mixed-chunk, SGLang mixes running decode requests into a prefill batch,
    where its own sampler draws their next token. For requests whose sampling depends on state
    only our worker keeps (penalties, custom logit processors: `admission.needs_own_sampling`)
    that token would be wrong, so while such a request runs, prefill batches are not mixed, the
    way SGLang itself never mixes requests that return logprobs."""
    from sglang_dflash.integration.admission import needs_own_sampling

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
        runtime = getattr(worker, "runtime", None)
        if runtime is not None:  # how this draft's family proposes (`propose/proposers.py`)
            state["dflash_proposals"] = runtime.proposer.name
            state["dflash_draft_weights"] = runtime.weights_line()  # fp8: dequantised at load
            if runtime.kv_plan is not None:  # full and sliding layers' bytes per token, apart
                # and why the sliding layers keep K/V for every token (SGLANG_DFLASH_DRAFT_WINDOW_POOL)
                why_no_ring = getattr(worker, "why_no_window_ring", None)
                state["dflash_draft_kv"] = {
                    **runtime.kv_plan.server_info(),
                    "window_ring_why_not": why_no_ring,
                }
            if runtime.last_tokens is not None:  # LiLiCorr: a missing last-token feature costs acceptance
                state["dflash_lilicorr_last_tokens"] = runtime.last_tokens.describe()
        window = getattr(worker, "grammar_window", None)
        if window is not None and window.propose:  # a proposal the draft did not rank costs acceptance
            state["dflash_grammar_proposals"] = describe_choices(window)
        misses = getattr(worker, "window_misses", None)
        if misses is not None:  # a window ring: drafts over positions its slot does not hold
            state["dflash_window_misses"] = misses.describe()
        check = getattr(worker, "context_check", None)
        if check is not None:
            state["dflash_requests_without_draft_context"] = check.requests_without_context

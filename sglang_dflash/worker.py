"""`DFlashWorker`: the speculative worker SGLang runs for `--speculative-algorithm DFLASH`.

One decode step, for a batch of bs requests with committed lengths `seq_lens`:

  1. draft:   block `[bonus, MASK x (Bd-1)]` -> one draft forward over the draft KV store,
              eager or from a CUDA graph (`draft_step.py`)
              -> the target's lm_head argmax at block positions 1..B-1 = proposals.
  2. verify:  one target TARGET_VERIFY forward over `[bonus, d1 .. d_{B-1}]` as a causal chain.
  3. accept:  longest run of proposals equal to the target's predictions, plus its next token;
              the target's logits adjusted first as decode steps would (penalties, grammar
              mask, logit_bias, custom logit processors: `verifier.py`), and logprobs taken from
              them for requests that ask.
  4. commit:  `new_seq_lens = seq_lens + accept_len + 1`, published to the scheduler.
  5. inject:  the committed tokens' target features -> context K/V in the draft KV store.

Grammar-constrained requests (`grammar.py`) get a mask for every verify row, and with
grammar-aware proposals (on by default, `SGLANG_DFLASH_GRAMMAR_PROPOSALS=0` turns them off)
the draft proposes only tokens their grammar allows.

Prefill and extend chunks run the target forward and inject every new token (step 5).
Bd is the checkpoint's trained block size; B (`--speculative-num-draft-tokens`) <= Bd is the
verify width: the draft always runs its full trained block, and only B tokens are verified.

See docs/architecture.md ("How it works").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Optional

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.model_loader.weight_utils import initialize_dummy_weights
from sglang.srt.runtime_context import get_disagg, get_exec, get_memory, get_model, get_parallel, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker, HiCacheDraftMode, HiCacheDraftPlan
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

from sglang_dflash import (
    IMPL_NAME,
    __version__,
    draft_context,
    draft_step,
    flashinfer_attention,
    fused_forward,
    ops,
    sampling_mask,
)
from sglang_dflash.attention import SdpaDraftAttention, planning_lens
from sglang_dflash.block import extend_positions, gather_slots
from sglang_dflash.config import (
    DFlashDraftConfig,
    load_mask_embedding,
    resolve_checkpoint_dir,
    resolve_mask_token_id,
)
from sglang_dflash.cpu import verify_attention
from sglang_dflash.draft_model import DFlashDraftModel
from sglang_dflash.draft_pool import DraftKVPool
from sglang_dflash.grammar import GrammarWindow
from sglang_dflash.kv_store import DraftKVStore, kv_cache_region, resolve_draft_kv_dtype
from sglang_dflash.linear_state import LinearStateCommit
from sglang_dflash.metrics import DFlashMetrics
from sglang_dflash.sampling import SamplingRows
from sglang_dflash.server_args import draft_load_format
from sglang_dflash.step_timer import StepTimer
from sglang_dflash.target_features import FeatureLayout
from sglang_dflash.target_head import TargetHead
from sglang_dflash.target_pool import num_target_slots
from sglang_dflash.tensor_parallel import TensorParallel, check_ranks_agree
from sglang_dflash.verifier import Verifier
from sglang_dflash.verify import forced_acceptance
from sglang_dflash.width_policy import ENV_VAR as ADAPTIVE_WIDTH_ENV
from sglang_dflash.width_policy import FAIR_SLACK_ENV, policy_for

OFF_FORWARD_ENV = "SGLANG_DFLASH_WIDTH1_FORWARD"  # decode | verify: override the start-up choice
COLD_DECODE_STEPS = 8  # a server's first decode steps, whose intervals the width policy ignores

logger = logging.getLogger(__name__)


def _simulated_acceptance() -> Optional[tuple[float, str, str]]:
    """SGLang's benchmark knob, honoured as its built-in DFLASH does: (mean, method, token mode)."""
    from sglang.srt.environ import envs
    from sglang.srt.speculative.spec_utils import check_simulate_acc_token_mode

    mean = envs.SGLANG_SIMULATE_ACC_LEN.get()
    if mean <= 0:
        return None
    check_simulate_acc_token_mode()
    return mean, envs.SGLANG_SIMULATE_ACC_METHOD.get(), envs.SGLANG_SIMULATE_ACC_TOKEN_MODE.get()


def _draft_tensor_parallel(parallel) -> TensorParallel:
    """This rank's shard of the draft: SGLang's whole TP group. With DP attention or context
    parallelism the target's attention runs on a smaller group; both are refused at start-up
    (`server_args.py`), and this says so if a server got here another way."""
    if parallel.attn_tp_size != parallel.tp_size:
        raise ValueError(
            f"sglang-dflash shards the draft over the whole TP group (tp_size {parallel.tp_size}); "
            f"attention TP size {parallel.attn_tp_size} (DP attention or context parallelism) "
            "is not supported"
        )
    return TensorParallel.from_sglang()


def _keep_final_hidden_states(model) -> bool:
    """With --enable-return-hidden-states (or --return-hidden-states-mode), make the target's
    logits processor also keep its final hidden states (`last_hidden_states`): with DFLASH the
    `hidden_states` it returns are the captured layers the draft is conditioned on."""
    from sglang.srt.model_executor.forward_batch_info import get_server_return_hidden_states_mode

    if not get_server_return_hidden_states_mode().need_capture():
        return False
    processor = getattr(model, "logits_processor", None)
    if not hasattr(processor, "keep_last_hidden_states"):
        raise RuntimeError(
            f"the server returns hidden states, but {type(model).__name__} has no SGLang logits "
            "processor to keep them with DFLASH; launch without --enable-return-hidden-states"
        )
    processor.keep_last_hidden_states = True
    return True


@contextlib.contextmanager
def _sglang_graph_capture():
    """SGLang's capture context on its shared capture stream: under tensor parallelism it makes
    the draft's all-reduces capturable (custom all-reduce, pynccl); with graph-pool borrowing on
    (SGLANG_ENABLE_GRAPH_POOL_BORROW) it retires the borrow pool first. Yields the stream."""
    from sglang.srt.distributed.parallel_state import graph_capture
    from sglang.srt.model_executor.runner_utils.pool import (
        get_or_create_global_graph_capture_stream,
        graph_pool_capture_scope,
    )

    stream = get_or_create_global_graph_capture_stream()
    with graph_pool_capture_scope(), graph_capture(stream=stream) as context:
        yield context.stream


def make_draft_input(bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor) -> DFlashDraftInputV2:
    """SGLang's cross-step DFLASH state: the bonus token and committed length per request."""
    bs, device = new_seq_lens.numel(), bonus_tokens.device
    return DFlashDraftInputV2(
        # Eagle-shaped fields SGLang's overlap relay reads; DFLASH leaves them empty.
        topk_p=torch.empty((bs, 0), device=device, dtype=torch.float32),
        topk_index=torch.empty((bs, 0), device=device, dtype=torch.int64),
        hidden_states=torch.empty((bs, 0), device=device, dtype=torch.float16),
        bonus_tokens=bonus_tokens.to(torch.int64),
        new_seq_lens=new_seq_lens.to(torch.int64),
    )


class DFlashWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        from sglang_dflash.plugin import install_scheduler_hooks

        install_scheduler_hooks()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None  # the draft runs inside this worker, not in a TpModelWorker
        runner = target_worker.model_runner
        self.device = runner.device
        # The draft is sharded over SGLang's TP group, like the target's attention and MLPs.
        self.tp = _draft_tensor_parallel(get_parallel())

        spec = get_spec()
        path = resolve_checkpoint_dir(
            spec.speculative_draft_model_path, spec.speculative_draft_model_revision
        )
        # B is resolved by now: a checkpoint without block_size drafts blocks of B.
        self.config = DFlashDraftConfig.from_pretrained(
            path, default_block_size=int(spec.speculative_num_draft_tokens)
        )
        text_config = runner.model_config.hf_text_config
        self.vocab_size = int(runner.model_config.vocab_size)
        self.config = resolve_mask_token_id(self.config, target_worker.tokenizer, self.vocab_size)
        layer_ids = self.config.check_target(
            hidden_size=int(text_config.hidden_size),
            vocab_size=self.vocab_size,
            num_layers=int(text_config.num_hidden_layers),
        )
        captured = list(runner.spec_aux_config.dflash_target_layer_ids or [])
        if captured != list(layer_ids):
            raise RuntimeError(f"target captures layers {captured}, but the draft needs {list(layer_ids)}")
        # SGLang captures each layer once, in layer order; fc reads them as listed.
        self.features = FeatureLayout(layer_ids, int(text_config.hidden_size), self.device)
        self.num_draft_tokens = int(spec.speculative_num_draft_tokens)  # B, the verify width
        self.config.check_num_draft_tokens(self.num_draft_tokens)
        self.block_size = self.config.block_size  # Bd, the trained draft block
        # --speculative-draft-window-size: the draft sees only the last W committed tokens.
        self.context_window = spec.speculative_draft_window_size

        load_format = draft_load_format(spec.speculative_draft_load_format, get_model().load_format)
        self.draft_model = DFlashDraftModel.from_pretrained(
            path,
            self.config,
            len(layer_ids),
            dtype=runner.dtype,
            device=self.device,
            tp=self.tp,
            init_weights=initialize_dummy_weights if load_format == "dummy" else None,
        )
        # The draft's forward: fused kernels on CUDA where they apply, else the module's maths.
        self.draft_forward, forward_choice = self._choose_forward(int(runner.model_config.context_len))
        target = runner.model
        self.head = TargetHead(target, self.vocab_size, self.tp)  # the draft's embedding and LM head
        trained_mask_row = load_mask_embedding(path, self.config)
        if trained_mask_row is not None:
            self.head.use_trained_mask_row(self.config.mask_token_id, trained_mask_row)
        self.store: Optional[DraftKVStore] = None
        self.kv_pool: Optional[DraftKVPool] = None  # the store, as SGLang's KV pool of the draft
        self.context_check: Optional[draft_context.DraftContextCheck] = None  # PD decode engines
        self.attention = None  # SdpaDraftAttention or FlashInferDraftAttention, chosen with the store
        self.draft_step: Optional[draft_step.DraftStep] = None  # eager or graphed, with the store

        self.returns_hidden_states = _keep_final_hidden_states(target)
        self.linear_state = LinearStateCommit.for_target(runner)  # None unless the target is hybrid
        self.grammar_window = GrammarWindow(
            propose=os.environ.get("SGLANG_DFLASH_GRAMMAR_PROPOSALS", "1") != "0",
            vocab_size=self.vocab_size,
        )
        self.simulated_acceptance = _simulated_acceptance()
        self.sampling_mask_max_tokens = int(get_exec().features.sampling_mask_max_tokens)
        self.skip_decode_injection = os.environ.get("SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION") == "1"
        # Test aid: prefill/decode disaggregation leaves the draft's K/V out of the transfer.
        self.skip_draft_transfer = os.environ.get("SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER") == "1"
        # Test aid: HiCache leaves the draft's K/V out of its backups.
        self.skip_draft_hicache = os.environ.get("SGLANG_DFLASH_TEST_SKIP_DRAFT_HICACHE") == "1"
        self.test_width1_steps = int(os.environ.get("SGLANG_DFLASH_TEST_WIDTH1_STEPS", "0"))
        # Debugging aid: every rank's proposals and committed tokens compared each step.
        self.check_ranks = self.tp.size > 1 and os.environ.get("SGLANG_DFLASH_CHECK_RANKS") == "1"
        self.timer = StepTimer.from_env(self.device)  # no-op unless SGLANG_DFLASH_STEP_TIMING
        # The verify width per step: adaptive (`width_policy.py`) or always B.
        self.width_policy, width_choice = policy_for(
            self.num_draft_tokens,
            torch.device(self.device).type,
            os.environ.get(ADAPTIVE_WIDTH_ENV),
            tp_size=self.tp.size,
            fair_slack=os.environ.get(FAIR_SLACK_ENV),
        )
        # (start, bs, width, context, measured) of the last decode step; None after an extend or
        # idle step.
        self._last_decode: Optional[tuple[float, int, int, int, bool]] = None
        self._decode_steps = 0
        self.decode_when_off, off_forward = self._choose_off_forward()
        width_choice += f"; width 1 runs {off_forward}"
        self.metrics = DFlashMetrics.from_runtime(self.num_draft_tokens)  # None without --enable-metrics
        trace_path = os.environ.get("SGLANG_DFLASH_TRACE_PROPOSALS")
        self.trace_file = open(trace_path, "a") if trace_path else None
        if self.simulated_acceptance is not None:
            logger.warning(
                "DFLASH acceptance is SIMULATED (SGLANG_SIMULATE_ACC_LEN=%s, method=%s, tokens=%s): "
                "outputs are not the model's; benchmark use only",
                *self.simulated_acceptance,
            )
        logger.info(
            "DFLASH is served by %s %s: draft=%s layers=%d draft_options=%s mask_row=%s "
            "target_layer_ids=%s (%s) block_size=%d verify_width=%d (%s) draft_window=%s device=%s "
            "dtype=%s draft_forward=%s lm_head=%s grammar_aware_proposals=%s hidden_states=%s "
            "linear_attention_state_commit=%s%s%s%s%s%s",
            IMPL_NAME,
            __version__,
            path,
            self.config.num_hidden_layers,
            ", ".join(self.config.options_in_use()) or "none",
            self.head.mask_row_kind,
            list(layer_ids),
            self.features.describe(),
            self.block_size,
            self.num_draft_tokens,
            width_choice,
            self.context_window,
            self.device,
            runner.dtype,
            forward_choice,
            self.head.kind,
            self.grammar_window.propose,
            self.returns_hidden_states,
            self.linear_state is not None,
            " [test: decode-time injection OFF]" if self.skip_decode_injection else "",
            " [test: draft K/V left out of the PD transfer]" if self.skip_draft_transfer else "",
            " [test: draft K/V left out of HiCache]" if self.skip_draft_hicache else "",
            " [checking that tensor-parallel ranks agree each step]" if self.check_ranks else "",
            f" [tracing proposals to {trace_path}]" if trace_path else "",
        )

    # ------------------------------------------------------------ scheduler API

    @property
    def model_runner(self):
        return self.target_worker.model_runner

    def _build_hicache_draft_plan(self) -> HiCacheDraftPlan:
        """HiCache backs up and reloads the draft's K/V as a sidecar of the target's, at the
        target's host slots (SGLang's plan for a non-packed draft pool); the base class finds no
        draft runner here and would plan nothing."""
        plan = super()._build_hicache_draft_plan()  # also resets the target runner's MTP pools
        memory = get_memory()
        offloads = (
            memory.enable_hierarchical_cache
            or memory.enable_unified_cache_external_linker
            or get_disagg().disaggregation_decode_retraction_backup == "host_pool"
        )
        if plan.mode != HiCacheDraftMode.NONE or not offloads or self.skip_draft_hicache:
            return plan
        return HiCacheDraftPlan(mode=HiCacheDraftMode.SIDECAR, device_pools=(self.kv_pool,))

    @property
    def primary_draft_kv_pool(self) -> Optional[DraftKVPool]:
        """Prefill/decode disaggregation transfers this pool's buffers with the target's."""
        return None if self.skip_draft_transfer else self.kv_pool

    def alloc_memory_pool(
        self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        # Same slot-id space as the target pool (SGLang budgeted the draft's bytes per token
        # into the target pool's cell size, so this is the memory it set aside for us).
        num_slots = num_target_slots(self.model_runner.token_to_kv_pool)
        # FlashInfer keeps each step's block K/V in scratch slots past the target's range.
        max_bs = req_to_token_pool.req_to_token.shape[0]
        self.flashinfer_unavailable = flashinfer_attention.unavailable_reason(
            self.config, torch.device(self.device)
        )
        scratch = 0
        if self.flashinfer_unavailable is None:
            scratch = flashinfer_attention.num_scratch_slots(max_bs, self.block_size)
        # Every persistent buffer sits in SGLang's memory-saver KV region, with the target's pools.
        with kv_cache_region():
            self.store = DraftKVStore(
                num_slots=num_slots + scratch,
                num_layers=self.config.num_hidden_layers,
                num_kv_heads=self.tp.split(self.config.num_key_value_heads, "KV heads"),  # this rank's
                head_dim=self.config.head_dim,
                dtype=resolve_draft_kv_dtype(self.model_runner.dtype),
                device=self.device,
            )
            self.attention = self._choose_attention(num_slots)
            # SGLang's random seed, broadcast from rank 0: the same on every tensor-parallel rank.
            self.verifier = Verifier(
                max_bs, self.vocab_size, self.device, seed=self.target_worker.random_seed
            )
        # Outside the region: the pool's small pointer tables must survive a memory-saver release
        # (its K/V buffers are the store's, inside it).
        self.kv_pool = DraftKVPool(
            self.store,
            self.model_runner.token_to_kv_pool,
            enable_memory_saver=get_exec().features.enable_memory_saver,
        )
        self.draft_step = draft_step.DraftStep(
            self.draft_forward,
            self.head.embed,
            self.attention,
            block_size=self.block_size,
            mask_token_id=self.config.mask_token_id,
            context_window=self.context_window,
        )
        self.context_check = draft_context.for_decode_engine(
            self.store, self.primary_draft_kv_pool is not None, self.metrics
        )
        injection = ops.choose_inject_context_kv(self.draft_model, self.store)
        logger.info("DFLASH draft attention: %s; context-KV injection: %s", self.attention_name, injection)
        logger.info(
            "DFLASH draft KV store: %d slots, %s, %.1f MB",
            num_slots,
            self.store.k.dtype,
            self.store.nbytes / 2**20,
        )

    def init_cuda_graphs(self):
        """SGLang's last start-up hook, after the target's attention backends and graphs: warm
        the draft step up, capture its CUDA graphs, and with step timing on, count the target's
        attention plans."""
        if self.timer.enabled:  # the target's attention plans per step, in the step records
            backend = self.model_runner.attn_backend
            for method in ("init_forward_metadata", "init_forward_metadata_out_graph"):  # eager, graphed
                if hasattr(backend, method):
                    counted = self.timer.counted(getattr(backend, method), "target_attention_plans")
                    setattr(backend, method, counted)
        self._warm_up()
        self._capture_draft_graphs()

    @torch.no_grad()
    def _warm_up(self) -> None:
        """One draft step at batch 1 over a one-token context before serving: the injection,
        every draft layer kind's attention, the LM head. FlashInfer (and the fused op's first
        launch) compile on first use, which with FlashInfer's PyPI wheel takes minutes; inside
        the first decode step that would stall serving under the scheduler's watchdog. Writes
        only the sink slot 0 and FlashInfer's scratch slots."""
        start = time.perf_counter()
        device, dtype = self.device, self.model_runner.dtype
        one = torch.ones(1, dtype=torch.int64, device=device)
        features = torch.zeros(1, self.draft_model.fc.in_features, dtype=dtype, device=device)
        ops.inject_context_kv(self.draft_model, self.store, features, one - 1, one - 1)  # slot 0
        # One block after a one-token context (req_to_token's row 0; only read).
        _, _, hidden = self.draft_step(
            self.req_to_token_pool.req_to_token, one - 1, one, one, one.cpu(), True
        )
        self.head.argmax(hidden[:, 1:])
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        logger.info(
            "DFLASH warm-up (injection, %s draft attention, LM head): %.1f s",
            self.attention_name,
            time.perf_counter() - start,
        )

    def _capture_draft_graphs(self) -> None:
        """The draft step's CUDA graphs, one per SGLang capture size, in SGLang's graph memory
        pool; or why there are none (logged once)."""
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
        from sglang.srt.model_executor.runner_utils.pool import (
            get_or_create_global_graph_memory_pool,
            graph_pool_replay_scope,
        )
        from sglang.srt.utils.common import get_available_gpu_memory

        reason = draft_step.graphs_unavailable_reason(
            device=torch.device(self.device),
            attention_name=self.attention_name,
            disable_cuda_graph=check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED),
            env=os.environ.get(draft_step.GRAPHS_ENV),
        )
        if reason is None:
            # The target's captured sizes (its verify graphs), else the configured ones.
            sglang_sizes = (
                self.model_runner.decode_cuda_graph_capture_bs or get_exec().graph.cuda_graph_config.decode.bs
            )
            req_to_token = self.req_to_token_pool.req_to_token
            sizes = draft_step.capture_sizes(sglang_sizes, req_to_token.shape[0])
            if not sizes:
                reason = f"no capture batch sizes (SGLang's: {sglang_sizes})"
        if reason is not None:
            logger.info("DFLASH draft step: eager, no CUDA graphs (%s)", reason)
            return
        capacity = flashinfer_attention.kv_indices_capacity(
            max(sizes), int(self.model_runner.model_config.context_len), self.block_size, self.context_window
        )
        # SGLang's own measure of its graphs' memory: free GB after returning the cache.
        free_before = get_available_gpu_memory(self.device, self.model_runner.gpu_id)
        buffers = flashinfer_attention.GraphBuffers.allocate(self.config, capacity, self.attention.workspace)

        def make_attention(size: int) -> flashinfer_attention.FlashInferDraftAttention:
            return flashinfer_attention.FlashInferDraftAttention(
                self.config,
                self.store,
                scratch_base=self.attention.scratch_base,
                max_batch_size=size,
                context_window=self.context_window,
                q_dtype=self.model_runner.dtype,
                graph_batch_size=size,
                graph_buffers=buffers,
            )

        seconds = self.draft_step.capture(
            sizes,
            make_attention,
            req_to_token,
            kv_indices_capacity=capacity,
            pool=get_or_create_global_graph_memory_pool(torch.cuda),
            capture_context=_sglang_graph_capture,
            replay_scope=graph_pool_replay_scope,
        )
        used_gb = free_before - get_available_gpu_memory(self.device, self.model_runner.gpu_id)
        # In SGLang's start-up accounting (server info, metrics) as the draft's decode graphs.
        self._additional_graph_memory_usage["draft_decode"] = used_gb
        self._additional_graph_time_usage["draft_decode"] = seconds
        logger.info(
            "DFLASH draft step: CUDA graphs for batch sizes %s (%.2f GB, %.1f s; page-index buffer %d); "
            "eager above %d requests and for steps without exact host lengths",
            list(sizes),
            used_gb,
            seconds,
            capacity,
            sizes[-1],
        )

    def _choose_forward(self, context_len: int):
        """The draft network's forward, chosen once: fused kernels (`fused_forward.py`) where
        they apply, else the module's own maths; with the reason."""
        reason = fused_forward.unavailable_reason(self.draft_model, torch.device(self.device))
        if reason is None:
            # Block positions reach context_len + Bd - 1.
            forward = fused_forward.FusedDraftForward(self.draft_model, context_len + self.block_size)
            kernels = forward.kernels.describe(torch.device(self.device))
            return forward, f"fused ({kernels}; stacked projections)"
        if torch.device(self.device).type == "cuda":  # a real slowdown there: say so louder
            logger.warning("DFLASH draft forward: module by module, not fused (%s)", reason)
        return self.draft_model, f"module ({reason})"

    def _choose_attention(self, num_target_slots: int):
        """FlashInfer on CUDA when it applies, else PyTorch SDPA; chosen once, with the reason."""
        if self.flashinfer_unavailable is None:
            self.attention_name = "flashinfer"
            return flashinfer_attention.FlashInferDraftAttention(
                self.config,
                self.store,
                scratch_base=num_target_slots,
                max_batch_size=self.req_to_token_pool.req_to_token.shape[0],
                context_window=self.context_window,
                q_dtype=self.model_runner.dtype,
            )
        self.attention_name = f"torch-sdpa ({self.flashinfer_unavailable})"
        return SdpaDraftAttention(
            self.config, self.store, self.context_window, sinks=self.draft_model.attention_sinks()
        )

    def server_info(self) -> str:
        return f"{IMPL_NAME} {__version__}"

    def forward_batch_generation(
        self, batch: ScheduleBatch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None
    ) -> GenerationBatchResult:
        if batch.forward_mode.is_idle():
            self._last_decode = None
            return self._forward_idle(on_publish)
        with self.verifier.seeded(batch):
            if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
                return self._forward_extend(batch, on_publish, grammar_barrier)
            return self._forward_decode(batch, on_publish, grammar_barrier)

    # ------------------------------------------------------------------ steps

    def _forward_extend(self, batch: ScheduleBatch, on_publish, grammar_barrier) -> GenerationBatchResult:
        """Prefill / extend chunk / mixed batch: target forward, then inject every new token."""
        self._last_decode = None  # the interval across an extend step is not a decode step's cost
        with self.timer.phase("extend"):
            if grammar_barrier is not None and batch.has_grammar and batch.forward_mode.is_mixed():
                # The decode requests mixed in sample their next token with SGLang's sampler,
                # under their grammar's mask: it must have seen the previous step's tokens.
                grammar_barrier()
            result = self.target_worker.forward_batch_generation(
                batch, capture_hidden_mode=CaptureHiddenMode.FULL
            )
            result.new_seq_lens = batch.seq_lens
            if on_publish is not None:
                on_publish(result.new_seq_lens)
            logits_output = result.logits_output
        with self.timer.phase("inject"):
            # The injection must land in this step: the scheduler may insert these tokens into
            # the radix cache as soon as the step returns.
            positions = extend_positions(batch.prefix_lens, batch.extend_lens, self.device)
            features = self.features.arrange(logits_output.hidden_states)  # [T, K*H]
            ops.inject_context_kv(self.draft_model, self.store, features, positions, batch.out_cache_loc)
            self._hand_over_hidden_states(batch, logits_output, extend=True)
            self.verifier.start_requests(batch)
            result.next_draft_input = make_draft_input(result.next_token_ids, batch.seq_lens)
        self.timer.end_step(len(batch.reqs), kind="extend")
        return result

    def _forward_decode(self, batch: ScheduleBatch, on_publish, grammar_barrier) -> GenerationBatchResult:
        seq_lens = batch.seq_lens  # [bs] committed lengths
        bs = seq_lens.shape[0]
        draft_input: DFlashDraftInputV2 = batch.spec_info
        # [bs] host committed lengths to plan the draft's attention with (no device sync), exact
        # when the scheduler has them, else upper bounds.
        host_lens, host_lens_exact = planning_lens(batch.seq_lens_cpu, draft_input.nxt_kv_lens_cpu)
        # W: the verify width of this step, 1 <= W <= B.
        width = self._choose_width(bs, batch.seq_lens_sum or 0, batch.reqs)
        # W = 1 through the target's decode forward (else a verify over the window, `_verify`).
        decoded = width == 1 and self.decode_when_off

        if width == 1:
            # Speculation off for this step: no draft; the target runs one token per request.
            candidates = draft_input.bonus_tokens.to(torch.int64)[:, None]  # [bs, 1]
            positions = seq_lens.to(torch.int64)[:, None]  # [bs, 1]
            proposals, draft_logits = candidates[:, 1:], None  # [bs, 0]
        else:
            with self.timer.phase("draft"):
                # [bs, W] x2, [bs, W-1, H]
                block_ids, positions, draft_hidden = self._draft(batch, width, host_lens, host_lens_exact)
                draft_logits = None
                if batch.has_grammar:  # the grammar window ranks the draft's candidates
                    draft_logits = self.head.logits(draft_hidden)  # [bs, W-1, V]
                    proposals = torch.argmax(draft_logits, dim=-1)  # [bs, W-1]
                else:  # (vocab-parallel under tensor parallelism)
                    proposals = self.head.argmax(draft_hidden)  # [bs, W-1]
        grammar_mask = None
        if batch.has_grammar:
            with self.timer.phase("grammar"):
                if grammar_barrier is not None:
                    grammar_barrier()  # the matchers first take in the previous step's tokens
                proposals, grammar_mask = self.grammar_window(batch.reqs, proposals, draft_logits)
        del draft_logits  # [bs, W-1, V]: not kept alive through the verify forward
        if width > 1:
            candidates = torch.cat([block_ids[:, :1], proposals], dim=1)  # [bs, W] = [bonus, d1..]

        with self.timer.phase("verify"):
            # The verify window's KV slots, reserved by prepare_for_decode.
            verify_slots = gather_slots(
                self.req_to_token_pool.req_to_token, batch.req_pool_indices, seq_lens, width
            )  # [bs, W]
            if decoded:
                verified = self._decode(batch, candidates, verify_slots)
            else:
                verified = self._verify(batch, candidates, positions, verify_slots)
            logits_output = verified.logits_output

        with self.timer.phase("accept"):
            logits = logits_output.next_token_logits  # [bs*W, V]
            accept_len, out_tokens, new_bonus, logits = self.verifier.verify(
                batch, candidates, logits, positions, grammar_mask
            )
            if self.simulated_acceptance is not None:
                accept_len, out_tokens, new_bonus = self._simulate(candidates, logits)
            commit_lens = (accept_len + 1).to(torch.int32)
            if batch.sampling_info.sampling_mask_batch_indices is not None:
                logits_output.sampling_mask_output = self._sampling_masks(
                    batch, logits, out_tokens, commit_lens
                )
            if self.check_ranks:
                check_ranks_agree(self.tp, candidates=candidates, commit_lens=commit_lens, tokens=out_tokens)
            self.verifier.commit(batch, candidates, commit_lens)
            if self.linear_state is not None and not decoded:
                # (A decode forward advanced the linear-attention state itself.)
                self.linear_state(batch, seq_lens, commit_lens)
            new_seq_lens = seq_lens + commit_lens.to(seq_lens.dtype)
            if on_publish is not None:
                on_publish(new_seq_lens)

        if batch.return_logprob:
            with self.timer.phase("logprobs"):
                # SGLang's own: one entry per window row, from the adjusted logits; its result
                # processor keeps the committed rows (accepted proposals and the bonus).
                logits_output.next_token_logits = logits
                compute_spec_logprobs(batch, logits_output, out_tokens.reshape(-1), chain_stride=width)

        with self.timer.phase("inject"):
            # The committed tokens (bonus, d1..d_accept); the rest go to the sink slot 0.
            if not self.skip_decode_injection:
                committed = torch.arange(width, device=self.device)[None, :] < commit_lens[:, None]
                slots = torch.where(committed, verify_slots, 0).view(-1)
                features = self.features.arrange(logits_output.hidden_states)  # [bs*W, K*H]
                ops.inject_context_kv(self.draft_model, self.store, features, positions.reshape(-1), slots)
            self._hand_over_hidden_states(batch, logits_output)
        if self.trace_file is not None:
            self._trace(batch, seq_lens, host_lens, proposals)
        self.timer.end_step(
            bs, width=width, probe=self.width_policy is not None and self.width_policy.probing
        )

        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=verified.can_run_cuda_graph,
            next_draft_input=make_draft_input(new_bonus, new_seq_lens),
            speculative_num_draft_tokens=width,
            new_seq_lens=new_seq_lens,
            # Captured per verify slot; a rejected slot is rewritten by the next verify of its
            # position, so each committed slot ends up with its committed token's values.
            routed_experts_output=verified.routed_experts_output,
            indexer_topk_output=verified.indexer_topk_output,
        )

    def _sampling_masks(self, batch: ScheduleBatch, logits, out_tokens, commit_lens):
        """`return_sampling_mask`: the support and logprob of every window row's token, for the
        requests that asked (`sampling_mask.py`); SGLang's result processor keeps the committed
        rows. logits [bs*W, V] adjusted, out_tokens [bs, W], commit_lens [bs]."""
        from sglang.srt.layers.logits_processor import SamplingMaskOutput

        info = batch.sampling_info
        requests = info.sampling_mask_batch_indices  # [r] device rows, in batch order
        bs, width = out_tokens.shape
        masks = sampling_mask.sampling_masks(
            logits.view(bs, width, -1).index_select(0, requests).flatten(0, 1),
            SamplingRows.from_sampling_info(info).select(requests),
            out_tokens.index_select(0, requests),
            self.sampling_mask_max_tokens,
            info.sampling_support_logprobs_capture_indices,
        )
        return SamplingMaskOutput(**masks, num_accept_tokens=commit_lens.index_select(0, requests))

    def _choose_off_forward(self) -> tuple[bool, str]:
        """How a step at width 1 (no draft) runs the target, chosen once: its plain DECODE
        forward, or on the CPU engine with the batched verify attention, a verify forward over a
        window of one (exactly decode attention, in one SDPA per layer for the batch instead of
        SGLang's per-request decode loop: 12.5 vs 13.4 ms a step at batch 25, docs/verify-width.md)."""
        override = os.environ.get(OFF_FORWARD_ENV)
        if override not in (None, "", "decode", "verify"):
            raise ValueError(f"{OFF_FORWARD_ENV} must be decode or verify, got {override!r}")
        if override:
            return override == "decode", f"{override} forward ({OFF_FORWARD_ENV}={override})"
        if torch.device(self.device).type == "cpu" and verify_attention.mode() == "batched":
            return False, "a verify forward over one token (batched CPU verify attention)"
        return True, "the target's decode forward"

    def _choose_width(self, bs: int, context: int, reqs) -> int:
        """This step's verify width for the `bs` requests `reqs` holding `context` committed
        tokens (a host count), and the interval since the last decode step's start fed to the
        policy's cost model (host clocks only)."""
        now = time.perf_counter()
        if self.test_width1_steps > 0:  # test aid: speculation off for the first N decode steps
            self.test_width1_steps -= 1
            width = 1
        elif self.width_policy is None:
            width = self.num_draft_tokens
        else:
            if self._last_decode is not None and self._last_decode[4]:
                start, last_bs, last_width, last_context, _ = self._last_decode
                self.width_policy.observe_step(last_bs, last_width, now - start, last_context)
            width = self.width_policy.choose(bs, context, [req.rid for req in reqs])
        # Intervals that are not a step's steady cost are not measured: the server's first
        # decode steps (one-time start-up costs), and the first decode step after an extend
        # (the scheduler also settles the extend's results in it).
        self._decode_steps += 1
        measured = self._last_decode is not None and self._decode_steps > COLD_DECODE_STEPS
        self._last_decode = (now, bs, width, context, measured)
        if self.metrics is not None:
            self.metrics.observe_width(width)
        return width

    def _draft(
        self, batch: ScheduleBatch, width: int, host_lens: torch.Tensor, host_lens_exact: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft forward over the full trained block -> the block's first W ids [bs, W]
        (`[bonus, MASK ...]`), their positions [bs, W], and the draft's final hidden states at
        window positions 1..W-1 [bs, W-1, H] (read out by the LM head into the proposals)."""
        draft_input: DFlashDraftInputV2 = batch.spec_info
        # [bs, Bd] x2, [bs, Bd, H]; `hidden` may be a graph's static output, which the target's
        # verify graph may overwrite (a shared pool): it is read before the verify.
        block_ids, block_positions, hidden = self.draft_step(
            self.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            draft_input.bonus_tokens,
            batch.seq_lens,
            host_lens,
            host_lens_exact,
        )
        return block_ids[:, :width], block_positions[:, :width], hidden[:, 1:width]

    def _verify(self, batch: ScheduleBatch, candidates, positions, verify_slots) -> GenerationBatchResult:
        """One TARGET_VERIFY forward of the target over the window, a plain causal chain."""
        width = candidates.shape[1]
        verify_input = DFlashVerifyInput(
            draft_token=candidates.reshape(-1),
            positions=positions.reshape(-1),
            draft_token_num=width,
            custom_mask=None,
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
        batch.out_cache_loc = verify_slots.reshape(-1)
        # Attention planning reads host lengths; during verify they cover the window too.
        seq_lens_cpu, seq_lens_sum = batch.seq_lens_cpu, batch.seq_lens_sum
        if seq_lens_cpu is not None:
            batch.seq_lens_cpu = seq_lens_cpu + width
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        # Planning is left to the forward (ModelRunner plans a verify batch that is not marked
        # planned, once, eager or graphed); planning here too would plan every verify twice.
        forward_batch, _ = verify_input.prepare_for_verify(
            batch, self.target_worker, defer_metadata_init=True
        )
        batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum
        return self.target_worker.forward_batch_generation(
            batch=None, forward_batch=forward_batch, is_verify=True
        )

    def _decode(
        self, batch: ScheduleBatch, bonus: torch.Tensor, slots: torch.Tensor
    ) -> GenerationBatchResult:
        """W = 1: the target's ordinary DECODE forward over each request's bonus token [bs, 1],
        written to `slots` [bs, 1], keeping the captured layers for the draft's injection."""
        seq_lens, seq_lens_cpu, seq_lens_sum = batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum
        forward_mode = batch.forward_mode
        # A decode forward's lengths include its input token.
        batch.forward_mode = ForwardMode.DECODE
        batch.input_ids = bonus.view(-1)
        batch.out_cache_loc = slots.view(-1)
        batch.seq_lens = seq_lens + 1
        if seq_lens_cpu is not None:
            batch.seq_lens_cpu = seq_lens_cpu + 1
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        try:
            return self.target_worker.forward_batch_generation(
                batch, capture_hidden_mode=CaptureHiddenMode.FULL, is_verify=True
            )
        finally:
            batch.forward_mode, batch.seq_lens = forward_mode, seq_lens
            batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum

    def _forward_idle(self, on_publish) -> GenerationBatchResult:
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        if on_publish is not None:
            on_publish(empty)
        return GenerationBatchResult(
            next_token_ids=empty,
            accept_lens=torch.empty((0,), dtype=torch.int32, device=self.device),
            next_draft_input=make_draft_input(empty, empty),
            speculative_num_draft_tokens=self.num_draft_tokens,
            new_seq_lens=empty,
        )

    # ------------------------------------------------------------------ helpers

    def _hand_over_hidden_states(self, batch: ScheduleBatch, logits_output, extend: bool = False) -> None:
        """After injection: `hidden_states` held the draft's captured target layers, which the
        scheduler must not copy out. For requests that asked for hidden states it gets the
        target's final hidden states instead, laid out as without speculation: one row per
        forward token, or after a prefill in LAST mode (--return-hidden-states-mode last) one
        row per request, its last token's (the scheduler decides which, with the rule below)."""
        final = logits_output.last_hidden_states
        logits_output.last_hidden_states = None
        if final is not None and batch.return_hidden_states:
            if extend and SchedulerBatchResultProcessor._get_prefill_hidden_capture_mode(batch).is_last():
                # E.g., extend_lens [3, 2] -> rows [2, 4].
                last = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0) - 1
                final = final[last.to(final.device, non_blocking=True)]
        else:
            final = None
        logits_output.hidden_states = final

    def _simulate(self, candidates: torch.Tensor, logits: torch.Tensor):
        from sglang.srt.speculative.spec_utils import sample_simulated_acc_len

        mean, method, token_mode = self.simulated_acceptance
        commit_len = sample_simulated_acc_len(mean, method, candidates.shape[1])
        target_predict = torch.argmax(logits, dim=-1).view(candidates.shape)
        return forced_acceptance(
            candidates, target_predict, commit_len, real_draft_tokens=token_mode == "real-draft-token"
        )

    def _trace(
        self, batch: ScheduleBatch, seq_lens: torch.Tensor, host_lens: torch.Tensor, proposals: torch.Tensor
    ) -> None:
        """Test aid: record each request's verified proposals per step, with its committed length
        on the device and the host length the draft's attention plans with (host sync; off by
        default)."""
        rows = zip(batch.reqs, seq_lens.tolist(), host_lens.tolist(), proposals.tolist())
        for req, prefix, host_prefix, row in rows:
            record = {"rid": req.rid, "prefix_len": prefix, "host_prefix_len": host_prefix, "proposals": row}
            self.trace_file.write(json.dumps(record) + "\n")
        self.trace_file.flush()

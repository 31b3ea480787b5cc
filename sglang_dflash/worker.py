"""`DFlashWorker`: the speculative worker SGLang runs for `--speculative-algorithm DFLASH`.

One decode step, for a batch of bs requests with committed lengths `seq_lens`, runs as stages
over one record (`DecodeStep`, `integration/decode_step.py`):

  1. propose:    the step's verify width W (`width/step.py`); the block `[bonus, MASK x (Bd-1)]`
                 -> one draft forward over the draft KV store, eager or from a CUDA graph
                 (`draft/step.py`) -> proposals d1 .. d_{W-1} (`propose/proposers.py`). At W = 1
                 no draft runs.
  2. constrain:  under a grammar (`propose/grammar.py`), a mask for every verify row, and with
                 grammar-aware proposals (on by default, `SGLANG_DFLASH_GRAMMAR_PROPOSALS=0`
                 turns them off) only proposals the grammar allows.
  3. verify:     one target TARGET_VERIFY forward over `[bonus, d1 .. d_{W-1}]` as a causal chain
                 (at W = 1, by default, the target's decode forward).
  4. accept and commit: the longest run of proposals equal to the target's predictions, plus its
                 next token, on the target's logits adjusted as decode steps would (penalties,
                 grammar mask, logit_bias, custom logit processors: `verify/verifier.py`);
                 `new_seq_lens = seq_lens + accept_len + 1`, published to the scheduler; logprobs
                 from the same logits for requests that ask.
  5. inject:     the committed tokens' target features -> context K/V in the draft KV store (at
                 W = 1 queued, and injected in bulk before the next draft or extend:
                 `draft/deferred_injection.py`).

Prefill and extend chunks run the target forward and inject every new token. Bd is the
checkpoint's trained block size; B (`--speculative-num-draft-tokens`) <= Bd is the widest
verify, and W this step's: the draft always runs its full trained block, and only W tokens are
verified.

The draft side (checkpoint, network, store, attention, draft step, verifier) is built by
`DraftRuntime` (`runtime.py`), in the two phases of SGLang's hooks. The environment's knobs are
parsed and checked once, at start-up (`knobs.py`, docs/knobs.md), and the aids among them resolved
into what the step calls (`integration/step_aids.py`). See docs/architecture.md ("How it works").
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.runtime_context import get_disagg, get_exec, get_memory, get_model, get_parallel, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker, HiCacheDraftMode, HiCacheDraftPlan
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

from sglang_dflash import IMPL_NAME, __version__
from sglang_dflash.draft.attention import planning_lens
from sglang_dflash.draft.block import extend_last_rows, extend_positions, extend_requests, gather_slots
from sglang_dflash.draft.deferred_injection import DeferredInjection, why_not_deferred
from sglang_dflash.draft.tensor_parallel import TensorParallel
from sglang_dflash.draft.window_misses import WindowMisses
from sglang_dflash.integration import draft_budget, returned_hidden_states
from sglang_dflash.integration.decode_step import DecodeStep, idle_result, make_draft_input, proposal_inputs
from sglang_dflash.integration.draft_context import DraftContextCheck
from sglang_dflash.integration.draft_pool import DraftKVPool
from sglang_dflash.integration.linear_state import LinearStateCommit
from sglang_dflash.integration.metrics import DFlashMetrics
from sglang_dflash.integration.step_aids import StepAids, skipped
from sglang_dflash.integration.target_forward import decode_forward, replays_decode, verify_forward
from sglang_dflash.knobs import Knobs
from sglang_dflash.propose.grammar import GrammarWindow
from sglang_dflash.propose.proposers import LiLiCorrProposer, Proposals
from sglang_dflash.runtime import DraftRuntime
from sglang_dflash.step_timer import StepTimer
from sglang_dflash.verify.acceptance import simulated_warning
from sglang_dflash.verify.sampling_mask import sampling_mask_output
from sglang_dflash.width.step import StepWidth
from sglang_dflash.width.verify_runners import start_up_costs, verify_widths_for
from sglang_dflash.width.verify_widths import widths_to_build

logger = logging.getLogger(__name__)


def _draft_tensor_parallel(parallel) -> TensorParallel:
    """This rank's shard of the draft: SGLang's whole TP group. With DP attention or context
    parallelism the target's attention runs on a smaller group; both are refused at start-up
    (`integration/server_args.py`), and this says so if a server got here another way."""
    if parallel.attn_tp_size != parallel.tp_size:
        raise ValueError(
            f"sglang-dflash shards the draft over the whole TP group (tp_size {parallel.tp_size}); "
            f"attention TP size {parallel.attn_tp_size} (DP attention or context parallelism) "
            "is not supported"
        )
    return TensorParallel.from_sglang()


class _StepReadsHostLengths:
    """The decode step among the scheduler's attention backends: it needs host lengths."""

    needs_cpu_seq_lens = True


STEP_READS_HOST_LENGTHS = _StepReadsHostLengths()


def _offloads_draft_kv() -> bool:
    """Whether cached slots are backed up to host memory (HiCache, or a PD decode engine's
    retraction backup), and with them the draft's K/V."""
    memory = get_memory()
    return bool(memory.enable_hierarchical_cache or _draft_kv_offloads())


def _draft_kv_offloads() -> Optional[str]:
    """What backs cached slots up beyond HiCache's host memory, by its flag (None: nothing)."""
    memory = get_memory()
    if memory.hicache_storage_backend is not None:
        return f"--hicache-storage-backend {memory.hicache_storage_backend}"
    if memory.enable_unified_cache_external_linker:
        return "--enable-unified-cache-external-linker"
    if get_disagg().disaggregation_decode_retraction_backup == "host_pool":
        return "a PD decode engine's host-pool retraction backup"
    return None


class DFlashWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None  # the draft runs inside this worker, not in a TpModelWorker
        runner, spec = target_worker.model_runner, get_spec()
        self.device = runner.device
        self.knobs = Knobs.from_env()
        # The draft is sharded over SGLang's TP group, like the target's attention and MLPs.
        self.tp = _draft_tensor_parallel(get_parallel())
        self.num_draft_tokens = int(spec.speculative_num_draft_tokens)  # B, the widest verify
        self.runtime = DraftRuntime.from_spec(
            spec, get_model().load_format, runner, target_worker.tokenizer, self.tp, self.knobs
        )
        # SGLANG_DFLASH_DRAFT_WINDOW_POOL: whether the windowed layers may keep a window ring,
        # which the target's pool budget (sized after this) sets aside, and under auto decides
        # on; `alloc_memory_pool` reads the decision. None: it may.
        self.why_no_window_ring = self._window_pool()
        self.window_misses = None  # with a window ring: the drafts over positions it does not hold
        self.metrics = DFlashMetrics.from_runtime(self.num_draft_tokens)  # None without --enable-metrics
        self.step_width = StepWidth(
            self.num_draft_tokens, self.device, self.tp.size, self.knobs, self.metrics
        )
        self.grammar_window = GrammarWindow(
            propose=self.knobs.grammar_proposals, vocab_size=self.runtime.vocab_size
        )
        self.returns_hidden_states = returned_hidden_states.keep_final_hidden_states(runner.model)
        self._why_not_deferred = why_not_deferred(
            switched_off=not self.knobs.deferred_injection,
            offloads=_offloads_draft_kv(),
            disaggregation=str(get_disagg().disaggregation_mode),
            last_tokens=isinstance(self.runtime.proposer, LiLiCorrProposer),
        )
        # Steps at W = 1 queue their tokens' features for one bulk injection; None: inject each step.
        self.deferred = None if self._why_not_deferred else DeferredInjection(self.runtime.inject)
        # None unless the target is hybrid.
        self.linear_state = LinearStateCommit.for_target(runner, skip=self.knobs.skip_state_commit)
        self.sampling_mask_max_tokens = int(get_exec().features.sampling_mask_max_tokens)
        self.verify_widths = None  # the target's backend and graphs per verify width (start-up)
        self.timer = StepTimer(self.knobs.step_timing, self.device)  # no-op unless SGLANG_DFLASH_STEP_TIMING
        self.aids = StepAids.from_knobs(self.knobs, self.tp, self.num_draft_tokens)
        self.runtime.trace_features = self.aids.trace_features
        # SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION: decode steps inject no context K/V.
        self._inject_committed = skipped if self.knobs.skip_decode_injection else self._inject_committed_kv
        self._log_start_up()

    def _window_pool(self) -> Optional[str]:
        """Why the windowed layers keep K/V for every token (None: a window ring is declared to
        the target's budget): `draft_budget.why_no_window_ring`."""
        reason = draft_budget.why_no_window_ring(
            self.knobs.window_pool,
            device_type=torch.device(self.device).type,
            windowed_layers=self.runtime.window_layers,
            disaggregation=str(get_disagg().disaggregation_mode),
            offloads=_draft_kv_offloads(),
        )
        if reason is not None:
            return reason
        budget = self.runtime.window_budget(
            reprefill=not self.knobs.skip_window_reprefill, auto=self.knobs.window_pool == "auto"
        )
        draft_budget.declare(budget)
        return None

    def _windowed_line(self) -> str:
        """Which draft layers are windowed, and what they keep (`draft/window_ring.py`)."""
        layers = list(self.runtime.window_layers)
        if not layers:
            return "none"
        if self.why_no_window_ring is not None:
            return f"{layers}, K/V for every token ({self.why_no_window_ring})"
        rows, reach = self.runtime.window_ring(1).rows_per_request, self.runtime.window_reach
        ring = f"a window ring of {rows} rows per request slot (reach {reach} + block)"
        if self.knobs.window_pool == "auto":
            return f"{layers}, {ring} where the target's pool gains (decided as SGLang sizes it)"
        return f"{layers}, {ring}"

    def _log_start_up(self) -> None:
        """One line: what serves DFLASH here, each field from the component that owns it."""
        fields = self.runtime.describe() + [
            ("verify_width", self.step_width.describe()),
            ("grammar_aware_proposals", self.grammar_window.propose),
            ("hidden_states", self.returns_hidden_states),
            ("linear_attention_state_commit", self.linear_state is not None),
            ("width1_injection", f"off ({self._why_not_deferred})" if self.deferred is None else "deferred"),
            ("draft_kv_windowed_layers", self._windowed_line()),
        ]
        line = " ".join(f"{name}={value}" for name, value in fields)
        aids = "".join(f" [{aid}]" for aid in self.knobs.aids_on())
        logger.info("DFLASH is served by %s %s: %s%s", IMPL_NAME, __version__, line, aids)
        if self.knobs.simulated_acceptance is not None:
            logger.warning(simulated_warning(self.knobs.simulated_acceptance))

    # ------------------------------------------------------------ scheduler API

    @property
    def model_runner(self):
        return self.target_worker.model_runner

    @property
    def spec_v2_attn_backends(self) -> tuple:
        """What the scheduler ORs `needs_cpu_seq_lens` over (`decide_needs_cpu_seq_lens`): the
        target's attention backend and this step, which reads the host lengths every decode
        step (the draft attention's planning, `planning_lens`; the width policy's context).
        SGLang's Triton backend says it needs none, and overlap scheduling then drops them."""
        return (self.target_worker.model_runner.attn_backend, STEP_READS_HOST_LENGTHS)

    @property
    def width_policy(self):
        """The adaptive width policy, fed acceptance by `metrics.resolve_spec_tokens_hook`."""
        return self.step_width.policy

    @property
    def context_check(self) -> Optional[DraftContextCheck]:
        """On a PD decode engine: which requests arrived without their draft K/V."""
        return self.runtime.context_check

    def _build_hicache_draft_plan(self) -> HiCacheDraftPlan:
        """HiCache backs up and reloads the draft's K/V as a sidecar of the target's, at the
        target's host slots (SGLang's plan for a non-packed draft pool); the base class finds no
        draft runner here and would plan nothing."""
        plan = super()._build_hicache_draft_plan()  # also resets the target runner's MTP pools
        if plan.mode != HiCacheDraftMode.NONE or not _offloads_draft_kv() or self.knobs.skip_draft_hicache:
            return plan
        if self.runtime.kv_pool is None:  # an all-windowed ring: a reloaded prefix re-prefills it all
            return plan
        return HiCacheDraftPlan(mode=HiCacheDraftMode.SIDECAR, device_pools=(self.runtime.kv_pool,))

    @property
    def primary_draft_kv_pool(self) -> Optional[DraftKVPool]:
        """Prefill/decode disaggregation transfers this pool's buffers with the target's (never
        with a window ring, which PD refuses: the pool then holds the full layers only)."""
        store = self.runtime.store
        if self.knobs.skip_draft_transfer or (store is not None and store.ring is not None):
            return None
        return self.runtime.kv_pool

    def alloc_memory_pool(
        self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        ring = draft_budget.ring_chosen()  # the target's budget has set it aside
        if not ring and self.why_no_window_ring is None:
            self.why_no_window_ring = draft_budget.declined()
        self.runtime.allocate(
            req_to_token_pool.req_to_token,
            self.model_runner.token_to_kv_pool,
            seed=self.target_worker.random_seed,
            enable_memory_saver=get_exec().features.enable_memory_saver,
            transfers_draft_kv=not self.knobs.skip_draft_transfer,
            metrics=self.metrics,
            window_pool=ring,
        )
        if ring:
            self.window_misses = WindowMisses(self.runtime.window_reach)
        elif self.runtime.kv_plan.sliding_layers:  # memory the target could have had: say why
            logger.warning(
                "DFLASH draft KV: sliding layers %s keep K/V for every token (%.1f MiB), not only their "
                "window: %s",
                list(self.runtime.kv_plan.sliding_layers),
                self.runtime.kv_plan.store_slots * self.runtime.kv_plan.sliding_bytes_per_token / 2**20,
                self.why_no_window_ring,
            )

    def init_cuda_graphs(self):
        """SGLang's last start-up hook, after the target's attention backends and graphs: the
        target's verify backends and graphs at the narrower widths, the draft step's warm-up
        and CUDA graphs, the width policy's start-up costs, and with step timing on, the count
        of the target's attention plans."""
        knobs = self.knobs
        self.verify_widths, described = verify_widths_for(
            self.model_runner,
            self.num_draft_tokens,
            knobs.verify_graphs,
            self.tp.size,
            widths_to_build(self.num_draft_tokens, knobs.adaptive_width, knobs.width1_steps, knobs.widths),
        )
        self.timer.count_attention_plans(self.model_runner.attn_backend)
        if self.verify_widths is not None:
            for width, pair in self.verify_widths.pairs.items():
                self.timer.count_attention_plans(pair.attn_backend, width)
            if self.verify_widths.graphed:  # SGLang's start-up accounting, as EAGLE's adaptive
                pairs = self.verify_widths.pairs.values()
                self._additional_graph_memory_usage["target_verify"] = sum(p.gigabytes for p in pairs)
                self._additional_graph_time_usage["target_verify"] = sum(p.seconds for p in pairs)
        req_to_token = self.req_to_token_pool.req_to_token
        self.runtime.warm_up(req_to_token)
        captured = self.runtime.capture_graphs(
            self.model_runner, req_to_token, self.knobs.draft_graphs, self.knobs.draft_plan_free
        )
        if captured is not None:
            # In SGLang's start-up accounting (server info, metrics) as the draft's decode graphs.
            used_gb, seconds = captured
            self._additional_graph_memory_usage["draft_decode"] = used_gb
            self._additional_graph_time_usage["draft_decode"] = seconds
        if self.verify_widths is not None:
            self.step_width.use_verify_widths(self.verify_widths.widths, self.verify_widths.graphed)
            if self.step_width.wants_costs:  # a fixed width reads no cost table: none is timed
                table, costs = start_up_costs(self.model_runner, self.verify_widths, self.runtime.step)
                self.step_width.seed(table)
                described += f"; step costs: {costs}"
        if not replays_decode(self.model_runner.decode_cuda_graph_runner):
            self.step_width.decode_runs_eager("the target's CUDA graphs are TARGET_VERIFY graphs")
        logger.info(
            "DFLASH verify backends per width: %s; verify_width=%s", described, self.step_width.describe()
        )

    def server_info(self) -> str:
        return f"{IMPL_NAME} {__version__}"

    def forward_batch_generation(
        self, batch: ScheduleBatch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None
    ) -> GenerationBatchResult:
        if batch.forward_mode.is_idle():
            self.step_width.not_decoding()
            return idle_result(self.device, self.num_draft_tokens, on_publish)
        with self.runtime.verifier.seeded(batch):
            if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
                return self._forward_extend(batch, on_publish, grammar_barrier)
            return self._forward_decode(batch, on_publish, grammar_barrier)

    # ------------------------------------------------------------------ steps

    def _forward_extend(self, batch: ScheduleBatch, on_publish, grammar_barrier) -> GenerationBatchResult:
        """Prefill / extend chunk / mixed batch: target forward, then inject every new token."""
        self.step_width.not_decoding()  # the interval across an extend step is not a decode step's cost
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
            if self.deferred is not None:  # the queued writes first: slots may have been reused
                self.deferred.flush()
                self.deferred.take_flush_seconds()  # an extend's interval is not measured anyway
            positions = extend_positions(batch.prefix_lens, batch.extend_lens, self.device)
            last_rows, token_reqs = None, None
            if self.runtime.last_tokens is not None:  # each request's last new token
                last_rows = extend_last_rows(batch.extend_lens, self.device)
            if self.window_misses is not None:  # the window ring's rows are per request slot
                token_reqs = extend_requests(batch.req_pool_indices, batch.extend_lens)
                self.window_misses.extend(batch.reqs, batch.prefix_lens, batch.extend_lens)
            self.runtime.inject(
                logits_output.hidden_states,
                positions,
                batch.out_cache_loc,
                last_rows,
                batch.req_pool_indices,
                token_reqs,
            )
            returned_hidden_states.hand_over(batch, logits_output, extend=True)
            self.runtime.verifier.start_requests(batch)
            result.next_draft_input = make_draft_input(result.next_token_ids, batch.seq_lens)
        self.timer.end_step(len(batch.reqs), kind="extend")
        return result

    def _forward_decode(self, batch: ScheduleBatch, on_publish, grammar_barrier) -> GenerationBatchResult:
        """One decode step, stage by stage over one `DecodeStep` record."""
        step, proposed = self._propose(batch)
        self._constrain(step, batch, proposed, grammar_barrier)
        del proposed  # its logits [bs, W-1, V] are not kept alive through the verify forward
        self._verify(step, batch)
        self._accept_and_commit(step, batch, on_publish)
        self._inject(step, batch)
        if self.deferred is not None:  # its cost belongs to the steps that queued it
            self.step_width.exclude(self.deferred.take_flush_seconds())
        self.aids.trace(step, batch.reqs)
        self.step_width.end_step()
        self.timer.end_step(step.bs, width=step.width, probe=self.step_width.probing)
        return step.result()

    def _propose(self, batch: ScheduleBatch) -> tuple[DecodeStep, Proposals]:
        """Stage 1: this step's width W and the draft's proposals d1 .. d_{W-1} (none at W = 1,
        which runs no draft)."""
        seq_lens = batch.seq_lens  # [bs] committed lengths
        draft_input: DFlashDraftInputV2 = batch.spec_info
        # [bs] host committed lengths to plan the draft's attention with (no device sync), exact
        # when the scheduler has them, else upper bounds.
        host_lens, host_lens_exact = planning_lens(batch.seq_lens_cpu, draft_input.nxt_kv_lens_cpu)
        # W: the verify width of this step, 1 <= W <= B.
        width = self.step_width.choose(
            seq_lens.shape[0], batch.seq_lens_sum or 0, [r.rid for r in batch.reqs]
        )
        # W = 1 through the target's decode forward (else a verify over the window).
        step = DecodeStep(seq_lens, host_lens, width, decoded=width == 1 and self.step_width.decode_when_off)
        if width == 1:
            # Speculation off for this step: no draft; the target runs one token per request.
            step.candidates = draft_input.bonus_tokens.to(torch.int64)[:, None]  # [bs, 1]
            step.positions = seq_lens.to(torch.int64)[:, None]  # [bs, 1]
            return step, Proposals(step.candidates[:, 1:])  # [bs, 0]
        if self.deferred is not None:
            with self.timer.phase("inject"):
                self.deferred.flush()  # the draft reads the tokens committed at W = 1
        with self.timer.phase("draft"):
            # [bs, W] x2, [bs, Bd, H]
            block_ids, step.positions, block_hidden = self._draft(batch, width, host_lens, host_lens_exact)
            step.candidates = block_ids[:, :1]  # [bs, 1]: the bonus, before its proposals
            inputs = proposal_inputs(
                batch, block_ids, step.positions, block_hidden, self.req_to_token_pool.req_to_token
            )
            return step, self.runtime.proposer(block_hidden[:, :width], inputs)

    def _constrain(self, step: DecodeStep, batch: ScheduleBatch, proposed: Proposals, grammar_barrier):
        """Stage 2: the window `[bonus, d1 .. d_{W-1}]`, its proposals re-picked where a grammar
        forbids them, with the grammar's mask over its rows."""
        step.proposals, step.draft_q = proposed.tokens, proposed.q  # [bs, W-1]; q: None for point masses
        if batch.has_grammar:
            with self.timer.phase("grammar"):
                if grammar_barrier is not None:
                    grammar_barrier()  # the matchers first take in the previous step's tokens
                step.proposals, step.grammar_mask = self.grammar_window(
                    batch.reqs, step.proposals, proposed.logits, proposed.fallback
                )
                if step.draft_q is not None:  # a re-picked proposal is a point mass
                    step.draft_q = step.draft_q.pinned(step.proposals)
        if step.width > 1:
            step.candidates = torch.cat([step.candidates, step.proposals], dim=1)  # [bs, W] = [bonus, d1..]

    def _verify(self, step: DecodeStep, batch: ScheduleBatch) -> None:
        """Stage 3: the target's forward over the window, into the window's KV slots."""
        candidates, positions, width = step.candidates, step.positions, step.width
        req_to_token = self.req_to_token_pool.req_to_token
        with self.timer.phase("verify"):
            # The verify window's KV slots, reserved by prepare_for_decode.
            step.verify_slots = slots = gather_slots(
                req_to_token, batch.req_pool_indices, step.seq_lens, width
            )
            if step.decoded:
                step.verified = decode_forward(self.target_worker, batch, candidates, slots)
            else:
                with self._verify_backend(width):
                    step.verified = verify_forward(self.target_worker, batch, candidates, positions, slots)

    def _accept_and_commit(self, step: DecodeStep, batch: ScheduleBatch, on_publish) -> None:
        """Stage 4: the longest accepted run and its next token, on the logits adjusted as decode
        steps would; the committed lengths, published; the verifier's and the linear-attention
        state's commits; logprobs for requests that ask."""
        candidates, logits_output = step.candidates, step.logits_output
        with self.timer.phase("accept"):
            logits = logits_output.next_token_logits  # [bs*W, V]
            accept_len, out_tokens, new_bonus, logits = self.runtime.verifier.verify(
                batch, candidates, logits, step.positions, step.grammar_mask, step.draft_q
            )
            accept_len, out_tokens, new_bonus = self.aids.accepted(
                candidates, logits, (accept_len, out_tokens, new_bonus)
            )
            step.logits, step.out_tokens, step.new_bonus = logits, out_tokens, new_bonus
            step.commit_lens = commit_lens = (accept_len + 1).to(torch.int32)
            if batch.sampling_info.sampling_mask_batch_indices is not None:
                logits_output.sampling_mask_output = sampling_mask_output(
                    batch, logits, out_tokens, commit_lens, self.sampling_mask_max_tokens
                )
            self.aids.check_ranks(candidates=candidates, commit_lens=commit_lens, tokens=out_tokens)
            self.runtime.verifier.commit(batch, candidates, commit_lens)
            if self.linear_state is not None and not step.decoded:
                # (A decode forward advanced the linear-attention state itself.)
                self.linear_state(batch, step.seq_lens, commit_lens)
            step.new_seq_lens = step.seq_lens + commit_lens.to(step.seq_lens.dtype)
            if on_publish is not None:
                on_publish(step.new_seq_lens)
        if batch.return_logprob:
            with self.timer.phase("logprobs"):
                step.compute_logprobs(batch)

    def _inject(self, step: DecodeStep, batch: ScheduleBatch) -> None:
        """Stage 5: the committed tokens' captured target layers -> their context K/V in the draft
        KV store (queued at W = 1 when deferred); then the final hidden states requests asked for
        take the captured layers' place in the output."""
        with self.timer.phase("inject"):
            self._inject_committed(step, batch)
            returned_hidden_states.hand_over(batch, step.logits_output)

    def _inject_committed_kv(self, step: DecodeStep, batch: ScheduleBatch) -> None:
        """The committed tokens (bonus, d1..d_accept) -> their context K/V; the rest go to the sink
        slot 0."""
        captured, slots = step.logits_output.hidden_states, step.injection_slots(self.device)  # [bs*W]
        last_rows = None
        if self.runtime.last_tokens is not None:  # row b*W + commit_len - 1: the new last token
            last_rows = step.last_rows(self.device)
        positions = step.positions.reshape(-1)
        token_reqs = batch.req_pool_indices[:, None].expand(step.positions.shape).reshape(-1)  # [bs*W]
        if step.width == 1 and self.deferred is not None:  # no draft reads it before a flush
            self.deferred.push(captured, positions, slots, token_reqs)
        else:
            self.runtime.inject(captured, positions, slots, last_rows, batch.req_pool_indices, token_reqs)

    def _verify_backend(self, width: int):
        """The target's attention backend and graph runner of this width, for its verify."""
        if self.verify_widths is None:
            return contextlib.nullcontext()
        return self.verify_widths.active(width)

    def _draft(
        self, batch: ScheduleBatch, width: int, host_lens: torch.Tensor, host_lens_exact: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft forward over the full trained block -> the block's first W ids [bs, W]
        (`[bonus, MASK ...]`), their positions [bs, W], and the draft's final hidden states over
        the whole block [bs, Bd, H] (read out into the proposals: `propose/proposers.py`)."""
        draft_input: DFlashDraftInputV2 = batch.spec_info
        # [bs, Bd] x2, [bs, Bd, H]; `hidden` may be a graph's static output, which the target's
        # verify graph may overwrite (a shared pool): it is read before the verify.
        block_ids, block_positions, hidden = self.runtime.step(
            self.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            draft_input.bonus_tokens,
            batch.seq_lens,
            host_lens,
            host_lens_exact,
        )
        return block_ids[:, :width], block_positions[:, :width], hidden

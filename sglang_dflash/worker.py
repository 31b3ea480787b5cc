"""`DFlashWorker`: the speculative worker SGLang runs for `--speculative-algorithm DFLASH`.

One decode step, for a batch of bs requests with committed lengths `seq_lens`:

  1. draft:   block `[bonus, MASK x (Bd-1)]` -> one draft forward over the draft KV store,
              eager or from a CUDA graph (`draft/step.py`)
              -> proposals at block positions 1..W-1 (`propose/proposers.py`: the target's lm_head
              argmax).
  2. verify:  one target TARGET_VERIFY forward over `[bonus, d1 .. d_{W-1}]` as a causal chain.
  3. accept:  longest run of proposals equal to the target's predictions, plus its next token;
              the target's logits adjusted first as decode steps would (penalties, grammar
              mask, logit_bias, custom logit processors: `verify/verifier.py`), and logprobs taken from
              them for requests that ask.
  4. commit:  `new_seq_lens = seq_lens + accept_len + 1`, published to the scheduler.
  5. inject:  the committed tokens' target features -> context K/V in the draft KV store
              (at W = 1 queued, and injected in bulk before the next draft or extend:
              `draft/deferred_injection.py`).

Grammar-constrained requests (`propose/grammar.py`) get a mask for every verify row, and with
grammar-aware proposals (on by default, `SGLANG_DFLASH_GRAMMAR_PROPOSALS=0` turns them off)
the draft proposes only tokens their grammar allows.

Prefill and extend chunks run the target forward and inject every new token (step 5).
Bd is the checkpoint's trained block size; B (`--speculative-num-draft-tokens`) <= Bd is the
widest verify, and W (`width/step.py`) this step's: the draft always runs its full trained
block, and only W tokens are verified.

The draft side (checkpoint, network, store, attention, draft step, verifier) is built by
`DraftRuntime` (`runtime.py`), in the two phases of SGLang's hooks; the environment's
knobs are read once (`knobs.py`). See docs/architecture.md ("How it works").
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Optional

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.model_loader.weight_utils import initialize_dummy_weights
from sglang.srt.runtime_context import get_disagg, get_exec, get_memory, get_model, get_parallel, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker, HiCacheDraftMode, HiCacheDraftPlan
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

from sglang_dflash import IMPL_NAME, __version__
from sglang_dflash.checkpoint.config import resolve_checkpoint_dir
from sglang_dflash.draft.attention import planning_lens
from sglang_dflash.draft.block import extend_last_rows, extend_positions, gather_slots
from sglang_dflash.draft.deferred_injection import DeferredInjection, why_not_deferred
from sglang_dflash.draft.tensor_parallel import TensorParallel, check_ranks_agree
from sglang_dflash.integration import returned_hidden_states
from sglang_dflash.integration.draft_context import DraftContextCheck
from sglang_dflash.integration.draft_pool import DraftKVPool
from sglang_dflash.integration.linear_state import LinearStateCommit
from sglang_dflash.integration.metrics import DFlashMetrics
from sglang_dflash.integration.server_args import draft_load_format
from sglang_dflash.integration.target_forward import decode_forward, verify_forward
from sglang_dflash.knobs import Knobs
from sglang_dflash.propose.grammar import GrammarWindow
from sglang_dflash.propose.proposers import LiLiCorrProposer, ProposalInputs, Proposals
from sglang_dflash.runtime import DraftRuntime
from sglang_dflash.step_timer import StepTimer
from sglang_dflash.verify.acceptance import simulated_acceptance
from sglang_dflash.verify.sampling_mask import sampling_mask_output
from sglang_dflash.width.step import StepWidth
from sglang_dflash.width.verify_runners import cost_table, verify_widths_for

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


class _StepReadsHostLengths:
    """The decode step among the scheduler's attention backends: it needs host lengths."""

    needs_cpu_seq_lens = True


STEP_READS_HOST_LENGTHS = _StepReadsHostLengths()


def _offloads_draft_kv() -> bool:
    """Whether cached slots are backed up to host memory (HiCache, or a PD decode engine's
    retraction backup), and with them the draft's K/V."""
    memory = get_memory()
    return bool(
        memory.enable_hierarchical_cache
        or memory.enable_unified_cache_external_linker
        or get_disagg().disaggregation_decode_retraction_backup == "host_pool"
    )


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
        load_format = draft_load_format(spec.speculative_draft_load_format, get_model().load_format)
        self.runtime = DraftRuntime(
            resolve_checkpoint_dir(spec.speculative_draft_model_path, spec.speculative_draft_model_revision),
            runner,
            target_worker.tokenizer,
            self.tp,
            num_draft_tokens=self.num_draft_tokens,
            context_window=spec.speculative_draft_window_size,
            init_weights=initialize_dummy_weights if load_format == "dummy" else None,
            domino_pool_size=spec.speculative_domino_candidate_pool_size,
            lilicorr_sampled_walks=self.knobs.lilicorr_sampling,
        )
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
        self.check_ranks = self.tp.size > 1 and self.knobs.check_ranks
        self.timer = StepTimer(self.knobs.step_timing, self.device)  # no-op unless SGLANG_DFLASH_STEP_TIMING
        self.trace_file = open(self.knobs.trace_proposals, "a") if self.knobs.trace_proposals else None
        self._log_start_up()

    def _log_start_up(self) -> None:
        """One line: what serves DFLASH here, each field from the component that owns it."""
        fields = self.runtime.describe() + [
            ("verify_width", self.step_width.describe()),
            ("grammar_aware_proposals", self.grammar_window.propose),
            ("hidden_states", self.returns_hidden_states),
            ("linear_attention_state_commit", self.linear_state is not None),
            ("width1_injection", f"off ({self._why_not_deferred})" if self.deferred is None else "deferred"),
        ]
        line = " ".join(f"{name}={value}" for name, value in fields)
        aids = "".join(f" [{aid}]" for aid in self.knobs.aids_on())
        logger.info("DFLASH is served by %s %s: %s%s", IMPL_NAME, __version__, line, aids)
        if self.knobs.simulated_acceptance is not None:
            s = self.knobs.simulated_acceptance
            logger.warning(
                "DFLASH acceptance is SIMULATED (SGLANG_SIMULATE_ACC_LEN=%s, method=%s, tokens=%s): "
                "outputs are not the model's; benchmark use only",
                s.mean,
                s.method,
                s.token_mode,
            )

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
        return HiCacheDraftPlan(mode=HiCacheDraftMode.SIDECAR, device_pools=(self.runtime.kv_pool,))

    @property
    def primary_draft_kv_pool(self) -> Optional[DraftKVPool]:
        """Prefill/decode disaggregation transfers this pool's buffers with the target's."""
        return None if self.knobs.skip_draft_transfer else self.runtime.kv_pool

    def alloc_memory_pool(
        self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.runtime.allocate(
            req_to_token_pool.req_to_token,
            self.model_runner.token_to_kv_pool,
            seed=self.target_worker.random_seed,
            enable_memory_saver=get_exec().features.enable_memory_saver,
            transfers_draft_kv=not self.knobs.skip_draft_transfer,
            metrics=self.metrics,
        )

    def init_cuda_graphs(self):
        """SGLang's last start-up hook, after the target's attention backends and graphs: the
        target's verify backends and graphs at the narrower widths, the draft step's warm-up
        and CUDA graphs, the width policy's start-up costs, and with step timing on, the count
        of the target's attention plans."""
        self.verify_widths, described = verify_widths_for(
            self.model_runner, self.num_draft_tokens, self.knobs.verify_graphs, self.tp.size
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
            table, costs = None, "learnt online"
            if self.verify_widths.graphed:
                # The plan-free graphs where there are (they serve the short contexts), else the
                # split-KV ones; either replays its capture-time (empty) contexts.
                step = self.runtime.step
                draft_graphs = {size: g.graph for size, g in (step.plan_free or step.graphs).items()}
                table, costs = cost_table(self.model_runner, self.verify_widths, draft_graphs)
            self.step_width.use_verify_widths(self.verify_widths.widths, self.verify_widths.graphed, table)
            described += f"; step costs: {costs}"
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
            return self._forward_idle(on_publish)
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
            last_rows = None
            if self.runtime.last_tokens is not None:  # each request's last new token
                last_rows = extend_last_rows(batch.extend_lens, self.device)
            self.runtime.inject(
                logits_output.hidden_states, positions, batch.out_cache_loc, last_rows, batch.req_pool_indices
            )
            returned_hidden_states.hand_over(batch, logits_output, extend=True)
            self.runtime.verifier.start_requests(batch)
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
        width = self.step_width.choose(bs, batch.seq_lens_sum or 0, [req.rid for req in batch.reqs])
        # W = 1 through the target's decode forward (else a verify over the window).
        decoded = width == 1 and self.step_width.decode_when_off

        if width == 1:
            # Speculation off for this step: no draft; the target runs one token per request.
            candidates = draft_input.bonus_tokens.to(torch.int64)[:, None]  # [bs, 1]
            positions = seq_lens.to(torch.int64)[:, None]  # [bs, 1]
            proposed = Proposals(candidates[:, 1:])  # [bs, 0]
        else:
            if self.deferred is not None:
                with self.timer.phase("inject"):
                    self.deferred.flush()  # the draft reads the tokens committed at W = 1
            with self.timer.phase("draft"):
                # [bs, W] x2, [bs, Bd, H]
                block_ids, positions, block_hidden = self._draft(batch, width, host_lens, host_lens_exact)
                # With a grammar, its window ranks the draft's candidates by their logits.
                grammar_rows = [req.grammar is not None for req in batch.reqs] if batch.has_grammar else None
                inputs = ProposalInputs(block_ids[:, 0], positions, batch.sampling_info, grammar_rows)
                inputs.req_to_token = self.req_to_token_pool.req_to_token
                inputs.req_pool_indices = batch.req_pool_indices
                if width < block_hidden.shape[1]:
                    inputs.block_hidden = block_hidden
                proposed = self.runtime.proposer(block_hidden[:, :width], inputs)
        proposals, draft_q = proposed.tokens, proposed.q  # [bs, W-1]; q: None for point masses
        grammar_mask = None
        if batch.has_grammar:
            with self.timer.phase("grammar"):
                if grammar_barrier is not None:
                    grammar_barrier()  # the matchers first take in the previous step's tokens
                proposals, grammar_mask = self.grammar_window(
                    batch.reqs, proposals, proposed.logits, proposed.fallback
                )
                if draft_q is not None:  # a re-picked proposal is a point mass
                    draft_q = draft_q.pinned(proposals)
        del proposed  # its logits [bs, W-1, V] are not kept alive through the verify forward
        if width > 1:
            candidates = torch.cat([block_ids[:, :1], proposals], dim=1)  # [bs, W] = [bonus, d1..]

        with self.timer.phase("verify"):
            # The verify window's KV slots, reserved by prepare_for_decode.
            verify_slots = gather_slots(
                self.req_to_token_pool.req_to_token, batch.req_pool_indices, seq_lens, width
            )  # [bs, W]
            if decoded:
                verified = decode_forward(self.target_worker, batch, candidates, verify_slots)
            else:
                with self._verify_backend(width):
                    verified = verify_forward(self.target_worker, batch, candidates, positions, verify_slots)
            logits_output = verified.logits_output

        with self.timer.phase("accept"):
            logits = logits_output.next_token_logits  # [bs*W, V]
            accept_len, out_tokens, new_bonus, logits = self.runtime.verifier.verify(
                batch, candidates, logits, positions, grammar_mask, draft_q
            )
            if self.knobs.simulated_acceptance is not None:
                accept_len, out_tokens, new_bonus = simulated_acceptance(
                    candidates, logits, self.knobs.simulated_acceptance, self.num_draft_tokens
                )
            commit_lens = (accept_len + 1).to(torch.int32)
            if batch.sampling_info.sampling_mask_batch_indices is not None:
                logits_output.sampling_mask_output = sampling_mask_output(
                    batch, logits, out_tokens, commit_lens, self.sampling_mask_max_tokens
                )
            if self.check_ranks:
                check_ranks_agree(self.tp, candidates=candidates, commit_lens=commit_lens, tokens=out_tokens)
            self.runtime.verifier.commit(batch, candidates, commit_lens)
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
            if not self.knobs.skip_decode_injection:
                committed = torch.arange(width, device=self.device)[None, :] < commit_lens[:, None]
                slots = torch.where(committed, verify_slots, 0).view(-1)  # [bs*W]
                last_rows = None
                if self.runtime.last_tokens is not None:  # row b*W + commit_len - 1: the new last token
                    last_rows = torch.arange(bs, device=self.device) * width + commit_lens - 1
                if width == 1 and self.deferred is not None:  # no draft reads it before a flush
                    self.deferred.push(logits_output.hidden_states, positions.reshape(-1), slots)
                else:
                    self.runtime.inject(
                        logits_output.hidden_states,
                        positions.reshape(-1),
                        slots,
                        last_rows,
                        batch.req_pool_indices,
                    )
            returned_hidden_states.hand_over(batch, logits_output)
        if self.deferred is not None:  # its cost belongs to the steps that queued it
            self.step_width.exclude(self.deferred.take_flush_seconds())
        if self.trace_file is not None:
            self._trace(batch, seq_lens, host_lens, proposals)
        self.step_width.end_step()
        self.timer.end_step(bs, width=width, probe=self.step_width.probing)

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

    def _verify_backend(self, width: int):
        """The target's attention backend and graph runner of this width, for its verify."""
        if self.verify_widths is None:
            return contextlib.nullcontext()
        return self.verify_widths.active(width)

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

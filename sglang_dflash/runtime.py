"""`DraftRuntime`: the draft side of one engine, built in the two phases of SGLang's worker
hooks, and what it says about itself in the start-up line.

At the worker's construction (`DraftRuntime.from_spec`, from SGLang's speculative settings):
  the checkpoint's config, checked against the target (its mask token resolved with the
  target's tokenizer); the layout of the captured target layers the draft's `fc` reads; the
  draft network and its forward (fused kernels on CUDA where they apply, else the module's
  maths, chosen once); the target's embedding and LM head as the draft borrows them (with a
  trained mask row if the checkpoint has one); the proposer of the checkpoint's family.

At `alloc_memory_pool` (`allocate`), once SGLang has its pools:
  the draft KV store over the target's slot ids (plus FlashInfer's scratch slots); the draft
  attention (FlashInfer on CUDA where it applies, else PyTorch SDPA, chosen once); the
  verifier; the store as SGLang's KV pool; the draft step; on a PD decode engine, the check
  that requests arrive with their draft K/V.

At SGLang's last start-up hook: `warm_up`, then `capture_graphs` (`draft/step.py`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from sglang_dflash import ops
from sglang_dflash.checkpoint.config import DFlashDraftConfig, resolve_checkpoint_dir
from sglang_dflash.checkpoint.mask_token import load_mask_embedding, resolve_mask_token_id
from sglang_dflash.draft import flashinfer_attention, fused_forward
from sglang_dflash.draft.attention import SdpaDraftAttention
from sglang_dflash.draft.kv_plan import DraftKVPlan
from sglang_dflash.draft.kv_store import DraftKVStore, kv_cache_region, resolve_draft_kv_dtype
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.draft.step import PLAN_FREE_MAX_LEN, DraftStep, capture_in_sglang
from sglang_dflash.draft.target_features import (
    FeatureLayout,
    captured_layer_ids,
    captures_after_last_layer,
    target_depth,
)
from sglang_dflash.draft.target_head import TargetHead
from sglang_dflash.draft.tensor_parallel import TensorParallel
from sglang_dflash.draft.window_ring import WindowRing
from sglang_dflash.integration import draft_budget, draft_context
from sglang_dflash.integration.draft_budget import DraftBudget
from sglang_dflash.integration.draft_pool import DraftKVPool
from sglang_dflash.integration.server_args import draft_load_format
from sglang_dflash.integration.step_aids import skipped
from sglang_dflash.integration.target_pool import num_target_slots
from sglang_dflash.propose.domino import DEFAULT_POOL_SIZE
from sglang_dflash.propose.lilicorr import LastTokenStore
from sglang_dflash.propose.proposers import LiLiCorrProposer, ProposalInputs, proposer_for
from sglang_dflash.verify.verifier import Verifier

logger = logging.getLogger(__name__)


class DraftRuntime:
    def __init__(
        self,
        path: str,
        runner,
        tokenizer,
        tp: TensorParallel,
        *,
        num_draft_tokens: int,
        context_window: Optional[int] = None,
        init_weights: Optional[Callable] = None,
        domino_pool_size: int = DEFAULT_POOL_SIZE,
        lilicorr_sampled_walks: bool = True,
    ):
        """`path`: the checkpoint directory; `runner`: the target's ModelRunner; `tokenizer`:
        the target's (for a `mask_token` string); `num_draft_tokens`: B, the verify width;
        `context_window`: --speculative-draft-window-size; `init_weights`: SGLang's dummy
        initialiser for `--speculative-draft-load-format dummy`; `domino_pool_size`:
        --speculative-domino-candidate-pool-size (Domino drafts only); `lilicorr_sampled_walks`:
        sampled requests walk LiLiCorr's lattice by sampling (LiLiCorr drafts only)."""
        self.path = path
        self.tp = tp
        self.device = runner.device
        self.dtype = runner.dtype
        self.context_len = int(runner.model_config.context_len)
        self.vocab_size = int(runner.model_config.vocab_size)
        self.config, self.features = self._checked_config(path, runner, tokenizer, num_draft_tokens)
        self.trace_features: Callable = skipped  # (positions, features): the worker's aid, if on
        layer_ids = self.features.layer_ids
        self.block_size = self.config.block_size  # Bd, the trained draft block
        self.context_window = context_window  # the draft sees only the last W committed tokens

        self.draft_model = DFlashDraftModel.from_pretrained(
            path,
            self.config,
            len(layer_ids),
            dtype=self.dtype,
            device=self.device,
            tp=tp,
            init_weights=init_weights,
        )
        self.forward, self.forward_choice = self._choose_forward()
        self.head = TargetHead(runner.model, self.vocab_size, tp)  # the draft's embedding and LM head
        trained_mask_row = load_mask_embedding(path, self.config)
        if self.config.own_embedding:  # Nemotron-3.5: the draft's own table embeds the block
            self.head.use_draft_embedding(
                self.draft_model.embed_tokens, self.config.mask_token_id, trained_mask_row
            )
        elif trained_mask_row is not None:
            self.head.use_trained_mask_row(self.config.mask_token_id, trained_mask_row)
        self.proposer = proposer_for(self.draft_model, self.head, domino_pool_size, lilicorr_sampled_walks)

        # Built by `allocate`:
        self.store: Optional[DraftKVStore] = None
        self.kv_plan: Optional[DraftKVPlan] = None  # what the store costs, full and sliding layers apart
        self.attention = None  # SdpaDraftAttention or FlashInferDraftAttention
        self.attention_name = ""
        self.verifier: Optional[Verifier] = None
        self.kv_pool: Optional[DraftKVPool] = None  # the store, as SGLang's KV pool of the draft
        self.step: Optional[DraftStep] = None  # eager or graphed
        self.context_check: Optional[draft_context.DraftContextCheck] = None  # PD decode engines
        # LiLiCorr drafts: the context feature of each request's last committed token.
        self.last_tokens: Optional[LastTokenStore] = None

    @classmethod
    def from_spec(cls, spec, model_load_format: str, runner, tokenizer, tp: TensorParallel, knobs):
        """From SGLang's speculative settings (`get_spec()`), the target's load format and the
        worker's knobs: the checkpoint directory resolved (a local path or a Hub id at a
        revision), SGLang's dummy initialiser for `--speculative-draft-load-format dummy`."""
        from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

        load_format = draft_load_format(spec.speculative_draft_load_format, model_load_format)
        return cls(
            resolve_checkpoint_dir(spec.speculative_draft_model_path, spec.speculative_draft_model_revision),
            runner,
            tokenizer,
            tp,
            num_draft_tokens=int(spec.speculative_num_draft_tokens),
            context_window=spec.speculative_draft_window_size,
            init_weights=initialize_dummy_weights if load_format == "dummy" else None,
            domino_pool_size=spec.speculative_domino_candidate_pool_size,
            lilicorr_sampled_walks=knobs.lilicorr_sampling,
        )

    def _checked_config(self, path: str, runner, tokenizer, num_draft_tokens: int):
        """The checkpoint's config, checked against the target and B, with its mask token id;
        and the layout of the target layers it reads, which SGLang must capture."""
        text_config = runner.model_config.hf_text_config
        # B is resolved by now: a checkpoint without block_size drafts blocks of B.
        config = DFlashDraftConfig.from_pretrained(path, default_block_size=num_draft_tokens)
        config = resolve_mask_token_id(config, tokenizer, self.vocab_size).with_target_vocab(self.vocab_size)
        layer_ids = config.check_target(
            hidden_size=int(text_config.hidden_size),
            vocab_size=self.vocab_size,
            num_layers=target_depth(text_config),
            after_last_layer=captures_after_last_layer(runner.model),
        )
        config.check_num_draft_tokens(num_draft_tokens)
        captured = list(runner.spec_aux_config.dflash_target_layer_ids or [])
        needed = captured_layer_ids(layer_ids, runner.model_config.hf_config.model_type, config.architecture)
        if captured != needed:
            raise RuntimeError(f"target captures layers {captured}, but the draft needs {needed}")
        # SGLang captures each layer once, in layer order; fc reads them as listed.
        return config, FeatureLayout(layer_ids, int(text_config.hidden_size), self.device)

    def describe(self) -> list[tuple[str, object]]:
        """This side's fields of the start-up line."""
        return [
            ("draft", self.path),
            ("layers", self.config.num_hidden_layers),
            ("draft_options", ", ".join(self.config.options_in_use()) or "none"),
            ("draft_inert_fields", self.inert_fields_line()),
            ("draft_weights", self.weights_line()),
            ("mask_row", self.head.mask_row_kind),
            ("target_layer_ids", f"{list(self.features.layer_ids)} ({self.features.describe()})"),
            ("block_size", self.block_size),
            ("draft_window", self.context_window),
            ("device", self.device),
            ("dtype", self.dtype),
            ("draft_forward", self.forward_choice),
            ("lm_head", self.head.kind),
            ("proposals", self.proposer.name),
        ]

    def inert_fields_line(self) -> str:
        """The config keys accepted and not applied, because they change no proposal."""
        fields = self.config.inert_fields
        if not fields:
            return "none"
        return f"{', '.join(fields)} (not applied: they keep the argmax of the target's head)"

    def weights_line(self) -> str:
        """The draft's weights as served; for fp8 ones, the memory their dequantisation costs."""
        parts = []
        numel = self.draft_model.dequantized_numel
        if self.config.quantization is not None and numel:
            quant = self.config.quantization
            extra = numel * (self.dtype.itemsize - quant.bytes_per_weight) / 2**20  # stored: scales included
            parts.append(f"{quant.describe()} dequantised at load to {self.dtype}: +{extra:.1f} MiB in all")
        if self.config.own_embedding:  # whole on every rank, where the target's is split
            table = self.draft_model.embed_tokens.weight
            mib = table.numel() * table.element_size() / 2**20
            parts.append(f"its own token embedding {list(table.shape)}: {mib:.1f} MiB on every rank")
        return "; ".join(parts) or "as stored"

    def _choose_forward(self):
        """The draft network's forward, chosen once: fused kernels (`draft/fused_forward.py`) where
        they apply, else the module's own maths; with the reason."""
        device = torch.device(self.device)
        reason = fused_forward.unavailable_reason(self.draft_model, device)
        if reason is None:
            # Block positions reach context_len + Bd - 1.
            forward = fused_forward.FusedDraftForward(self.draft_model, self.context_len + self.block_size)
            return forward, f"fused ({forward.kernels.describe(device)}; stacked projections)"
        if device.type == "cuda":  # a real slowdown there: say so louder
            logger.warning("DFLASH draft forward: module by module, not fused (%s)", reason)
        return self.draft_model, f"module ({reason})"

    def inject(
        self,
        captured: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        last_rows: Optional[torch.Tensor] = None,
        req_pool_indices: Optional[torch.Tensor] = None,
        token_reqs: Optional[torch.Tensor] = None,
    ) -> None:
        """The target's captured layers of T tokens [T, C*H] at `positions` [T] -> their context
        K/V in the draft KV store at `slots` [T] (slot 0: the sink, for tokens not committed);
        with a window ring, the windowed layers' at the rows of each token's request slot
        `token_reqs` [T]. With `last_tokens` (LiLiCorr), `last_rows` [n] are the rows of the
        last committed token of the requests `req_pool_indices` [n], whose context features
        that store keeps."""
        features = self.features.arrange(captured)  # [T, K*H]
        self.trace_features(positions, features)
        rows = None
        if self.store.ring is not None:
            rows = self.store.ring.write_rows(token_reqs, positions, slots != 0)  # [T]
        ops.inject_context_kv(self.draft_model, self.store, features, positions, slots, rows)
        if self.last_tokens is not None:
            last = features[last_rows].to(self.draft_model.fc.weight.dtype)  # [n, K*H]
            self.last_tokens.write(
                req_pool_indices, self.draft_model.fuse_target_features(last), slots[last_rows]
            )

    # ------------------------------------------------------------ at alloc_memory_pool

    def allocate(
        self,
        req_to_token: torch.Tensor,
        target_kv_pool,
        *,
        seed: int,
        enable_memory_saver: bool,
        transfers_draft_kv: bool,
        metrics=None,
        window_pool: bool = False,
    ) -> None:
        """`req_to_token`: SGLang's request-to-slot table [max bs, max context];
        `target_kv_pool`: the target's KV pool, whose slot ids the store shares; `seed`: SGLang's
        random seed, broadcast from rank 0 (the same on every tensor-parallel rank);
        `transfers_draft_kv`: PD transfer registers the draft's pool; `window_pool`: the
        windowed layers keep a window ring (SGLANG_DFLASH_DRAFT_WINDOW_POOL's choice), which SGLang's
        budget set aside (`integration/draft_budget.py`)."""
        # Same slot-id space as the target pool (SGLang budgeted the draft's bytes per token
        # into the target pool's cell size, so this is the memory it set aside for us).
        num_slots = num_target_slots(target_kv_pool)
        max_bs = req_to_token.shape[0]
        ring = self.window_ring(max_bs) if window_pool else None
        flashinfer_unavailable = flashinfer_attention.unavailable_reason(
            self.config, torch.device(self.device), self.dtype
        )
        # FlashInfer keeps each step's block K/V in scratch rows: past the target's slot range
        # for the layers at slot ids, past the ring's sink for the windowed layers of a ring.
        scratch = 0
        if flashinfer_unavailable is None:
            scratch = flashinfer_attention.num_scratch_slots(max_bs, self.block_size)
        # Every persistent buffer sits in SGLang's memory-saver KV region, with the target's pools.
        num_kv_heads = self.tp.split(self.config.num_key_value_heads, "KV heads")  # this rank's
        kv_dtype = resolve_draft_kv_dtype(self.dtype)
        self.kv_plan = self._kv_plan(num_slots, ring)
        if ring is not None:
            draft_budget.check_set_aside(self.kv_plan.ring_bytes)
        with kv_cache_region():
            self.store = DraftKVStore(
                num_slots=num_slots + scratch,
                num_layers=self.config.num_hidden_layers,
                num_kv_heads=num_kv_heads,
                head_dim=self.config.head_dim,
                dtype=kv_dtype,
                device=self.device,
                ring=ring,
                windowed_layers=self.window_layers,
                ring_scratch_rows=scratch,
            )
            self.attention, self.attention_name = self._choose_attention(
                flashinfer_unavailable, num_slots, max_bs
            )
            self.verifier = Verifier(max_bs, self.vocab_size, self.device, seed=seed)
            if isinstance(self.proposer, LiLiCorrProposer):
                self.last_tokens = LastTokenStore(max_bs, self.config.hidden_size, self.dtype, self.device)
                self.proposer.last_tokens = self.last_tokens
        # Outside the region: the pool's small pointer tables must survive a memory-saver release
        # (its K/V buffers are the store's, inside it). With a window ring the pool holds the
        # full layers only, which HiCache backs up (a reloaded prefix re-prefills the ring's
        # window); None when every layer is windowed.
        if self.store.k.shape[0]:
            self.kv_pool = DraftKVPool(self.store, target_kv_pool, enable_memory_saver=enable_memory_saver)
        # The most context rows a step lists per request (what bounds its page indices): under
        # FlashInfer with every layer in a window ring, the ring's reach.
        visible = self.context_window
        if self.attention_name == "flashinfer":
            visible = self.attention.longest_visible
        self.step = DraftStep(
            self.forward,
            self.head.embed,
            self.attention,
            block_size=self.block_size,
            mask_token_id=self.config.mask_token_id,
            context_window=visible,
        )
        self.context_check = draft_context.for_decode_engine(self.store, transfers_draft_kv, metrics)
        injection = ops.choose_inject_context_kv(self.draft_model, self.store)
        logger.info("DFLASH draft attention: %s; context-KV injection: %s", self.attention_name, injection)
        logger.info("DFLASH draft KV store (%s): %s", self.store.k.dtype, self.kv_plan.describe())

    @property
    def window_layers(self) -> tuple[int, ...]:
        """The draft layers a window ring would hold: those with a reach (`DraftKVPlan`)."""
        return self._kv_plan(0).sliding_layers

    def window_ring(self, num_requests: int) -> WindowRing:
        """The ring of the windowed layers for `num_requests` request slots."""
        return WindowRing.for_reach(self.window_reach, self.block_size, num_requests)

    def window_budget(self, reprefill: bool = True, auto: bool = False) -> DraftBudget:
        """What the draft's K/V costs with a window ring (`integration/draft_budget.py`);
        `reprefill`: a radix-cache hit re-prefills the window (off: a test aid); `auto`: the
        target's budget keeps the ring only where its pool gains."""
        plan = self._kv_plan(0)
        per_request = self.window_ring(1).rows_per_request * plan.sliding_bytes_per_token
        return DraftBudget(
            len(plan.reach), len(plan.full_layers), per_request, self.window_reach, reprefill, auto
        )

    @property
    def window_reach(self) -> int:
        """The longest windowed layer's reach."""
        return max(r for r in self._kv_plan(0).reach if r is not None)

    def _kv_plan(self, store_slots: int, ring: Optional[WindowRing] = None) -> DraftKVPlan:
        """This rank's `DraftKVPlan` (its KV heads, the resolved KV dtype)."""
        return DraftKVPlan.for_draft(
            self.config,
            context_window=self.context_window,
            num_kv_heads=self.tp.split(self.config.num_key_value_heads, "KV heads"),
            itemsize=resolve_draft_kv_dtype(self.dtype).itemsize,
            store_slots=store_slots,
            ring=ring,
        )

    def _choose_attention(self, flashinfer_unavailable: Optional[str], num_slots: int, max_bs: int):
        """FlashInfer on CUDA when it applies, else PyTorch SDPA; chosen once, with the reason."""
        if flashinfer_unavailable is None:
            return self._flashinfer_attention(num_slots, max_bs), "flashinfer"
        sdpa = SdpaDraftAttention(
            self.config, self.store, self.context_window, sinks=self.draft_model.attention_sinks()
        )
        return sdpa, f"torch-sdpa ({flashinfer_unavailable})"

    def _flashinfer_attention(self, scratch_base: int, max_batch_size: int, **graph):
        """FlashInfer's draft attention over the store, eager or (`graph`) in CUDA-graph mode."""
        return flashinfer_attention.FlashInferDraftAttention(
            self.config,
            self.store,
            scratch_base=scratch_base,
            max_batch_size=max_batch_size,
            context_window=self.context_window,
            q_dtype=self.dtype,
            **graph,
        )

    # ------------------------------------------------------------ at init_cuda_graphs

    @torch.no_grad()
    def warm_up(self, req_to_token: torch.Tensor) -> None:
        """One draft step at batch 1 over a one-token context before serving: the injection,
        every draft layer kind's attention, the proposals. FlashInfer (and the fused op's first
        launch) compile on first use, which with FlashInfer's PyPI wheel takes minutes; inside
        the first decode step that would stall serving under the scheduler's watchdog. Writes
        only the sink slot 0 and FlashInfer's scratch slots."""
        start = time.perf_counter()
        one = torch.ones(1, dtype=torch.int64, device=self.device)
        features = torch.zeros(1, self.draft_model.fc.in_features, dtype=self.dtype, device=self.device)
        sink = None if self.store.ring is None else one * self.store.ring.sink  # the ring's sink row
        ops.inject_context_kv(self.draft_model, self.store, features, one - 1, one - 1, sink)  # slot 0
        # One block after a one-token context (req_to_token's row 0; only read).
        block_ids, positions, hidden = self.step(req_to_token, one - 1, one, one, one.cpu(), True)
        self.proposer(hidden, ProposalInputs(block_ids[:, 0], positions))
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info(
            "DFLASH warm-up (injection, %s draft attention, LM head): %.1f s",
            self.attention_name,
            time.perf_counter() - start,
        )

    def capture_graphs(
        self,
        runner,
        req_to_token: torch.Tensor,
        enabled: bool = True,
        plan_free_max_len: Optional[int] = PLAN_FREE_MAX_LEN,
    ):
        """The draft step's CUDA graphs in SGLang's pool (`draft/step.py`, `capture_in_sglang`):
        (GB, seconds), or None when none were captured. `enabled`, `plan_free_max_len`: the
        knobs `Knobs.draft_graphs` and `Knobs.draft_plan_free`."""

        def graph_attention(max_size: int, plan_free_max_len: Optional[int]):
            # The plan-free layout lists up to the bound per request, whatever the context length.
            longest = max(self.context_len, plan_free_max_len or 0)
            buffers = self.attention.graph_buffers(max_size, longest)

            def make_attention(size: int, **plan_free):
                return self._flashinfer_attention(
                    self.attention.scratch_base,
                    size,
                    graph_batch_size=size,
                    graph_buffers=buffers,
                    **plan_free,
                )

            def make_plan_free(size: int):
                return make_attention(size, plan_free_max_len=plan_free_max_len)

            plan_free = make_plan_free if plan_free_max_len is not None else None
            return buffers.capacity, make_attention, plan_free

        return capture_in_sglang(
            self.step,
            runner,
            req_to_token,
            attention_name=self.attention_name,
            graph_attention=graph_attention,
            enabled=enabled,
            plan_free_max_len=plan_free_max_len,
        )

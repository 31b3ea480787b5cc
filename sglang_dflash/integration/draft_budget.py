"""What the draft's K/V costs the target's pool budget, with a window ring (`draft/window_ring.py`).

SGLang sizes the target's KV pool after the draft worker is built: it charges the draft's
bytes per token, every draft layer's (`mem_cache/draft_kv_budget.py`), into each token's cell
(`KVCacheConfigurator.dflash_draft_cell_size_per_token`). With a window ring only the full
layers cost a row per token; the windowed layers cost a fixed R rows per request slot. The
worker declares that split (`declare`) before the pools are sized, and two hooks apply it:

* AROUND `resolve_dflash_draft_cell_size`: the cell is SGLang's times the full layers' share,
  at least 1 byte (0 would send SGLang back to layer-count scaling, which charges more).
* AROUND `KVCacheConfigurator._profile_available_bytes`: the budget less the ring, for the
  most request slots SGLang can give the target (`--max-running-requests` per DP worker, else
  the 4096 that `resolve_max_num_reqs` caps at), plus its padding row and the sink.

Under SGLANG_DFLASH_DRAFT_WINDOW_POOL=auto (the default) the second hook decides, once, with
SGLang's own pool configurator: the ring is kept where the target's pool gets more tokens with
it than with the store of every token (`--max-total-tokens` capping both). Else the cell goes
back to SGLang's, and the decision and its numbers are logged (`declined`). A ring is a fixed
cost per request slot; at 4096 slots a window of 2048 costs 8.4M rows a layer, more than most
pools hold: `--max-running-requests` is what makes it pay.

And one on the radix cache: a request that reuses a cached prefix re-prefills its last `reach`
tokens (`reprefill_hook`), so that its ring holds the window before it drafts.

Worked example (the shipped draft re-declared all-sliding, window 32, block 16, fp32, 1024 B
per layer and token): cell 2048 -> 1 B; ring (32 + 16) x 2 x 1024 = 96 KiB per request slot,
3.1 MiB at 32 running requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

MAX_REQUEST_SLOTS = 4096  # `KVCacheConfigurator.resolve_max_num_reqs` never gives more


@dataclass(frozen=True)
class DraftBudget:
    num_layers: int  # all draft layers
    num_full_layers: int  # the layers that keep a row per target token
    ring_bytes_per_request: int  # the windowed layers' ring rows of one request slot, K and V
    reach: int = 0  # the longest windowed layer's reach: a cached prefix's tail re-prefilled
    reprefill: bool = True  # False: SGLANG_DFLASH_TEST_SKIP_WINDOW_REPREFILL
    auto: bool = False  # SGLANG_DFLASH_DRAFT_WINDOW_POOL=auto: the ring only where the target gains

    def cell_size(self, all_layers: int) -> int:
        """The bytes per token the full layers cost, from SGLang's for every layer."""
        return max(1, all_layers * self.num_full_layers // self.num_layers)

    def ring_bytes(self, max_running_requests: Optional[int], dp_size: int = 1) -> int:
        """The ring for the most request slots SGLang can allocate: req_to_token's rows (the
        requests and a padding row) and the sink row."""
        slots = MAX_REQUEST_SLOTS if max_running_requests is None else max(1, max_running_requests // dp_size)
        return (slots + 2) * self.ring_bytes_per_request


_declared: Optional[DraftBudget] = None
_set_aside: Optional[int] = None  # the ring bytes the target's budget left out
_every_token_cell: Optional[int] = None  # SGLang's draft cell, every layer per token (the cell hook)
_declined: Optional[str] = None  # why `auto` kept the store of every token


def declare(budget: Optional[DraftBudget]) -> None:
    """The worker's split of its draft K/V (None: every layer per token, SGLang's own charge)."""
    global _declared
    _declared = budget


def check_set_aside(ring_bytes: int) -> None:
    """At the draft's allocation: the ring it is about to allocate fits what the target's budget
    left out (a hook that did not run would leave the ring unbudgeted: refused, loudly)."""
    if _set_aside is None:
        raise RuntimeError(
            "SGLANG_DFLASH_DRAFT_WINDOW_POOL: the target's KV budget did not set the draft's window ring "
            "aside (KVCacheConfigurator._profile_available_bytes was not hooked)"
        )
    if ring_bytes > _set_aside:
        raise RuntimeError(
            f"the draft's window ring ({ring_bytes} B) exceeds what the target's KV budget left out "
            f"({_set_aside} B)"
        )


def declared() -> Optional[DraftBudget]:
    return _declared


def declined() -> Optional[str]:
    """Why SGLANG_DFLASH_DRAFT_WINDOW_POOL=auto kept the store of every token (None: it did not)."""
    return _declined


def ring_chosen() -> bool:
    """At the draft's allocation: whether its windowed layers keep a window ring (a ring no
    budget set aside is refused there, by `check_set_aside`)."""
    return _declared is not None


def cell_size_hook(original, **kwargs):
    """AROUND `draft_kv_budget.resolve_dflash_draft_cell_size`."""
    cell = original(**kwargs)
    if _declared is None or cell is None:
        return cell
    global _every_token_cell
    _every_token_cell = int(cell)
    return _declared.cell_size(int(cell))


def reprefill_hook(original, self, req=None) -> int:
    """AROUND `swa_reprefill_tail_tokens` of SGLang's prefix caches: a request matched in the
    radix cache re-prefills at least its prefix's last `reach` tokens, whose draft K/V its slot's
    ring does not hold (the target's K/V there is recomputed too: SGLang caps the match, as it
    does for its own per-request SWA rings). The first draft then reads a whole window."""
    tail = original(self, req)
    if _declared is None or not _declared.reprefill:
        return tail
    return max(tail, _declared.reach)


def available_bytes_hook(original, self, pre_model_load_memory: int) -> int:
    """AROUND `KVCacheConfigurator._profile_available_bytes` (the target's configurator)."""
    available = original(self, pre_model_load_memory)
    if _declared is None or self.is_draft_worker or not self.spec_algorithm.is_dflash_family():
        return available
    from sglang.srt.runtime_context import get_schedule

    global _set_aside
    ring = _declared.ring_bytes(get_schedule().max_running_requests, self.attn_dp_size)
    if _declared.auto:
        why = _why_the_ring_does_not_pay(self, available, ring)
        if why is not None:
            _decline(self, why)
            return available
    elif ring >= available:
        raise ValueError(
            f"SGLANG_DFLASH_DRAFT_WINDOW_POOL=1: the draft's window ring ({ring / 2**20:.1f} MiB) leaves "
            f"nothing of {available / 2**20:.1f} MiB for the KV pools: lower --max-running-requests, "
            "or unset SGLANG_DFLASH_DRAFT_WINDOW_POOL"
        )
    logger.info(
        "DFLASH draft KV budget: %d of %d layers per token; window ring %.1f MiB set aside",
        _declared.num_full_layers,
        _declared.num_layers,
        ring / 2**20,
    )
    _set_aside = ring
    return available - ring


def pool_tokens(configurator, budget_bytes: int) -> int:
    """The target's pool tokens SGLang's own pool configurator makes of `budget_bytes` at the
    configurator's draft cell, capped by --max-total-tokens (`config_from_budget`'s sizing,
    without its cross-rank agreement: every rank runs this on the agreed budget)."""
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_schedule

    schedule = get_schedule()
    sizes = create_memory_pool_configurator(configurator).calculate_pool_sizes(
        budget_bytes, schedule.page_size
    )
    tokens = int(sizes.max_total_num_tokens)
    return min(tokens, schedule.max_total_tokens) if schedule.max_total_tokens else tokens


def _why_the_ring_does_not_pay(configurator, available: int, ring: int) -> Optional[str]:
    """None where the target's pool gets more tokens with the ring than with the store of every
    token; else why not, with both counts."""
    if _every_token_cell is None:
        return "SGLang charges the draft nothing per token here"
    if ring >= available:
        return f"the ring ({ring / 2**20:.1f} MiB) would take the whole budget ({available / 2**20:.1f} MiB)"
    ring_cell = configurator.dflash_draft_cell_size_per_token  # the full layers' share (`cell_size_hook`)
    with_ring = pool_tokens(configurator, available - ring)
    configurator.dflash_draft_cell_size_per_token = _every_token_cell
    every_token = pool_tokens(configurator, available)
    configurator.dflash_draft_cell_size_per_token = ring_cell
    if with_ring <= every_token:
        return (
            f"the target's pool would hold {with_ring} tokens with the ring ({ring / 2**20:.1f} MiB), "
            f"{every_token} with K/V for every token (lower --max-running-requests to make it pay)"
        )
    logger.info(
        "DFLASH draft KV: window ring chosen (SGLANG_DFLASH_DRAFT_WINDOW_POOL=auto): the target's pool "
        "holds %d tokens with it, %d with K/V for every token",
        with_ring,
        every_token,
    )
    return None


def _decline(configurator, why: str) -> None:
    """`auto` keeps the store of every token: SGLang's cell, no ring, no re-prefill."""
    global _declared, _declined
    configurator.dflash_draft_cell_size_per_token = _every_token_cell
    _declared, _declined = None, why
    logger.info("DFLASH draft KV: no window ring (SGLANG_DFLASH_DRAFT_WINDOW_POOL=auto): %s", why)


def why_no_window_ring(mode: str, **server) -> Optional[str]:
    """SGLANG_DFLASH_DRAFT_WINDOW_POOL's choice (`mode`: "auto", "on" or "off") before the pools
    are sized: why the windowed layers keep K/V for every token, or None to declare the ring
    (which `auto` may still decline, `available_bytes_hook`). `server`: `why_not_window_pool`'s
    fields. "on" raises what the ring does not serve, by name."""
    if mode == "off":
        return "SGLANG_DFLASH_DRAFT_WINDOW_POOL=0"
    reason = why_not_window_pool(**server)
    if reason is not None and mode == "on":
        raise ValueError(f"SGLANG_DFLASH_DRAFT_WINDOW_POOL=1 does not serve {reason}; unset it")
    if reason is None and mode == "auto":
        reason = why_auto_declines(server["device_type"])
    return reason


def why_not_window_pool(
    *,
    device_type: str,
    windowed_layers: tuple[int, ...],
    disaggregation: str,
    offloads: Optional[str],
) -> Optional[str]:
    """Why the window ring cannot serve this server (None: it can): SGLANG_DFLASH_DRAFT_WINDOW_POOL=1
    refuses each by name at start-up, `auto` keeps K/V for every token. What moves the store by
    slot ids alone does not know the ring. `offloads`: what backs cached slots up other than
    HiCache's host memory (`worker._draft_kv_offloads`), None if nothing does.

    Served: HiCache's host tier (the full layers go to host as the store of every token's do,
    and a reloaded prefix re-prefills the window like any cache hit), any page size (a ring row
    is a request slot's position), any store dtype (the ring keeps the store's). On CUDA only when
    asked for (`why_auto_declines`)."""
    if not windowed_layers:
        return "the draft has no windowed layer (no sliding_window, no --speculative-draft-window-size)"
    if device_type not in ("cpu", "cuda"):
        return f"a {device_type} device (the window ring is served on CPU and CUDA)"
    if disaggregation != "null":
        return f"a PD {disaggregation} engine (the draft's K/V travels by slot ids)"
    if offloads is not None:
        return f"{offloads} (not tested with the window ring)"
    return None


def why_auto_declines(device_type: str) -> Optional[str]:
    """Why SGLANG_DFLASH_DRAFT_WINDOW_POOL=auto keeps K/V for every token on a server the ring
    could serve (None: it may keep the ring, where the pool gains: `available_bytes_hook`).
    On CUDA FlashInfer's draft attention and the draft step's CUDA graphs read the ring
    (`draft/flashinfer_attention.py`), tested on CPU against SDPA through a PyTorch stand-in of
    FlashInfer's paged prefill; their GPU tests (`make gpu-check-tests`) have not run yet, so
    the ring stays the user's choice there until they have."""
    if device_type == "cuda":
        return (
            "on CUDA the window ring's FlashInfer layout has not run on a GPU yet (make "
            "gpu-check-tests); SGLANG_DFLASH_DRAFT_WINDOW_POOL=1 serves it"
        )
    return None

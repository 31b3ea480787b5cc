"""DFLASH acceptance counters in SGLang's Prometheus `/metrics` (served with `--enable-metrics`).

SGLang runs prometheus_client in multiprocess mode: the launcher sets `PROMETHEUS_MULTIPROC_DIR`
before it starts the scheduler processes, every process writes its samples to memory-mapped
files there, and the HTTP server's `/metrics` merges them. So these metrics are created in the
scheduler process, like SGLang's own `SchedulerMetricsCollector`, carry the same labels
(`model_name`, `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`, ...), and use its `sglang:`
name prefix. Series (B = verify width, `--speculative-num-draft-tokens`):

  sglang:dflash_verify_steps_total           counter    one per request per decode step
                                                        (what SGLang's `spec_verify_ct` counts)
  sglang:dflash_accepted_drafts_total        counter    accepted draft tokens (bonus excluded)
  sglang:dflash_discarded_steps_total        counter    request-steps run for requests that had
                                                        already finished (overlap scheduling) or
                                                        been retracted; not in the others
  sglang:dflash_accepted_drafts_per_step     histogram  accepted drafts per request-step,
                                                        buckets le = 0 .. B-1
  sglang:dflash_position_accepted_total      counter    {position="k"}, k = 1..B-1: request-steps
                                                        that accepted at least k drafts
  sglang:dflash_position_verified_total      counter    {position="k"}: request-steps that verified
                                                        draft position k (verify width > k)
  sglang:dflash_position_accept_rate         gauge      {position="k"}: the lifetime ratio
                                                        position_accepted / position_verified
  sglang:dflash_verify_width                 histogram  the verify width chosen per decode step,
                                                        buckets le = 1 .. B (1 = no draft;
                                                        `width/policy.py`)
  sglang:dflash_requests_without_draft_context_total
                                             counter    requests a PD decode engine received
                                                        without their draft K/V
                                                        (`draft_context.py`)

Mean acceptance length (tokens per verify step, bonus included) over any window is
`1 + rate(accepted_drafts_total) / rate(verify_steps_total)`.

The scheduler side calls `observe(num_correct_drafts_per_req, live, width)` once per decode step
with host lists (no device sync); the worker calls `observe_width(width)` when it chooses one.
`live` says which requests were still running (SGLang's own rule for `spec_verify_ct`), which
keeps the counters equal to the sums of the requests' `meta_info`. A step at width 1 (no draft)
counts as a verify step that accepted nothing, as SGLang counts it in `spec_verify_ct`; the
per-position rates count only the steps that verified the position.
`observe` only appends to a list; a daemon thread pushes the totals into prometheus_client once
per `flush_interval` seconds (1 s by default), so the per-step cost does not grow with the
number of series, and the exported values lag by at most one interval.

See docs/measuring.md.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from typing import Optional, Sequence

PREFIX = "sglang:dflash_"


def scheduler_labels() -> dict:
    """The labels SGLang's scheduler metrics carry in this process (same rule as
    `SchedulerMetricsCollector.init_new`), so our series join theirs."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import (
        get_disagg,
        get_observability,
        get_parallel,
        get_schedule,
        get_serving,
    )

    parallel, disagg = get_parallel(), get_disagg()
    engine_type = (
        "dynamic"
        if disagg.enable_pd_role_switch
        else DisaggregationMode.to_engine_type(disagg.disaggregation_mode)
    )
    labels = {
        "model_name": get_serving().served_model_name,
        "engine_type": engine_type,
        "tp_rank": parallel.tp_rank,
        "pp_rank": parallel.pp_rank,
        "moe_ep_rank": parallel.moe_ep_rank,
    }
    if get_schedule().enable_priority_scheduling:
        labels["priority"] = ""
    if parallel.dp_rank is not None:
        labels["dp_rank"] = parallel.dp_rank
    labels.update(get_observability().extra_metric_labels or {})
    return labels


def metrics_enabled_here() -> bool:
    """`--enable-metrics`, on a rank that exports scheduler metrics (SGLang's rule)."""
    from sglang.srt.runtime_context import get_observability, get_parallel

    obs, parallel = get_observability(), get_parallel()
    exporting_rank = parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0
    return bool(obs.enable_metrics) and (exporting_rank or bool(obs.enable_metrics_for_all_schedulers))


def observe_many(histogram_child, value: float, count: int) -> None:
    """`histogram_child.observe(value)` repeated `count` times, in O(buckets).

    prometheus_client has no bulk observe; this adds to the bucket and the sum the way its
    `Histogram.observe` does (tests check the two agree). Falls back to a loop if the
    internals ever change shape."""
    buckets = getattr(histogram_child, "_buckets", None)
    bounds = getattr(histogram_child, "_upper_bounds", None)
    total = getattr(histogram_child, "_sum", None)
    if buckets is None or bounds is None or total is None or len(buckets) != len(bounds):
        for _ in range(count):
            histogram_child.observe(value)
        return
    for bucket, bound in zip(buckets, bounds):
        if value <= bound:
            bucket.inc(count)
            break
    total.inc(value * count)


class DFlashMetrics:
    """Acceptance counters of one scheduler process. `observe()` is cheap and thread-safe."""

    def __init__(
        self,
        labels: dict,
        num_draft_tokens: int,
        *,
        registry=None,
        flush_interval: Optional[float] = 1.0,
    ):
        # Imported here, after SGLang has set PROMETHEUS_MULTIPROC_DIR (as SGLang does).
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        registry = REGISTRY if registry is None else registry
        self.width = int(num_draft_tokens)
        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        self.positions = [str(k) for k in range(1, self.width)]
        kw = dict(labelnames=names, registry=registry)
        self._steps = Counter(
            PREFIX + "verify_steps", "DFLASH verify steps, one per request per decode step.", **kw
        ).labels(**self.labels)
        self._discarded_steps = Counter(
            PREFIX + "discarded_steps",
            "DFLASH request-steps run for requests already finished or retracted (tokens dropped).",
            **kw,
        ).labels(**self.labels)
        self._accepted = Counter(
            PREFIX + "accepted_drafts", "DFLASH accepted draft tokens (the bonus token excluded).", **kw
        ).labels(**self.labels)
        self._hist = Histogram(
            PREFIX + "accepted_drafts_per_step",
            "DFLASH accepted draft tokens per request per verify step.",
            buckets=[float(k) for k in range(self.width)],
            **kw,
        ).labels(**self.labels)
        kw_pos = dict(labelnames=[*names, "position"], registry=registry)
        position_total = Counter(
            PREFIX + "position_accepted",
            "DFLASH request-steps whose draft position k was accepted (i.e. >= k drafts accepted).",
            **kw_pos,
        )
        position_rate = Gauge(
            PREFIX + "position_accept_rate",
            "DFLASH lifetime acceptance rate of draft position k: position_accepted / verify_steps.",
            multiprocess_mode="mostrecent",
            **kw_pos,
        )
        position_verified = Counter(
            PREFIX + "position_verified",
            "DFLASH request-steps that verified draft position k (verify width > k).",
            **kw_pos,
        )
        self._without_context = Counter(
            PREFIX + "requests_without_draft_context",
            "DFLASH requests a PD decode engine received without their draft K/V (drafts see no context).",
            **kw,
        ).labels(**self.labels)
        self._width_hist = Histogram(
            PREFIX + "verify_width",
            "DFLASH verify width chosen per decode step (1 = no draft).",
            buckets=[float(k) for k in range(1, self.width + 1)],
            **kw,
        ).labels(**self.labels)
        self._position_total = [position_total.labels(**self.labels, position=k) for k in self.positions]
        self._position_verified = [
            position_verified.labels(**self.labels, position=k) for k in self.positions
        ]
        self._position_rate = [position_rate.labels(**self.labels, position=k) for k in self.positions]

        # Lifetime totals, mirrored here to compute the rate gauges.
        self.total_steps = 0
        self.total_position = [0] * len(self.positions)
        self.total_verified = [0] * len(self.positions)
        self._pending: list[tuple[int, int]] = []  # (accepted drafts, verify width) per request-step
        self._pending_widths: list[int] = []
        self._discarded = 0
        self._lock = threading.Lock()  # guards _pending (observe vs flush)
        self._flush_lock = threading.Lock()  # one flush at a time
        self._stop = threading.Event()
        self._thread = None
        if flush_interval:
            self._thread = threading.Thread(
                target=self._flush_loop, args=(flush_interval,), name="dflash-metrics", daemon=True
            )
            self._thread.start()

    @classmethod
    def from_runtime(cls, num_draft_tokens: int) -> Optional["DFlashMetrics"]:
        """The scheduler process's metrics, or None when metrics are off for this rank."""
        if not metrics_enabled_here():
            return None
        return cls(scheduler_labels(), num_draft_tokens)

    def observe(
        self,
        num_correct_drafts_per_req: Sequence[int],
        live: Optional[Sequence[bool]] = None,
        width: Optional[int] = None,
    ) -> None:
        """Record one verify step: accepted drafts per request (host ints, 0..width-1), at verify
        width `width` (B when None).

        `live[i]` False marks a request that had already finished or been retracted when the
        step ran (overlap scheduling runs one more step for it; SGLang drops its tokens and
        leaves it out of `spec_verify_ct`): it is counted as discarded, not as acceptance."""
        width = self.width if width is None else int(width)
        if live is None:
            live = [True] * len(num_correct_drafts_per_req)
        kept = [(n, width) for n, keep in zip(num_correct_drafts_per_req, live) if keep]
        with self._lock:
            self._pending.extend(kept)
            self._discarded += len(num_correct_drafts_per_req) - len(kept)

    def observe_width(self, width: int) -> None:
        """Record the verify width the worker chose for a decode step."""
        with self._lock:
            self._pending_widths.append(int(width))

    def observe_without_context(self, count: int) -> None:
        """Record requests that arrived without their draft K/V (rare; pushed at once)."""
        self._without_context.inc(count)

    def flush(self) -> None:
        """Push what was observed since the last flush into prometheus_client."""
        with self._flush_lock:
            with self._lock:
                pending, self._pending = self._pending, []
                widths, self._pending_widths = self._pending_widths, []
                discarded, self._discarded = self._discarded, 0
            if discarded:
                self._discarded_steps.inc(discarded)
            for width, count in Tally(widths).items():
                observe_many(self._width_hist, float(width), count)
            if pending:
                self._publish(pending)

    def _publish(self, pending: list[tuple[int, int]]) -> None:
        accepted = Tally(n for n, _ in pending)
        widths = Tally(w for _, w in pending)
        self._steps.inc(len(pending))
        self._accepted.inc(sum(n * c for n, c in accepted.items()))
        for n, count in accepted.items():
            observe_many(self._hist, float(n), count)
        self.total_steps += len(pending)
        at_least = sum(c for n, c in accepted.items() if n >= self.width)  # not expected; kept honest
        wider = sum(c for w, c in widths.items() if w > self.width)
        for k in range(self.width - 1, 0, -1):  # steps with >= k accepted drafts / width > k
            at_least += accepted.get(k, 0)
            wider += widths.get(k + 1, 0)
            if at_least:
                self._position_total[k - 1].inc(at_least)
                self.total_position[k - 1] += at_least
            if wider:
                self._position_verified[k - 1].inc(wider)
                self.total_verified[k - 1] += wider
        for total, verified, gauge in zip(self.total_position, self.total_verified, self._position_rate):
            if verified:
                gauge.set(total / verified)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()

    def _flush_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.flush()


def resolve_spec_tokens_hook(original, self, result, batch):
    """AROUND hook for SGLang's `SchedulerBatchResultProcessor._resolve_spec_v2_tokens`: feeds
    the worker's `metrics` and `width_policy` (if any) with the step's accepted-draft counts and
    verify width, once they are on the host, and which requests were still live (judged before
    SGLang settles this step, as it does)."""
    dflash_metrics = getattr(self.model_worker, "metrics", None)
    width_policy = getattr(self.model_worker, "width_policy", None)
    if dflash_metrics is None and width_policy is None:
        return original(self, result, batch)
    live = [not (req.is_retracted or req.finished()) for req in batch.reqs]
    out = original(self, result, batch)
    width = result.speculative_num_draft_tokens
    if dflash_metrics is not None:
        dflash_metrics.observe(result.num_correct_drafts_per_req_cpu, live, width)
    if width_policy is not None and width:
        accepted = result.num_correct_drafts_per_req_cpu
        kept = [n for n, keep in zip(accepted, live) if keep]
        rids = [req.rid for req, keep in zip(batch.reqs, live) if keep]
        width_policy.observe_acceptance(kept, width, rids)
        width_policy.observe_processed(len(accepted) + sum(accepted))
    return out

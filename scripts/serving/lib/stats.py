"""Per-request and aggregate statistics of streamed generation, with SGLang's bench conventions.

For one streamed request sent at `start`, whose chunks arrive at times t_i carrying cumulative
output-token counts n_i (chunks that add no token are ignored):

* TTFT  = t_first - start, t_first being the first chunk with a token.
* ITL   = per token: a later chunk adding m tokens after a gap g since the previous token chunk
          contributes m values g / m (`sglang.benchmark.serving` does the same, so a speculative
          step that delivers 5 tokens at once counts as 5 tokens of g/5 each).
* TPOT  = (latency - TTFT) / (output_tokens - 1), latency = end of stream - start.
* Percentiles interpolate linearly between order statistics (numpy's default).

Throughput over a measured window of `duration` seconds: completed requests / duration and
output tokens of completed requests / duration.

Acceptance: SGLang reports per request `spec_verify_ct` and `spec_correct_drafts_histogram`
(h[k] = verify steps that accepted k drafts). Summed over requests, the mean acceptance length
is sum((k+1) h[k]) / sum(h[k]) tokens per verify step (the bonus token included).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What one request did, as seen by the client (times are `time.perf_counter()` seconds)."""

    index: int
    endpoint: str
    start: float = 0.0
    end: float = 0.0
    ok: bool = False
    error: Optional[str] = None  # "timeout", "http_<status>", "connection", ...
    detail: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: Optional[float] = None
    tpot: Optional[float] = None
    itls: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    spec_verify_ct: int = 0
    spec_accept_length: Optional[float] = None
    spec_histogram: list = field(default_factory=list)  # h[k]: steps that accepted k drafts

    @property
    def latency(self) -> float:
        return self.end - self.start

    def row(self) -> dict:
        """A flat dict for CSV/JSON (ITLs summarised, not listed)."""
        out = asdict(self)
        itls = out.pop("itls")
        out["latency"] = self.latency
        out["itl_mean"] = sum(itls) / len(itls) if itls else None
        return out


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100), linear between order statistics; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict:
    """mean, p50, p90, p99 and max of `values` times `scale` (None for no values)."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None}
    out = {"mean": scale * sum(values) / len(values)}
    out.update({f"p{q}": scale * percentile(values, q) for q in PERCENTILES})
    out["max"] = scale * max(values)
    return out


def stream_timings(start: float, chunks: Sequence[tuple[float, int]], end: float) -> dict:
    """TTFT, TPOT, per-token ITLs and output tokens from (arrival time, cumulative tokens) chunks."""
    first, prev_t, prev_n, itls = None, None, 0, []
    for t, n in chunks:
        if n <= prev_n:
            continue
        if first is None:
            first = t
        else:
            new = n - prev_n
            itls.extend([(t - prev_t) / new] * new)
        prev_t, prev_n = t, n
    ttft = None if first is None else first - start
    tpot = (end - start - ttft) / (prev_n - 1) if ttft is not None and prev_n > 1 else None
    return {"ttft": ttft, "tpot": tpot, "itls": itls, "output_tokens": prev_n}


def acceptance(results: Sequence[RequestResult]) -> dict:
    """Acceptance over completed requests (empty dict when the server reported none)."""
    done = [r for r in results if r.ok and r.spec_verify_ct > 0]
    if not done:
        return {}
    width = max((len(r.spec_histogram) for r in done), default=0)
    hist = [0] * width
    for r in done:
        for k, count in enumerate(r.spec_histogram):
            hist[k] += count
    steps = sum(hist)
    verify = sum(r.spec_verify_ct for r in done)
    per_request = [r.spec_accept_length for r in done if r.spec_accept_length is not None]
    return {
        "verify_steps": verify,
        # tokens committed per verify step (bonus included), from the step histograms
        "accept_length_mean": sum((k + 1) * c for k, c in enumerate(hist)) / steps if steps else None,
        # SGLang's per-request definition, pooled: completion tokens / verify steps
        "accept_length_sglang": sum(r.output_tokens for r in done) / verify,
        # z-lab's benchmark: unweighted mean of the per-request values
        "accept_length_per_request_mean": sum(per_request) / len(per_request) if per_request else None,
        # accept length (tokens per step) -> number of request-steps
        "accept_length_histogram": {k + 1: c for k, c in enumerate(hist) if c},
    }


def aggregate(results: Sequence[RequestResult], duration: float) -> dict:
    """Aggregate metrics of one measured run; latencies in ms."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "error"] = errors.get(r.error or "error", 0) + 1
    output_tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    out = {
        "requests": len(results),
        "completed": len(ok),
        "errors": sum(v for k, v in errors.items() if k != "timeout"),
        "timeouts": errors.get("timeout", 0),
        "error_kinds": errors,
        "duration_s": duration,
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": output_tokens / duration if duration > 0 else None,
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None], 1e3),
        "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None], 1e3),
        "itl_ms": summarize(itls, 1e3),
        "e2e_ms": summarize([r.latency for r in ok], 1e3),
    }
    out["acceptance"] = acceptance(results)
    return out

"""One concurrency level of a load test: warm-up, then a closed loop of `concurrency` clients.

Each client sends its next request as soon as its previous one ends. A level is bounded by a
request count, or by a duration (no new requests after it; the ones in flight finish and count).
The measured window runs from the first request sent to the last one finished. A level can be
measured in several rounds (`Level`), so that servers compared on a noisy machine take turns
(`serving/load_test.py --rounds`): its result pools every round's requests over the sum of their windows.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Optional

import aiohttp
import requests

from scripts.serving.lib import client, server, stats

PUBLISH_WAIT = 1.5  # seconds; the server publishes its DFLASH counters once a second
PayloadFn = Callable[[int], dict]  # request index -> JSON payload


@dataclass
class LevelSpec:
    concurrency: int
    num_requests: Optional[int] = None  # bound by count ...
    duration: Optional[float] = None  # ... or by seconds
    warmup: int = 0
    timeout: float = 600.0
    flush_cache: bool = True
    progress: bool = True


async def _closed_loop(url, endpoint, payload, spec: LevelSpec, count, duration, bar) -> list:
    results: list[stats.RequestResult] = []
    next_index, failed = 0, 0
    deadline = None if duration is None else time.perf_counter() + duration

    def take() -> Optional[int]:
        nonlocal next_index
        if count is not None and next_index >= count:
            return None
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        next_index += 1
        return next_index - 1

    async def worker(session):
        nonlocal failed
        while (i := take()) is not None:
            result = await client.send(session, url, endpoint, payload(i), i, spec.timeout)
            results.append(result)
            if bar is not None:
                failed += not result.ok
                bar.update(1)
                bar.set_postfix(failed=failed, refresh=False)

    async with aiohttp.ClientSession(
        connector=client.connector(), timeout=aiohttp.ClientTimeout(total=None)
    ) as s:
        await asyncio.gather(*(worker(s) for _ in range(spec.concurrency)))
    return sorted(results, key=lambda r: r.index)


def _server_accept_length(url: str) -> Optional[float]:
    try:
        return server.server_info(url)["internal_states"][0].get("avg_spec_accept_length")
    except (requests.RequestException, KeyError, IndexError):
        return None


class Level:
    """One concurrency level against one server: `warm_up()` once, `measure()` once per round,
    then `result()`. The server's DFLASH counters are read before the first round and after the
    last, so the server must be idle (or paused) between rounds."""

    def __init__(self, url: str, endpoint: str, payload: PayloadFn, spec: LevelSpec):
        self.url, self.endpoint, self.payload, self.spec = url, endpoint, payload, spec
        self.rounds: list[tuple[list[stats.RequestResult], float]] = []  # (results, window seconds)
        self.before: Optional[dict] = None
        self.info_before: Optional[float] = None

    def warm_up(self) -> None:
        if self.spec.warmup:
            asyncio.run(
                _closed_loop(self.url, self.endpoint, self.payload, self.spec, self.spec.warmup, None, None)
            )

    def measure(self) -> None:
        spec = self.spec
        if spec.flush_cache:
            server.flush_cache(self.url)
        if not self.rounds:
            self.before = server.dflash_counters(server.prometheus_samples(self.url))
            if self.before is not None:  # let the warm-up's last steps reach the counters first
                time.sleep(PUBLISH_WAIT)
                self.before = server.dflash_counters(server.prometheus_samples(self.url))
            self.info_before = _server_accept_length(self.url)
        bar = None
        if spec.progress:
            from tqdm import tqdm

            desc = f"concurrency {spec.concurrency}" + (
                f" round {len(self.rounds) + 1}" if self.rounds else ""
            )
            bar = tqdm(total=spec.num_requests, desc=desc, unit="req")
        start = time.perf_counter()
        try:
            results = asyncio.run(
                _closed_loop(
                    self.url, self.endpoint, self.payload, spec, spec.num_requests, spec.duration, bar
                )
            )
        finally:
            if bar is not None:
                bar.close()
        first = min((r.start for r in results), default=start)
        last = max((r.end for r in results), default=start)
        self.rounds.append((results, last - first))

    def result(self) -> dict:
        if self.before is not None:
            time.sleep(PUBLISH_WAIT)
        after = server.dflash_counters(server.prometheus_samples(self.url))
        results = [r for round_results, _ in self.rounds for r in round_results]
        out = {
            "concurrency": self.spec.concurrency,
            "summary": stats.aggregate(results, sum(seconds for _, seconds in self.rounds)),
            "server_acceptance": server.dflash_window(self.before, after),
            "server_info_avg_accept_length": {
                "before": self.info_before,
                "after": _server_accept_length(self.url),
            },
            "requests": [
                dict(r.row(), round=k)
                for k, (round_results, _) in enumerate(self.rounds)
                for r in round_results
            ],
        }
        if len(self.rounds) > 1:
            out["round_output_throughput"] = [
                stats.aggregate(round_results, seconds)["output_throughput"]
                for round_results, seconds in self.rounds
            ]
        return out


def run_level(url: str, endpoint: str, payload: PayloadFn, spec: LevelSpec) -> dict:
    """Warm up, measure, and return the level's summary, server-side acceptance and requests."""
    level = Level(url, endpoint, payload, spec)
    level.warm_up()
    level.measure()
    return level.result()

"""Starting SGLang CPU engines for tests, and driving them with token-id prompts."""

from __future__ import annotations

import asyncio
import os
import random
import time
from unittest import mock

ADAPTIVE_WIDTH = "SGLANG_DFLASH_ADAPTIVE_WIDTH"
CPU_ENGINE = dict(
    device="cpu",
    attention_backend="torch_native",
    dtype="float32",
    max_total_tokens=6144,
    max_running_requests=32,
    log_level="error",
)
# For hybrid (linear-attention) targets: SGLang sizes their Mamba state pool from the memory free
# when it measures it, half a million slots on these machines, and allocating that took about
# 180 s of a plain engine's start. 256 slots keep every running request's (32 x SGLang's 3 per
# request, more with the extra buffer) and cached prefixes' states.
MAMBA_CACHE = dict(max_mamba_cache_size=256)


def start(
    target: str,
    draft: str | None = None,
    num_draft_tokens: int | None = None,
    *,
    fixed_width: bool = False,
    **kwargs,
):
    """An engine; with a draft, DFLASH. `fixed_width` verifies the full width every step
    (SGLANG_DFLASH_ADAPTIVE_WIDTH=0), for tests that measure the draft's acceptance rather than
    the width policy's choices."""
    import sglang as sgl

    args = dict(CPU_ENGINE, model_path=target, **kwargs)
    if draft is not None:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=draft)
        if num_draft_tokens is not None:
            args["speculative_num_draft_tokens"] = num_draft_tokens
    # The scheduler processes read the switch when they start, from the environment they inherit.
    with mock.patch.dict(os.environ, {ADAPTIVE_WIDTH: "0"} if fixed_width else {}):
        return sgl.Engine(**args)


def prompts(n: int, seed: int = 0, vocab: int = 384, min_len: int = 4, max_len: int = 40) -> list[list[int]]:
    """Seeded random token-id prompts (ids 0 and 1 are EOS and MASK, left out)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def generate(engine, input_ids: list[list[int]], sampling: dict, batch_size: int) -> list[dict]:
    """Run the prompts `batch_size` at a time (each group is submitted together)."""
    out: list[dict] = []
    for i in range(0, len(input_ids), batch_size):
        out += engine.generate(input_ids=input_ids[i : i + batch_size], sampling_params=sampling)
    return out


def generate_concurrently(engine, requests: list[tuple[list[int], dict]], stagger: float = 0.0) -> list[dict]:
    """Submit requests with their own sampling params concurrently (request i after
    i * stagger seconds), so they share batches at different stages."""

    async def one(i, input_ids, sampling):
        await asyncio.sleep(i * stagger)
        return await engine.async_generate(input_ids=input_ids, sampling_params=sampling)

    async def run():
        return await asyncio.gather(*(one(i, ids, s) for i, (ids, s) in enumerate(requests)))

    return engine.loop.run_until_complete(run())


def submit(engine, requests: list[dict], stagger: float = 0.0) -> list:
    """Submit requests concurrently, each given as `async_generate` keyword arguments (request i
    after i * stagger seconds); a request that fails yields its exception instead of an output."""

    async def one(i, kwargs):
        await asyncio.sleep(i * stagger)
        return await engine.async_generate(**kwargs)

    async def run():
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)), return_exceptions=True)

    return engine.loop.run_until_complete(run())


def submit_raw(engine, requests: list[dict]) -> list:
    """`submit` for request fields `Engine.async_generate` does not take (e.g.
    `return_sampling_mask`): each request is a `GenerateReqInput`'s keyword arguments, sent to the
    engine's tokenizer manager as the HTTP server sends it."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    async def one(kwargs):
        return await engine.tokenizer_manager.generate_request(GenerateReqInput(**kwargs), None).__anext__()

    async def run():
        return await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)

    return engine.loop.run_until_complete(run())


def generate_and_abort(engine, input_ids: list[int], sampling: dict, rid: str, after_chunks: int) -> dict:
    """Stream one request and abort it once `after_chunks` chunks have arrived."""

    async def run():
        last, seen = None, 0
        stream = await engine.async_generate(
            input_ids=input_ids, sampling_params=sampling, stream=True, rid=rid
        )
        async for chunk in stream:
            last, seen = chunk, seen + 1
            if seen == after_chunks:
                engine.tokenizer_manager.abort_request(rid)
        return last

    return engine.loop.run_until_complete(run())


def load(engine):
    """The scheduler's load snapshot (published immediately when it goes idle)."""
    return engine.loop.run_until_complete(engine.tokenizer_manager.get_loads())[0]


def idle_load(engine, idle, timeout: float = 30.0):
    """The load snapshot once it is back at `idle` (a snapshot taken before any request), or
    the last one after `timeout`. The scheduler publishes snapshots on its own schedule, so one
    taken right after the last output or a cache flush may still show the work before it; a
    leak stays in every snapshot and fails the caller's comparison."""
    deadline = time.time() + timeout
    while True:
        snapshot = load(engine)
        back = (snapshot.num_used_tokens, snapshot.num_running_reqs) == (idle.num_used_tokens, 0)
        if back or time.time() > deadline:
            return snapshot
        time.sleep(0.2)


def server_state(engine) -> dict:
    return engine.get_server_info()["internal_states"][0]


def flush_cache(engine, timeout: float = 30.0) -> None:
    """flush_cache fails while finished requests linger one loop iteration; retry briefly."""
    deadline = time.time() + timeout
    while True:
        result = engine.flush_cache()
        if getattr(result, "success", result):
            return
        if time.time() > deadline:
            raise TimeoutError(f"flush_cache kept failing: {result}")
        time.sleep(0.2)


def proposal_steps(trace_path) -> dict:
    """rid -> [(committed length, proposals)] per decode step, from the worker's proposal trace
    (SGLANG_DFLASH_TRACE_PROPOSALS)."""
    import json
    from collections import defaultdict

    steps = defaultdict(list)
    with open(trace_path) as f:
        for line in f:
            record = json.loads(line)
            steps[record["rid"]].append((record["prefix_len"], record["proposals"]))
    return steps


def shutdown(engine) -> None:
    engine.shutdown()


class Server:
    """`python -m sglang.launch_server` in a subprocess, on CPU, for HTTP-level tests."""

    def __init__(
        self,
        target: str,
        draft: str | None = None,
        num_draft_tokens: int | None = None,
        *extra: str,
        env: dict | None = None,
    ):
        import subprocess
        import sys

        from scripts.serving.lib.server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            target,
            "--port",
            str(self.port),
        ]
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32"]
        args += ["--max-total-tokens", "6144", "--log-level", "error"]
        if draft is not None:
            args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft]
            if num_draft_tokens is not None:
                args += ["--speculative-num-draft-tokens", str(num_draft_tokens)]
        self.process = subprocess.Popen([*args, *extra], env={**os.environ, **(env or {})})
        self._wait_ready()

    def _wait_ready(self, timeout: float = 240.0) -> None:
        import requests

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with code {self.process.returncode}")
            try:
                if requests.get(self.url + "/health_generate", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError("server did not become ready")

    def post(self, path: str, payload: dict) -> dict:
        import requests

        response = requests.post(self.url + path, json=payload, timeout=120)
        response.raise_for_status()
        return response.json()

    def get(self, path: str) -> dict:
        import requests

        response = requests.get(self.url + path, timeout=30)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        import signal

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except Exception:
                self.process.kill()
                self.process.wait()

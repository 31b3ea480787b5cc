"""Soak test: a DFLASH server under mixed, messy traffic for a while; nothing may leak or hang.

    python scripts/serving/soak.py [--minutes 10] [--concurrency 32] [--target T --draft D] [--seed 0]

Starts a DFLASH server (CPU unless --device cuda; the shipped tiny pair unless --target) with
SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1, so SGLang's idle leak checker kills it on a
leak. `--concurrency` clients then send requests back to back, each drawn at random:

* native /generate (token ids) or OpenAI chat (text); streamed or not;
* short, medium and long prompts, some sharing one of a few long prefixes (radix-cache hits);
* max_new_tokens from 1 to 512; greedy or sampled (temperature, top-p, top-k, min-p);
  sometimes ignore_eos or a stop token;
* some streamed requests are dropped by the client after a few chunks (disconnect), some
  aborted through /abort_request, and some non-streamed ones cut by a short client timeout;
* some constrained (JSON schema, regex, EBNF; OpenAI `response_format` on chat), some asking for
  logprobs (top-k, chosen token ids, input logprobs; OpenAI `logprobs` on chat), some with
  penalties or a custom logit processor (the server runs with --enable-custom-logit-processor),
  and a few with an invalid JSON schema, which must be refused (HTTP 400, or an abort in the
  stream's last chunk) and nothing else. Outcomes are also tallied per kind of request.

PASS needs: no 5xx, no connection failures, no stream errors, no unexpected 4xx; no request
left hanging (each ends, or is cancelled by the client, within --request-timeout); the server
alive throughout; and after the run, once idle and with the cache flushed, the load snapshot
(/v1/loads: used KV tokens, token usage, running and waiting requests) equal to the idle level
measured before the run. Prints a PASS/FAIL summary; the exit code is 0 only on PASS.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import shlex
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts.serving.lib import client, server  # noqa: E402
from scripts.serving.lib.prompts import synthetic  # noqa: E402

LOAD_KEYS = ("num_used_tokens", "token_usage", "num_running_reqs", "num_waiting_reqs")
MAX_NEW_TOKENS = [1, 2, 4, 16, 64, 128, 256, 512]
MAX_NEW_WEIGHTS = [1, 1, 1, 3, 3, 2, 1, 1]


@dataclass
class Scenario:
    endpoint: str  # generate / chat
    payload: dict
    stream: bool
    action: str = "complete"  # complete / disconnect / abort / cut (non-stream short timeout)
    after_chunks: int = 0
    cut_after: float = 0.0
    expect_status: int = 200  # 400 for a deliberately invalid request
    kind: str = "plain"  # the feature it exercises, for the per-kind tally


JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "items": {"type": "array", "items": {"type": "integer"}}},
    "required": ["name", "items"],
}
GRAMMARS = [
    {"json_schema": json.dumps(JSON_SCHEMA)},
    {"regex": r"(yes|no|maybe), [a-z ]{1,40}\."},
    {"ebnf": 'root ::= "[" num ("," num)* "]"\nnum ::= [0-9]+'},
]
INVALID_SCHEMA = '{"type": "objekt"}'


@functools.cache
def disallowed_tokens_processor() -> str:
    """SGLang's own DisallowedTokensLogitsProcessor, serialized (importing sglang takes seconds)."""
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    return DisallowedTokensLogitsProcessor.to_str()


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    by_kind: dict = field(default_factory=dict)  # kind -> Counter of outcomes
    failures: list = field(default_factory=list)  # (outcome, detail), the first few
    output_tokens: int = 0

    def add(self, outcome: str, detail: str = "", tokens: int = 0, kind: str = "plain") -> None:
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        self.output_tokens += tokens
        if outcome not in GOOD and len(self.failures) < 20:
            self.failures.append((outcome, detail[:300]))


GOOD = {"ok", "disconnected", "aborted", "cut", "rejected"}


class ScenarioMaker:
    """Random requests over a fixed set of shared prefixes, seeded."""

    def __init__(self, seed: int, vocab: int):
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.prefixes = [self.ids(self.rng.randint(64, 600)) for _ in range(4)]
        self.texts = [p.text for p in synthetic(32, seed)]
        self.system = " ".join(self.texts[:12])  # a long shared system prompt for chat

    def ids(self, n: int) -> list:
        return [self.rng.randrange(2, self.vocab) for _ in range(n)]

    def prompt_ids(self) -> list:
        r = self.rng.random()
        if r < 0.35:
            return self.rng.choice(self.prefixes) + self.ids(self.rng.randint(1, 64))
        if r < 0.6:
            return self.ids(self.rng.randint(1, 16))
        if r < 0.9:
            return self.ids(self.rng.randint(32, 256))
        return self.ids(self.rng.randint(512, 1500))

    def sampling(self) -> dict:
        rng = self.rng
        params = {"max_new_tokens": rng.choices(MAX_NEW_TOKENS, MAX_NEW_WEIGHTS)[0]}
        if rng.random() < 0.5:
            params["temperature"] = 0.0
        else:
            params["temperature"] = rng.choice([0.5, 1.0, 1.3])
            params["top_p"] = rng.choice([1.0, 0.9, 0.7])
            params["top_k"] = rng.choice([-1, 20, 50])
            params["min_p"] = rng.choice([0.0, 0.05])
        if rng.random() < 0.5:
            params["ignore_eos"] = True
        return params

    def generate_features(self, payload: dict) -> tuple[str, int]:
        """Grammar, logprobs, penalties or a processor on a /generate request: (kind, the
        expected HTTP status)."""
        rng, sampling, r = self.rng, payload["sampling_params"], self.rng.random()
        if r < 0.12:
            grammar = rng.choice(GRAMMARS)
            sampling.update(grammar)
            return next(iter(grammar)), 200
        if r < 0.22:
            payload.update(return_logprob=True, top_logprobs_num=rng.choice([0, 1, 5]))
            if rng.random() < 0.3:
                payload["token_ids_logprob"] = [rng.randrange(2, self.vocab) for _ in range(3)]
            if rng.random() < 0.3:
                payload["logprob_start_len"] = 0
            return "logprobs", 200
        if r < 0.26:
            sampling.update(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2)
            return "penalties", 200
        if r < 0.29:
            # One token set for all: SGLang's processor asserts that a batch shares one.
            payload["custom_logit_processor"] = disallowed_tokens_processor()
            sampling["custom_params"] = {"token_ids": [5, 6, 7, 8, 9]}
            return "processor", 200
        if r < 0.31:
            sampling["json_schema"] = INVALID_SCHEMA
            return "invalid_schema", 400
        return "plain", 200

    def chat_features(self, payload: dict) -> str:
        rng, r = self.rng, self.rng.random()
        if r < 0.1:
            schema = {"name": "record", "schema": JSON_SCHEMA}
            payload["response_format"] = rng.choice(
                [{"type": "json_object"}, {"type": "json_schema", "json_schema": schema}]
            )
            return "chat_" + payload["response_format"]["type"]
        if r < 0.2:
            payload.update(logprobs=True, top_logprobs=rng.choice([0, 3]))
            return "chat_logprobs"
        return "chat"

    def make(self) -> Scenario:
        rng, sampling = self.rng, self.sampling()
        stream = rng.random() < 0.8
        if rng.random() < 0.7:
            if rng.random() < 0.1:
                sampling["stop_token_ids"] = [rng.randrange(2, self.vocab)]
            payload = {"input_ids": self.prompt_ids(), "sampling_params": sampling, "stream": stream}
            payload["rid"] = uuid.uuid4().hex
            kind, expect = self.generate_features(payload)
            scenario = Scenario("generate", payload, stream, expect_status=expect, kind=kind)
            if expect != 200:
                return scenario
        else:
            messages = [{"role": "user", "content": rng.choice(self.texts)}]
            if rng.random() < 0.5:
                messages.insert(0, {"role": "system", "content": self.system})
            payload = client.chat_payload(messages, sampling)
            payload["stream"] = stream
            if not stream:
                payload.pop("stream_options")
            scenario = Scenario("chat", payload, stream, kind=self.chat_features(payload))
        r = rng.random()
        if stream and r < 0.1:
            scenario.action, scenario.after_chunks = "disconnect", rng.randint(0, 8)
        elif stream and r < 0.2 and scenario.endpoint == "generate":
            scenario.action, scenario.after_chunks = "abort", rng.randint(0, 8)
        elif not stream and r < 0.05:
            scenario.action, scenario.cut_after = "cut", rng.uniform(0.01, 1.0)
        return scenario


async def run_scenario(session, url: str, s: Scenario, timeout: float) -> tuple:
    """(outcome, detail, output tokens) of one scenario."""
    path = client.ENDPOINTS[s.endpoint]
    try:
        async with asyncio.timeout(timeout):
            if s.action == "cut":
                try:
                    async with asyncio.timeout(s.cut_after):
                        return await _plain(session, url + path, s)
                except TimeoutError:
                    return "cut", "", 0
            if not s.stream:
                return await _plain(session, url + path, s)
            return await _streamed(session, url, path, s)
    except TimeoutError:
        return "hung", f"{s.endpoint} {s.action} no end after {timeout:.0f} s", 0
    except (aiohttp.ClientError, ConnectionError) as e:
        return "connection_error", repr(e), 0


async def _plain(session, url: str, s: Scenario) -> tuple:
    async with session.post(url, json=s.payload) as response:
        body = await response.text()
        if response.status != 200:
            if response.status == s.expect_status:
                return "rejected", "", 0
            return _status_outcome(response.status), body, 0
    if s.expect_status != 200:
        return "accepted_invalid", body, 0
    return "ok", "", 0


async def _streamed(session, url: str, path: str, s: Scenario) -> tuple:
    chunks, tokens = 0, 0
    async with session.post(url + path, json=s.payload) as response:
        if response.status != 200:
            if response.status == s.expect_status:
                return "rejected", "", 0
            return _status_outcome(response.status), await response.text(), 0
        if s.after_chunks == 0 and s.action == "disconnect":
            response.close()
            return "disconnected", "", 0
        if s.after_chunks == 0 and s.action == "abort":
            await _abort(session, url, s.payload["rid"])
        finish = None
        async for data in client.iter_sse(response):
            if "error" in data:
                if s.expect_status != 200:
                    return "rejected", "", tokens  # the error reached a stream already open
                return "stream_error", str(data["error"]), tokens
            chunks += 1
            meta = data.get("meta_info") or {}
            tokens = meta.get("completion_tokens", tokens)
            finish = meta.get("finish_reason") or finish
            if chunks == s.after_chunks and s.action == "disconnect":
                response.close()
                return "disconnected", "", tokens
            if chunks == s.after_chunks and s.action == "abort":
                await _abort(session, url, s.payload["rid"])
    if s.action == "abort":
        return "aborted", "", tokens
    if s.expect_status != 200:
        # A stream already open reports the refusal as an abort in its last chunk.
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return "rejected", "", tokens
        return "accepted_invalid", str(finish), tokens
    return "ok", "", tokens


async def _abort(session, url: str, rid: str) -> None:
    async with session.post(url + "/abort_request", json={"rid": rid}) as response:
        await response.read()


def _status_outcome(status: int) -> str:
    return "http_5xx" if status >= 500 else f"http_{status}"


async def soak(url: str, args, vocab: int, proc: server.ServerProcess) -> Tally:
    tally = Tally()
    deadline = time.perf_counter() + args.minutes * 60
    makers = [ScenarioMaker(args.seed * 1000 + i, vocab) for i in range(args.concurrency)]

    async def worker(session, maker):
        while time.perf_counter() < deadline and proc.alive():
            scenario = maker.make()
            outcome, detail, tokens = await run_scenario(session, url, scenario, args.request_timeout)
            label = f"{scenario.endpoint}[{scenario.kind}]/{scenario.action}: {detail}"
            tally.add(outcome, label, tokens, scenario.kind)

    async def reporter():
        start = time.perf_counter()
        while time.perf_counter() < deadline and proc.alive():
            await asyncio.sleep(min(args.report_every, max(0.1, deadline - time.perf_counter())))
            load = await asyncio.to_thread(_safe_loads, url)
            done = sum(tally.outcomes.values())
            print(
                f"[{time.perf_counter() - start:6.0f} s] {done} requests {dict(tally.outcomes)} "
                f"running={load.get('num_running_reqs')} waiting={load.get('num_waiting_reqs')} "
                f"kv_used={load.get('num_used_tokens')}",
                flush=True,
            )

    async with aiohttp.ClientSession(
        connector=client.connector(), timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        await asyncio.gather(reporter(), *(worker(session, m) for m in makers))
    return tally


def _safe_loads(url: str) -> dict:
    try:
        return server.loads(url)
    except Exception:  # the status line must not stop the soak
        return {}


def wait_idle(url: str, timeout: float) -> dict:
    deadline = time.time() + timeout
    while True:
        load = server.loads(url)
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 or time.time() > deadline:
            return load
        time.sleep(1)


def snapshot(url: str) -> dict:
    load = server.loads(url)
    return {k: load.get(k) for k in LOAD_KEYS}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds before a request counts as hung"
    )
    server.add_launch_args(
        p, devices=("cpu", "cuda"), server_args="--max-total-tokens 16384 --chunked-prefill-size 1024"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-every", type=float, default=15.0, help="seconds between status lines")
    p.add_argument("--log", help="server log file (default: in a temp dir)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    target, draft = (args.target, args.draft) if args.target else server.default_models()
    vocab = _vocab(target)
    extra = ["--max-running-requests", str(args.concurrency), "--enable-custom-logit-processor"]
    extra += shlex.split(args.server_args)
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
    config = server.ServerConfig("dflash", target, draft, args.num_draft_tokens, args.device, extra, env)
    log = args.log or os.path.join(tempfile.mkdtemp(prefix="dflash-soak-log-"), "server.log")
    print(f"starting the DFLASH server ({args.device}); log {log}", flush=True)
    with server.ServerProcess(config, log) as proc:
        server.flush_cache(proc.url)
        idle = snapshot(proc.url)
        print(f"idle: {idle}; soaking {args.minutes:g} min at concurrency {args.concurrency}", flush=True)
        start = time.perf_counter()
        tally = asyncio.run(soak(proc.url, args, vocab, proc))
        elapsed = time.perf_counter() - start
        after, alive = {}, proc.alive()
        if alive:
            wait_idle(proc.url, 120)
            server.flush_cache(proc.url)
            time.sleep(5)  # let SGLang's idle leak checker look at the idle pools
            after = snapshot(proc.url)
            alive = proc.alive()
        tracebacks = _count(log, "Traceback")
    return summary(args, tally, elapsed, idle, after, alive, tracebacks, log)


def summary(args, tally, elapsed, idle, after, alive, tracebacks, log) -> int:
    o = tally.outcomes
    server_errors = o["http_5xx"] + o["connection_error"] + o["stream_error"]
    client_errors = sum(v for k, v in o.items() if k.startswith("http_4"))
    checks = [
        ("server alive (no crash, no leak-checker kill)", alive, ""),
        ("server errors (5xx, connection, stream)", server_errors == 0, str(server_errors)),
        ("unexpected 4xx", client_errors == 0, str(client_errors)),
        ("hung requests", o["hung"] == 0, str(o["hung"])),
        ("invalid requests served as valid", o["accepted_invalid"] == 0, str(o["accepted_invalid"])),
        ("load back at idle level after flush", after == idle, f"idle {idle} / after {after}"),
        ("tracebacks in server log", tracebacks == 0, str(tracebacks)),
    ]
    total = sum(o.values())
    print(f"\n== soak: {total} requests in {elapsed:.0f} s at concurrency {args.concurrency} ==")
    print(f"outcomes: {dict(o)}; {tally.output_tokens} output tokens streamed by /generate")
    for kind, outcomes in sorted(tally.by_kind.items()):
        print(f"  {kind:20s} {dict(outcomes)}")
    for name, ok, detail in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""))
    for outcome, detail in tally.failures:
        print(f"  - {outcome}: {detail}")
    passed = all(ok for _, ok, _ in checks)
    print(("PASS" if passed else "FAIL") + f" (server log: {log})")
    return 0 if passed else 1


def _vocab(target: str) -> int:
    import json

    try:
        with open(os.path.join(target, "config.json")) as f:
            config = json.load(f)
        return int((config.get("text_config") or config)["vocab_size"])
    except (OSError, KeyError, ValueError):
        return 1000


def _count(path: str, needle: str) -> int:
    with open(path, errors="replace") as f:
        return sum(needle in line for line in f)


if __name__ == "__main__":
    sys.exit(main())

"""Streaming HTTP requests to an SGLang server: native `/generate` and OpenAI `/v1/chat/completions`.

Each request is timed on the client (see `stats.py` for the definitions). Acceptance comes back
per request: `/generate` puts SGLang's spec fields in `meta_info`; chat requests ask for them
with `return_spec_tokens_details` and get them in the final chunk's `sglext`. Chat streams ask
for `continuous_usage_stats`, so every chunk carries the cumulative completion-token count
(otherwise content chunks are counted, which undercounts chunks that carry several tokens).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Optional

import aiohttp

from scripts.serving.lib.stats import RequestResult, stream_timings

ENDPOINTS = {"generate": "/generate", "chat": "/v1/chat/completions"}


def connector() -> aiohttp.TCPConnector:
    """Unlimited connections, one per request (no keep-alive reuse).

    SGLang's HTTP server closes a connection once it has been idle for SGLANG_TIMEOUT_KEEP_ALIVE
    seconds (5 by default), counted from when the server finished writing the last response.
    A client counts from when it has read that response, which is later when its event loop
    lags (on a machine the server keeps busy, by seconds). So a client can send a request on a
    connection the server is closing, however short its own idle limit, and the POST fails with
    `ClientOSError: Can not write request body` or `ServerDisconnectedError`: an error of the
    client's connection reuse, not of the server. A new connection per request has no such
    window, and on loopback it costs well under a millisecond. `scripts/serving/keepalive_race.py`
    shows the race."""
    return aiohttp.TCPConnector(limit=0, force_close=True)


async def iter_sse(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """Decoded `data:` events of a server-sent-event stream, until `[DONE]` or the end."""
    buffer = b""
    async for block in response.content.iter_any():
        buffer += block
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)


def generate_payload(
    prompt_text: Optional[str], sampling: dict, rid: Optional[str] = None, input_ids: Optional[list] = None
) -> dict:
    """A streamed native /generate request, from text or (`input_ids`) token ids."""
    prompt = {"text": prompt_text} if input_ids is None else {"input_ids": list(input_ids)}
    payload = {**prompt, "sampling_params": dict(sampling), "stream": True}
    if rid is not None:
        payload["rid"] = rid
    return payload


def chat_payload(messages: list, sampling: dict, model: str = "default") -> dict:
    """OpenAI chat request; SGLang's sampling names map onto OpenAI's (top_k/ignore_eos are
    SGLang extensions)."""
    payload = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "return_spec_tokens_details": True,
    }
    names = {"max_new_tokens": "max_tokens"}
    for key, value in sampling.items():
        payload[names.get(key, key)] = value
    return payload


def _read_spec(result: RequestResult, info: dict) -> None:
    if info.get("spec_verify_ct"):
        result.spec_verify_ct = int(info["spec_verify_ct"])
        result.spec_accept_length = info.get("spec_accept_length")
        result.spec_histogram = list(info.get("spec_correct_drafts_histogram") or [])


def _on_generate_chunk(result: RequestResult, data: dict) -> Optional[int]:
    meta = data.get("meta_info") or {}
    result.prompt_tokens = meta.get("prompt_tokens", result.prompt_tokens)
    finish = meta.get("finish_reason")
    if finish:
        result.finish_reason = finish.get("type") if isinstance(finish, dict) else str(finish)
    _read_spec(result, meta)
    return meta.get("completion_tokens")


def _on_chat_chunk(result: RequestResult, data: dict, counted: int) -> Optional[int]:
    usage = data.get("usage") or {}
    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    spec = (data.get("sglext") or {}).get("spec_tokens_details")
    if isinstance(spec, list):
        spec = spec[0] if spec else None
    if spec:
        _read_spec(result, spec)
    for choice in data.get("choices") or []:
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    if "completion_tokens" in usage:
        return usage["completion_tokens"]
    has_text = any((c.get("delta") or {}).get("content") for c in data.get("choices") or [])
    return counted + 1 if has_text else None


async def send(
    session: aiohttp.ClientSession,
    base_url: str,
    endpoint: str,
    payload: dict,
    index: int = 0,
    timeout: Optional[float] = None,
) -> RequestResult:
    """POST one streaming request and time it; never raises for request failures."""
    result = RequestResult(index=index, endpoint=endpoint)
    chunks: list[tuple[float, int]] = []
    tokens = 0
    result.start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with session.post(base_url + ENDPOINTS[endpoint], json=payload) as response:
                if response.status != 200:
                    result.error = f"http_{response.status}"
                    result.detail = (await response.text())[:300]
                    return result
                async for data in iter_sse(response):
                    if "error" in data:
                        result.error, result.detail = "stream_error", json.dumps(data["error"])[:300]
                        return result
                    if endpoint == "generate":
                        count = _on_generate_chunk(result, data)
                    else:
                        count = _on_chat_chunk(result, data, tokens)
                    if count is not None and count > tokens:
                        tokens = count
                        chunks.append((time.perf_counter(), tokens))
        result.ok = True
    except TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientError as e:
        result.error, result.detail = "connection", repr(e)[:300]
    except json.JSONDecodeError as e:
        result.error, result.detail = "bad_stream", repr(e)[:300]
    finally:
        result.end = time.perf_counter()
        timings = stream_timings(result.start, chunks, result.end)
        result.ttft, result.tpot, result.itls = timings["ttft"], timings["tpot"], timings["itls"]
        result.output_tokens = timings["output_tokens"]
    return result

"""Prefill/decode disaggregation with DFLASH, end to end on CPU, over Mooncake's TCP transport.

Two `launch_server` processes, `--disaggregation-mode prefill` and `decode`, with
`--disaggregation-transfer-backend mooncake` (`mooncake-transfer-engine-non-cuda`,
`MOONCAKE_PROTOCOL=tcp` on loopback). Each request goes to both with the same bootstrap fields,
as SGLang's PD router sends it. The prefill engine computes the prompt's target K/V and the
draft's context K/V; Mooncake moves both into the decode engine's pools at the request's slots.

Oracle: one engine serving the same prompts. The decode engine's greedy tokens must equal it,
and so must the draft's raw proposals at its first decode steps (the proposal trace), which
holds only if the decode engine's draft sees the whole prompt. With the draft K/V left out of
the transfer (a test-only knob), the tokens are still equal (the target verifies) but the
proposals differ and acceptance drops: the check can fail.

Mooncake's CPU build links libibverbs, even for TCP; `make` unpacks Debian's libibverbs1 and
libnl into `.venv/rdma` (see the Makefile), and the servers get it on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import threading
from collections import defaultdict

import pytest

from tests import engines

pytestmark = pytest.mark.sglang

B = 8  # the shipped draft's block size, verified in full every step (fixed width)
N = 48
NUM_PROMPTS = 4
COMPARED_STEPS = 4  # decode steps per request whose proposals are compared
GREEDY = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}
TRACE = "SGLANG_DFLASH_TRACE_PROPOSALS"
SKIP_DRAFT_TRANSFER = "SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER"


def mooncake_env() -> dict:
    """The environment a server needs for Mooncake over TCP, or a failure that says what is
    missing. Without the package the test is skipped (`make test` installs it)."""
    pytest.importorskip("mooncake", reason="mooncake-transfer-engine-non-cuda is not installed")
    libs = ":".join(
        sorted(glob.glob(os.path.join(sys.prefix, "rdma", "**", "lib", "*-linux-gnu"), recursive=True))
    )
    env = {
        "MOONCAKE_PROTOCOL": "tcp",
        "LD_LIBRARY_PATH": ":".join(filter(None, [libs, os.environ.get("LD_LIBRARY_PATH")])),
    }
    check = subprocess.run(
        [sys.executable, "-c", "import mooncake.engine"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        pytest.fail(
            f"Mooncake's engine does not load (run `make install`): {check.stderr.strip().splitlines()[-1]}"
        )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate_pd(prefill: engines.Server, decode: engines.Server, bootstrap_port: int, ids, rid: str) -> dict:
    """One request, as SGLang's PD router sends it: to both engines at once, with the prefill
    engine's bootstrap address and a room that pairs the two halves."""
    payload = {
        "input_ids": ids,
        "sampling_params": GREEDY,
        "rid": rid,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": abs(hash(rid)) % 2**62,
    }
    results = {}

    def send(name, server):
        results[name] = server.post("/generate", payload)

    threads = [
        threading.Thread(target=send, args=item) for item in (("prefill", prefill), ("decode", decode))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results["decode"]


def _steps(trace_path) -> dict[str, list]:
    """rid -> [(committed length, proposals)] per decode step, from the proposal trace."""
    steps = defaultdict(list)
    with open(trace_path) as f:
        for line in f:
            record = json.loads(line)
            steps[record["rid"]].append((record["prefix_len"], record["proposals"]))
    return steps


@pytest.fixture(scope="module")
def pair_and_prompts():
    from transformers import AutoTokenizer

    from sglang_dflash.assets import tiny_pair, tiny_pair_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair()[0])
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in tiny_pair_prompts()[:NUM_PROMPTS]]
    return tiny_pair(), prompts


def _serve(pair, *extra, env) -> engines.Server:
    return engines.Server(*pair, B, *extra, env={engines.ADAPTIVE_WIDTH: "0", **env})


@pytest.fixture(scope="module")
def single(pair_and_prompts, tmp_path_factory):
    """The oracle: one engine, the same prompts and rids, one at a time."""
    pair, prompts = pair_and_prompts
    trace = tmp_path_factory.mktemp("single") / "trace.jsonl"
    server = _serve(pair, env={TRACE: str(trace)})
    try:
        outputs = [
            server.post("/generate", {"input_ids": p, "sampling_params": GREEDY, "rid": f"r{i}"})
            for i, p in enumerate(prompts)
        ]
    finally:
        server.stop()
    return outputs, _steps(trace)


def _run_pd(pair, prompts, tmp_path, decode_variants, *, skip_draft_transfer=False) -> list:
    """One prefill engine; for each decode variant (extra flags), a decode engine that serves
    every prompt. Returns [(outputs, steps)] per variant."""
    env = mooncake_env()
    if skip_draft_transfer:
        env[SKIP_DRAFT_TRANSFER] = "1"  # both sides: neither registers the draft's buffers
    port = _free_port()
    pd = ("--disaggregation-transfer-backend", "mooncake", "--disaggregation-bootstrap-port", str(port))
    prefill = _serve(pair, "--disaggregation-mode", "prefill", *pd, env=env)
    runs = []
    try:
        for k, extra in enumerate(decode_variants):
            trace = tmp_path / f"decode{k}.jsonl"
            decode = _serve(
                pair, "--disaggregation-mode", "decode", *pd, *extra, env={**env, TRACE: str(trace)}
            )
            try:
                outputs = [_generate_pd(prefill, decode, port, p, f"r{i}") for i, p in enumerate(prompts)]
            finally:
                decode.stop()
            runs.append((outputs, _steps(trace)))
    finally:
        prefill.stop()
    return runs


def _verify_steps(outputs) -> int:
    return sum(o["meta_info"]["spec_verify_ct"] for o in outputs)


def test_decode_engine_drafts_with_the_prompts_context(pair_and_prompts, single, tmp_path):
    pair, prompts = pair_and_prompts
    want, want_steps = single
    variants = {"overlap": (), "no-overlap": ("--disable-overlap-schedule",)}
    runs = _run_pd(pair, prompts, tmp_path, list(variants.values()))
    for name, (got, got_steps) in zip(variants, runs):
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want], name
        for i in range(len(prompts)):
            rid = f"r{i}"
            assert len(got_steps[rid]) >= COMPARED_STEPS, name
            assert got_steps[rid][:COMPARED_STEPS] == want_steps[rid][:COMPARED_STEPS], (name, rid)
        assert _verify_steps(got) == _verify_steps(want), name


def test_check_fails_when_the_draft_kv_is_left_out_of_the_transfer(pair_and_prompts, single, tmp_path):
    pair, prompts = pair_and_prompts
    want, want_steps = single
    [(got, got_steps)] = _run_pd(pair, prompts, tmp_path, [()], skip_draft_transfer=True)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]  # the target verifies
    for i in range(len(prompts)):
        rid = f"r{i}"
        assert got_steps[rid][0][0] == want_steps[rid][0][0]  # the same committed length...
        assert got_steps[rid][0][1] != want_steps[rid][0][1]  # ...but proposals without context
    assert _verify_steps(got) > _verify_steps(want)  # acceptance dropped

"""Prefill/decode disaggregation with DFLASH, end to end on CPU, over Mooncake's TCP transport.

Two `launch_server` processes, `--disaggregation-mode prefill` and `decode`, with
`--disaggregation-transfer-backend mooncake` (`mooncake-transfer-engine-non-cuda`,
`MOONCAKE_PROTOCOL=tcp` on loopback), behind SGLang's PD router (`sglang-router`), which sends
each request to both with the same bootstrap fields. The prefill engine computes the prompt's
target K/V and the draft's context K/V; Mooncake moves both into the decode engine's pools at
the request's slots.

Oracle: one engine serving the same prompts. The decode engine's greedy tokens must equal it,
and so must the draft's raw proposals at its first decode steps (the proposal trace), which
holds only if the decode engine's draft sees the whole prompt. With the draft K/V left out of
the transfer (a test-only knob), the tokens are still equal (the target verifies) but the
proposals differ and acceptance drops: the check can fail. The decode engine also counts those
requests (`integration/draft_context.py`), and counts none when the draft K/V arrives.

Mooncake's CPU build links libibverbs, even for TCP; `make` unpacks Debian's libibverbs1 and
libnl into `.venv/rdma` (see the Makefile), and the servers get it on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import pytest

from scripts.serving.lib.server import free_port
from tests.support import engines

pytestmark = pytest.mark.sglang

B = 8  # the shipped draft's block size, verified in full every step (fixed width)
N = 48
NUM_PROMPTS = 4
COMPARED_STEPS = 4  # decode steps per request whose proposals are compared
GREEDY = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}
TRACE = "SGLANG_DFLASH_TRACE_PROPOSALS"
SKIP_DRAFT_TRANSFER = "SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER"  # the prefill engine registers no draft K/V


def mooncake_env() -> dict:
    """The environment a server needs for Mooncake over TCP, or a failure that says what is
    missing. Without the package the test is skipped (`make test` installs it)."""
    pytest.importorskip("mooncake", reason="mooncake-transfer-engine-non-cuda is not installed")
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")
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


class Router:
    """SGLang's PD router (`sglang_router.launch_router --pd-disaggregation`) in front of one
    prefill and one decode engine: it sends each request to both, with the prefill engine's
    bootstrap address and a room that pairs the two halves."""

    def __init__(self, prefill: engines.Server, bootstrap_port: int, decode: engines.Server):
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        command += ["--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url]
        command += ["--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--log-level", "warn"]
        self.process = subprocess.Popen(command)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        """Until a request goes through: the router answers /health before its health checks
        have admitted the workers."""
        import requests

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the router exited with code {self.process.returncode}")
            try:
                probe = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
                if requests.post(self.url + "/generate", json=probe, timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError("the router did not admit the engines")

    def generate(self, ids, rid: str) -> dict:
        import requests

        response = requests.post(
            self.url + "/generate",
            json={"input_ids": ids, "sampling_params": GREEDY, "rid": rid},
            timeout=120,
        )
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


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
    return outputs, engines.proposal_steps(trace)


def _run_pd(pair, prompts, tmp_path, decode_variants, *, prefill_sends_draft_kv=True) -> list:
    """One prefill engine; for each decode variant (extra flags), a decode engine that serves
    every prompt. Returns [(outputs, steps, requests received without draft K/V)] per variant."""
    env = mooncake_env()
    port = free_port()
    pd = ("--disaggregation-transfer-backend", "mooncake", "--disaggregation-bootstrap-port", str(port))
    prefill_env = env if prefill_sends_draft_kv else {**env, SKIP_DRAFT_TRANSFER: "1"}
    prefill = _serve(pair, "--disaggregation-mode", "prefill", *pd, env=prefill_env)
    runs = []
    try:
        for k, extra in enumerate(decode_variants):
            trace = tmp_path / f"decode{k}.jsonl"
            decode = _serve(
                pair, "--disaggregation-mode", "decode", *pd, *extra, env={**env, TRACE: str(trace)}
            )
            try:
                router = Router(prefill, port, decode)
                try:
                    outputs = [router.generate(p, f"r{i}") for i, p in enumerate(prompts)]
                finally:
                    router.stop()
                [state] = decode.get("/server_info")["internal_states"]
            finally:
                decode.stop()
            without_context = state["dflash_requests_without_draft_context"]
            runs.append((outputs, engines.proposal_steps(trace), without_context))
    finally:
        prefill.stop()
    return runs


def _verify_steps(outputs) -> int:
    return sum(o["meta_info"]["spec_verify_ct"] for o in outputs)


def test_decode_engine_drafts_with_the_prompts_context(pair_and_prompts, single, tmp_path):
    pair, prompts = pair_and_prompts
    want, want_steps = single
    variants = {"overlap": ()}  # overlap off: the same transfer; its scheduler is tested elsewhere
    runs = _run_pd(pair, prompts, tmp_path, list(variants.values()))
    for name, (got, got_steps, without_context) in zip(variants, runs):
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want], name
        assert without_context == 0, name
        for i in range(len(prompts)):
            rid = f"r{i}"
            assert len(got_steps[rid]) >= COMPARED_STEPS, name
            assert got_steps[rid][:COMPARED_STEPS] == want_steps[rid][:COMPARED_STEPS], (name, rid)
        assert _verify_steps(got) == _verify_steps(want), name


@pytest.mark.slow  # one more PD pair (about 150 s): with --run-slow
def test_a_prefill_engine_that_sends_no_draft_kv_is_caught(pair_and_prompts, single, tmp_path):
    """The prefill engine leaves its draft K/V out of the transfer (as one without speculation
    would): the proposal check fails, and the decode engine counts every request. This shows the
    step-for-step comparison above can fail."""
    pair, prompts = pair_and_prompts
    want, want_steps = single
    [(got, got_steps, without_context)] = _run_pd(pair, prompts, tmp_path, [()], prefill_sends_draft_kv=False)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]  # the target verifies
    for i in range(len(prompts)):
        rid = f"r{i}"
        assert got_steps[rid][0][0] == want_steps[rid][0][0]  # the same committed length...
        assert got_steps[rid][0][1] != want_steps[rid][0][1]  # ...but proposals without context
    assert _verify_steps(got) > _verify_steps(want)  # acceptance dropped
    assert without_context >= len(prompts)  # and the router's readiness probes


@pytest.mark.parametrize(
    "prefill_tp, draft_entries, refused",
    [(2, 4, True), (1, 4, False), (2, 0, False)],
    ids=["other-tp", "same-tp", "no-draft-registered"],
)
def test_a_prefill_peer_of_another_tp_size_is_refused_by_name(prefill_tp, draft_entries, refused):
    """The decode side's check, on a stand-in of SGLang's KV manager after it fetched the
    prefill peer's parallel info."""
    from types import SimpleNamespace

    from sglang_dflash.integration.scheduler_hooks import _refuse_prefill_peer_of_another_tp_size

    manager = SimpleNamespace(
        attn_tp_size=1,
        kv_args=SimpleNamespace(num_draft_entries=draft_entries),
        prefill_info_table={"10.0.0.1:8998": SimpleNamespace(attn_tp_size=prefill_tp)},
    )
    fetched = lambda self, addr: True  # noqa: E731
    if refused:
        with pytest.raises(RuntimeError, match="prefill engine at 10.0.0.1:8998 has 2, this decode engine 1"):
            _refuse_prefill_peer_of_another_tp_size(fetched, manager, "10.0.0.1:8998")
    else:
        assert _refuse_prefill_peer_of_another_tp_size(fetched, manager, "10.0.0.1:8998") is True


def test_context_check_counts_the_rows_no_transfer_overwrote(caplog):
    import torch

    from sglang_dflash.draft.kv_store import DraftKVStore
    from sglang_dflash.integration.draft_context import DraftContextCheck

    store = DraftKVStore(
        num_slots=16, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.bfloat16, device="cpu"
    )
    observed = []
    check = DraftContextCheck(store, metrics=type("M", (), {"observe_without_context": observed.append})())
    for first in (3, 7, 11):
        check.stamp(torch.tensor([first, first + 1]))
    store.write(torch.tensor([7]), torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4))  # 7's K/V arrived
    with caplog.at_level("WARNING"):
        assert check.check(torch.tensor([3, 7, 11]), ["a", "b", "c"]) == 2
        assert check.check(torch.tensor([3, 7, 11]), ["a", "b", "c"]) == 0  # the sentinel is cleared
    assert not torch.isnan(store.k.float()).any()  # nothing left for the draft to read
    assert check.requests_without_context == 2 and observed == [2]
    assert [r.message.split(" arrived")[0] for r in caplog.records] == ["DFLASH: request a"]

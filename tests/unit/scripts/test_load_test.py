"""scripts/serving/load_test.py: its statistics against hand-computed oracles, its reports, and a short
run against a CPU DFLASH server whose JSON, CSV and PNG outputs must be complete and consistent."""

import asyncio
import json
import random

import numpy as np
import pytest

from scripts.serving import load_test
from scripts.serving.lib import client, prompts, report, runner, server, stats
from tests.support import plots

# ------------------------------------------------------------------------------ statistics


def test_percentile_hand_oracles():
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile([4, 1, 3, 2], 90) == pytest.approx(3.7)  # rank 2.7 of 0..3
    assert stats.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert stats.percentile([1, 2, 3, 4], 0) == 1 and stats.percentile([1, 2, 3, 4], 100) == 4
    assert stats.percentile([7.0], 99) == 7.0
    assert stats.percentile([], 50) is None


def test_percentile_matches_numpy_linear():
    rng = random.Random(0)
    for n in (2, 3, 10, 101):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (50, 90, 99):
            assert stats.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_summarize_scales_and_orders():
    s = stats.summarize([0.001, 0.002, 0.003, 0.004], 1e3)
    assert s == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97, "max": 4.0})
    assert stats.summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_stream_timings_hand_oracle():
    # Sent at 0; tokens 1 @0.5, (no new token @0.6), 3 @0.7, 4 @1.0; stream ends at 1.1.
    t = stats.stream_timings(0.0, [(0.5, 1), (0.6, 1), (0.7, 3), (1.0, 4)], 1.1)
    assert t["ttft"] == 0.5
    assert t["output_tokens"] == 4
    # 2 tokens after a 0.2 s gap -> two ITLs of 0.1; 1 token after 0.3 s -> one of 0.3.
    assert t["itls"] == pytest.approx([0.1, 0.1, 0.3])
    assert t["tpot"] == pytest.approx((1.1 - 0.5) / 3)
    assert stats.summarize(t["itls"]) == pytest.approx(
        {"mean": 0.5 / 3, "p50": 0.1, "p90": 0.26, "p99": 0.296, "max": 0.3}
    )


def test_stream_timings_without_tokens_or_with_one():
    assert stats.stream_timings(0.0, [], 1.0) == {"ttft": None, "tpot": None, "itls": [], "output_tokens": 0}
    one = stats.stream_timings(1.0, [(1.25, 1)], 2.0)
    assert (one["ttft"], one["tpot"], one["itls"], one["output_tokens"]) == (0.25, None, [], 1)


def _request(i, ok=True, tokens=0, verify=0, hist=(), error=None, start=0.0, end=1.0):
    r = stats.RequestResult(index=i, endpoint="generate", start=start, end=end, ok=ok, error=error)
    r.output_tokens, r.spec_verify_ct, r.spec_histogram = tokens, verify, list(hist)
    r.spec_accept_length = tokens / verify if verify else None
    return r


def test_acceptance_hand_oracle():
    # r1: 3 steps accepting 0, 1, 2 drafts -> 1 + (1+2+3) = 7 tokens; r2: 2 steps accepting 0.
    results = [_request(0, tokens=7, verify=3, hist=[1, 1, 1]), _request(1, tokens=3, verify=2, hist=[2])]
    results.append(_request(2, ok=False, error="timeout", verify=9, hist=[9]))  # ignored
    acc = stats.acceptance(results)
    assert acc["verify_steps"] == 5
    assert acc["accept_length_histogram"] == {1: 3, 2: 1, 3: 1}
    assert acc["accept_length_mean"] == pytest.approx((1 * 3 + 2 * 1 + 3 * 1) / 5)
    assert acc["accept_length_sglang"] == pytest.approx((7 + 3) / 5)
    assert acc["accept_length_per_request_mean"] == pytest.approx((7 / 3 + 3 / 2) / 2)
    assert stats.acceptance([_request(0, tokens=5)]) == {}  # no speculation


def test_aggregate_counts_and_throughput():
    results = [
        _request(0, tokens=7, verify=3, hist=[1, 1, 1], start=0.0, end=1.0),
        _request(1, tokens=3, verify=2, hist=[2], start=0.5, end=2.0),
        _request(2, ok=False, error="timeout"),
        _request(3, ok=False, error="http_500"),
    ]
    agg = stats.aggregate(results, duration=2.0)
    assert (agg["requests"], agg["completed"], agg["errors"], agg["timeouts"]) == (4, 2, 1, 1)
    assert agg["error_kinds"] == {"timeout": 1, "http_500": 1}
    assert agg["output_tokens"] == 10
    assert agg["output_throughput"] == 5.0 and agg["request_throughput"] == 1.0
    assert agg["e2e_ms"]["max"] == pytest.approx(1500.0)


def test_a_level_in_rounds_pools_their_requests_over_their_windows(monkeypatch):
    """Two rounds: 10 tokens in 2 s, then 30 in 1 s -> 40 tokens over 3 s, rounds 5 and 30."""
    batches = iter(
        [
            [_request(0, tokens=4, start=10.0, end=11.0), _request(1, tokens=6, start=10.5, end=12.0)],
            [_request(0, tokens=30, start=20.0, end=21.0)],
        ]
    )

    async def closed_loop(*args):
        return next(batches)

    monkeypatch.setattr(runner, "_closed_loop", closed_loop)
    for name in ("flush_cache", "prometheus_samples"):
        monkeypatch.setattr(server, name, lambda url: None)
    monkeypatch.setattr(runner, "_server_accept_length", lambda url: None)
    level = runner.Level("http://x", "generate", None, runner.LevelSpec(concurrency=2, progress=False))
    level.measure()
    level.measure()
    result = level.result()
    assert result["summary"]["output_tokens"] == 40 and result["summary"]["duration_s"] == 3.0
    assert result["summary"]["output_throughput"] == pytest.approx(40 / 3)
    assert result["round_output_throughput"] == [5.0, 30.0]
    assert [(r["index"], r["round"]) for r in result["requests"]] == [(0, 0), (1, 0), (0, 1)]


def test_servers_take_turns_one_at_a_time(monkeypatch):
    """`--rounds 3` over two servers: each level warms each server once, then measures them in
    turn, in order and reversed every other round; only the server measured runs."""
    events, running = [], set()

    class Proc:
        def __init__(self, name):
            self.name, self.url = name, f"http://{name}"

        def pause(self):
            running.discard(self.name)

        def resume(self):
            running.add(self.name)

    class Level:
        def __init__(self, url, endpoint, payload, spec):
            self.name, self.spec = url.removeprefix("http://"), spec

        def warm_up(self):
            events.append(("warm", self.name, self.spec.concurrency))

        def measure(self):
            assert running == {self.name}
            events.append(("measure", self.name, self.spec.concurrency))

        def result(self):
            return {"concurrency": self.spec.concurrency}

    monkeypatch.setattr(runner, "Level", Level)
    monkeypatch.setattr(load_test, "payload_fn", lambda args, url, prompts: None)
    args = load_test.parse_args(["--configs", "baseline,dflash", "--rounds", "3", "--concurrency", "1,4"])
    runs = load_test.sweep_in_turns(args, {"baseline": Proc("baseline"), "dflash": Proc("dflash")}, [])
    assert running == {"baseline", "dflash"}  # all resumed at the end, for shutdown
    assert [r["server"] for r in runs] == ["baseline", "dflash"]
    assert all([lvl["concurrency"] for lvl in r["levels"]] == [1, 4] for r in runs)
    order = ["baseline", "dflash", "dflash", "baseline", "baseline", "dflash"]
    for c in (1, 4):
        level_events = [e[:2] for e in events if e[2] == c]
        assert level_events == [("warm", "baseline"), ("measure", "baseline"), ("warm", "dflash")] + [
            ("measure", name) for name in order[1:]
        ]
    with pytest.raises(SystemExit):
        load_test.parse_args(["--url", "http://x", "--rounds", "2"])


def test_dflash_window_hand_oracle():
    before = {
        "verify_steps": 10,
        "accepted_drafts": 5,
        "buckets": {0.0: 6, 1.0: 8, 2.0: 10, float("inf"): 10},
    }
    before["positions"] = {1: 4, 2: 1}
    # 5 more steps accepting 0, 1, 2, 2, 2 drafts.
    after = {
        "verify_steps": 15,
        "accepted_drafts": 12,
        "buckets": {0.0: 7, 1.0: 10, 2.0: 15, float("inf"): 15},
    }
    after["positions"] = {1: 8, 2: 4}
    w = server.dflash_window(before, after)
    assert w["verify_steps"] == 5
    assert w["accept_length_mean"] == pytest.approx(1 + 7 / 5)
    assert w["accept_length_histogram"] == {1: 1, 2: 1, 3: 3}
    assert w["position_accept_rate"] == pytest.approx({1: 4 / 5, 2: 3 / 5})
    assert server.dflash_window(None, after) == {}


# ------------------------------------------------------------------------- client & prompts


class _FakeContent:
    def __init__(self, blocks):
        self.blocks = blocks

    async def iter_any(self):
        for block in self.blocks:
            yield block


class _FakeResponse:
    def __init__(self, blocks):
        self.content = _FakeContent(blocks)


def test_iter_sse_reassembles_split_events_and_stops_at_done():
    blocks = [b'data: {"a"', b': 1}\n\ndata: {"a": 2}\n', b"\n: comment\ndata: [DONE]\n\ndata: {}\n\n"]

    async def collect():
        return [event async for event in client.iter_sse(_FakeResponse(blocks))]

    assert asyncio.run(collect()) == [{"a": 1}, {"a": 2}]


def test_chat_payload_maps_sampling_names():
    p = client.chat_payload([{"role": "user", "content": "hi"}], {"max_new_tokens": 8, "temperature": 0.5})
    assert p["max_tokens"] == 8 and p["temperature"] == 0.5 and "max_new_tokens" not in p
    assert p["stream"] and p["stream_options"]["continuous_usage_stats"] and p["return_spec_tokens_details"]


def test_output_lengths_from_a_range_are_the_same_per_request_on_every_server():
    assert load_test.token_range("128") == (128, 128)
    assert load_test.token_range("64-192") == (64, 192)
    for bad in ("0", "192-64"):
        with pytest.raises(Exception, match="LOW-HIGH"):
            load_test.token_range(bad)
    lengths = [load_test.output_length((64, 192), i) for i in range(400)]
    assert min(lengths) == 64 and max(lengths) == 192 and len(set(lengths)) > 100
    assert abs(sum(lengths) / len(lengths) - 128) < 5  # uniform: mean 128
    texts = [prompts.Prompt(text=f"prompt {i}") for i in range(3)]
    for endpoint, key in (("generate", "max_new_tokens"), ("chat", "max_tokens")):
        args = load_test.parse_args(
            ["--url", "http://x", "--endpoint", endpoint, "--max-new-tokens", "64-192"]
        )
        payload = load_test.payload_fn(args, "http://x", texts)
        got = [(payload(i).get("sampling_params") or payload(i))[key] for i in range(400)]
        assert got == lengths  # the request index decides, whichever server sends it
    fixed = load_test.parse_args(["--url", "http://x", "--max-new-tokens", "7"])
    assert load_test.payload_fn(fixed, "http://x", texts)(5)["sampling_params"]["max_new_tokens"] == 7


def test_prompt_files(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "hello"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "x"}]})
    )
    loaded = prompts.load("jsonl", str(path))
    assert loaded[0].text == "hello" and loaded[1].messages[0]["content"] == "x"
    assert loaded[1].as_text(lambda m: "T:" + m[0]["content"]) == "T:x"
    gsm = tmp_path / "g.jsonl"
    gsm.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    assert prompts.load("gsm8k", str(gsm))[0].text == "2+2?" + prompts.MATH_SUFFIX
    mt = tmp_path / "m.jsonl"
    mt.write_text(json.dumps({"turns": ["first", "second"], "category": "x"}) + "\n")
    assert prompts.load("mt-bench", str(mt))[0].as_messages() == [{"role": "user", "content": "first"}]
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no"}) + "\n")
    with pytest.raises(ValueError, match="b.jsonl:2"):
        prompts.load("jsonl", str(bad))
    assert len(prompts.load("synthetic")) == 64 and len(prompts.load("synthetic", limit=5)) == 5
    from sglang_dflash.assets import tiny_pair_prompts

    assert [p.text for p in prompts.load("code", limit=3)] == tiny_pair_prompts()[:3]


# ----------------------------------------------------------------------------------- reports


def _results(label=None):
    def level(c, tput, tpot):
        summary = stats.aggregate([], 1.0)
        summary.update(output_throughput=tput, tpot_ms=stats.summarize([tpot]))
        return {"concurrency": c, "summary": summary, "server_acceptance": {}, "requests": []}

    runs = [
        {
            "server": "baseline",
            "url": "u",
            "endpoint": "generate",
            "levels": [level(1, 100, 10), level(4, 300, 13)],
        },
        {
            "server": "dflash",
            "url": "u",
            "endpoint": "generate",
            "levels": [level(1, 250, 4), level(4, 600, 6.5)],
        },
    ]
    return {"label": label, "simulated": bool(label), "runs": runs}


def test_speedups_against_baseline():
    rows = report.speedups(_results()["runs"])
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert rows[0]["dflash_speedup"] == 2.5 and rows[1]["dflash_speedup"] == 2.0
    assert rows[0]["dflash_tpot_speedup"] == 2.5 and rows[1]["dflash_tpot_speedup"] == 2.0


def test_simulated_label_reaches_every_output(tmp_path):
    assert report.simulated_label({}) is None
    assert report.simulated_label({"SGLANG_SIMULATE_ACC_LEN": "-1"}) is None
    label = report.simulated_label({"SGLANG_SIMULATE_ACC_LEN": "3.5", "SGLANG_SIMULATE_ACC_METHOD": "x"})
    assert "SIMULATED" in label and "SGLANG_SIMULATE_ACC_LEN=3.5" in label and "METHOD=x" in label
    results = _results(label)
    assert label in report.summary_table(results["runs"][1], label)
    assert label in report.speedup_table(report.speedups(results["runs"]), label)
    assert all(row["simulated_acceptance"] == label for row in report.summary_rows(results))
    for path in report.plot(results, str(tmp_path)):
        assert label in plots.png_title(path)


def test_builtin_is_skipped_on_cpu():
    config = server.ServerConfig("dflash-builtin", "t", "d", device="cpu")
    assert "GPU only" in config.skip_reason()
    assert server.ServerConfig("dflash-builtin", "t", "d", device="cuda").skip_reason() is None
    assert server.ServerConfig("baseline", "t", device="cpu").environment().get("SGLANG_DFLASH_IMPL") is None


def test_compare_mode_on_cpu_skips_builtin_with_a_message(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--configs", "dflash-builtin", "--target", "t", "--draft", "d", "--device", "cpu"]
    assert load_test.main(argv + ["--output-dir", str(out), "--no-plots"]) == 0
    assert "GPU only" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["runs"] == [] and "GPU only" in results["skipped"][0]["reason"]


# ------------------------------------------------------------------ a run against a server


# ------------------------------------------------------------------------------ soak traffic


def test_soak_traffic_mixes_every_kind_of_request():
    from scripts.serving import soak

    maker = soak.ScenarioMaker(seed=0, vocab=384)
    scenarios = [maker.make() for _ in range(2000)]
    kinds = {(s.endpoint, s.stream, s.action) for s in scenarios}
    assert {
        ("generate", True, "complete"),
        ("generate", True, "disconnect"),
        ("generate", True, "abort"),
    } <= kinds
    assert {("chat", True, "complete"), ("chat", True, "disconnect"), ("chat", False, "complete")} <= kinds
    assert ("generate", False, "cut") in kinds
    ids = [s.payload["input_ids"] for s in scenarios if s.endpoint == "generate"]
    assert min(map(len, ids)) <= 16 and max(map(len, ids)) >= 512
    for prefix in maker.prefixes:  # every shared prefix is reused
        assert sum(p[: len(prefix)] == prefix for p in ids) >= 2
    sampling = [s.payload.get("sampling_params") or s.payload for s in scenarios]
    assert {p["temperature"] == 0.0 for p in sampling} == {True, False}
    new_tokens = {p.get("max_new_tokens", p.get("max_tokens")) for p in sampling}
    assert new_tokens == set(soak.MAX_NEW_TOKENS)
    assert all(0 <= t < 384 for p in ids for t in p)
    again = soak.ScenarioMaker(seed=0, vocab=384)
    assert [again.make().payload.get("input_ids") for _ in range(20)] == [
        s.payload.get("input_ids") for s in scenarios[:20]
    ]


def test_missing_matplotlib_is_one_line_before_any_work(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    hide = lambda name, *a: None if name == "matplotlib" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hide)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"pip install 'sglang-dflash\[bench\]'"):
        load_test.main(["--url", "http://127.0.0.1:9", "--output-dir", str(out)])
    assert not out.exists()  # nothing was started or written

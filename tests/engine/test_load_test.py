"""scripts/serving/load_test.py against running servers: its counts against the server's own."""

import csv
import json
import os

import pytest

from scripts.serving import load_test
from scripts.serving.lib import server
from tests.support import plots

MAX_NEW = 12


@pytest.fixture(scope="module")
def dflash_server(tiny, tmp_path_factory):
    target, draft = tiny.pair("a")
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    extra = ["--max-total-tokens", "6144", "--enable-metrics", "--log-level", "warning"]
    config = server.ServerConfig("dflash", target, draft, 8, "cpu", extra)
    with server.ServerProcess(config, log) as proc:
        yield proc


def _check_level(level: dict, width: int) -> None:
    s, reqs = level["summary"], level["requests"]
    assert s["requests"] == len(reqs) > 0
    assert s["completed"] == s["requests"] and s["errors"] == s["timeouts"] == 0
    assert all(r["ok"] and r["output_tokens"] == MAX_NEW for r in reqs)  # ignore_eos
    assert s["output_tokens"] == sum(r["output_tokens"] for r in reqs) == MAX_NEW * len(reqs)
    assert s["output_throughput"] == pytest.approx(s["output_tokens"] / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(s["completed"] / s["duration_s"])
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = s[name]
        assert 0 < st["p50"] <= st["p90"] <= st["p99"] <= st["max"], (name, st)
    assert s["ttft_ms"]["max"] <= s["e2e_ms"]["max"]
    # Acceptance: every request's steps add up, and each step commits 1..B tokens.
    acc = s["acceptance"]
    for r in reqs:
        assert sum(r["spec_histogram"]) == r["spec_verify_ct"] > 0
        assert sum((k + 1) * c for k, c in enumerate(r["spec_histogram"])) >= r["output_tokens"] - 1
    assert acc["verify_steps"] == sum(r["spec_verify_ct"] for r in reqs)
    assert sum(acc["accept_length_histogram"].values()) == acc["verify_steps"]
    assert 1.0 <= acc["accept_length_mean"] <= width
    server_side = level["server_acceptance"]
    if server_side:  # the worker exports sglang:dflash_* (see sglang_dflash/integration/metrics.py)
        assert server_side["verify_steps"] == acc["verify_steps"]
        assert server_side["accept_length_histogram"] == acc["accept_length_histogram"]


@pytest.mark.sglang
def test_load_test_generate_outputs(dflash_server, tmp_path):
    out = tmp_path / "out"
    argv = ["--url", dflash_server.url, "--concurrency", "1,2", "--duration", "2", "--warmup", "1"]
    argv += ["--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--output-dir", str(out), "--no-progress"]
    assert load_test.main(argv) == 0

    results = json.loads((out / "results.json").read_text())
    assert results["simulated"] is False and results["label"] is None
    (run,) = results["runs"]
    assert run["server"] == "dflash" and [lvl["concurrency"] for lvl in run["levels"]] == [1, 2]
    for level in run["levels"]:
        _check_level(level, width=8)

    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    for row, level in zip(rows, run["levels"]):
        assert int(row["output_tokens"]) == level["summary"]["output_tokens"]
        assert float(row["tpot_p99_ms"]) == pytest.approx(level["summary"]["tpot_ms"]["p99"])
        assert row["simulated_acceptance"] == ""
    requests = list(csv.DictReader(open(out / "requests.csv")))
    assert len(requests) == sum(lvl["summary"]["requests"] for lvl in run["levels"])
    assert all(int(r["output_tokens"]) == MAX_NEW for r in requests)

    import matplotlib.image

    for name in ("throughput.png", "latency.png", "acceptance.png"):
        path = out / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(str(path)).shape[0] > 100
        assert "SIMULATED" not in plots.png_title(str(path))


@pytest.mark.sglang
def test_load_test_openai_chat(dflash_server, tmp_path):
    out = tmp_path / "out"
    argv = ["--url", dflash_server.url, "--endpoint", "chat", "--concurrency", "2", "--num-requests", "4"]
    argv += ["--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--output-dir", str(out)]
    argv += ["--no-progress", "--no-plots", "--simulate-acc-len", "3"]  # declared: labels only
    assert load_test.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["simulated"] is True and "SGLANG_SIMULATE_ACC_LEN=3.0" in results["label"]
    (level,) = results["runs"][0]["levels"]
    assert level["summary"]["requests"] == 4
    _check_level(level, width=8)
    assert all(r["endpoint"] == "chat" for r in level["requests"])


@pytest.mark.sglang
@pytest.mark.slow
def test_compare_mode_end_to_end(tiny, tmp_path):
    """Starts no-speculation and DFLASH servers itself; the speedup table covers both."""
    target, draft = tiny.pair("a")
    out = tmp_path / "out"
    argv = ["--configs", "baseline,dflash,dflash-builtin", "--target", target, "--draft", draft]
    argv += ["--device", "cpu", "--num-draft-tokens", "8", "--concurrency", "1,2", "--num-requests", "4"]
    argv += ["--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--output-dir", str(out), "--no-progress"]
    assert load_test.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["server"] for r in results["runs"]] == ["baseline", "dflash"]
    assert [s["server"] for s in results["skipped"]] == ["dflash-builtin"]
    assert [r["concurrency"] for r in results["speedups"]] == [1, 2]
    assert all(r["dflash_speedup"] > 0 for r in results["speedups"])
    assert os.path.exists(out / "server-dflash.log")

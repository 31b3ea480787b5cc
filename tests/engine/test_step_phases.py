"""scripts/serving/step_phases.py against a running server."""

import json

import pytest

from scripts.serving import step_phases as bench_step


@pytest.mark.sglang
def test_bench_step_on_a_server(tiny, tmp_path):
    """bench_step starts a DFLASH server with fixed acceptance and breaks its steps down."""
    target, draft = tiny.pair("a")
    out = tmp_path / "breakdown.json"
    argv = ["--target", target, "--draft", draft, "--device", "cpu", "--num-draft-tokens", "8"]
    argv += ["--batch-sizes", "1,3", "--input-len", "16", "--output-len", "24", "--skip-steps", "1"]
    argv += ["--simulate-acc-len", "3", "--server-args=--max-total-tokens 6144", "--output", str(out)]
    assert bench_step.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["simulated"] and "SGLANG_SIMULATE_ACC_LEN=3.0" in data["label"]
    assert [row["batch_size"] for row in data["rows"]] == [1, 3]
    for row in data["rows"]:
        # 24 tokens = the prefill token + 8 steps of 3 (the last one cut to 2): 8 verify steps.
        assert row["accept_length"] == pytest.approx(24 / 8)
        assert row["steps"] >= 8 - 1  # --skip-steps 1 (overlap scheduling may run one more)
        assert set(row["phases_ms"]) >= {"draft", "verify", "accept", "inject"}
        assert all(stat["mean"] > 0 for stat in row["phases_ms"].values())
        means = sum(stat["mean"] for stat in row["phases_ms"].values())
        assert row["step_ms"]["mean"] == pytest.approx(means)
        assert row["overhead_ms"]["mean"] >= 0  # the gap between steps lies outside their phases

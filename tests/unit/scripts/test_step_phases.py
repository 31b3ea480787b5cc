"""scripts/serving/step_phases.py: the per-phase breakdown of step records, against hand oracles."""

import json

import pytest

from scripts.serving import step_phases as bench_step


def _record(t_start, bs, phases, kind="decode", pid=1, io_ms=0.0):
    return {"pid": pid, "kind": kind, "bs": bs, "t_start": t_start, "phases": phases, "io_ms": io_ms}


def test_breakdown_hand_oracle():
    records = [
        _record(0.000, 1, {"extend": 5.0}, kind="extend"),
        _record(0.010, 4, {"draft": 1.0, "verify": 3.0, "accept": 0.5, "inject": 0.5}),
        _record(0.016, 4, {"draft": 2.0, "verify": 4.0, "accept": 0.5, "inject": 0.5}, io_ms=0.1),
        _record(0.025, 4, {"draft": 3.0, "verify": 5.0, "accept": 0.5, "inject": 0.5}, io_ms=0.2),
        _record(0.040, 2, {"draft": 1.0, "verify": 1.0, "accept": 0.5, "inject": 0.5}, io_ms=0.1),
    ]
    row = bench_step.breakdown(records, 4)
    assert row["steps"] == 3
    assert row["phases_ms"]["draft"] == pytest.approx({"mean": 2.0, "p50": 2.0})
    assert row["phases_ms"]["verify"] == pytest.approx({"mean": 4.0, "p50": 4.0})
    assert list(row["phases_ms"]) == ["draft", "verify", "accept", "inject"]
    assert row["step_ms"] == pytest.approx({"mean": 7.0, "p50": 7.0})
    # Only bs-4 steps followed by a bs-4 step: intervals 6 and 9 ms; overheads 6-5-0.1, 9-7-0.2.
    assert row["interval_ms"] == pytest.approx({"mean": 7.5, "p50": 7.5})
    assert row["overhead_ms"] == pytest.approx({"mean": (0.9 + 1.8) / 2, "p50": (0.9 + 1.8) / 2})
    skipped = bench_step.breakdown(records, 4, skip=1)
    assert skipped["steps"] == 2 and skipped["overhead_ms"]["mean"] == pytest.approx(1.8)
    assert bench_step.breakdown(records, 16) is None


def test_intervals_do_not_cross_processes_or_extends():
    records = [
        _record(0.0, 2, {"draft": 1.0}),
        _record(0.1, 2, {"draft": 1.0}, pid=2),  # another scheduler process
        _record(0.2, 2, {"extend": 1.0}, kind="extend", pid=2),
        _record(0.3, 2, {"draft": 1.0}, pid=2),
        _record(0.4, 2, {"draft": 1.0}, pid=2),
    ]
    assert [(r["t_start"], round(iv, 6)) for r, iv, _ in bench_step.intervals(records)] == [(0.3, 100.0)]


def test_records_file_report(tmp_path, capsys):
    path = tmp_path / "steps.jsonl"
    lines = [json.dumps(_record(0.004 * i, 1, {"draft": 1.0, "verify": 2.0})) for i in range(5)]
    path.write_text("\n".join(lines) + "\n" + '{"partial": ')  # a line still being written
    out = tmp_path / "report.json"
    assert bench_step.main(["--records", str(path), "--skip-steps", "0", "--output", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch_size"] == 1 and row["steps"] == 5
    assert row["overhead_ms"]["mean"] == pytest.approx(4.0 - 3.0)
    assert "draft" in capsys.readouterr().out

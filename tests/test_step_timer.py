"""StepTimer (off: a shared no-op; on: per-step records with a synchronized clock) and
bench_step's report of those records, against hand-computed breakdowns."""

import json
import os

import pytest

from scripts.serving import step_phases as bench_step
from sglang_dflash import step_timer
from sglang_dflash.step_timer import StepTimer


class FakeClock:
    """`time.perf_counter` stand-in advancing only when told; counts device syncs."""

    def __init__(self):
        self.now, self.syncs = 100.0, 0

    def perf_counter(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds

    def sync(self):
        self.syncs += 1


@pytest.fixture
def clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(step_timer, "time", clock)
    return clock


def test_off_by_default_is_a_shared_noop(monkeypatch, tmp_path):
    monkeypatch.delenv(step_timer.ENV_VAR, raising=False)
    timer = StepTimer.from_env("cpu")
    assert not timer.enabled
    assert timer.phase("draft") is timer.phase("verify")  # one shared null context, no allocation
    with timer.phase("draft"):
        pass
    timer.end_step(4)
    assert os.listdir(tmp_path) == []


def test_env_var_turns_it_on(monkeypatch, tmp_path):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_timer.ENV_VAR, str(path))
    timer = StepTimer.from_env("cpu")
    assert timer.enabled and timer.path == str(path)


def test_records_phases_steps_and_syncs(clock, tmp_path):
    path = tmp_path / "steps.jsonl"
    timer = StepTimer(str(path), "cpu")
    timer._sync = clock.sync
    for phase, seconds in (("draft", 0.002), ("verify", 0.005), ("accept", 0.001)):
        with timer.phase(phase):
            clock.advance(seconds)
    with timer.phase("accept"):  # a phase entered twice in a step adds up
        clock.advance(0.0005)
    clock.advance(0.010)  # time outside phases is not attributed
    with timer.phase("inject"):
        clock.advance(0.003)
    timer.end_step(4)
    assert clock.syncs == 2 * 5  # before and after every phase
    clock.advance(0.020)
    with timer.phase("extend"):
        clock.advance(0.007)
    timer.end_step(2, kind="extend")
    timer.end_step(9)  # no phase ran: nothing written
    timer.close()

    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first["kind"] == "decode" and first["bs"] == 4 and first["pid"] == os.getpid()
    assert first["phases"] == pytest.approx({"draft": 2.0, "verify": 5.0, "accept": 1.5, "inject": 3.0})
    assert first["t_start"] == pytest.approx(100.0)
    assert first["t_end"] == pytest.approx(100.0215)
    assert first["io_ms"] == 0.0
    assert second["kind"] == "extend" and second["bs"] == 2
    assert second["phases"] == pytest.approx({"extend": 7.0})
    assert second["t_start"] == pytest.approx(100.0415)


def test_counted_calls_are_in_the_step_record_and_nested_ones_count_once(clock, tmp_path):
    """As the worker counts the target's plans: SGLang's default `init_forward_metadata` calls
    `init_forward_metadata_out_graph`, and both are wrapped; a graph replay calls the second alone."""
    path = tmp_path / "steps.jsonl"
    timer = StepTimer(str(path), "cpu")
    timer._sync = clock.sync

    class Backend:
        def init_forward_metadata(self, batch):
            self.init_forward_metadata_out_graph(batch)

        def init_forward_metadata_out_graph(self, batch):
            pass

    backend = Backend()
    for method in ("init_forward_metadata", "init_forward_metadata_out_graph"):
        setattr(backend, method, timer.counted(getattr(backend, method), "plans"))
    with timer.phase("verify"):
        backend.init_forward_metadata(None)  # eager: one plan
    timer.end_step(1)
    with timer.phase("verify"):
        backend.init_forward_metadata_out_graph(None)  # graph replay: one plan
        backend.init_forward_metadata(None)  # and a second plan in the same step
    timer.end_step(1)
    with timer.phase("verify"):
        pass
    timer.end_step(1)
    timer.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("counts") for r in records] == [{"plans": 1}, {"plans": 2}, None]
    off = StepTimer(None)
    assert off.counted(backend.init_forward_metadata, "plans") is backend.init_forward_metadata


def test_a_phase_that_raises_still_counts(clock, tmp_path):
    timer = StepTimer(str(tmp_path / "s.jsonl"), "cpu")
    with pytest.raises(RuntimeError):
        with timer.phase("verify"):
            clock.advance(0.004)
            raise RuntimeError("boom")
    assert timer._phases == pytest.approx({"verify": 4.0})


def test_cpu_sync_is_a_noop_and_cuda_sync_is_torch_cuda():
    import torch

    assert step_timer._synchronizer("cpu")() is None
    assert step_timer._synchronizer(torch.device("cuda", 0)) is torch.cuda.synchronize


# ------------------------------------------------------------------------- bench_step report


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


# ----------------------------------------------------------------- on a server, once wired


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

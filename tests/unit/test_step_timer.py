"""StepTimer (off: a shared no-op; on: per-step records with a synchronized clock) and
bench_step's report of those records, against hand-computed breakdowns."""

import json
import os

import pytest

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


# ----------------------------------------------------------------- on a server, once wired

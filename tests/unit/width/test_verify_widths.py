"""Verify widths with a backend (and on CUDA a graph) each (`sglang_dflash/width/verify_widths.py`),
the device step clock (`width/device_clock.py`), and the width policy restricted to them.

The engine test (each width's own backend in a running engine, lossless) is
`test_adaptive_width.py::test_per_width_backends_are_lossless`; the CUDA graphs themselves run
in `make gpu-proof` only.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from sglang_dflash.knobs import Knobs
from sglang_dflash.width.device_clock import MAX_PENDING, DeviceStepClock
from sglang_dflash.width.policy import WidthPolicy, policy_for
from sglang_dflash.width.step import StepWidth
from sglang_dflash.width.verify_widths import (
    VerifyWidths,
    WidthPair,
    build_failure,
    graph_widths,
    step_cost_table,
    why_not_per_width,
    widths_to_build,
)
from tests.support.width_workload import Workload, run


def test_graph_widths_by_hand():
    assert graph_widths(16) == (16, 8, 4, 2, 1)
    assert graph_widths(6) == (6, 4, 2, 1)
    assert graph_widths(8) == (8, 4, 2, 1)
    assert graph_widths(2) == (2, 1)
    assert graph_widths(1) == (1,)


def refusal(**overrides):
    settings = dict(
        device_type="cuda",
        mode="on",
        num_draft_tokens=16,
        tp_size=1,
        hybrid=False,
        lora=False,
        two_batch_overlap=False,
        disaggregation="null",
        graphs_disabled=False,
    )
    return why_not_per_width(**{**settings, **overrides})


def test_what_gets_per_width_graphs_and_what_is_refused_by_name():
    assert refusal() is None
    assert "SGLANG_DFLASH_VERIFY_GRAPHS=0" in refusal(mode="off")
    assert "no CUDA graphs on cpu" in refusal(device_type="cpu")
    assert refusal(device_type="cpu", mode="eager") is None  # the CPU rehearsal
    assert "disabled" in refusal(graphs_disabled=True)
    assert refusal(graphs_disabled=True, mode="eager") is None
    assert "tp_size 2" in refusal(tp_size=2)
    assert "hybrid" in refusal(hybrid=True)
    assert "LoRA" in refusal(lora=True)
    assert "two-batch overlap" in refusal(two_batch_overlap=True)
    assert "decode" in refusal(disaggregation="decode")
    assert "torch-compile" in refusal(torch_compile=True)
    assert "PD multiplexing" in refusal(pdmux=True)
    assert "is 1" in refusal(num_draft_tokens=1)


def fake_runner():
    return SimpleNamespace(attn_backend="backend-B", decode_cuda_graph_runner="runner-B")


def fake_pair(width, gigabytes=0.0):
    return WidthPair(width, f"backend-{width}", f"runner-{width}", seconds=0.5, gigabytes=gigabytes)


def test_pairs_are_built_widest_first_and_swapped_around_the_verify():
    runner, built = fake_runner(), []

    def make(width):
        built.append(width)
        return fake_pair(width)

    widths = VerifyWidths.build(runner, 16, make)
    assert built == [8, 4, 2, 1]
    assert widths.widths == (1, 2, 4, 8, 16)
    with widths.active(4):
        assert (runner.attn_backend, runner.decode_cuda_graph_runner) == ("backend-4", "runner-4")
    assert (runner.attn_backend, runner.decode_cuda_graph_runner) == ("backend-B", "runner-B")
    # B is SGLang's pair, read fresh (a recapture replaces it): nothing is swapped.
    runner.decode_cuda_graph_runner = "recaptured-B"
    with widths.active(16):
        assert runner.decode_cuda_graph_runner == "recaptured-B"
    # Put back after a failed verify too.
    with pytest.raises(RuntimeError), widths.active(1):
        raise RuntimeError("verify failed")
    assert (runner.attn_backend, runner.decode_cuda_graph_runner) == ("backend-B", "recaptured-B")
    with pytest.raises(ValueError, match="verify width 3 has no attention backend"):
        with widths.active(3):
            pass


def test_a_width_that_does_not_fit_is_dropped_by_name_and_narrower_ones_still_tried():
    """B's graphs took 3 GB; each width is expected to take what the last one built took."""
    free = [4.5]
    taken = {8: 1.5, 4: 3.2, 2: 0.5, 1: 0.4}

    def make(width):
        free[0] -= taken[width]
        return fake_pair(width, taken[width])

    widths = VerifyWidths.build(
        fake_runner(), 16, make, free_gb=lambda: free[0], full_width_gb=3.0, headroom_gb=1.0
    )
    # 8: 3 + 1 <= 4.5, built (3.0 left); 4: 1.5 + 1 <= 3.0, built (took 3.2: -0.2 left);
    # 2 and 1: 3.2 + 1 > -0.2, dropped.
    assert sorted(widths.pairs) == [4, 8]
    assert sorted(widths.dropped) == [1, 2]
    runner = widths.runner
    with widths.active(1):  # a step without draft still runs: on B's pair, eager
        assert (runner.attn_backend, runner.decode_cuda_graph_runner) == ("backend-B", "runner-B")
    with pytest.raises(ValueError, match="verify width 2 has no attention backend"):
        with widths.active(2):
            pass
    text = widths.describe()
    assert text.startswith("graphs at 4 (0.5 s, 3.20 GB), 8 (0.5 s, 1.50 GB)")
    assert "; 1 dropped (-0.20 GB free, about 3.20 GB needed + 1.00 GB headroom)" in text
    assert widths.widths == (4, 8, 16)


def test_a_fixed_width_builds_only_the_widths_a_test_aid_forces():
    """SGLANG_DFLASH_ADAPTIVE_WIDTH=0 verifies at B on every step: the narrower widths' backends,
    graphs and cost table would serve nothing, so none is built unless a test aid forces it."""
    assert widths_to_build(8, None, 0, ()) == (4, 2, 1)
    assert widths_to_build(8, True, 0, ()) == (4, 2, 1)
    assert widths_to_build(8, False, 0, ()) == ()
    assert widths_to_build(8, False, 0, (1, 8)) == (1,)
    assert widths_to_build(8, False, 3, ()) == (1,)  # SGLANG_DFLASH_TEST_WIDTH1_STEPS
    assert widths_to_build(8, False, 2, (4, 2)) == (4, 2, 1)
    built = []
    widths = VerifyWidths.build(fake_runner(), 8, lambda w: built.append(w) or fake_pair(w), widths=(1,))
    assert built == [1] and widths.widths == (1, 8)


class FakeOutOfMemoryError(RuntimeError):
    """torch.OutOfMemoryError's name and base (a RuntimeError), without a device."""


FakeOutOfMemoryError.__name__ = "OutOfMemoryError"


def test_a_width_whose_build_runs_out_of_memory_or_fails_to_capture_is_dropped_by_name():
    """Start-up goes on without a width whose capture failed (SGLang re-raises the capture's
    error as a plain Exception under its own words) or ran out of memory; narrower widths are
    still tried. Any other error is a defect, and start-up fails with it."""
    failures = {
        8: FakeOutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"),
        2: Exception(
            "Capture cuda graph failed: CUDA error: operation not permitted when stream is capturing"
        ),
    }

    def make(width):
        if width in failures:
            raise failures[width]
        return fake_pair(width)

    widths = VerifyWidths.build(fake_runner(), 16, make)
    assert sorted(widths.pairs) == [1, 4]
    assert (
        widths.dropped[8] == "out of memory while building it: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    assert widths.dropped[2] == (
        "its graph capture failed: CUDA error: operation not permitted when stream is capturing"
    )
    assert "; 8 dropped (out of memory" in widths.describe()

    def broken(width):
        raise ValueError("a defect")

    with pytest.raises(ValueError, match="a defect"):
        VerifyWidths.build(fake_runner(), 16, broken)
    assert build_failure(RuntimeError("shape mismatch")) is None
    assert build_failure(Exception("Capture cuda graph failed: RuntimeError: x")).startswith("its graph")


def test_eager_pairs_are_described_as_such():
    widths = VerifyWidths.build(fake_runner(), 4, lambda w: WidthPair(w, f"b{w}", None))
    assert not widths.graphed
    assert widths.describe().startswith("eager backends at 1 (")


def test_step_cost_table_by_hand():
    verify = {1: {8: 1.0, 32: 2.0}, 4: {8: 1.5, 32: 3.0}, 16: {8: 2.0, 32: 5.0}}
    draft = {16: 0.5}  # one bucket, 16: batch 32 runs the draft eagerly, no graph to time
    assert step_cost_table(verify, draft) == {(8, 1): 1.0, (32, 1): 2.0, (8, 4): 2.0, (8, 16): 2.5}


class FakeEvent:
    """A CUDA event on a fake device timeline: `record` stamps the host's launch order, the
    device reaches it when `device.now` passes its time."""

    def __init__(self, device):
        self.device, self.time = device, None

    def record(self):
        self.time = self.device.launch()

    def query(self):
        return self.device.now >= self.time

    def elapsed_time(self, end):
        return (end.time - self.time) * 1e3  # ms


class FakeDevice:
    def __init__(self, step_seconds):
        self.step_seconds = list(step_seconds)  # the device time of each step, in launch order
        self.queued = 0.0  # where the device's queue ends
        self.now = 0.0
        self.boundaries = 0

    def launch(self):
        # Events come in pairs (begin, end): a step's work lies between them.
        if self.boundaries % 2 == 1:
            self.queued += self.step_seconds.pop(0)
        self.boundaries += 1
        return self.queued


def test_the_device_clock_charges_each_step_its_own_time_without_waiting():
    """Host ahead of the device (overlap scheduling): steps A (20 ms) and B (5 ms) launched
    back to back; polls return only the steps the device has finished, each with its own time."""
    device = FakeDevice([0.020, 0.005, 0.010])
    clock = DeviceStepClock(lambda: FakeEvent(device))
    clock.begin(("A",))
    clock.end()
    clock.begin(("B",))
    clock.end()
    assert clock.poll() == []  # nothing finished: no wait
    device.now = 0.021
    assert clock.poll() == [(("A",), pytest.approx(0.020))]
    clock.begin(None)  # a cold step: not timed
    clock.begin(("C",))
    clock.end()
    device.now = 1.0
    assert clock.poll() == [(("B",), pytest.approx(0.005)), (("C",), pytest.approx(0.010))]


def test_the_device_clock_drops_unended_steps_and_bounds_its_queue():
    device = FakeDevice([0.001] * (MAX_PENDING + 10))
    clock = DeviceStepClock(lambda: FakeEvent(device))
    clock.begin(("never ended",))
    clock.begin(("ok",))
    clock.end()
    device.now = 10.0
    assert [record for record, _ in clock.poll()] == [("ok",)]
    assert clock.dropped == 1
    for i in range(MAX_PENDING + 5):
        clock.begin((i,))
        clock.end()
    assert len(clock.poll()) == MAX_PENDING
    assert clock.dropped == 6


def test_the_policy_chooses_among_the_allowed_widths_only():
    """Acceptance 0.9 and step costs that make width 6 the best: restricted to {1, 2, 4, 8}, the
    policy takes the best of those (4), and in a simulated run never leaves them."""
    seconds = np.array([1, 1.2, 1.3, 1.4, 1.5, 1.6, 3, 4]) * 1e-3
    # tokens per second: [1000, 1583, 2085, 2456, 2730, 2929, 1739, 1424]
    chosen = {}
    for name, allowed in (("free", None), ("restricted", (1, 2, 4, 8))):
        policy = WidthPolicy(8, allowed=allowed)
        policy.acceptance.rates = lambda: np.full(7, 0.9)
        policy.step_seconds = lambda bs, context=0.0: seconds.copy()
        chosen[name] = policy.best_width(4)
    assert chosen == {"free": 6, "restricted": 4}
    widths = run(WidthPolicy(8, allowed=(1, 2, 4, 8)), Workload(rate=0.8, per_token_ms=0.3), bs=4)
    assert set(widths) <= {1, 2, 4, 8}
    with pytest.raises(ValueError, match="1..8"):
        WidthPolicy(8, allowed=(1, 9))


def test_a_seeded_policy_probes_only_the_neighbours_of_its_best_width():
    policy = WidthPolicy(16, allowed=(1, 2, 4, 8, 16))
    assert policy.probe_widths == [1, 16, 1, 2]
    table = {(bs, w): 1e-3 * (1 + 0.01 * bs * w + (w > 1)) for bs in (1, 8, 64) for w in (1, 2, 4, 8, 16)}
    policy.seed(table)
    assert policy.cost.ready and policy.neighbour_probes
    policy._best = 4
    assert [policy._neighbour(p) for p in (1, 2, 3)] == [2, 8, 2]
    policy._best = 16
    assert policy._neighbour(1) == policy._neighbour(2) == 8
    policy._best = 1
    assert policy._neighbour(1) == 2
    # Through choose: every probe is a neighbour of the width chosen before it.
    workload = Workload(rate=0.8)
    last_best, probes = None, []
    for _ in range(300):
        width = workload.step(policy, 8)[0]
        if policy.probing:
            probes.append((last_best, width))
        else:
            last_best = width
    neighbours = {1: {2}, 2: {1, 4}, 4: {2, 8}, 8: {4, 16}, 16: {8}}
    assert probes and all(w in neighbours[b] for b, w in probes if b is not None), probes


def test_policy_for_on_cuda_adapts_with_verify_graphs():
    assert policy_for(8, "cuda", None)[0] is None
    policy, reason = policy_for(8, "cuda", None, graph_widths=(1, 2, 4, 8))
    assert policy is not None and "among [1, 2, 4, 8] (verify graphs at each" in reason
    assert policy_for(8, "cuda", False, graph_widths=(1, 2, 4, 8))[0] is None
    assert policy_for(8, "cuda", None, tp_size=2, graph_widths=(1, 2, 4, 8))[0] is None


def test_step_width_with_verify_widths():
    step = StepWidth(8, "cpu", 1, Knobs())
    assert step.policy is not None and step.policy.allowed.all()
    step.use_verify_widths((1, 2, 4, 8), graphed=False)
    assert step.policy.allowed.tolist() == [True, True, False, True, False, False, False, True]
    assert not step.decode_when_off  # W = 1 is a verify over one token, on its own backend
    assert step.clock is None  # host clocks off CUDA
    # Width 1 dropped (memory): a step without draft runs as it would without per-width pairs
    # (here, on CPU, a verify over one token on B's backend; the decode forward elsewhere).
    no_one = StepWidth(8, "cpu", 1, Knobs())
    before = no_one.decode_when_off, no_one.describe()
    no_one.use_verify_widths((4, 8), graphed=False)
    assert (no_one.decode_when_off, no_one.describe().split(";")[-1]) == (before[0], before[1].split(";")[-1])
    assert no_one.policy.allowed.tolist()[:4] == [True, False, False, True]
    forced = StepWidth(8, "cpu", 1, Knobs(widths=(1, 3)))
    with pytest.raises(ValueError, match=r"widths \[3\] have no verify backend"):
        forced.use_verify_widths((1, 2, 4, 8), graphed=False)


def test_a_fixed_width_times_nothing_and_reads_no_cost_table():
    """SGLANG_DFLASH_ADAPTIVE_WIDTH=0 with a test aid's widths on CUDA: no policy, so no device
    clock and no start-up cost table."""
    fixed = StepWidth(8, "cuda", 1, Knobs(adaptive_width=False, widths=(1, 8)))
    fixed.use_verify_widths((1, 8), graphed=True)
    assert fixed.policy is None and fixed.clock is None and not fixed.wants_costs
    fixed.seed({(1, 1): 0.01})  # nothing to seed: no error
    adaptive = StepWidth(8, "cpu", 1, Knobs())
    adaptive.use_verify_widths((1, 2, 4, 8), graphed=False)
    assert adaptive.wants_costs
    adaptive.seed({(1, 1): 0.01, (1, 8): 0.02})
    assert adaptive.policy.neighbour_probes


def test_a_decode_forward_at_width_1_that_runs_eager_says_so():
    step = StepWidth(8, "cuda", 1, Knobs())
    assert step.decode_when_off
    step.decode_runs_eager("the target's CUDA graphs are TARGET_VERIFY graphs")
    assert step.describe().endswith(
        "width 1 runs the target's decode forward, eager (the target's CUDA graphs are TARGET_VERIFY graphs))"
    )
    verify = StepWidth(8, "cpu", 1, Knobs())
    before = verify.describe()
    verify.decode_runs_eager("why")  # W = 1 is a verify here: nothing to say
    assert verify.describe() == before


def test_device_timed_steps_are_not_charged_the_schedulers_result_handling():
    """On host clocks an interval holds the scheduler's handling of the last step's results (the
    cost model's N term); a step timed on the device does not, so N is 0 in what the model
    fits and predicts."""
    fitted = []
    host, device = WidthPolicy(8), WidthPolicy(8)
    device.device_timed()
    for policy in (host, device):
        policy.cost.observe = lambda bs, width, seconds, context=0.0, processed=0.0: fitted.append(processed)
        policy.observe_processed(120)
        policy.observe_step(16, 8, 0.02, 1000)
    assert fitted == [120, 0]
    predicted = {}  # policy -> the result tokens of each prediction (the model's, the measurement's)
    for name, policy in (("host", host), ("device", device)):
        policy.cost.predict = lambda bs, widths, context=0.0, processed=0.0, name=name: (
            predicted.setdefault(name, []).append(float(np.max(processed))) or np.ones(len(widths))
        )
        policy.step_seconds(16, 1000)
    assert predicted["host"][0] > 16 and predicted["host"][1] == 120  # bs * E[commit | W]; measured
    assert predicted["device"] == [0.0, 0.0]


def test_step_width_times_steps_on_the_device_with_verify_graphs_on_cuda():
    step = StepWidth(8, "cuda", 1, Knobs())
    step.use_verify_widths((1, 2, 4, 8), graphed=True)
    assert step.clock is not None and not step.policy.charges_processed


def test_step_width_feeds_device_times_to_the_policy():
    """With a device clock, the policy sees each step's own device time, whatever the host
    intervals were; cold steps are not timed."""
    device = FakeDevice([0.010, 0.003])  # the timed steps' device times
    step = StepWidth(8, "cpu", 1, Knobs())
    step.clock = DeviceStepClock(lambda: FakeEvent(device))
    seen = []
    step.policy.observe_step = lambda bs, width, seconds, context=0.0: seen.append(
        (bs, width, round(seconds, 6))
    )
    for _ in range(10):
        step.choose(4, 100, ["a"])
        step.end_step()
    device.now = 1.0
    step.choose(4, 100, ["a"])
    assert [s for _, _, s in seen] == [0.010, 0.003]  # the 9th and 10th steps; 8 cold ones untimed

"""sglang_dflash.integration.metrics: the acceptance counters against hand-computed values, in a private
registry and in prometheus_client's multiprocess mode (the one SGLang's /metrics reads), and,
once the worker feeds them, on a CPU server's /metrics against the requests' own meta_info."""

import json
import os
import subprocess
import sys
import time

from sglang_dflash.integration import metrics
from sglang_dflash.integration.metrics import DFlashMetrics

LABELS = {"model_name": "m", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}
L = {k: str(v) for k, v in LABELS.items()}

# Two verify steps at width B = 4: requests accepting [0, 2, 3], then [1, 0].
STEPS = [[0, 2, 3], [1, 0]]
EXPECTED = {
    "sglang:dflash_verify_steps_total": 5,
    "sglang:dflash_accepted_drafts_total": 6,
    "sglang:dflash_accepted_drafts_per_step_count": 5,
    "sglang:dflash_accepted_drafts_per_step_sum": 6,
}
BUCKETS = {"0.0": 2, "1.0": 3, "2.0": 4, "3.0": 5, "+Inf": 5}  # cumulative
POSITIONS = {"1": 3, "2": 2, "3": 1}  # request-steps with >= k accepted drafts


def _registry_metrics(width=4):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    return registry, DFlashMetrics(LABELS, width, registry=registry, flush_interval=None)


def test_counters_hand_oracle():
    registry, m = _registry_metrics()
    for step in STEPS:
        m.observe(step)
    assert registry.get_sample_value("sglang:dflash_verify_steps_total", L) in (None, 0.0)  # not yet flushed
    m.flush()
    for name, value in EXPECTED.items():
        assert registry.get_sample_value(name, L) == value, name
    for le, value in BUCKETS.items():
        assert (
            registry.get_sample_value("sglang:dflash_accepted_drafts_per_step_bucket", {**L, "le": le})
            == value
        )
    for k, value in POSITIONS.items():
        labels = {**L, "position": k}
        assert registry.get_sample_value("sglang:dflash_position_accepted_total", labels) == value
        assert registry.get_sample_value("sglang:dflash_position_accept_rate", labels) == value / 5


def test_flushes_accumulate_and_rates_are_lifetime():
    registry, m = _registry_metrics()
    m.observe([3, 3])
    m.flush()
    m.observe([0, 0])
    m.flush()
    m.flush()  # nothing pending: no change
    assert registry.get_sample_value("sglang:dflash_verify_steps_total", L) == 4
    rate = registry.get_sample_value("sglang:dflash_position_accept_rate", {**L, "position": "3"})
    assert rate == 2 / 4


def test_bulk_histogram_observe_equals_repeated_observe():
    from prometheus_client import CollectorRegistry, Histogram

    outputs = []
    for bulk in (True, False):
        registry = CollectorRegistry()
        hist = Histogram("h", "d", ["a"], buckets=[0.0, 1.0, 2.0], registry=registry).labels(a="x")
        for value, count in ((0.0, 3), (2.0, 2), (7.0, 1)):
            if bulk:
                metrics.observe_many(hist, value, count)
            else:
                for _ in range(count):
                    hist.observe(value)
        samples = [s for family in registry.collect() for s in family.samples]
        outputs.append(
            {(s.name, s.labels.get("le")): s.value for s in samples if not s.name.endswith("_created")}
        )
    assert outputs[0] == outputs[1]
    assert outputs[0][("h_bucket", "+Inf")] == 6 and outputs[0][("h_sum", None)] == 11.0


def test_background_thread_publishes(tmp_path):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    m = DFlashMetrics(LABELS, 4, registry=registry, flush_interval=0.05)
    try:
        m.observe([1, 2])
        deadline = time.time() + 30
        while registry.get_sample_value("sglang:dflash_verify_steps_total", L) != 2:
            assert time.time() < deadline, "the flush thread never published"
            time.sleep(0.02)
    finally:
        m.close()
    assert registry.get_sample_value("sglang:dflash_accepted_drafts_total", L) == 3


MULTIPROCESS_SCRIPT = """
import json, sys
from sglang_dflash.integration.metrics import DFlashMetrics
labels, steps = json.loads(sys.argv[1]), json.loads(sys.argv[2])
m = DFlashMetrics(labels, 4, flush_interval=None)
for step in steps:
    m.observe(step)
m.flush()
from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.exposition import generate_latest
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
out = {}
for family in text_string_to_metric_families(generate_latest(registry).decode()):
    for s in family.samples:
        out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
print(json.dumps(out))
"""


def test_multiprocess_mode_as_sglang_serves_it(tmp_path):
    """In SGLang the scheduler process writes to PROMETHEUS_MULTIPROC_DIR and the HTTP server
    merges the files for /metrics; do the same across a process boundary."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", MULTIPROCESS_SCRIPT, json.dumps(LABELS), json.dumps(STEPS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    samples = json.loads(out.stdout)

    def value(name, **extra):
        return samples[name + json.dumps({**L, **extra}, sort_keys=True)]

    for name, expected in EXPECTED.items():
        assert value(name) == expected, name
    for le, expected in BUCKETS.items():
        assert value("sglang:dflash_accepted_drafts_per_step_bucket", le=le) == expected
    for k, expected in POSITIONS.items():
        assert value("sglang:dflash_position_accepted_total", position=k) == expected
        assert value("sglang:dflash_position_accept_rate", position=k) == expected / 5


# ----------------------------------------------------------------- on a server, once wired

"""The pieces around the worker's step: the knobs read once from the environment, the verify
width of each step, the proposal interface, and the module layout (no import circle, no
environment read in the worker)."""

import ast
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.support import paths

ROOT = str(paths.REPO)


def test_the_worker_reads_no_environment_variable():
    for module in ("worker.py", "runtime.py", "width/step.py", "propose/proposers.py"):
        tree = ast.parse(open(os.path.join(ROOT, "sglang_dflash", module)).read())
        names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        names |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert not names & {"environ", "getenv"}, module


def test_no_import_circle_between_plugin_hooks_and_worker():
    """The plugin registers; the worker imports neither the plugin nor the scheduler hooks."""
    for module in ("worker", "runtime", "integration/scheduler_hooks"):
        tree = ast.parse(open(os.path.join(ROOT, "sglang_dflash", f"{module}.py")).read())
        imported = {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
        }
        assert "sglang_dflash.plugin" not in imported, module
        if module != "integration/scheduler_hooks":
            assert "sglang_dflash.integration.scheduler_hooks" not in imported, module


@pytest.mark.sglang
def test_importing_the_worker_loads_neither_plugin_nor_hooks():
    code = (
        "import sys, sglang_dflash.worker; "
        "print(sorted(set(sys.modules) & {'sglang_dflash.plugin', "
        "'sglang_dflash.integration.scheduler_hooks'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------ the verify width


# ------------------------------------------------------------------ proposals


def test_the_scheduler_keeps_host_lengths_for_the_step_whatever_the_targets_backend(monkeypatch):
    """SGLang's Triton backend says it needs no host sequence lengths; the decode step reads
    them (draft planning, the width policy's context), so the worker's backends still ask for
    them. Without the step among them, SGLang's own decision would be False."""
    from sglang.srt.managers import overlap_utils

    from sglang_dflash.worker import DFlashWorker

    monkeypatch.setattr(
        overlap_utils,
        "get_exec",
        lambda: SimpleNamespace(overlap=SimpleNamespace(enable_two_batch_overlap=False)),
    )
    monkeypatch.setattr(overlap_utils, "get_spec", lambda: SimpleNamespace(speculative_algorithm="DFLASH"))
    triton_like = SimpleNamespace(needs_cpu_seq_lens=False)
    worker = SimpleNamespace(
        target_worker=SimpleNamespace(model_runner=SimpleNamespace(attn_backend=triton_like))
    )
    backends = DFlashWorker.spec_v2_attn_backends.fget(worker)
    assert overlap_utils.decide_needs_cpu_seq_lens(backends) is True
    assert overlap_utils.decide_needs_cpu_seq_lens((triton_like,)) is False  # the base class's answer

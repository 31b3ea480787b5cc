"""The plugin entry point, the implementation switch, and the CPU stand-ins."""

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from sglang_dflash import plugin
from tests import engines


def test_entry_point_is_declared():
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "dflash"]
    assert ep.value == "sglang_dflash.plugin:register"
    assert ep.load() is plugin.register


def test_register_is_cheap_and_idempotent():
    """register() only records hooks: no worker, scheduler or model imports; twice is once."""
    code = """
import sys, time
import sglang.srt.plugins.hook_registry as hr
t = time.perf_counter()
import sglang_dflash.plugin as p
p.register(); p.register()
elapsed = time.perf_counter() - t
ours = {k: len(v) for k, v in hr.HookRegistry._hooks.items()
        if any('sglang_dflash' in h.__module__ for _, h, _ in v)}
heavy = [m for m in ("sglang_dflash.worker", "sglang.srt.managers.scheduler") if m in sys.modules]
print(json.dumps([elapsed, sorted(ours.values()), heavy]))
"""
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, check=True
    )
    elapsed, hook_counts, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert elapsed < 0.5
    assert hook_counts == [1, 1, 1]
    assert heavy == []


def test_impl_switch(monkeypatch):
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    assert not plugin.use_builtin()
    monkeypatch.setenv(plugin.IMPL_ENV, "builtin")
    assert plugin.use_builtin()
    monkeypatch.setenv(plugin.IMPL_ENV, "ours")
    with pytest.raises(
        ValueError, match="SGLANG_DFLASH_IMPL must be 'sglang-dflash' or 'builtin', got 'ours'"
    ):
        plugin.use_builtin()


@pytest.mark.sglang
def test_builtin_opt_out_reaches_sglangs_own_dflash(tiny, monkeypatch):
    """With SGLANG_DFLASH_IMPL=builtin, SGLang's own DFLASH argument handling runs: on CPU it
    refuses the device, which our implementation accepts."""
    monkeypatch.setenv(plugin.IMPL_ENV, "builtin")
    with pytest.raises(
        ValueError, match="DFLASH speculative decoding is not supported by .* on device 'cpu'"
    ):
        engines.shutdown(engines.start(*tiny.pair("a"), 8))


# ------------------------------------------------------------------- CPU stand-ins


def test_sgl_kernel_is_served_by_the_stand_ins_on_cpu():
    code = "import sgl_kernel; print(sgl_kernel.__file__); sgl_kernel.decode_attention_cpu()"
    env = {"SGLANG_USE_CPU_ENGINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "sglang_dflash/cpu/sgl_kernel_shim/__init__.py" in result.stdout
    assert "NotImplementedError: sgl_kernel.decode_attention_cpu is not available" in result.stderr


def test_assign_req_to_token_pool_cpu_matches_a_loop():
    from sglang_dflash.cpu.sgl_kernel_shim import assign_req_to_token_pool_cpu

    rows, start, end = torch.tensor([2, 0, 5]), torch.tensor([0, 3, 7]), torch.tensor([2, 3, 11])
    loc = torch.arange(100, 106)
    table = torch.zeros(6, 16, dtype=torch.int32)
    assign_req_to_token_pool_cpu(rows, table, start, end, loc, 16)
    want, offset = torch.zeros_like(table), 0
    for r, s, e in zip(rows.tolist(), start.tolist(), end.tolist()):
        want[r, s:e] = loc[offset : offset + e - s]
        offset += e - s
    assert torch.equal(table, want)


def test_copy_all_layer_kv_cache_cpu_moves_rows_of_every_buffer():
    from sglang_dflash.cpu.sgl_kernel_shim import copy_all_layer_kv_cache_cpu

    buffers = [torch.randn(10, 3, 4), torch.randn(10, 3, 4, dtype=torch.float64)]
    before = [b.clone() for b in buffers]
    ptrs = torch.tensor([b.data_ptr() for b in buffers])
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers])
    copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([7, 1]), torch.tensor([2, 9]))
    for b, old in zip(buffers, before):
        old[[7, 1]] = old[[2, 9]]
        assert torch.equal(b, old)


def test_stand_ins_serve_when_the_script_sets_the_cpu_engine_itself():
    """SGLang reads SGLANG_USE_CPU_ENGINE when it needs it; so do the stand-ins, so a script may
    set it before importing sglang rather than in its environment."""
    code = (
        "import os; os.environ['SGLANG_USE_CPU_ENGINE'] = '1'\nimport sgl_kernel; print(sgl_kernel.__file__)"
    )
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "sglang_dflash/cpu/sgl_kernel_shim/__init__.py" in result.stdout, result.stderr[-2000:]

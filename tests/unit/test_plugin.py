"""The plugin entry point, the implementation switch, and the CPU stand-ins."""

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from sglang_dflash import plugin


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
    with pytest.raises(ValueError, match="SGLANG_DFLASH_IMPL='ours' is not sglang-dflash or builtin"):
        plugin.use_builtin()


# ------------------------------------------------------------------- CPU stand-ins

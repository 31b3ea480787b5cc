"""`tests/unit` starts no SGLang engine or server: those tests live in `tests/engine`.

A test here that constructs `sglang.Engine` or launches `sglang.launch_server` fails at once,
naming the folder it belongs in. The engine module is patched when it is first imported, so a
unit test that never imports SGLang pays nothing for the check.
"""

import importlib.abc
import importlib.util
import subprocess
import sys

import pytest

ENGINE_MODULE = "sglang.srt.entrypoints.engine"
REFUSAL = "tests/unit starts no SGLang engine: move this test to tests/engine"


_originals: dict = {}  # module -> Engine.__init__ before the patch


def _refuse_engine(module) -> None:
    def refused(self, *args, **kwargs):
        raise AssertionError(REFUSAL)

    _originals[module] = module.Engine.__init__
    module.Engine.__init__ = refused


class _EngineGuard(importlib.abc.MetaPathFinder):
    """Patches `Engine.__init__` as SGLang's engine module finishes loading."""

    def find_spec(self, name, path, target=None):
        if name != ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_refuse(module):
            exec_module(module)
            _refuse_engine(module)

        loader.exec_module = exec_and_refuse
        return spec


@pytest.fixture(autouse=True, scope="package")
def _no_engine():
    original_popen = subprocess.Popen.__init__

    def popen(self, args, *rest, **kwargs):
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
        if "sglang.launch_server" in argv:  # `python -m sglang.launch_server ...`
            raise AssertionError(REFUSAL)
        original_popen(self, args, *rest, **kwargs)

    if ENGINE_MODULE in sys.modules:
        _refuse_engine(sys.modules[ENGINE_MODULE])
    guard = _EngineGuard()
    sys.meta_path.insert(0, guard)
    subprocess.Popen.__init__ = popen
    yield
    subprocess.Popen.__init__ = original_popen
    sys.meta_path.remove(guard)
    for module, init in _originals.items():
        module.Engine.__init__ = init
    _originals.clear()

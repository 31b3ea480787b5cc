"""Make `import sgl_kernel` succeed under SGLANG_USE_CPU_ENGINE on hosts without its CPU build.

Run at interpreter start by `sglang_dflash_cpu.pth`, only when SGLANG_USE_CPU_ENGINE is set.
The first `import sgl_kernel` tries the real module once; if it cannot load, the stand-ins in
`sgl_kernel_shim.py` are served under the name `sgl_kernel`, and one log line says so.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys

logger = logging.getLogger("sglang_dflash")


class _AlreadyLoaded(importlib.abc.Loader):
    """Hands the import system a module that is already imported, keeping its own spec."""

    def __init__(self, module):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec


class SglKernelFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "sgl_kernel":
            return None
        sys.meta_path.remove(self)  # decide once, then get out of the way
        try:
            module = importlib.import_module("sgl_kernel")
            return importlib.machinery.ModuleSpec(name, _AlreadyLoaded(module))
        except (ImportError, OSError) as error:
            for key in [k for k in sys.modules if k == "sgl_kernel" or k.startswith("sgl_kernel.")]:
                del sys.modules[key]
            shim = os.path.join(os.path.dirname(__file__), "sgl_kernel_shim.py")
            logger.info(
                "sgl_kernel cannot load on this host (%s); sglang_dflash serves its pure-PyTorch "
                "stand-ins (sglang_dflash/cpu/sgl_kernel_shim.py) as sgl_kernel",
                str(error).strip().splitlines()[-1][:160],
            )
            return importlib.util.spec_from_file_location(name, shim)


def install() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "").lower() not in ("1", "true", "yes"):
        return
    if "sgl_kernel" in sys.modules or any(isinstance(f, SglKernelFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, SglKernelFinder())

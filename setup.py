"""Build hooks beyond pyproject.toml.

1. Ship `sglang_dflash_cpu.pth` at the top of site-packages. It lets SGLang's CPU engine import
   `sgl_kernel` on hosts without its CPU build (see sglang_dflash/cpu/bootstrap.py); it must sit
   next to the packages, not inside one. A regular wheel gets it from `build_py`; an editable
   install (`pip install -e .`) builds its wheel without copying build outputs, so
   `EditableWheel` writes it in.
2. Build the CUDA extension `sglang_dflash._C` (sources in cuda/) when a CUDA toolkit is found.
   Without it the package runs its pure-PyTorch reference ops. Build it against the installed
   torch: `pip install --no-build-isolation .`

   SGLANG_DFLASH_BUILD_CUDA   unset: build if nvcc is found; a failed build only warns.
                              1: build; a missing torch/nvcc or a compile error fails the install.
                              0: never build.
   SGLANG_DFLASH_CUDA_ARCHS   SM versions to compile for (default "80;90;100;120"; the last also
                              gets PTX). TORCH_CUDA_ARCH_LIST, if set, takes precedence.

   Both are parsed by the package's registry of variables, `sglang_dflash/knobs.py`, loaded here
   by its path (it imports only the standard library at module level; the package itself may not
   be importable at build time), so a bad value is refused as at launch (docs/knobs.md).
"""

import importlib.util
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "sglang_dflash_cpu.pth"
ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_knobs():
    """sglang_dflash/knobs.py as a module of its own, without importing the package."""
    spec = importlib.util.spec_from_file_location(
        "_sglang_dflash_knobs", os.path.join(ROOT, "sglang_dflash", "knobs.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


knobs = _load_knobs()


def _knob(name: str):
    """The typed value of one build variable; a bad one stops the build, saying what it takes."""
    try:
        return knobs.value(name)
    except knobs.KnobError as error:
        sys.exit(str(error))


class BuildPy(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class EditableWheel(editable_wheel):
    """`pip install -e .`: the editable wheel carries the .pth too."""

    def _select_strategy(self, *args, **kwargs):
        # setuptools writes an editable wheel through a strategy object (64 <= version, at
        # least up to 84); the wrapper adds one file to what the strategy writes.
        return _WithPth(super()._select_strategy(*args, **kwargs))


class _WithPth:
    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        with open(os.path.join(ROOT, PTH), "rb") as f:
            wheel.writestr(PTH, f.read())

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


def _build_mode() -> str:
    return {None: "auto", False: "off", True: "required"}[_knob("SGLANG_DFLASH_BUILD_CUDA")]


def _skip(mode: str, reason: str) -> dict:
    if mode == "required":
        sys.exit(f"SGLANG_DFLASH_BUILD_CUDA=1 but the CUDA extension cannot be built: {reason}")
    print(f"sglang-dflash: not building the CUDA extension ({reason}); the PyTorch reference ops will run")
    return {}


def _gencode_flags() -> list[str]:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return []  # torch turns it into -gencode flags itself
    archs = _knob("SGLANG_DFLASH_CUDA_ARCHS")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    return flags + [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]


def _find_cuda_home() -> str | None:
    """A toolkit root with bin/nvcc and include/cuda_runtime.h. torch guesses it from the
    `nvcc` on PATH, which is wrong when that is a wrapper script (e.g. /usr/local/bin/nvcc)."""
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc")
    if explicit:
        candidates = [explicit]
    else:
        candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
        candidates.append("/usr/local/cuda")
    for home in candidates:
        if all(os.path.exists(os.path.join(home, f)) for f in ("bin/nvcc", "include/cuda_runtime.h")):
            return home
    return None


def _cuda_extension_kwargs() -> dict:
    mode = _build_mode()
    if mode == "off":
        return {}
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        return _skip(mode, "no CUDA toolkit found (set CUDA_HOME)")
    os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import
    try:
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError as error:
        return _skip(mode, f"torch is not importable ({error}); build with --no-build-isolation")

    class OptionalBuildExtension(BuildExtension):
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as error:  # only in auto mode: the package still works without it
                if mode == "required":
                    raise
                stale = self.get_ext_fullpath(ext.name)  # never ship a library from older sources
                if os.path.exists(stale):
                    os.remove(stale)
                print(
                    f"sglang-dflash: WARNING: building {ext.name} failed ({error}); using the reference ops"
                )

    extension = CUDAExtension(
        "sglang_dflash._C",
        sources=["cuda/bindings.cpp", "cuda/context_kv.cu"],
        include_dirs=[os.path.join(ROOT, "cuda", "include")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo", *_gencode_flags()]},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": OptionalBuildExtension}}


kwargs = _cuda_extension_kwargs()
setup(cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel, **kwargs.pop("cmdclass", {})}, **kwargs)

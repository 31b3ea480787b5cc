"""Build hooks beyond pyproject.toml: ship `sglang_dflash_cpu.pth` at the top of site-packages.

The .pth file lets SGLang's CPU engine import `sgl_kernel` on hosts without its CPU build (see
sglang_dflash/cpu/bootstrap.py); it must sit next to the packages, not inside one.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "sglang_dflash_cpu.pth"


class BuildPy(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPy})

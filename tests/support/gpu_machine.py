"""A Python that sees what the GPU machine would after the serving kit: this environment's
packages except those neither on that machine (tests/gpu_kit/bundle.py GPU_MACHINE_HAS) nor in the
serve bundle. Subprocesses run in it import the way SGLang would import there."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from tests.gpu_kit import bundle as gpu_bundle
from tests.support import paths

ROOT = paths.REPO
STANDIN = ROOT / "tests" / "gpu_kit" / "serve" / "standin"


def python(root: pathlib.Path) -> str:
    """A venv seeing this environment's packages except those neither in the serve bundle nor on
    the GPU machine (as the kit installs them there)."""
    import sysconfig
    from importlib import metadata

    travel = {gpu_bundle.canonical(n) for n in gpu_bundle.SERVE_DEPS}
    travel |= {"sglang", "flashinfer-python", "apache-tvm-ffi"}

    def entries(dist) -> set:
        return {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}

    hidden, shown = set(), set()
    for dist in metadata.distributions():
        name = gpu_bundle.canonical(dist.metadata["Name"])
        (shown if name in travel or name in gpu_bundle.GPU_MACHINE_HAS else hidden).update(entries(dist))
    hidden -= shown  # namespace folders shared with a shown package (nvidia/, cuda/) stay
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    view = root / "site"
    view.mkdir()
    base = pathlib.Path(sysconfig.get_paths()["purelib"])
    for entry in base.iterdir():
        if entry.name not in hidden and entry.suffix != ".pth" and entry.name != "__pycache__":
            (view / entry.name).symlink_to(entry)
    python = str(root / "venv" / "bin" / "python")
    purelib = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    (pathlib.Path(purelib) / "_view.pth").write_text(f"{view}\n")
    return python


def run(
    python_path: str, code: str, *, kit: bool = True, standin: bool = True, extra_path=(), cwd=None
) -> subprocess.CompletedProcess:
    """`code` in that Python, from the checkout's root (or `cwd`), with the kit's stand-in folder
    first on PYTHONPATH and (`kit`) the kit's opt-ins set; SGLang's CPU-engine switch is left out."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env["PYTHONPATH"] = os.pathsep.join([*([str(STANDIN)] if standin else []), *map(str, extra_path)])
    if kit:
        env.update(SGLANG_DFLASH_SGL_KERNEL_STANDIN="1", SGLANG_DFLASH_GPU_KIT="1")
    cwd = cwd or ROOT
    return subprocess.run([python_path, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)

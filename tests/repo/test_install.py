"""Installs the way users install: an editable install and a wheel each carry the CPU `.pth`,
and CPU serving works after `pip install -e .` in a fresh venv whose script sets
SGLANG_USE_CPU_ENGINE itself, before importing sglang.

The fresh venv gets its dependencies (sglang, torch, ...) by linking this venv's packages,
leaving out sglang-dflash, so that it imports only what `pip install -e .` put there; pip builds
the project in an isolated build environment as users' pip does (setuptools from the index or
the pip cache). The CUDA extension is not built here (SGLANG_DFLASH_BUILD_CUDA=0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.support import paths

ROOT = str(paths.REPO)
PTH = "sglang_dflash_cpu.pth"
OURS = ("sglang_dflash", PTH)  # this venv's install of the project, hidden from the fresh one

# Runs in the fresh venv: no SGLANG_USE_CPU_ENGINE in its environment.
SCRIPT = """
import os
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
import json, sys
import sglang as sgl
import sglang_dflash
from sglang_dflash.assets import tiny_pair


def run(**spec):
    target, draft = tiny_pair()
    engine = sgl.Engine(model_path=target, device="cpu", attention_backend="torch_native",
                        dtype="float32", max_total_tokens=1024, log_level="error", **spec)
    try:
        out = engine.generate(input_ids=[[5, 6, 7, 8, 9, 10]], sampling_params=dict(
            max_new_tokens=12, temperature=0.0, ignore_eos=True))
        info = engine.get_server_info()
        return out[0]["output_ids"], info["internal_states"][0].get("dflash_implementation", "")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    plain, _ = run()
    spec, implementation = run(speculative_algorithm="DFLASH",
                               speculative_draft_model_path=tiny_pair()[1])
    print(json.dumps(dict(package=sglang_dflash.__file__, plain=plain, spec=spec,
                          implementation=implementation)))
"""


def _pip(python: str, *args: str, cwd: str = ROOT) -> None:
    env = dict(os.environ, SGLANG_DFLASH_BUILD_CUDA="0")
    cmd = [python, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> str:
    """A new venv with this venv's packages linked in, except sglang-dflash's own."""
    root = tmp_path_factory.mktemp("fresh")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
    python = str(root / "venv" / "bin" / "python")
    deps = root / "deps"
    deps.mkdir()
    base = sysconfig.get_paths()["purelib"]
    for name in os.listdir(base):
        if not name.startswith(OURS) and not name.endswith(".pth"):
            os.symlink(os.path.join(base, name), deps / name)
    fresh = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    with open(os.path.join(fresh, "_deps.pth"), "w") as f:
        f.write(f"{deps}\n")
    return python


@pytest.mark.sglang
def test_editable_install_serves_on_cpu_when_the_script_sets_the_engine(fresh_venv, tmp_path):
    _pip(fresh_venv, "install", "--no-deps", "-e", ".")
    site = subprocess.check_output(
        [fresh_venv, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    assert os.path.isfile(os.path.join(site, PTH))
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    result = subprocess.run(
        [fresh_venv, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    import json

    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["package"].startswith(os.path.join(ROOT, "sglang_dflash")), got["package"]  # the source
    assert got["implementation"].startswith("sglang-dflash"), got
    assert got["spec"] == got["plain"] and len(got["plain"]) == 12


def test_wheel_carries_the_pth_and_admits_what_sglang_admits(tmp_path):
    from importlib.metadata import metadata

    from packaging.specifiers import SpecifierSet

    _pip(sys.executable, "wheel", "--no-deps", "-w", str(tmp_path), ".")
    (wheel,) = tmp_path.glob("sglang_dflash-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert PTH in names  # at the top of site-packages, not inside the package
    assert "sglang_dflash/cpu/bootstrap.py" in names
    ours = SpecifierSet(
        next(line.split(":", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Python"))
    )
    # SGLang 0.5.23 ships cp312 wheels, and the GPU serving kit runs on Python 3.12.
    assert {"3.11", "3.12", "3.13"} <= set(ours.filter(["3.10", "3.11", "3.12", "3.13"]))
    assert ours == SpecifierSet(metadata("sglang")["Requires-Python"])

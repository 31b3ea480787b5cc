"""What a GPU machine that has PyTorch and no package index needs, built here where pip works.

    python tests/gpu_kit/bundle.py [--out .gpu-bundle]  # make gpu-check: FlashInfer, 27 MiB
    python tests/gpu_kit/bundle.py --serve [--out .gpu-bundle]  # make gpu-proof: SGLang too (make gpu-bundle)

Both download wheels for the GPU machine's Python (3.12) with pip.

* Default (`.gpu-bundle/wheels`): `flashinfer-python` and `apache-tvm-ffi`, FlashInfer repacked
  without what its JIT path for our draft attention (fa2 paged prefill) does not read: the
  kernel sources of other modules (`data/csrc/<subdir>/`), CUTLASS, CCCL's docs, tests and
  Python bindings, and the kernel sources kept beside the Python of `experimental`, `fused_moe`
  and `moe_ep`. The 62 MiB wheel becomes 24 MiB. FlashInfer's other needs (click, einops,
  tabulate, nvidia-ml-py, numpy, ninja) are on that machine already.
* `--serve` (`.gpu-bundle/serve`): everything SGLang 0.5.23 needs to serve there, installed into
  one site folder and packed as `site.tar.xz`, with `manifest.json` (every wheel's version,
  download checksum and what was left out; the archive's checksum). SGLang's wheel goes without
  its Rust extensions, the Rust radix-tree core (built for torch 2.14; SGLang falls back to its
  Python tree), `multimodal_gen`, `test` and `benchmark`. FlashInfer keeps CUTLASS's headers
  (its sm90 kernels include them). The Python packages are `SERVE_DEPS`, at the versions of the
  environment running this script; every other requirement of SGLang is on the GPU machine
  (`GPU_MACHINE_HAS`) or left out with a reason (`NOT_SERVED`), and the build fails on one that
  is neither. The archive and the checkout together must fit the 64 MiB a call carries.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from typing import Callable

FLASHINFER = "flashinfer-python==0.7.2"  # what sglang 0.5.23 installs
TVM_FFI = "apache-tvm-ffi==0.1.11"
SGLANG = "sglang==0.5.23"
PLATFORMS = [
    "manylinux_2_34_x86_64",  # SGLang's wheel; the GPU machine's glibc is 2.39
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]
CALL_LIMIT = 64 * 2**20  # what one device call carries: the checkout and the bundle together

# ---- FlashInfer ----------------------------------------------------------------------------

CUTLASS = "flashinfer/data/cutlass/"
# CUTLASS's headers, which FlashInfer's sm90 kernels include (`cutlass/arch/reg_reconfig.h`).
CUTLASS_HEADERS = (CUTLASS + "include/", CUTLASS + "tools/util/include/")
# Subpackages whose Python `import flashinfer` runs, and whose kernel sources we never compile.
PYTHON_ONLY = ("flashinfer/experimental/", "flashinfer/fused_moe/", "flashinfer/moe_ep/")
# CCCL: only its three header trees.
CCCL_KEEP = (
    "flashinfer/data/cccl/cub/cub/",
    "flashinfer/data/cccl/libcudacxx/include/",
    "flashinfer/data/cccl/thrust/thrust/",
)


def keep(name: str, cutlass_headers: bool = False) -> bool:
    """Whether a FlashInfer wheel entry stays. E.g., `flashinfer/data/csrc/batch_prefill.cu`
    stays, `flashinfer/data/csrc/fused_moe/x.cu` does not, and `flashinfer/data/cutlass/...`
    only its headers, with `cutlass_headers`."""
    if name.startswith(CUTLASS):
        return cutlass_headers and name.startswith(CUTLASS_HEADERS)
    if name.startswith(PYTHON_ONLY):
        return name.endswith(".py")
    if name.startswith("flashinfer/data/cccl/"):
        return name.startswith(CCCL_KEEP)
    if name.startswith("flashinfer/data/csrc/"):
        return "/" not in name[len("flashinfer/data/csrc/") :]
    return True


# ---- SGLang --------------------------------------------------------------------------------

SGLANG_DROP = ("sglang/multimodal_gen/", "sglang/test/", "sglang/benchmark/", "sglang/srt/rust_extensions/")


def keep_sglang(name: str) -> bool:
    """SGLang's wheel without its Rust extensions and tree core, image generation, tests and
    benchmarks. E.g., `sglang/srt/mem_cache/radix_cache.py` stays;
    `sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so` does not."""
    if name.startswith(SGLANG_DROP):
        return False
    return not (name.startswith("sglang/srt/mem_cache/rust_tree_core/") and name.endswith(".so"))


# Python packages SGLang imports when it serves on CUDA that the GPU machine lacks, or has too
# old (typing-extensions >= 4.16, anyio >= 4.1); IPython and its own, since `import sglang`
# imports it. tests/unit/gpu_kit/test_bundle.py imports SGLang's serving modules seeing only these and
# GPU_MACHINE_HAS.
SERVE_DEPS = (
    "annotated-types", "anyio", "asttokens", "cffi", "compressed-tensors", "dill", "distro", "executing",
    "fastapi", "gguf", "interegular", "ipython", "ipython-pygments-lexers", "jedi", "jiter",
    "jsonschema", "jsonschema-specifications", "loguru", "matplotlib-inline", "msgspec", "openai",
    "opentelemetry-api", "orjson", "parso", "partial-json-parser", "pexpect", "prompt-toolkit",
    "ptyprocess", "pure-eval", "pybase64", "pycparser", "pydantic", "pydantic-core",
    "python-multipart", "pyzmq", "referencing", "rpds-py", "setproctitle", "sniffio", "soundfile",
    "stack-data", "starlette", "traitlets", "typing-extensions", "typing-inspection", "uvicorn",
    "wcwidth", "xgrammar",
)  # fmt: skip

# SGLang's other requirements (and theirs), with why they do not travel.
NOT_SERVED = {
    "sglang-kernel": "the kit's labelled stand-in serves the few kernels the dense CUDA path calls",
    "flash-attn-4": "fa4 attention; the kit serves with --attention-backend flashinfer",
    "nvidia-cutlass-dsl": "CuTe-DSL kernels (dual GEMM is Blackwell-only); the kit stands in for the import",
    "cuda-python": "imported by the CuTe-DSL kernels only",
    "cuda-tile": "FlashInfer's cuTile kernels, not on the fa2 path",
    "nvidia-cudnn-frontend": "FlashInfer's cuDNN backend, not used",
    "nccl-extensions": "FlashInfer's multi-GPU communication; the kit serves one GPU",
    "nccl4py": "FlashInfer's expert-parallel communication (moe_ep)",
    "nvshmem4py-cu13": "multi-GPU MoE communication",
    "sgl-deep-ep": "expert-parallel MoE",
    "sgl-deep-gemm": "FP8 GEMMs",
    "sgl-flash-mla": "MLA attention (DeepSeek)",
    "humming-kernels": "quantized kernels",
    "kernels": "Hugging Face kernel hub",
    "tilelang": "tilelang kernels (sparse attention)",
    "quack-kernels": "fa4's kernels",
    "torch-c-dlpack-ext": "fa4's DLPack bridge",
    "nvidia-mathdx": "cuFFTDx/cuBLASDx for specific kernels",
    "torch-memory-saver": "--enable-memory-saver only",
    "torchcodec": "video inputs (multimodal)",
    "datasets": "benchmarks",
    "modelscope": "SGLANG_USE_MODELSCOPE downloads",
    "outlines": "the outlines grammar backend; the default is xgrammar",
    "llguidance": "the llguidance grammar backend; the default is xgrammar",
    "anthropic": "the Anthropic-compatible API",
    "openai-harmony": "gpt-oss's harmony format",
    "mistral-common": "Mistral tokenizers",
    "blobfile": "tiktoken files on blob storage",
    "py-spy": "profiling",
    "smg-grpc-servicer": "the gRPC server",
    "deepseek-recipe": "DeepSeek-specific encodings",
    "tml-renderers": "chat renderers outside the default path",
    "easydict": "multimodal processors",
    "watchfiles": "uvicorn's --reload",
    "zstandard": "compressed request bodies",
}

# The GPU machine's image, as read on 2026-11-17: packages already there.
GPU_MACHINE_HAS = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax
    e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist
    fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
    imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
    joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
    markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
    numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
    nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
    opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
    portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
    pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
    sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
    sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
    tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
    tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
    transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def unaccounted_requirements(root: str, requirements: Callable[[str], list[str]]) -> dict[str, str]:
    """Requirements reachable from `root` that neither travel, nor are on the GPU machine, nor
    are left out with a reason: {name: the package that requires it}. `requirements(name)` lists
    a package's requirement names for Python 3.12 on Linux (environment markers applied)."""
    travel = {canonical(n) for n in SERVE_DEPS} | {"sglang", "flashinfer-python", "apache-tvm-ffi"}
    stop = {canonical(n) for n in NOT_SERVED} | set(GPU_MACHINE_HAS)
    found: dict[str, str] = {}
    todo, seen = [canonical(root)], {canonical(root)}
    while todo:
        name = todo.pop()
        for req in map(canonical, requirements(name)):
            if req in stop or req in seen:
                continue
            seen.add(req)
            if req in travel:
                todo.append(req)
            else:
                found[req] = name
    return found


def installed_requirements(name: str) -> list[str]:
    """A package's requirement names from this environment's metadata, for Python 3.12 on Linux."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
    env.update(platform_machine="x86_64", platform_system="Linux", implementation_name="cpython", extra="")
    names = []
    for line in metadata.distribution(name).requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            names.append(req.name)
    return names


# ---- wheels ----------------------------------------------------------------------------------


def record_line(name: str, data: bytes) -> str:
    """A wheel RECORD row (CSV: SGLang has file names with commas in them)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    row = io.StringIO()
    csv.writer(row, lineterminator="").writerow([name, f"sha256={digest}", len(data)])
    return row.getvalue()


def repack(src: str, dst: str, keep_entry: Callable[[str], bool]) -> tuple[int, int]:
    """Copy the wheel `src` to `dst` keeping the entries `keep_entry` accepts, with a new RECORD.
    Returns (entries kept, entries dropped)."""
    kept = dropped = 0
    out = zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9)
    with zipfile.ZipFile(src) as zin, out as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        records = []
        for info in zin.infolist():
            if info.filename == record_name or info.is_dir():
                continue
            if not keep_entry(info.filename):
                dropped += 1
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            records.append(record_line(info.filename, data))
            kept += 1
        zout.writestr(record_name, "\n".join(records + [f"{record_name},,"]) + "\n")
    return kept, dropped


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_name_matches(filename: str, name: str) -> bool:
    """`pydantic_core-2.50.5-cp312-...whl` matches "pydantic-core"; "pydantic" does not."""
    return canonical(filename.split("-")[0]) == canonical(name)


def download(spec: str, into: str, python_version: str) -> str:
    name = spec.split("==")[0]
    found = [f for f in os.listdir(into) if f.endswith(".whl") and wheel_name_matches(f, name)]
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", python_version, "--implementation", "cp", "-d", into, spec]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        found = [f for f in os.listdir(into) if f.endswith(".whl") and wheel_name_matches(f, name)]
    if len(found) != 1:
        raise SystemExit(f"expected one wheel of {name} in {into}, found {found}: remove the stale ones")
    return os.path.join(into, found[0])


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def checkout_bytes(root: str = ".") -> int:
    """What a device call carries of the checkout at `root`: tracked and untracked-not-ignored
    files."""
    listed = subprocess.run(
        ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    paths = [os.path.join(root, p) for p in listed.decode().split("\0") if p]
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


# ---- the two bundles -------------------------------------------------------------------------


def build_check(out: str, python_version: str) -> None:
    downloads = os.path.join(out, "downloads")
    os.makedirs(downloads, exist_ok=True)
    flashinfer = download(FLASHINFER, downloads, python_version)
    tvm_ffi = download(TVM_FFI, downloads, python_version)
    wheels = os.path.join(out, "wheels")
    os.makedirs(wheels, exist_ok=True)
    for stale in os.listdir(wheels):
        os.remove(os.path.join(wheels, stale))
    kept, dropped = repack(flashinfer, os.path.join(wheels, os.path.basename(flashinfer)), keep)
    print(f"{os.path.basename(flashinfer)}: kept {kept} entries, dropped {dropped}")
    shutil.copy(tvm_ffi, wheels)
    for wheel in sorted(os.listdir(wheels)):
        print(f"  {wheel}: {mib(os.path.getsize(os.path.join(wheels, wheel)))}")
    print(f"original {os.path.basename(flashinfer)}: {mib(os.path.getsize(flashinfer))}")
    print(f"install there: python3 -m pip install --no-index --no-deps --target DIR {wheels}/*.whl")


def serve_specs() -> list[str]:
    """`name==version` of every wheel the serve bundle holds; the Python packages at this
    environment's versions (the ones `make test` runs SGLang with)."""
    specs = [SGLANG, FLASHINFER, TVM_FFI]
    return specs + [f"{name}=={metadata.version(name)}" for name in SERVE_DEPS]


def build_serve(out: str, python_version: str) -> dict:
    missing = unaccounted_requirements("sglang", installed_requirements)
    if missing:
        listed = ", ".join(f"{n} (required by {p})" for n, p in sorted(missing.items()))
        raise SystemExit(f"requirements neither bundled nor known to be unneeded: {listed}")
    downloads = os.path.join(out, "downloads")
    serve = os.path.join(out, "serve")
    wheels = os.path.join(serve, "wheels")
    shutil.rmtree(serve, ignore_errors=True)
    os.makedirs(wheels)
    os.makedirs(downloads, exist_ok=True)
    slim = {
        "sglang": lambda n: keep_sglang(n),
        "flashinfer-python": lambda n: keep(n, cutlass_headers=True),
    }
    entries = []
    for spec in serve_specs():
        name, version = spec.split("==")
        src = download(spec, downloads, python_version)
        entry = dict(name=name, version=version, wheel=os.path.basename(src), sha256=sha256(src))
        entry["bytes"] = os.path.getsize(src)
        dst = os.path.join(wheels, os.path.basename(src))
        if name in slim:
            entry["kept"], entry["dropped"] = repack(src, dst, slim[name])
        else:
            shutil.copy(src, dst)
        entries.append(entry)
    site = os.path.join(serve, "site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile"]
    cmd += ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    cmd += ["--target", site] + [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(cmd + sorted(os.path.join(wheels, w) for w in os.listdir(wheels)), check=True)
    shutil.rmtree(os.path.join(site, "bin"), ignore_errors=True)  # console scripts: python -m serves
    archive = os.path.join(serve, "site.tar.xz")
    print(f"packing {site} -> {archive} (xz, a minute or two)", flush=True)
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        tar.add(site, arcname="site")
    shutil.rmtree(site)
    shutil.rmtree(wheels)
    manifest = dict(
        built_by="python tests/gpu_kit/bundle.py --serve",
        python_version=python_version,
        archive=dict(file="site.tar.xz", sha256=sha256(archive), bytes=os.path.getsize(archive)),
        wheels=entries,
    )
    with open(os.path.join(serve, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", default=".gpu-bundle")
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--serve", action="store_true", help="the serve bundle (make gpu-proof)")
    args = parser.parse_args()
    if not args.serve:
        build_check(args.out, args.python_version)
        return
    manifest = build_serve(args.out, args.python_version)
    for entry in manifest["wheels"]:
        print(f"  {entry['name']} {entry['version']}: {mib(entry['bytes'])} downloaded")
    bundle, tree = manifest["archive"]["bytes"], checkout_bytes()
    print(
        f"{args.out}/serve/site.tar.xz: {mib(bundle)}; checkout: {mib(tree)}; "
        f"one call carries {mib(CALL_LIMIT)}"
    )
    if bundle + tree > CALL_LIMIT:
        raise SystemExit(f"the bundle and the checkout come to {mib(bundle + tree)}: over one call's limit")
    print(f"on the GPU machine: make gpu-proof (carry {args.out}/serve and {args.out}/aot from make gpu-aot)")


if __name__ == "__main__":
    main()

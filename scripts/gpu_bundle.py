"""FlashInfer for a GPU machine that has PyTorch and no package index, in 27 MiB.

    python scripts/gpu_bundle.py [--out .gpu-bundle] [--python-version 3.12]

Downloads (pip, from here) `flashinfer-python` and `apache-tvm-ffi` wheels for the GPU machine's
Python, and repacks FlashInfer without what its JIT path for our draft attention (fa2 paged
prefill) does not read: the kernel sources of other modules (`data/csrc/<subdir>/`), CUTLASS,
CCCL's docs, tests and Python bindings, and the kernel sources kept beside the Python of
`experimental`, `fused_moe` and `moe_ep`. The 62 MiB wheel becomes 24 MiB, so it
travels with the working tree. `make gpu-check BUNDLE=<out>` installs it there (README,
"Checking the GPU path"). FlashInfer's other needs (click, einops, tabulate, nvidia-ml-py,
numpy, ninja) are assumed present, as on any machine with a CUDA PyTorch and pip's usual set.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import subprocess
import sys
import zipfile

FLASHINFER = "flashinfer-python==0.7.2"  # what sglang 0.5.23 installs
TVM_FFI = "apache-tvm-ffi==0.1.11"
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]

DROP_PREFIXES = ("flashinfer/data/cutlass/",)
# Subpackages whose Python `import flashinfer` runs, and whose kernel sources we never compile.
PYTHON_ONLY = ("flashinfer/experimental/", "flashinfer/fused_moe/", "flashinfer/moe_ep/")
# CCCL: only its three header trees.
CCCL_KEEP = (
    "flashinfer/data/cccl/cub/cub/",
    "flashinfer/data/cccl/libcudacxx/include/",
    "flashinfer/data/cccl/thrust/thrust/",
)


def keep(name: str) -> bool:
    """Whether a FlashInfer wheel entry stays. E.g., `flashinfer/data/csrc/batch_prefill.cu`
    stays, `flashinfer/data/csrc/fused_moe/x.cu` and `flashinfer/data/cutlass/...` do not."""
    if name.startswith(DROP_PREFIXES):
        return False
    if name.startswith(PYTHON_ONLY):
        return name.endswith(".py")
    if name.startswith("flashinfer/data/cccl/"):
        return name.startswith(CCCL_KEEP)
    if name.startswith("flashinfer/data/csrc/"):
        return "/" not in name[len("flashinfer/data/csrc/") :]
    return True


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack(src: str, dst: str) -> tuple[int, int]:
    """Copy the wheel `src` to `dst` keeping the entries `keep` accepts, with a new RECORD.
    Returns (entries kept, entries dropped)."""
    kept = dropped = 0
    out = zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9)
    with zipfile.ZipFile(src) as zin, out as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        records = []
        for info in zin.infolist():
            if info.filename == record_name or info.is_dir():
                continue
            if not keep(info.filename):
                dropped += 1
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            records.append(record_line(info.filename, data))
            kept += 1
        zout.writestr(record_name, "\n".join(records + [f"{record_name},,"]) + "\n")
    return kept, dropped


def download(spec: str, into: str, python_version: str) -> str:
    name = spec.split("==")[0].replace("-", "_")
    found = [f for f in os.listdir(into) if f.lower().startswith(name.lower())] if os.path.isdir(into) else []
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", python_version, "--implementation", "cp", "-d", into, spec]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        found = [f for f in os.listdir(into) if f.lower().startswith(name.lower())]
    return os.path.join(into, found[0])


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", default=".gpu-bundle")
    parser.add_argument("--python-version", default="3.12")
    args = parser.parse_args()
    downloads = os.path.join(args.out, "downloads")
    os.makedirs(downloads, exist_ok=True)
    flashinfer = download(FLASHINFER, downloads, args.python_version)
    tvm_ffi = download(TVM_FFI, downloads, args.python_version)
    wheels = os.path.join(args.out, "wheels")
    os.makedirs(wheels, exist_ok=True)
    for stale in os.listdir(wheels):
        os.remove(os.path.join(wheels, stale))
    repacked = os.path.join(wheels, os.path.basename(flashinfer))
    kept, dropped = repack(flashinfer, repacked)
    print(f"{os.path.basename(flashinfer)}: kept {kept} entries, dropped {dropped}")
    with open(tvm_ffi, "rb") as f, open(os.path.join(wheels, os.path.basename(tvm_ffi)), "wb") as g:
        g.write(f.read())
    for wheel in sorted(os.listdir(wheels)):
        print(f"  {wheel}: {os.path.getsize(os.path.join(wheels, wheel)) / 2**20:.1f} MiB")
    print(f"original {os.path.basename(flashinfer)}: {os.path.getsize(flashinfer) / 2**20:.1f} MiB")
    print(f"install there: python3 -m pip install --no-index --no-deps --target DIR {wheels}/*.whl")


if __name__ == "__main__":
    main()

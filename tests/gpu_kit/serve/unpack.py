"""Install the serve bundle (`tests/gpu_kit/bundle.py --serve`) on the GPU machine: check the
archive against its manifest, then unpack it into a site folder, once; then FlashInfer's
precompiled modules (`tests/gpu_kit/aot.py`), if carried, into that site's FlashInfer.

    python -m tests.gpu_kit.serve.unpack BUNDLE_DIR SITE_PARENT [AOT_DIR]   # from the checkout's root

Leaves SITE_PARENT/site with a `.bundle-sha256` marker (run again with the same archive, it
unpacks nothing), a dist-info there that declares this checkout's plugin entry point, and each
AOT module at `site/flashinfer/data/aot/<uri>/<uri>.so`, where FlashInfer loads it without
compiling (`flashinfer/jit/env.py`, `get_aot_artifacts`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import time

from tests.gpu_kit.bundle import sha256

MARKER = ".bundle-sha256"


def checked_manifest(folder: str) -> dict:
    """`folder/manifest.json`, once the archive it names matches its sha256; SystemExit naming
    the mismatch otherwise."""
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    archive = os.path.join(folder, manifest["archive"]["file"])
    if not os.path.isfile(archive):
        raise SystemExit(f"{archive} is missing: carry the whole folder")
    got = sha256(archive)
    if got != manifest["archive"]["sha256"]:
        raise SystemExit(f"{archive}: sha256 {got}, the manifest says {manifest['archive']['sha256']}")
    return manifest


def check(bundle: str) -> dict:
    """The serve bundle's manifest, checked, for this Python."""
    manifest = checked_manifest(bundle)
    python = "{}.{}".format(*sys.version_info[:2])
    if python != manifest["python_version"]:
        raise SystemExit(f"the bundle is for Python {manifest['python_version']}, this is {python}")
    return manifest


def register_checkout(site: str, root: str) -> str:
    """Make the checkout at `root` (imported from PYTHONPATH) visible to SGLang's plugin discovery:
    SGLang finds plugins through package metadata (`sglang.srt.plugins` entry points), which a
    source tree on PYTHONPATH lacks. Writes a minimal dist-info for it into `site`, from
    pyproject.toml's name, version and entry points."""
    import tomllib

    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    name, version = project["name"], project["version"]
    info = os.path.join(site, f"{name.replace('-', '_')}-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        for group, entries in project.get("entry-points", {}).items():
            f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n")
    with open(os.path.join(info, "INSTALLER"), "w") as f:
        f.write(f"sglang-dflash GPU kit: the checkout at {root}, on PYTHONPATH\n")
    return info


def unpack(bundle: str, parent: str) -> str:
    manifest = check(bundle)
    site = os.path.join(parent, "site")
    marker = os.path.join(site, MARKER)
    if os.path.isfile(marker) and open(marker).read() == manifest["archive"]["sha256"]:
        print(f"{site}: already holds this bundle")
        return site
    shutil.rmtree(site, ignore_errors=True)
    os.makedirs(parent, exist_ok=True)
    start = time.perf_counter()
    with tarfile.open(os.path.join(bundle, manifest["archive"]["file"])) as tar:
        tar.extractall(parent, filter="data")
    # Byte-compile once, on every core: the bundle's wheels were installed without .pyc files,
    # and otherwise each fresh process (servers, schedulers, warm-ups) compiles SGLang's
    # thousands of modules for itself, one after another.
    import compileall

    compileall.compile_dir(site, quiet=2, workers=0)
    with open(marker, "w") as f:
        f.write(manifest["archive"]["sha256"])
    names = ", ".join(f"{w['name']} {w['version']}" for w in manifest["wheels"][:3])
    print(f"{site}: {len(manifest['wheels'])} packages ({names}, ...) in {time.perf_counter() - start:.0f} s")
    return site


def install_aot(aot: str, site: str) -> list[str]:
    """FlashInfer's precompiled modules from `aot` (tests/gpu_kit/aot.py) into the site's FlashInfer,
    checked against their manifest and the site's FlashInfer version. Returns their URIs."""
    manifest = checked_manifest(aot)
    with open(os.path.join(site, "flashinfer", "_build_meta.py")) as f:
        meta = f.read()
    if f'"{manifest["flashinfer_version"]}"' not in meta:
        raise SystemExit(
            f"{aot} holds FlashInfer {manifest['flashinfer_version']} modules; the site's is other"
        )
    into = os.path.join(site, "flashinfer", "data", "aot")
    os.makedirs(into, exist_ok=True)
    with tarfile.open(os.path.join(aot, manifest["archive"]["file"])) as tar:
        tar.extractall(into, filter="data")
    uris = [m["uri"] for m in manifest["modules"]]
    missing = [u for u in uris if not os.path.isfile(os.path.join(into, u, f"{u}.so"))]
    if missing:
        raise SystemExit(f"{aot}: the archive lacks {', '.join(missing)}")
    return uris


if __name__ == "__main__":
    site = unpack(*sys.argv[1:3])
    if len(sys.argv) > 3 and os.path.isdir(sys.argv[3]):
        uris = install_aot(sys.argv[3], site)
        print(f"{site}/flashinfer/data/aot: {len(uris)} precompiled FlashInfer modules ({', '.join(uris)})")
    print(
        f"{register_checkout(site, os.getcwd())}: this checkout's entry points, for SGLang's plugin discovery"
    )

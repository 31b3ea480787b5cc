"""What one GPU call carries for `make gpu-first`, built and checked here (`make gpu-carry`).

    python tests/gpu_kit/carry.py [--check] [--bundle .gpu-bundle]

Builds what is missing, then checks what would travel. The serve bundle (`bundle.py --serve`,
2-3 minutes, downloads about 110 MiB) is rebuilt only when its archive does not match its
manifest; FlashInfer's AOT modules (`aot.py`, about 25 minutes on 2 cores, resumable: a module
staged earlier is kept) only when the archive is missing, does not match its manifest or lacks
a module of `aot.MODULES`. `--check` builds nothing.

It fails (exit 1) when:

* a bundle is missing, its archive does not match its manifest, or the AOT archive lacks a
  module the GPU run requests (`aot.MODULES`);
* the checkout's carried files and both bundles are over one call's 64 MiB;
* a file gpu-first needs from the checkout would not travel. The device tool carries tracked
  files and untracked files git does not ignore, plus the carry paths; a git-ignored module
  stays behind. The files are followed from `proof.py`: every import that resolves inside the
  checkout, and every module or script named in a string (`-m tests.gpu_kit.serve.lossless`,
  `scripts/serving/load_test.py`, the plugin's entry point), transitively; plus `READS`, the
  files read rather than imported.

It prints the carry list to pass with the call (`carry`) and each part's size.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu_kit.bundle import CALL_LIMIT, checkout_bytes, mib  # noqa: E402

CARRY = (".gpu-bundle/serve", ".gpu-bundle/aot")  # relative to the checkout, as the call names them
ENTRY = "tests/gpu_kit/proof.py"
# Read, not imported: setup.py and the CUDA sources (the proof builds _C on the machine),
# pyproject.toml (its entry points, which unpack.py registers; their modules are followed), the
# shipped trained pair (the lossless step's), the stand-in's folder (put on PYTHONPATH).
READS = (
    "setup.py",
    "pyproject.toml",
    "cuda",
    "sglang_dflash/assets/tiny_pair",
    "tests/gpu_kit/serve/standin",
)
# Imported but built on the machine, so never carried: the proof's `build _C` step.
BUILT_THERE = {"sglang_dflash._C"}
CHECKOUT_PACKAGES = ("tests", "sglang_dflash", "scripts")  # a module of these must be in the checkout
# A string that names a checkout module (`-m tests.gpu_kit.serve.lossless`, an entry point
# `sglang_dflash.plugin:register`) or a script (`scripts/serving/load_test.py`).
MODULE_STRING = re.compile(r"^((?:tests|sglang_dflash|scripts)(?:\.\w+)+)(?::\w+)?$")
SCRIPT_STRING = re.compile(r"^((?:tests|sglang_dflash|scripts)/[\w/]+\.py)$")


def carried(root: str = ROOT) -> set[str]:
    """The checkout's files a call carries, relative: tracked and untracked-not-ignored."""
    listed = subprocess.run(
        ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    return {p for p in listed.decode().split("\0") if p and os.path.isfile(os.path.join(root, p))}


def module_file(name: str, root: str, near: str = "") -> str | None:
    """The checkout file of module `name` (relative), looked up from the checkout's root and from
    `near` (a script's own folder is on its sys.path); None when it is not there."""
    parts = name.split(".")
    for base in (root, near) if near else (root,):
        stem = os.path.join(base, *parts)
        for path in (stem + ".py", os.path.join(stem, "__init__.py")):
            if os.path.isfile(path):
                return os.path.relpath(path, root)
    return None


def imported(path: str, root: str) -> tuple[set[str], set[str]]:
    """The checkout files `path` (relative) imports or names, and the checkout modules it
    imports that are not there (e.g. a file left ignored, or never written)."""
    with open(os.path.join(root, path)) as f:
        tree = ast.parse(f.read(), path)
    near = os.path.dirname(os.path.join(root, path))
    package = os.path.dirname(path).replace(os.sep, ".")
    names: set[str] = set()
    maybe: set[str] = set()  # `from X import Y`: Y a submodule or a name in X, so never missing
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in [*up, base] if p)
            names.add(base)
            maybe.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if MODULE_STRING.match(node.value):
                maybe.add(MODULE_STRING.match(node.value).group(1))  # may name a function
            elif SCRIPT_STRING.match(node.value):
                names.add(node.value)
    files, missing = set(), set()
    for name in sorted(names | maybe):
        if name.endswith(".py"):
            found = name if os.path.isfile(os.path.join(root, name)) else None
        else:
            found = module_file(name, root, near)
        if found:
            files.add(found)
            # a package's modules import through their __init__ files
            parts = found.split(os.sep)[:-1]
            files.update(os.path.join(*parts[:i], "__init__.py") for i in range(1, len(parts) + 1))
        elif name not in maybe and name not in BUILT_THERE and name.split(".")[0] in CHECKOUT_PACKAGES:
            missing.add(name)
    return {f for f in files if os.path.isfile(os.path.join(root, f))}, missing


def entry_point_files(root: str) -> list[str]:
    """The modules of pyproject.toml's entry points (the plugin SGLang loads: unpack.py
    registers the checkout's entry points on the machine)."""
    import tomllib

    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        groups = tomllib.load(f).get("project", {}).get("entry-points", {})
    modules = [v.split(":")[0] for entries in groups.values() for v in entries.values()]
    return [found for found in (module_file(m, root) for m in modules) if found]


def needed(root: str = ROOT) -> tuple[set[str], set[str]]:
    """Every checkout file gpu-first needs (relative), followed from ENTRY plus READS, and the
    checkout modules it imports that do not exist."""
    todo, seen, missing = [ENTRY, *entry_point_files(root)], set(), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        files, gone = imported(path, root)
        missing |= gone
        todo += sorted(files - seen)
    for read in READS:
        full = os.path.join(root, read)
        if os.path.isfile(full):
            seen.add(read)
        for folder, _, names in os.walk(full):
            if "__pycache__" not in folder:
                seen.update(os.path.relpath(os.path.join(folder, n), root) for n in names)
    return seen, missing


def bundle_problems(bundle: str) -> list[str]:
    """Why the serve bundle or the AOT archive would not do; [] when both would."""
    from tests.gpu_kit import aot
    from tests.gpu_kit.serve.unpack import checked_manifest

    problems = []
    for part in ("serve", "aot"):
        folder = os.path.join(bundle, part)
        if not os.path.isfile(os.path.join(folder, "manifest.json")):
            problems.append(f"{folder}: not built")
            continue
        try:
            manifest = checked_manifest(folder)
        except (SystemExit, OSError) as error:
            problems.append(f"{folder}: {error}")
            continue
        if part == "aot":
            lacking = set(aot.MODULES) - {m["uri"] for m in manifest["modules"]}
            if lacking:
                problems.append(
                    f"{folder}: lacks {len(lacking)} of aot.MODULES: {', '.join(sorted(lacking))}"
                )
    return problems


def build(bundle: str) -> None:
    """Build each part whose check fails: the serve bundle, then the AOT modules (resumable)."""
    out = os.path.dirname(os.path.join(bundle, "serve"))
    for part, cmd in (
        ("serve", [sys.executable, "tests/gpu_kit/bundle.py", "--serve", "--out", out]),
        ("aot", ["nice", sys.executable, "tests/gpu_kit/aot.py", "--out", out]),
    ):
        if any(p.startswith(os.path.join(bundle, part) + ":") for p in bundle_problems(bundle)):
            print(f"== building {part}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="build nothing, only check")
    p.add_argument("--bundle", default=os.path.join(ROOT, ".gpu-bundle"))
    args = p.parse_args(argv)
    if not args.check:
        build(args.bundle)
    failures = bundle_problems(args.bundle)
    files, missing = needed()
    left_behind = sorted(files - carried())
    failures += [f"{m}: imported by gpu-first's code, not in the checkout" for m in sorted(missing)]
    failures += [f"{f}: needed by gpu-first, git-ignored (would not travel)" for f in left_behind]
    sizes = {"the checkout (tracked, untracked-not-ignored)": checkout_bytes(ROOT)}
    for part in CARRY:
        folder = os.path.join(args.bundle, os.path.basename(part))
        sizes[part] = folder_bytes(folder) if os.path.isdir(folder) else 0
    total = sum(sizes.values())
    for what, n in sizes.items():
        print(f"{mib(n):>10}  {what}")
    print(f"{mib(total):>10}  in all, of {mib(CALL_LIMIT)} a call carries")
    if not left_behind:
        print(f"{len(files)} checkout files gpu-first needs, followed from {ENTRY}: all carried")
    if total > CALL_LIMIT:
        failures.append(f"{mib(total)} is over the {mib(CALL_LIMIT)} a call carries")
    print("carry: " + json.dumps(list(CARRY)))
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""The package's imports flow one way (docs/architecture.md, "Imports flow one way").

Every import of one of our modules by another, at module level or inside a function, goes to the
importer's own folder or to a lower layer of `LAYERS`; and no chain of imports comes back to
where it started. Pure AST, no imports of the package: a checker over a tree, run on the real one
and on small trees that break each rule.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support import paths

ROOT = paths.REPO
PACKAGE = "sglang_dflash"

# Bottom to top. A unit is a folder (`draft`) or a top-level module (`worker`); a module may import
# from its own unit and from units of lower layers, never from its layer's other units or above.
LAYERS: list[set[str]] = [
    {"", "knobs", "assets"},  # the package root's names, the knobs' names, the shipped pair
    {"checkpoint"},
    {"verify"},
    {"propose"},
    {"draft"},
    {"ops", "cpu"},
    {"width", "integration"},
    {"runtime", "step_timer", "train"},
    {"worker"},
    {"plugin"},
]


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root/package` (a package is its __init__)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path], package: str) -> set[str]:
    """The modules of `known` that module `name` imports: `import a.b`, `from a import b` (b a
    module, else a), relative forms resolved; each at its longest known prefix."""

    def known_prefix(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == package or target.startswith(package + "."):
                hit = known_prefix(target)
                if hit and hit != name:
                    found.add(hit)
    return found


def unit(module: str, package: str) -> str:
    """sglang_dflash.draft.step -> draft; sglang_dflash.worker -> worker; sglang_dflash -> ''."""
    return module.removeprefix(package).lstrip(".").partition(".")[0]


def layer_of(u: str, layers: list[set[str]]) -> int:
    for i, units in enumerate(layers):
        if u in units:
            return i
    raise KeyError(f"{u!r} is in no layer: add it to LAYERS (and to docs/architecture.md)")


def against_the_flow(graph: dict[str, set[str]], layers: list[set[str]], package: str) -> list[str]:
    """'a -> b (why)' for each import that goes up a layer or sideways into another unit."""
    bad = []
    for importer, targets in sorted(graph.items()):
        source = unit(importer, package)
        for target in sorted(targets):
            dest = unit(target, package)
            if dest == source:
                continue
            a, b = layer_of(source, layers), layer_of(dest, layers)
            if b >= a:
                bad.append(f"{importer} -> {target} ({source or 'root'} is layer {a}, {dest or 'root'} {b})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    known = modules(root, package)
    return {name: imports(name, path, known, package) for name, path in known.items()}


# ---------------------------------------------------------------------- the package itself


def test_every_unit_has_a_layer():
    units = {unit(m, PACKAGE) for m in modules(ROOT, PACKAGE)}
    for u in units:
        layer_of(u, LAYERS)
    assert units == set().union(*LAYERS), "LAYERS names a unit the package does not have"


def test_imports_flow_down_the_layers():
    bad = against_the_flow(import_graph(), LAYERS, PACKAGE)
    assert not bad, "imports against the flow (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_graph_sees_lazy_relative_and_from_imports():
    graph = import_graph()
    assert "sglang_dflash.worker" in graph["sglang_dflash.plugin"]  # inside a function
    assert (
        "sglang_dflash.cpu.linear_attention" in graph["sglang_dflash.cpu.sgl_kernel_shim.mamba"]
    )  # relative
    assert (
        "sglang_dflash.checkpoint.contract" in graph["sglang_dflash.checkpoint.config"]
    )  # from pkg import mod


def documented_layers(text: str) -> list[set[str]]:
    """The layers of docs/architecture.md's "Layout" table, bottom to top: a row whose first cell
    is 7 and second names runtime.py and train/ gives {"runtime", "train"} at index 7 (and
    __init__.py gives "")."""
    layers: dict[int, set[str]] = {}
    for row in re.findall(r"^\| (\d+) \| ([^|]+) \|", text, flags=re.M):
        names = re.findall(r"`([^`]+)`", row[1])
        layers[int(row[0])] = {"" if n == "__init__.py" else n.removesuffix(".py").rstrip("/") for n in names}
    return [layers[i] for i in sorted(layers)]


def test_the_architecture_doc_lists_the_layers():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layout = text[text.index("## Layout") : text.index("## Module map")]
    assert documented_layers(layout) == LAYERS


def test_a_layer_the_doc_lacks_is_found():
    assert documented_layers("| 1 | `a.py`, `b/` | x |\n| 0 | `__init__.py` | y |") == [{""}, {"a", "b"}]
    assert documented_layers("| 0 | `__init__.py` | y |") != [{""}, {"a", "b"}]


# Folders the module map names as a whole: each one's __init__ docstring maps its own modules.
MAPPED_AS_FOLDERS = ("cpu", "ops", "train", "assets")


def test_every_module_is_in_the_module_map():
    """docs/architecture.md's module map names every module by its path from the repository root
    (a package by its folder), except inside the folders it names as a whole."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for name, path in modules(ROOT, PACKAGE).items():
        if unit(name, PACKAGE) in MAPPED_AS_FOLDERS and name.count(".") > 1:
            continue
        shown = path.parent if path.name == "__init__.py" else path
        where = shown.relative_to(ROOT).as_posix() + ("/" if shown.is_dir() else "")
        if where != f"{PACKAGE}/" and where not in text:
            missing.append(where)
    assert not missing, "not in docs/architecture.md's module map: " + ", ".join(missing)


# ---------------------------------------------------------------------- the checker can fail


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path, "pkg")


def test_a_back_import_is_found(tmp_path):
    layers = [{""}, {"low"}, {"high"}]
    graph = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "def f():\n    from pkg.high import b  # lazy, still counted\n",
            "high/__init__.py": "",
            "high/b.py": "from pkg.low import a\n",
        },
    )
    assert against_the_flow(graph, layers, "pkg") == ["pkg.low.a -> pkg.high.b (low is layer 1, high 2)"]
    assert circles(graph) == [["pkg.high.b", "pkg.low.a"]]


def test_a_sideways_import_is_found(tmp_path):
    layers = [{""}, {"left", "right"}]
    graph = _tree(
        tmp_path,
        {"__init__.py": "", "left.py": "from . import right\n", "right.py": "import pkg\n"},
    )
    assert against_the_flow(graph, layers, "pkg") == ["pkg.left -> pkg.right (left is layer 1, right 1)"]


def test_a_circle_inside_one_folder_is_found(tmp_path):
    graph = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "f/__init__.py": "",
            "f/a.py": "from pkg.f.b import x\n",
            "f/b.py": "from .c import y\nx = 1\n",
            "f/c.py": "from pkg.f import a\ny = 2\n",
        },
    )
    assert against_the_flow(graph, [{""}, {"f"}], "pkg") == []  # one folder: the layers allow it
    assert circles(graph) == [["pkg.f.a", "pkg.f.b", "pkg.f.c"]]

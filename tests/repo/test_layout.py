"""The tests' layout: no test module imports another test module, and nothing outside `tests/`
imports `tests` (docs/testing.md, "Where tests live").

Test modules (`test_*.py`) may import from `tests.support` (builders and oracles) and from
`tests.gpu_kit` (the GPU machine's kit, which its own tests test); the support package and the
kit import no test module. Pure AST over the real tree, and over small trees that break each rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import paths

SHARED = ("tests.support", "tests.gpu_kit")  # what test modules may import from `tests`
OUTSIDE = ("sglang_dflash", "scripts", "setup.py")  # never import `tests`


def imported(path: Path) -> set[str]:
    """Every module `path` imports (absolute forms; the tree uses no relative imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _of_tests(name: str) -> bool:
    return name == "tests" or name.startswith("tests.")


def violations(root: Path) -> list[str]:
    """'file: imports X' for each import that breaks the rules, under `root`."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        rel = path.relative_to(root)
        for name in sorted(imported(path)):
            if not _of_tests(name):
                continue
            if any(part.startswith("test_") for part in name.split(".")):
                found.append(f"{rel}: imports the test module {name}")
            elif not any(name == s or name.startswith(s + ".") for s in SHARED):
                found.append(f"{rel}: imports {name}, which is not in {' or '.join(SHARED)}")
    for top in OUTSIDE:
        for path in sorted((root / top).rglob("*.py")) if (root / top).is_dir() else [root / top]:
            if path.exists():
                found += [
                    f"{path.relative_to(root)}: imports {n}" for n in sorted(imported(path)) if _of_tests(n)
                ]
    return found


def test_the_tree_follows_the_layout():
    assert violations(paths.REPO) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_test_importing_another_test_is_found(tmp_path):
    root = _tree(tmp_path, {"tests/unit/test_a.py": "from tests.unit.test_b import helper\n"})
    assert violations(root) == ["tests/unit/test_a.py: imports the test module tests.unit.test_b.helper"]


def test_a_test_importing_from_outside_support_is_found(tmp_path):
    root = _tree(tmp_path, {"tests/unit/test_a.py": "from tests.unit import helpers\n"})
    assert violations(root) == [
        "tests/unit/test_a.py: imports tests.unit.helpers, which is not in tests.support or tests.gpu_kit"
    ]


def test_support_importing_a_test_module_is_found(tmp_path):
    root = _tree(tmp_path, {"tests/support/x.py": "from tests.support.test_y import z\n"})
    assert violations(root) == ["tests/support/x.py: imports the test module tests.support.test_y.z"]


def test_the_package_or_the_scripts_importing_tests_are_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "sglang_dflash/a.py": "import tests.support.engines\n",
            "scripts/b.py": "from tests import support\n",
        },
    )
    assert violations(root) == [
        "sglang_dflash/a.py: imports tests.support.engines",
        "scripts/b.py: imports tests.support",
    ]


def test_tests_importing_support_are_allowed(tmp_path):
    root = _tree(
        tmp_path,
        {
            "tests/unit/test_a.py": "from tests.support import engines\nfrom tests.gpu_kit import proof\n",
            "tests/gpu_kit/x.py": "from tests.support.tiny import make_draft\n",
        },
    )
    assert violations(root) == []

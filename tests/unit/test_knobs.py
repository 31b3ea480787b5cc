"""Knobs: every environment variable in one registry, each parsed to its typed value and checked at
start-up (a bad value refused naming the variable, the value and what it takes), and read nowhere
else in the package, scripts/ or setup.py."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

import pytest

import sglang_dflash
from sglang_dflash import knobs
from sglang_dflash.knobs import KnobError, Knobs
from tests.support import paths


def test_every_knob_is_read_from_its_variable(tmp_path):
    steps, trace = str(tmp_path / "steps.jsonl"), str(tmp_path / "trace.jsonl")
    env = {
        "SGLANG_DFLASH_GRAMMAR_PROPOSALS": "0",
        "SGLANG_DFLASH_ADAPTIVE_WIDTH": "1",
        "SGLANG_DFLASH_FAIR_SLACK": "off",
        "SGLANG_DFLASH_WIDTH1_FORWARD": "decode",
        "SGLANG_DFLASH_DRAFT_CUDA_GRAPH": "0",
        "SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN": "512",
        "SGLANG_DFLASH_VERIFY_GRAPHS": "eager",
        "SGLANG_DFLASH_DEFERRED_INJECTION": "0",
        "SGLANG_DFLASH_DRAFT_WINDOW_POOL": "1",
        "SGLANG_DFLASH_STEP_TIMING": steps,
        "SGLANG_ENABLE_LILICORR_SAMPLING": "0",
        "SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION": "1",
        "SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER": "1",
        "SGLANG_DFLASH_TEST_SKIP_DRAFT_HICACHE": "1",
        "SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT": "1",
        "SGLANG_DFLASH_TEST_SKIP_WINDOW_REPREFILL": "1",
        "SGLANG_DFLASH_TEST_WIDTH1_STEPS": "3",
        "SGLANG_DFLASH_TEST_WIDTHS": "1,4, 2",
        "SGLANG_DFLASH_CHECK_RANKS": "1",
        "SGLANG_DFLASH_TRACE_PROPOSALS": trace,
        "SGLANG_DFLASH_TRACE_FEATURES": trace,
    }
    got = Knobs.from_env(env, simulated=False)
    assert got == Knobs(
        grammar_proposals=False,
        adaptive_width=True,
        fair_slack=None,
        width1_forward="decode",
        draft_graphs=False,
        draft_plan_free=512,
        verify_graphs="eager",
        deferred_injection=False,
        window_pool="on",
        step_timing=steps,
        lilicorr_sampling=False,
        skip_decode_injection=True,
        skip_draft_transfer=True,
        skip_draft_hicache=True,
        skip_state_commit=True,
        skip_window_reprefill=True,
        width1_steps=3,
        widths=(1, 4, 2),
        check_ranks=True,
        trace_proposals=trace,
        trace_features=trace,
    )
    assert len(got.aids_on()) == 10
    # Unset or empty: the defaults, and no aid in the start-up line.
    assert Knobs.from_env({}, simulated=False) == Knobs()
    assert Knobs.from_env(dict.fromkeys(env, ""), simulated=False) == Knobs()
    assert Knobs().aids_on() == []


# ------------------------------------------------------------------ each parser, good and bad values

GOOD = [
    ("SGLANG_DFLASH_IMPL", "builtin", "builtin"),
    ("SGLANG_DFLASH_IMPL", " BuiltIn ", "builtin"),  # stripped and case-folded, as before
    ("SGLANG_DFLASH_IMPL", "sglang-dflash", "sglang-dflash"),
    ("SGLANG_DFLASH_GRAMMAR_PROPOSALS", "1", True),
    ("SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION", "0", False),
    ("SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER", "1", True),
    ("SGLANG_DFLASH_TEST_SKIP_DRAFT_HICACHE", "1", True),
    ("SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT", "0", False),
    ("SGLANG_DFLASH_TEST_SKIP_WINDOW_REPREFILL", "1", True),
    ("SGLANG_DFLASH_CHECK_RANKS", "0", False),
    ("SGLANG_DFLASH_ADAPTIVE_WIDTH", "0", False),
    ("SGLANG_DFLASH_FAIR_SLACK", "0.2", 0.2),
    ("SGLANG_DFLASH_FAIR_SLACK", "0", 0.0),
    ("SGLANG_DFLASH_FAIR_SLACK", "off", None),
    ("SGLANG_DFLASH_WIDTH1_FORWARD", "verify", "verify"),
    ("SGLANG_DFLASH_DEFERRED_INJECTION", "1", True),
    ("SGLANG_DFLASH_DRAFT_WINDOW_POOL", "1", "on"),
    ("SGLANG_DFLASH_DRAFT_WINDOW_POOL", "0", "off"),
    ("SGLANG_DFLASH_DRAFT_CUDA_GRAPH", "1", True),
    ("SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN", "0", None),  # no plan-free graphs
    ("SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN", "4096", 4096),
    ("SGLANG_DFLASH_VERIFY_GRAPHS", "0", "off"),
    ("SGLANG_DFLASH_OPS", "reference", "reference"),
    ("SGLANG_DFLASH_OPS", "cuda", "cuda"),
    ("SGLANG_DFLASH_CPU_VERIFY_ATTENTION", "per-request", "per-request"),
    ("SGLANG_DFLASH_SAMPLING_MEMORY_MB", "2048", 2048),
    ("SGLANG_DFLASH_ALLOW_OTHER_TARGET", "1", True),
    ("SGLANG_DFLASH_SIMULATE_ACC_METHOD", "geometric", "geometric"),
    ("SGLANG_DFLASH_TEST_WIDTH1_STEPS", "0", 0),
    ("SGLANG_DFLASH_TEST_WIDTHS", "8", (8,)),
    ("SGLANG_DFLASH_TEST_WIDTHS", "1,2,", (1, 2)),
    ("SGLANG_DFLASH_BUILD_CUDA", "1", True),
    ("SGLANG_DFLASH_BUILD_CUDA", "0", False),
    ("SGLANG_DFLASH_CUDA_ARCHS", "90", ("90",)),
    ("SGLANG_DFLASH_CUDA_ARCHS", "80; 90a;", ("80", "90a")),
    ("SGLANG_DFLASH_SGL_KERNEL_STANDIN", "1", True),
    ("SGLANG_DFLASH_GPU_KIT", "1", True),
    ("SGLANG_ENABLE_LILICORR_SAMPLING", "False", False),  # SGLang's booleans
    ("SGLANG_ENABLE_LILICORR_SAMPLING", "y", True),
    ("SGLANG_LILICORR_REQUIRE_SAMPLING", "yes", True),
]

BAD = [
    ("SGLANG_DFLASH_IMPL", "ours", "sglang-dflash or builtin"),
    ("SGLANG_DFLASH_GRAMMAR_PROPOSALS", "yes", "0 or 1"),
    ("SGLANG_DFLASH_ADAPTIVE_WIDTH", "true", "0 or 1"),
    ("SGLANG_DFLASH_FAIR_SLACK", "-1", "a number >= 0 or off"),
    ("SGLANG_DFLASH_FAIR_SLACK", "nan", "a number >= 0 or off"),
    ("SGLANG_DFLASH_FAIR_SLACK", "yes", "a number >= 0 or off"),
    ("SGLANG_DFLASH_WIDTH1_FORWARD", "fast", "decode or verify"),
    ("SGLANG_DFLASH_DEFERRED_INJECTION", "off", "0 or 1"),
    ("SGLANG_DFLASH_DRAFT_WINDOW_POOL", "on", "one of auto, 0, 1"),
    ("SGLANG_DFLASH_DRAFT_CUDA_GRAPH", "yes", "0 or 1"),
    ("SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN", "banana", "a non-negative integer"),
    ("SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN", "-1", "a non-negative integer"),
    ("SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN", "2k", "a non-negative integer"),
    ("SGLANG_DFLASH_VERIFY_GRAPHS", "1", "0 or eager"),
    ("SGLANG_DFLASH_OPS", "fast", "one of auto, reference, cuda"),
    ("SGLANG_DFLASH_CPU_VERIFY_ATTENTION", "fastest", "batched or per-request"),
    ("SGLANG_DFLASH_SAMPLING_MEMORY_MB", "0", "a positive integer"),
    ("SGLANG_DFLASH_SAMPLING_MEMORY_MB", "1.5", "a positive integer"),
    ("SGLANG_DFLASH_ALLOW_OTHER_TARGET", "yes", "0 or 1"),
    ("SGLANG_DFLASH_SIMULATE_ACC_METHOD", "uniform", "geometric"),
    ("SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION", "yes", "0 or 1"),  # once silently off
    ("SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER", "2", "0 or 1"),
    ("SGLANG_DFLASH_TEST_SKIP_DRAFT_HICACHE", "on", "0 or 1"),
    ("SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT", "True", "0 or 1"),
    ("SGLANG_DFLASH_TEST_SKIP_WINDOW_REPREFILL", "yes", "0 or 1"),
    ("SGLANG_DFLASH_TEST_WIDTH1_STEPS", "-2", "a non-negative integer"),
    ("SGLANG_DFLASH_TEST_WIDTHS", "1,0", "a list of positive integers separated by commas"),
    ("SGLANG_DFLASH_TEST_WIDTHS", "1;2", "a list of positive integers separated by commas"),
    ("SGLANG_DFLASH_TEST_WIDTHS", ",", "a list of positive integers separated by commas"),
    ("SGLANG_DFLASH_CHECK_RANKS", "yes", "0 or 1"),
    ("SGLANG_DFLASH_BUILD_CUDA", "auto", "0 or 1"),
    ("SGLANG_DFLASH_CUDA_ARCHS", "9.0", "a list of SM versions separated by ';'"),
    ("SGLANG_DFLASH_CUDA_ARCHS", "80,90", "a list of SM versions separated by ';'"),
    ("SGLANG_DFLASH_SGL_KERNEL_STANDIN", "yes", "0 or 1"),
    ("SGLANG_DFLASH_GPU_KIT", "true", "0 or 1"),
    ("SGLANG_ENABLE_LILICORR_SAMPLING", "maybe", "a boolean (1/true/yes/y or 0/false/no/n)"),
]


@pytest.mark.parametrize("name, text, want", GOOD)
def test_a_good_value_gives_its_typed_value(name, text, want):
    assert knobs.value(name, {name: text}) == want
    assert knobs.parse({name: text})[name] == want


@pytest.mark.parametrize("name, text, allowed", BAD)
def test_a_bad_value_is_refused_naming_the_variable_the_value_and_what_it_takes(name, text, allowed):
    with pytest.raises(KnobError) as error:
        knobs.value(name, {name: text})
    assert str(error.value) == f"{name}={text!r} is not {knobs.BY_NAME[name].parser.allowed}"
    assert allowed in str(error.value)
    with pytest.raises(KnobError, match=re.escape(f"{name}={text!r} is not")):
        Knobs.from_env({name: text}, simulated=False)  # the start-up check


# The knobs that name a file to append records to.
RECORD_FILES = {"SGLANG_DFLASH_STEP_TIMING", "SGLANG_DFLASH_TRACE_PROPOSALS", "SGLANG_DFLASH_TRACE_FEATURES"}


def test_every_knob_with_a_parser_is_tried_good_and_bad():
    parsed = {k.name for k in knobs.REGISTRY if k.parser is not None}
    path_knobs = RECORD_FILES  # below
    assert {name for name, _, _ in GOOD} | path_knobs == parsed
    assert {name for name, _, _ in BAD} | path_knobs | {"SGLANG_LILICORR_REQUIRE_SAMPLING"} == parsed


def test_a_plan_free_bound_that_is_not_a_number_is_refused_by_name():
    with pytest.raises(KnobError) as error:
        Knobs.from_env({"SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN": "banana"}, simulated=False)
    assert str(error.value) == "SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN='banana' is not a non-negative integer"


@pytest.mark.parametrize("name", sorted(RECORD_FILES))
def test_a_record_file_must_open_for_appending(name, tmp_path):
    """STEP_TIMING, TRACE_PROPOSALS and TRACE_FEATURES: a file this process can append to, checked
    by opening it at start-up (created empty if new; what is there is kept), in a directory that
    exists."""
    new = tmp_path / "steps.jsonl"
    assert knobs.value(name, {name: str(new)}) == str(new) and new.read_text() == ""
    new.write_text('{"kept": 1}\n')
    assert knobs.value(name, {name: str(new)}) == str(new) and new.read_text() == '{"kept": 1}\n'
    for bad, why in (
        (tmp_path / "no-such-dir" / "s.jsonl", "No such file or directory"),
        (tmp_path, "Is a directory"),
    ):
        with pytest.raises(KnobError) as error:
            knobs.value(name, {name: str(bad)})
        assert str(error.value) == (
            f"{name}={str(bad)!r} is not a file that can be opened for appending, in a directory that "
            f"exists ({why})"
        )
    assert not (tmp_path / "no-such-dir").exists()


def test_every_problem_is_in_one_error_and_unknown_names_are_refused():
    env = {
        "SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN": "banana",
        "SGLANG_DFLASH_ADAPTIV_WIDTH": "1",  # a typo: silently ignored before
        "SGLANG_DFLASH_NEW_THING": "1",
        "SGLANG_DFLASH_EAGER_DRAFT_SAMPLER": "1",  # SGLang's own: known, left to SGLang
        "SGLANG_OTHER": "x",  # not our prefix
    }
    with pytest.raises(KnobError) as error:
        knobs.parse(env)
    assert str(error.value).split("; ") == [
        "SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN='banana' is not a non-negative integer",
        "SGLANG_DFLASH_ADAPTIV_WIDTH is not a variable sglang-dflash reads "
        "(did you mean SGLANG_DFLASH_ADAPTIVE_WIDTH?)",
        "SGLANG_DFLASH_NEW_THING is not a variable sglang-dflash reads (docs/knobs.md lists them)",
    ]


def test_lilicorr_sampling_cannot_be_off_when_required():
    with pytest.raises(KnobError, match="SGLANG_LILICORR_REQUIRE_SAMPLING is set"):
        Knobs.from_env(
            {"SGLANG_ENABLE_LILICORR_SAMPLING": "0", "SGLANG_LILICORR_REQUIRE_SAMPLING": "1"}, simulated=False
        )
    assert Knobs.from_env({"SGLANG_LILICORR_REQUIRE_SAMPLING": "1"}, simulated=False).lilicorr_sampling


def test_use_builtin():
    assert not knobs.use_builtin({})
    assert knobs.use_builtin({"SGLANG_DFLASH_IMPL": "builtin"})
    with pytest.raises(KnobError, match="SGLANG_DFLASH_IMPL='ours' is not sglang-dflash or builtin"):
        knobs.use_builtin({"SGLANG_DFLASH_IMPL": "ours"})


# ------------------------------------------------------------------------------- the registry


def test_the_registry_is_one_table_of_distinct_well_formed_knobs():
    names = [k.name for k in knobs.REGISTRY]
    assert len(names) == len(set(names)) == 36
    for knob in knobs.REGISTRY:
        assert knob.kind in knobs.KINDS, knob.name
        assert knob.name.startswith(("SGLANG_DFLASH_", "SGLANG_")), knob.name
        assert knob.meaning and "\n" not in knob.meaning and "|" not in knob.meaning, knob.name
        assert (knob.parser is None) <= (knob.kind == knobs.SGLANG), knob.name  # ours all parsed
    # Every worker field comes from one knob, and the dataclass defaults are the registry's.
    fields = {f.name for f in dataclasses.fields(Knobs)} - {"simulated_acceptance"}
    carried = [k.field for k in knobs.REGISTRY if k.field]
    assert sorted(carried) == sorted(fields)
    for knob in knobs.REGISTRY:
        if knob.field:
            assert getattr(Knobs(), knob.field) == knob.default, knob.name
    assert knobs.BY_NAME["SGLANG_DFLASH_IMPL"].default == sglang_dflash.IMPL_NAME


ROOT = paths.REPO


def _python_files(root: Path) -> list[Path]:
    """What the one-reader rule covers: the package, scripts/ and setup.py."""
    files = [*sorted((root / "sglang_dflash").rglob("*.py")), *sorted((root / "scripts").rglob("*.py"))]
    return files + [root / "setup.py"] if (root / "setup.py").exists() else files


def test_every_variable_named_in_the_repository_is_registered():
    """The package, scripts/, setup.py, the GPU kit and the docs name only registered variables."""
    texts = [p.read_text(encoding="utf-8") for p in _python_files(ROOT)]
    texts += [
        p.read_text(encoding="utf-8")
        for p in sorted((ROOT / "tests" / "gpu_kit").rglob("*"))
        if p.suffix in (".py", ".sh")
    ]
    texts += [
        p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    ]
    named = {m for text in texts for m in re.findall(r"\bSGLANG_DFLASH_[A-Z0-9_]*[A-Z0-9]\b", text)}
    assert named - set(knobs.BY_NAME) == set()


# --------------------------------------------------------------- nothing else reads the environment


def _constants(tree: ast.AST) -> dict[str, ast.expr]:
    """A module's `NAME = <value>` assignments."""
    return {
        target.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _module_constants(root: Path, module: str) -> dict[str, ast.expr]:
    """The constants of module `module` of the tree at `root` ({} when it is not in the tree)."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return _constants(ast.parse(path.read_text(encoding="utf-8")))
    return {}


def environment_reads(source: str, root: Path = ROOT) -> list[int]:
    """The lines where `source` reads an SGLANG_DFLASH_ variable from the process environment:
    `os.environ.get(K)`, `os.environ.setdefault(K, ...)`, `os.environ[K]`, `os.getenv(K)`,
    `K in os.environ`, or a filter by an SGLANG_DFLASH_ prefix (`name.startswith(K)`), where K is
    the name, or a constant holding it: the module's own, one it imports from a module of the
    tree at `root` (`from m import X`), or an attribute of such a module (`m.X`). Writing a child
    process's environment (`env[K] = ...`, `dict(os.environ, K=...)`) and asking the registry
    (`knobs.value(K)`) are not reads."""
    tree = ast.parse(source)
    constants, modules = _constants(tree), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                imported = _module_constants(root, node.module)
                if alias.name in imported:
                    constants[alias.asname or alias.name] = imported[alias.name]
                else:  # perhaps a module: `from scripts.serving.lib import report`
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def ours(node) -> bool:
        if isinstance(node, ast.Name) and node.id in constants:
            node = constants[node.id]
        elif (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
        ):
            node = _module_constants(root, modules[node.value.id]).get(node.attr, node)
        if isinstance(node, ast.Tuple):
            return any(ours(element) for element in node.elts)
        return (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("SGLANG_DFLASH_")
        )

    def environ(node) -> bool:
        return ast.unparse(node).split(".")[-1] == "environ"

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and ours(node.args[0]):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            on_environ = isinstance(func, ast.Attribute) and environ(func.value)
            if name in ("getenv", "startswith") or (name in ("get", "setdefault") and on_environ):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if environ(node.value) and ours(node.slice):
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and ours(node.left):
            if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
                map(environ, node.comparators)
            ):
                lines.append(node.lineno)
    return sorted(lines)


def reads_outside_the_registry(root: Path) -> list[str]:
    """'path:line' for each read of an SGLANG_DFLASH_ variable outside sglang_dflash/knobs.py."""
    return [
        f"{path.relative_to(root)}:{line}"
        for path in _python_files(root)
        if path != root / "sglang_dflash" / "knobs.py"
        for line in environment_reads(path.read_text(encoding="utf-8"), root)
    ]


def test_only_the_registry_reads_our_variables():
    assert reads_outside_the_registry(ROOT) == []


def test_a_read_outside_the_registry_is_found(tmp_path):
    files = {
        "sglang_dflash/knobs.py": 'import os\nos.environ.get("SGLANG_DFLASH_OPS")\n',  # the registry: allowed
        "sglang_dflash/ops.py": 'import os\nmode = os.environ.get("SGLANG_DFLASH_OPS", "auto")\n',
        "sglang_dflash/sub/mod.py": 'import os\nENV = "SGLANG_DFLASH_X"\n\nx = os.environ[ENV]\n',
        "scripts/tool.py": (
            "import os\n"
            'a = "SGLANG_DFLASH_IMPL" in os.environ\n'
            'b = os.getenv("SGLANG_DFLASH_IMPL")\n'
            'c = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_DFLASH_SIMULATE_")}\n'
        ),
        "setup.py": 'from os import environ\nenviron.setdefault("SGLANG_DFLASH_BUILD_CUDA", "0")\n',
        "sglang_dflash/names.py": 'TIMING = "SGLANG_DFLASH_STEP_TIMING"\nPREFIXES = ("SGLANG_DFLASH_",)\n',
        "sglang_dflash/timer.py": (
            "import os\n"
            "from sglang_dflash.names import TIMING as ENV_VAR\n"
            "from sglang_dflash import names\n"
            "a = os.environ.get(ENV_VAR)\n"
            "b = [k for k in os.environ if k.startswith(names.PREFIXES)]\n"
        ),
        "scripts/fine.py": (
            "import os\n"
            "from sglang_dflash import knobs\n"
            'mode = knobs.value("SGLANG_DFLASH_OPS")\n'
            'env = dict(os.environ, SGLANG_DFLASH_IMPL="builtin")\n'
            'env["SGLANG_DFLASH_ADAPTIVE_WIDTH"] = "0"\n'
            'env.pop("SGLANG_DFLASH_IMPL", None)\n'
            'home = os.environ.get("CUDA_HOME")\n'
        ),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert sorted(reads_outside_the_registry(tmp_path)) == [
        "scripts/tool.py:2",
        "scripts/tool.py:3",
        "scripts/tool.py:4",
        "setup.py:2",
        "sglang_dflash/ops.py:2",
        "sglang_dflash/sub/mod.py:4",
        "sglang_dflash/timer.py:4",
        "sglang_dflash/timer.py:5",
    ]


def test_the_modules_that_read_their_own_variable_get_typed_values(monkeypatch, tmp_path):
    """ops/, cpu/verify_attention.py, verify/sampling.py, step_timer.py and the plugin ask the
    registry: a bad value fails there too, naming it."""
    from sglang_dflash import plugin
    from sglang_dflash.step_timer import StepTimer
    from sglang_dflash.verify.sampling import rows_per_draw

    monkeypatch.setenv("SGLANG_DFLASH_SAMPLING_MEMORY_MB", "2048")
    assert rows_per_draw(151936) == 147
    monkeypatch.setenv("SGLANG_DFLASH_SAMPLING_MEMORY_MB", "lots")
    with pytest.raises(KnobError, match="SGLANG_DFLASH_SAMPLING_MEMORY_MB='lots' is not a positive integer"):
        rows_per_draw(151936)
    monkeypatch.setenv("SGLANG_DFLASH_STEP_TIMING", str(tmp_path / "missing" / "s.jsonl"))
    with pytest.raises(KnobError, match="SGLANG_DFLASH_STEP_TIMING="):
        StepTimer.from_env("cpu")
    monkeypatch.setenv("SGLANG_DFLASH_IMPL", "BUILTIN")
    assert plugin.use_builtin()


# --------------------------------------------------------------------------------- docs/knobs.md


def test_the_docs_table_renders_every_knob_with_its_default():
    text = knobs.markdown()
    for knob in knobs.REGISTRY:
        assert f"| `{knob.name}` |" in text
    assert "| `SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN` | a non-negative integer | `2048` |" in text
    assert "| `SGLANG_DFLASH_FAIR_SLACK` | a number >= 0 or off | `0.05` |" in text
    assert "| `SGLANG_DFLASH_VERIFY_GRAPHS` | 0 or eager | unset |" in text
    assert "| `SGLANG_DFLASH_CUDA_ARCHS` | a list of SM versions separated by ';' (e.g. 90;100a) |" in text
    assert [line for line in text.splitlines() if line.startswith("## ")] == [
        f"## {kind}" for kind in knobs.KINDS
    ]


def test_os_environ_is_the_default_environment(monkeypatch):
    monkeypatch.setenv("SGLANG_DFLASH_TEST_WIDTHS", "2,4")
    assert knobs.value("SGLANG_DFLASH_TEST_WIDTHS") == (2, 4)
    assert knobs.parse()["SGLANG_DFLASH_TEST_WIDTHS"] == (2, 4)
    assert os.environ["SGLANG_DFLASH_TEST_WIDTHS"] == "2,4"

"""make gpu-carry's check (tests/gpu_kit/carry.py): what gpu-first needs from the checkout travels."""

from __future__ import annotations

import subprocess

from tests.gpu_kit import carry


def test_every_checkout_file_gpu_first_needs_is_carried():
    """Followed from proof.py (imports, `-m` modules and scripts named in strings) and the
    plugin's entry point: none missing, none git-ignored."""
    files, missing = carry.needed()
    assert not missing, missing
    for path in (
        "tests/gpu_kit/serve/lossless.py",
        "scripts/serving/load_test.py",
        "scripts/bench/draft_step.py",
    ):
        assert path in files
    assert "sglang_dflash/plugin.py" in files  # through pyproject.toml's entry point
    assert not files - carry.carried()


def test_an_ignored_or_absent_module_is_found(tmp_path):
    """A module the proof runs that git ignores stays behind; one that is not there is missing."""
    (tmp_path / "tests" / "gpu_kit").mkdir(parents=True)
    for init in ("tests/__init__.py", "tests/gpu_kit/__init__.py"):
        (tmp_path / init).write_text("")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    (tmp_path / carry.ENTRY).write_text('import tests.gpu_kit.gone\nCMD = ["-m", "tests.gpu_kit.hidden"]\n')
    (tmp_path / "tests/gpu_kit/hidden.py").write_text("")
    (tmp_path / ".gitignore").write_text("hidden.py\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    files, missing = carry.needed(str(tmp_path))
    assert missing == {"tests.gpu_kit.gone"}
    assert files - carry.carried(str(tmp_path)) == {"tests/gpu_kit/hidden.py"}

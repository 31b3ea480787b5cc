"""The GPU kit's runs rehearsed on CPU engines: the proof, the races and the matrix, each under its
deadline."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

from tests.gpu_kit import proof as gpu_proof
from tests.support import paths


def rehearse(tmp_path, deadline: int, timeout: int, *args: str) -> pathlib.Path:
    """`tests/gpu_kit/proof.py` on SGLang's CPU engine with `args`, no bundle, under `deadline`
    seconds; it must succeed. Returns its --out folder."""
    out, state = tmp_path / "out", tmp_path / "state"
    cmd = [sys.executable, "-m", "tests.gpu_kit.proof", "--device", "cpu", "--out", str(out)]
    cmd += ["--state", str(state), "--bundle", str(tmp_path / "no-bundle"), "--deadline", str(deadline)]
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [*cmd, *args], cwd=paths.REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return out


@pytest.mark.sglang
@pytest.mark.slow  # five servers, about 3 minutes: run it before a GPU session (--run-slow)
def test_the_gpu_run_rehearses_on_cpu(tmp_path):
    """The default step list (lossless, lossless through every verify width's own backend, the
    race at 6.5, the draft-step benchmark) on SGLang's
    CPU engine: the shipped trained pair for lossless, the tiny pair for the race; the pieces
    that need CUDA are skipped and say why."""
    out = rehearse(
        tmp_path, 400, 600, "--lossless-pairs", "trained", "--race-concurrency", "1", "--race-seconds", "2"
    )
    steps = {s["name"]: s for s in json.loads((out / "gpu-proof.json").read_text())["steps"]}
    assert steps["lossless trained (overlap)"]["note"] == "lossless: identical"
    assert steps["lossless trained (widths)"]["note"] == "lossless: identical"  # each width's backend
    for name in ("race-6.5 dflash", "race baseline"):
        assert steps[name]["status"] == "ok"
    assert "refuses the CPU" in steps["race-6.5 dflash-builtin"]["note"]
    assert steps["bench-draft-step"]["note"] == "needs CUDA"
    report = (out / "gpu-proof-report.md").read_text()
    assert "| 6.5 | 1 |" in report and "x |" in report  # the race row, with ours / no speculation
    assert "accept_length_at_bs1" in report
    with tarfile.open(out / gpu_proof.RESULTS_ARCHIVE) as tar:
        names = set(tar.getnames())
    assert {"results/race-6.5-dflash/results.json", "results/race-baseline/results.json"} <= names
    assert sorted(os.listdir(out)) == ["gpu-proof-report.md", "gpu-proof-results.tar.gz", "gpu-proof.json"]


@pytest.mark.sglang
@pytest.mark.slow  # four servers, about 3 minutes: run it before a GPU session (--run-slow)
def test_the_race_rehearses_on_cpu(tmp_path):
    """make gpu-race's steps on SGLang's CPU engine, at two levels: SGLang's simulated
    acceptance 3 (ours, ours at B, no speculation; the built-in refuses the CPU), then the
    geometric acceptance 3 (ours and ours at B only); the report's table has every column."""
    out = rehearse(
        tmp_path,
        500,
        700,
        "--steps",
        "race-3,race-geo-3",
        "--race-concurrency",
        "1,2",
        "--race-seconds",
        "2",
        "--race-servers",
        "dflash,dflash-builtin,baseline,dflash-fixed",
    )
    records = json.loads((out / "gpu-proof.json").read_text())["steps"]
    status = {(s["name"], s["status"]) for s in records}
    for name in ("race-3 dflash", "race-3 dflash-fixed", "race-geo-3 dflash", "race-geo-3 dflash-fixed"):
        assert (name, "ok") in status, records
    assert ("race baseline", "ok") in status  # once; the second acceptance skips it
    assert not any(s["name"] == "race-geo-3 dflash-builtin" for s in records)  # ours only
    report = (out / "gpu-proof-report.md").read_text()
    assert "| 3 | 2 |" in report and "| geo-3 | 2 |" in report
    with tarfile.open(out / gpu_proof.RESULTS_ARCHIVE) as tar:
        results = tar.extractfile("results/race-geo-3-dflash/results.json").read().decode()
    assert "SGLANG_DFLASH_SIMULATE_ACC_METHOD=geometric" in results  # the servers ran it


@pytest.mark.sglang
@pytest.mark.slow  # two servers, about 100 s; a subset of the race above (gpu-first's covers race-3)
def test_the_adaptive_race_against_ours_at_b_rehearses_on_cpu(tmp_path):
    """make gpu-race's own comparison in brief: the geometric acceptance step, ours adaptive
    against ours at B, one level, through the proof's steps, servers and report (the race above
    runs every server at two levels)."""
    out = rehearse(
        tmp_path,
        300,
        400,
        "--steps",
        "race-geo-3",
        "--race-concurrency",
        "2",
        "--race-seconds",
        "1",
        "--race-servers",
        "dflash,dflash-fixed",
    )
    records = json.loads((out / "gpu-proof.json").read_text())["steps"]
    status = {(s["name"], s["status"]) for s in records}
    assert {("race-geo-3 dflash", "ok"), ("race-geo-3 dflash-fixed", "ok")} <= status, records
    table = [
        line for line in (out / "gpu-proof-report.md").read_text().splitlines() if "| geo-3 | 2 |" in line
    ]
    assert len(table) == 1 and table[0].count("|") == 11, table  # ours, ours at B, widths chosen
    with tarfile.open(out / gpu_proof.RESULTS_ARCHIVE) as tar:
        results = tar.extractfile("results/race-geo-3-dflash/results.json").read().decode()
    assert "SGLANG_DFLASH_SIMULATE_ACC_METHOD=geometric" in results


@pytest.mark.sglang
@pytest.mark.slow  # two families, two engines each, about 2 minutes: run it before a GPU session
def test_the_matrix_rehearses_on_cpu(tmp_path):
    """make gpu-matrix's step on SGLang's CPU engine, two families one after the other: each
    built, compared (batch 1, together, prefix round) and reported in the families' table; the
    draft family with its sampled and grammar requests."""
    out = rehearse(tmp_path, 500, 700, "--steps", "matrix", "--families", "gemma4,dflash2")
    records = {s["name"]: s for s in json.loads((out / "gpu-proof.json").read_text())["steps"]}
    for family in ("gemma4", "dflash2"):
        assert records[f"matrix {family}"]["status"] == "ok", records
        assert records[f"matrix {family}"]["note"].startswith("lossless: identical"), records
        assert "prefix 2/2" in records[f"matrix {family}"]["note"]
    assert "sampled chi-square p" not in records["matrix gemma4"]["note"]
    assert "grammar: 0 outside, greedy identical" in records["matrix dflash2"]["note"]
    report = (out / "gpu-proof-report.md").read_text()
    assert "## Target families (make gpu-matrix)" in report and "| gemma4 | sliding-window" in report
    assert "| gemma4: dflash overlap | sglang scheduler_e2e |" in report  # each family's start-up phases


@pytest.mark.sglang
def test_gpu_first_rehearses_on_cpu(tmp_path):
    """make gpu-first's plan in brief, in `make test`: one plain engine as the oracle of one
    DFLASH run cycling through every verify width, the race at acceptance 3 (ours and no
    speculation; the built-in refuses the CPU), the W = 1 step against the baseline and its
    table; race-more-3 without levels is skipped and says so. Left out here: race-6.5 (race-3's
    code at another acceptance) and the draft-step benchmark (CUDA only)."""
    steps = [s for s in gpu_proof.FIRST_MUST + gpu_proof.FIRST_IF_TIME if s != "race-6.5"]
    # About 260 s on a 2-core machine; the deadline leaves room for a slower one (it cut a CI run
    # short at 300 s), and the steps inside it are what a GPU's 15 minutes run.
    out = rehearse(
        tmp_path,
        600,
        720,
        "--plan",
        "first",
        "--steps",
        ",".join(steps),
        "--lossless-pairs",
        "trained",
        "--race-concurrency",
        "1",
        "--race-more-concurrency",
        "",
        "--width1-concurrency",
        "1",
        "--race-seconds",
        "1",
        "--race-servers",
        "dflash,dflash-builtin,baseline",
    )
    records = json.loads((out / "gpu-proof.json").read_text())["steps"]
    steps = {s["name"]: s for s in records}
    assert steps["lossless trained (widths)"]["note"] == "lossless: identical", records
    assert sum(s["name"].startswith("lossless") for s in records) == 1  # one step: one plain engine
    for name in ("race-3 dflash", "race baseline", "width1"):
        assert steps[name]["status"] == "ok", records
    assert "refuses the CPU" in steps["race-3 dflash-builtin"]["note"]
    assert steps["race-3 (more)"]["note"] == "no levels given"
    assert steps["bench-draft-step"]["note"] == "needs CUDA"
    report = (out / "gpu-proof-report.md").read_text()
    assert "| 3 | 1 |" in report  # the race row
    w1 = [line for line in report.splitlines() if line.startswith("| 1 |") and "x | " in line]
    assert len(w1) == 1 and w1[0].count("|") == 6, report  # the W = 1 step against the plain one
    with tarfile.open(out / gpu_proof.RESULTS_ARCHIVE) as tar:
        results = json.load(tar.extractfile(f"results/{gpu_proof.WIDTH1_FOLDER}/results.json"))
    widths = results["runs"][0]["levels"][0]["server_acceptance"]["verify_width_histogram"]
    assert {str(w) for w, n in widths.items() if n} == {"1"}, widths  # every step at width 1

"""The one-command GPU run (scripts/gpu/proof.py, `make gpu-proof`), checked on CPU: its deadline
and skip logic, its outputs after every step, the lossless verdict, and a rehearsal of the same
step list on SGLang's CPU engine, so that a broken script is found here and not on the GPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tarfile
import time

import pytest

from scripts.gpu import proof as gpu_proof
from scripts.gpu.serve import lossless

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- the lossless verdict --------------------------------------------------------------------


def test_the_near_tie_rule_scales_with_the_logits():
    """Two rounding steps at the logits' magnitude: the first differences of the random
    head_dim-128 pair on an H100 (2026-11-26), margins up to 1/16, are near-ties at logits in
    [8, 16) (a step of 1/16), not at logits near 1e-5 (random weights, steps of 2^-24)."""
    assert lossless.rounding_step(10.0, "bfloat16") == 2**-4
    assert lossless.rounding_step(0.3, "bfloat16") == 2**-9
    assert lossless.rounding_step(10.0, "float32") == 2**-20
    h100 = [0.031, 0.0, 0.031, 0.0625, 0.0, 0.0, 0.031]
    assert all(lossless.is_near_tie(m, 10.0, "bfloat16") for m in h100)
    assert not lossless.is_near_tie(0.5, 10.0, "bfloat16")  # a decisive token differs
    assert not lossless.is_near_tie(0.031, 1e-5, "bfloat16")
    assert lossless.is_near_tie(0.0, 1e-5, "bfloat16")  # an exact tie
    assert lossless.is_near_tie(0.1, None, "bfloat16") and not lossless.is_near_tie(0.2, None, "bfloat16")
    assert lossless.verdict(["identical", "near-ties only"]) == "near-ties only"
    assert lossless.verdict(["identical", False]) is False
    assert lossless.verdict(["identical"]) == "identical"


class PlainModel:
    """A deterministic greedy "model": the next token is `table[last token]`, with a margin of
    `tie_margin` after token 9 (a near-tie between 6 and 9) and 1.0 elsewhere; logprob -0.1."""

    def __init__(self, table: dict, tie_margin: float = 0.01):
        self.table, self.tie_margin = table, tie_margin

    def generate(self, prefix: list, n: int) -> "lossless.Output":
        ids, margins, last = [], [], prefix[-1]
        for _ in range(n):
            margins.append(self.tie_margin if last == 4 else 1.0)
            last = self.table[last]
            ids.append(last)
        return lossless.Output(ids, [-0.1] * n, margins)


def test_after_a_near_tie_the_comparison_resyncs_and_goes_on():
    """The plain engine: 1 -> 4 -> 6 -> 7 -> 8 -> 1 ..., where after 4 the top two (6 and 9) are
    a near-tie. DFLASH took 9 at that tie; the plain engine continued from DFLASH's tokens gives
    9 -> 3 -> 8 -> 1, so DFLASH's [4, 9, 3, 8, 1, 4] is lossless with one near-tie; the same
    output with a wrong token after the resync is caught there."""
    model = PlainModel({1: 4, 4: 6, 6: 7, 7: 8, 8: 1, 9: 3, 3: 8})
    prompt = [1]
    plain = model.generate(prompt, 6)
    assert plain.ids == [4, 6, 7, 8, 1, 4]

    def follow(got_ids, logprobs=None):
        got = lossless.Output(got_ids, logprobs or [-0.1] * len(got_ids), [1.0] * len(got_ids))
        return lossless.follow(
            got,
            plain,
            lambda prefix: model.generate(prompt + prefix, 6 - len(prefix)),
            lambda prefix: 10.0,  # logits in [8, 16): a near-tie is within 1/8
            "bfloat16",
        )

    result = follow([4, 9, 3, 8, 1, 4])
    assert result["verdict"] == "near-ties only" and result["ties"] == [(1, 0.01)]
    # Without the resync the rest of the output would differ from the plain engine's own.
    assert lossless.first_difference([4, 9, 3, 8, 1, 4][2:], plain.ids[2:]) == 0
    wrong = follow([4, 9, 3, 5, 1, 4])
    assert wrong["verdict"] is False and wrong["wrong"] == (3, 1.0, 10.0)
    assert follow([4, 6, 7, 8, 1, 4])["verdict"] == "identical"
    assert follow([4, 7, 7, 8, 1, 4])["verdict"] is False  # a difference where the margin is 1.0
    # Logprobs compared where the tokens agree: 0.25 off at position 2 (after the resync).
    shifted = follow([4, 9, 3, 8, 1, 4], [-0.1, -0.1, -0.35, -0.1, -0.1, -0.1])
    assert shifted["max_logprob_difference"] == pytest.approx(0.25)


# ---- the clock, the skips and the outputs ----------------------------------------------------


def make_proof(tmp_path, deadline: float) -> gpu_proof.Proof:
    (tmp_path / "state" / "results" / "logs").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    return gpu_proof.Proof("cpu", deadline, str(tmp_path / "state"), str(tmp_path / "out"))


def records(proof) -> dict:
    data = json.loads((pathlib.Path(proof.out) / "gpu-proof.json").read_text())
    return {s["name"]: s for s in data["steps"]}


def test_a_step_that_cannot_finish_before_the_deadline_is_skipped_and_reported(tmp_path):
    proof = make_proof(tmp_path, deadline=gpu_proof.REPORT_MARGIN + 60)
    ran = []
    proof.step("short", 5, lambda: (ran.append("short") or True, ""))
    proof.step("long", 600, lambda: (ran.append("long") or True, ""))
    assert ran == ["short"]
    steps = records(proof)
    assert steps["short"]["status"] == "ok"
    assert steps["long"]["status"] == "skipped" and "needs about 600 s" in steps["long"]["note"]
    report = (pathlib.Path(proof.out) / "gpu-proof-report.md").read_text()
    assert "| long | skipped |" in report


def test_a_child_still_running_at_the_deadline_is_cut_and_what_it_printed_is_kept(tmp_path):
    proof = make_proof(tmp_path, deadline=gpu_proof.REPORT_MARGIN + 3)
    cmd = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    start = time.monotonic()
    proof.step("sleeper", 1, lambda: (proof.run("sleeper", cmd) == 0, ""))
    assert time.monotonic() - start < 30
    assert records(proof)["sleeper"]["status"] == "cut at the deadline"
    with tarfile.open(pathlib.Path(proof.out) / gpu_proof.RESULTS_ARCHIVE) as tar:
        log = tar.extractfile("results/logs/sleeper.log").read().decode()
    assert "started" in log and "cut after" in log


def test_a_background_child_is_timed_to_its_end_not_to_its_collection(tmp_path):
    proof = make_proof(tmp_path, deadline=120)
    proof.start_background("quick", [sys.executable, "-c", "print('done')"])
    time.sleep(3)  # it ends at once; collected seconds later
    record = proof.wait_background("quick", "beside")
    assert record.status == "ok" and record.seconds < 2.5


# ---- the rehearsal -----------------------------------------------------------------------------


def rehearse(tmp_path, deadline: int, timeout: int, *args: str) -> pathlib.Path:
    """`scripts/gpu/proof.py` on SGLang's CPU engine with `args`, no bundle, under `deadline`
    seconds; it must succeed. Returns its --out folder."""
    out, state = tmp_path / "out", tmp_path / "state"
    cmd = [sys.executable, "-m", "scripts.gpu.proof", "--device", "cpu", "--out", str(out)]
    cmd += ["--state", str(state), "--bundle", str(tmp_path / "no-bundle"), "--deadline", str(deadline)]
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
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
def test_the_adaptive_race_against_ours_at_b_rehearses_on_cpu(tmp_path):
    """make gpu-race's own comparison in brief, in `make test`: the geometric acceptance step,
    ours adaptive against ours at B, one level, through the proof's steps, servers and report
    (the slow test above runs every server at two levels)."""
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


def test_the_race_table_has_ours_at_b_and_the_widths_chosen():
    """The report's race table from rows by hand: ours / built-in, / no speculation, / ours at B,
    the widths ours chose; geometric acceptance after SGLang's, without a built-in."""
    from scripts.gpu.serve.report import race_table

    def row(acc, server, c, tok_s, widths=None):
        return dict(acc=acc, server=server, concurrency=c, tok_s=tok_s, tpot_ms=10.0, widths=widths or {})

    rows = [
        row(None, "baseline", 128, 1000.0),
        row("3", "dflash", 128, 1500.0, {"4": 70, "8": 20, "1": 10}),
        row("3", "dflash-builtin", 128, 1000.0),
        row("3", "dflash-fixed", 128, 1200.0),
        row("geo-3", "dflash", 128, 1300.0, {"2": 100}),
        row("geo-3", "dflash-fixed", 128, 1000.0),
    ]
    lines = race_table(rows).splitlines()
    widths = "4 70%, 8 20%, 1 10%"
    assert (
        lines[2]
        == f"| 3 | 128 | 1000 | 1500 (10.0) | 1000 (10.0) | 1200 | 1.50x | 1.50x | 1.25x | {widths} |"
    )
    assert lines[3] == "| geo-3 | 128 | 1000 | 1300 (10.0) | - | 1000 | - | 1.30x | 1.30x | 2 100% |"


# ---- make gpu-matrix -------------------------------------------------------------------------


def test_the_rounds_add_a_prefix_cache_round_after_the_two_batches():
    ids = [[5, 6], [7, 8, 9, 10, 11, 12], [3]]
    rounds = lossless.rounds(ids, prefix_round=True)
    assert list(rounds) == ["bs1", "bs3", "prefix"]  # served in this order: the first prompt is cached
    assert rounds["prefix"] == [[5, 6, 7, 8, 9, 10], [5, 6, 3]]
    assert list(lossless.rounds(ids, prefix_round=False)) == ["bs1", "bs3"]
    assert list(lossless.rounds(ids[:1], prefix_round=True)) == ["bs1"]  # bs1 once; no other prompt


def test_the_matrix_families_come_in_the_issues_priority_order():
    from scripts.gpu.serve import families

    names = [f.name for f in families.FAMILIES]
    assert names[:6] == ["gpt_oss", "gemma4", "qwen3_moe", "qwen3_5", "deepseek_v3", "llama_fp32"]
    assert all(f.engine_args("cuda")["attention_backend"] == "triton" for f in families.FAMILIES)
    assert families.BY_NAME["llama_fp32"].engine_args("cuda")["dtype"] == "float32"
    assert families.BY_NAME["gemma4"].engine_args("cpu") == {"attention_backend": None}
    assert [f.name for f in families.select("gemma4,gpt_oss")] == ["gemma4", "gpt_oss"]
    # Then the draft families, on the dense target, each its own draft variant and flags.
    everything = families.select("")
    assert [f.name for f in everything[-4:]] == ["dflash2", "domino", "laguna_draft", "mimo_sinks"]
    assert {f.draft for f in everything[:-4]} == {"a"}
    assert families.BY_NAME["domino"].dflash_args == {"speculative_domino_candidate_pool_size": 16}
    # Sampled and grammar requests: the draft families and the float32 one.
    assert [f.name for f in everything if f.sampled] == ["llama_fp32"] + [
        f.name for f in families.DRAFT_FAMILIES
    ]
    with pytest.raises(SystemExit, match="unknown families"):
        families.select("gpt_oss,nope")


def _samples(seed: int, probabilities: list, n: int = 600) -> list:
    import random

    rng = random.Random(seed)
    return [[0] + rng.choices(range(len(probabilities)), probabilities, k=3) for _ in range(n)]


def test_the_sampled_round_fails_on_another_distribution_a_text_outside_the_grammar_or_a_greedy_difference():
    """compare_samples against its oracles: two samples of one distribution pass (the first,
    prefill, token is not tested); another distribution at the verify's positions, a
    constrained text outside the regex, or a greedy difference not at a near-tie fails."""
    greedy = lossless.Output([5, 6, 7], [-0.1] * 3, [2.0, 2.0, 0.01])

    def run(samples, texts=("ab", "cdh"), ids=(5, 6, 7)):
        return {
            "samples": samples,
            "constrained": list(texts),
            "greedy_constrained": lossless.Output(list(ids), [-0.1] * 3, [2.0] * 3),
            "accept_length_sampled": 2.0,
        }

    plain = run(_samples(0, [0.4, 0.3, 0.2, 0.1]))
    same = lossless.compare_samples(
        run(_samples(1, [0.4, 0.3, 0.2, 0.1])), dict(plain, greedy_constrained=greedy), "bfloat16"
    )
    assert same["sampled_ok"] and lossless.samples_verdict(same) == "identical"
    other = lossless.compare_samples(run(_samples(1, [0.25] * 4)), plain, "bfloat16")
    assert not other["sampled_ok"] and lossless.samples_verdict(other) is False
    outside = lossless.compare_samples(
        run(_samples(1, [0.4, 0.3, 0.2, 0.1]), texts=("ab", "abcd")), plain, "bfloat16"
    )
    assert outside["constrained_outside_grammar"] == ["abcd"] and lossless.samples_verdict(outside) is False
    plain = dict(plain, greedy_constrained=greedy)
    wrong = lossless.compare_samples(run(_samples(1, [0.4, 0.3, 0.2, 0.1]), ids=(5, 9, 7)), plain, "bfloat16")
    assert wrong["greedy_constrained"] == "differs at token 1" and lossless.samples_verdict(wrong) is False
    tie = lossless.compare_samples(run(_samples(1, [0.4, 0.3, 0.2, 0.1]), ids=(5, 6, 9)), plain, "bfloat16")
    assert tie["greedy_constrained"] == "near-tie" and lossless.samples_verdict(tie) == "near-ties only"


def test_a_familys_row_says_what_its_comparison_found(tmp_path):
    results = {
        "dtype": "bfloat16",
        "lossless": "near-ties only",
        "runs": {
            "dflash overlap": {
                "startup_s": 40.1,
                "proposals": "argmax",
                "accept_length_at_bs1": 2.5,
                "accept_length_at_bs6": 2.25,
                "identical_at_bs1": "6/6",
                "max_logprob_difference_at_bs1": 0.01,
                "identical_at_bs6": "5/6",
                "max_logprob_difference_at_bs6": 0.03,
                "near_ties_at_bs6": ["token 9: plain's top-2 margin 0.0312"],
                "sampled": {
                    "sampled_chi_square_p": [0.21, 0.09, 0.5],
                    "sampled_ok": True,
                    "constrained_outside_grammar": [],
                    "greedy_constrained": "identical",
                },
            },
            "plain": {"startup_s": 30.0},
        },
    }
    path = tmp_path / "matrix-gemma4.json"
    path.write_text(json.dumps(results))
    note = gpu_proof.family_note(str(path))
    assert note == (
        "lossless: near-ties only; bfloat16; identical bs1 6/6, bs6 5/6; near-ties 1; "
        "max logprob difference 0.03; acceptance 2.50 / 2.25; start-up dflash overlap 40.1 s, plain 30.0 s; "
        "sampled chi-square p 0.21, 0.09, 0.5; grammar: 0 outside, greedy identical; proposals: argmax"
    )
    assert gpu_proof.family_note(str(tmp_path / "missing.json")) == "no results"


def test_a_margin_is_counted_in_rounding_steps_at_the_logits_magnitude():
    import torch

    from scripts.gpu.serve import families

    token, steps = families.margin_steps(torch.tensor([9.95, 10.0, 3.0]), "bfloat16")
    assert token == 1 and steps == pytest.approx(0.8, abs=1e-4)  # 0.05 at a step of 1/16
    # In float32 the same margin is 0.05 * 2^20 steps: no tie.
    assert families.margin_steps(torch.tensor([9.95, 10.0, 3.0]), "float32")[1] > 5e4


def test_the_near_tie_rate_is_measured_on_the_familys_target(tmp_path):
    """A favoured dense target has few near-ties at its greedy choices; the same target with its
    LM head zeroed (every logit equal) has one at every position: the count can fail."""
    import torch
    from safetensors.torch import load_file, save_file

    from scripts.gpu.serve import families

    target, _ = families.build(str(tmp_path), families.BY_NAME["llama_fp32"])
    prompts = lossless.random_prompts(384, 2)
    found = families.near_ties(target, prompts, 4)
    assert found["positions"] == 8 and found["near_ties"] <= 2
    file = os.path.join(target, "model.safetensors")
    weights = load_file(file)
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, file, metadata={"format": "pt"})
    assert families.near_ties(target, prompts, 4)["near_ties"] == 8


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

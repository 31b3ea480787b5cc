"""The one-command GPU run (tests/gpu_kit/proof.py, `make gpu-proof`), checked on CPU: its deadline
and skip logic, its outputs after every step, the lossless verdict, and a rehearsal of the same
step list on SGLang's CPU engine, so that a broken script is found here and not on the GPU."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tarfile
import time

import pytest

from tests.gpu_kit import proof as gpu_proof
from tests.gpu_kit.serve import lossless
from tests.support import paths

ROOT = paths.REPO


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


def test_the_race_table_has_ours_at_b_and_the_widths_chosen():
    """The report's race table from rows by hand: ours / built-in, / no speculation, / ours at B,
    the widths ours chose; geometric acceptance after SGLang's, without a built-in."""
    from tests.gpu_kit.serve.report import race_table

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
    from tests.gpu_kit.serve import families

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

    from tests.gpu_kit.serve import families

    token, steps = families.margin_steps(torch.tensor([9.95, 10.0, 3.0]), "bfloat16")
    assert token == 1 and steps == pytest.approx(0.8, abs=1e-4)  # 0.05 at a step of 1/16
    # In float32 the same margin is 0.05 * 2^20 steps: no tie.
    assert families.margin_steps(torch.tensor([9.95, 10.0, 3.0]), "float32")[1] > 5e4


def test_the_near_tie_rate_is_measured_on_the_familys_target(tmp_path):
    """A favoured dense target has few near-ties at its greedy choices; the same target with its
    LM head zeroed (every logit equal) has one at every position: the count can fail."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.gpu_kit.serve import families

    target, _ = families.build(str(tmp_path), families.BY_NAME["llama_fp32"])
    prompts = lossless.random_prompts(384, 2)
    found = families.near_ties(target, prompts, 4)
    assert found["positions"] == 8 and found["near_ties"] <= 2
    file = os.path.join(target, "model.safetensors")
    weights = load_file(file)
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, file, metadata={"format": "pt"})
    assert families.near_ties(target, prompts, 4)["near_ties"] == 8


# ---- make gpu-first --------------------------------------------------------------------------


def test_gpu_firsts_must_run_part_fits_its_deadline_by_the_cuda_estimates():
    """make gpu-first's plan: its must-run part (the prerequisites, lossless, the race at 3 from
    1 to 256 with every server) is held by the 540 s deadline by the H100 estimates, unpack and
    the report's margin included; the if-time steps come after it, in the issue's order."""
    args = gpu_proof.parse_args(["--plan", "first"])
    steps = args.steps.split(",")
    assert steps == [*gpu_proof.FIRST_MUST, *gpu_proof.FIRST_IF_TIME]
    assert steps[:2] == ["lossless-widths", "race-3"] and steps[-1] == "bench-draft-step"
    assert args.race_concurrency == "1,32,128,256" and args.race_more_concurrency == "8,64"
    assert args.race_servers == "dflash,dflash-builtin,baseline" and args.bench_batch_sizes == "1"
    must = gpu_proof.plan_estimates("cuda", gpu_proof.FIRST_MUST, args)
    assert list(must)[:3] == ["unpack", "models", "import SGLang"]
    assert {"race-3 dflash", "race-3 dflash-builtin", "race-3 baseline"} <= set(must)
    # one engine per pair and its run: a plain one and one DFLASH (10 s: the oracle's load)
    assert must["lossless-widths trained"] == 10 + 2 * gpu_proof.ESTIMATES["cuda"]["lossless-engine"]
    total = sum(must.values()) + gpu_proof.REPORT_MARGIN
    assert total <= args.deadline == 540, must
    whole = gpu_proof.plan_estimates("cuda", steps, args)
    assert "race-6.5 baseline" not in whole  # measured once, by race-3


def test_a_race_servers_estimate_is_its_start_up_and_its_levels():
    """55 s, then each level and its drain: the H100's 3 levels of 10 s (83-92 s measured) at 100."""
    assert gpu_proof.race_estimate("cuda", 3, 10.0) == 100
    assert gpu_proof.race_estimate("cuda", 4, 6.0) == 99


def test_the_w1_table_and_a_second_set_of_levels_in_the_report(tmp_path):
    """race-<acc>-<server>@<tag> folders join the race table; race-width1 is its own table, the
    baseline's throughput over ours at W = 1 (the step time ratio), within 3% or not."""
    from tests.gpu_kit.serve import report

    def results(folder, levels):
        path = tmp_path / folder
        path.mkdir()
        summary = lambda tok: dict(output_throughput=tok, tpot_ms=dict(mean=5.0), requests=4, completed=4)  # noqa: E731
        runs = [dict(levels=[dict(concurrency=c, summary=summary(t)) for c, t in levels])]
        (path / "results.json").write_text(json.dumps(dict(runs=runs)))

    results("race-baseline", [(1, 100.0), (32, 1000.0)])
    results("race-3-dflash@more", [(8, 700.0)])
    results(gpu_proof.WIDTH1_FOLDER, [(1, 98.0), (32, 950.0)])
    rows = report.race_rows(str(tmp_path))
    assert {(r["acc"], r["server"], r["concurrency"]) for r in rows if r["server"] != "baseline"} == {
        ("3", "dflash", 8),
        (None, "width1", 1),
        (None, "width1", 32),
    }
    assert "| 3 | 8 | - | 700 (5.0) |" in report.race_table(rows)
    lines = report.width1_table(rows).splitlines()
    assert lines[2] == "| 1 | 100 (5.0) | 98 (5.0) | 1.020x | yes |"
    assert lines[3] == "| 32 | 1000 (5.0) | 950 (5.0) | 1.053x | no |"


def test_the_widths_run_takes_width_1_through_the_forward_its_pair_asks_for(tmp_path):
    """gpu-first's lossless runs: the trained pair's steps at W = 1 replay width 1's verify graph,
    the random pair's take the target's decode forward (SGLANG_DFLASH_WIDTH1_FORWARD=decode),
    each only inside its widths run, the environment put back after."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"block_size": 8}))
    os.environ.pop("SGLANG_DFLASH_WIDTH1_FORWARD", None)
    with lossless.run_env("dflash widths", str(draft), "cuda", "decode"):
        assert os.environ["SGLANG_DFLASH_TEST_WIDTHS"] == "1,2,4,8"
        assert os.environ["SGLANG_DFLASH_WIDTH1_FORWARD"] == "decode"
    assert "SGLANG_DFLASH_WIDTH1_FORWARD" not in os.environ and "SGLANG_DFLASH_TEST_WIDTHS" not in os.environ
    with lossless.run_env("dflash widths", str(draft), "cuda"):
        assert "SGLANG_DFLASH_WIDTH1_FORWARD" not in os.environ
    proof = gpu_proof.Proof(device="cuda", deadline=540, state=str(tmp_path), out=str(tmp_path))
    pairs = gpu_proof.lossless_pairs(proof)
    assert pairs["random"][2] == ["--width1-forward", "decode"]
    assert "--width1-forward" not in pairs["trained"][2]


def test_the_matrix_runs_a_hybrid_target_alone(tmp_path, monkeypatch):
    """Up to --matrix-parallel families at once, but a hybrid target's engines with no other
    family's beside them: it sizes its Mamba pool from the device memory free as it measures."""
    proof = gpu_proof.Proof(device="cuda", deadline=10**6, state=str(tmp_path), out=str(tmp_path))
    running, beside = set(), {}

    def start(name, cmd, env=None):
        running.add(name)
        beside[name] = set(running) - {name}

    def wait(name, why):
        running.discard(name)
        return gpu_proof.StepRecord(name, "failed")

    monkeypatch.setattr(proof, "start_background", start)
    monkeypatch.setattr(proof, "wait_background", wait)
    monkeypatch.setattr(proof, "write", lambda: None)
    monkeypatch.setattr(gpu_proof, "missing_op", lambda path: "")
    gpu_proof.matrix(proof, "gpt_oss,gemma4,qwen3_5,qwen3_next,qwen3_moe,dflash2", 3)
    assert beside["matrix gemma4"] == {"matrix gpt_oss"}  # two plain families together
    assert beside["matrix qwen3_5"] == set() and beside["matrix qwen3_next"] == set()
    assert beside["matrix qwen3_moe"] == set()  # started after the hybrid one ended
    assert beside["matrix dflash2"] == {"matrix qwen3_moe"}

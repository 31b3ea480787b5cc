"""`sglang_dflash.verify.sampling` against oracles: plain per-row code, SGLang's own sampler functions
and penalizers, the Triton murmur kernel, and analytic distributions.

Statistical tests. Each draws N independent trials of one or two verify steps over a bigram
target and compares the observed counts with the analytic law by Pearson's chi-square, at a
per-check false-alarm rate ALPHA = 1e-6 (threshold = chi2 upper quantile at ALPHA, with cells of
expected count < 5 pooled). Fixed seeds make every run identical; the thresholds are what a
random seed would be held to. There are 2 checks (joint of the first two emitted tokens,
acceptance length) per (filter, proposal, noise) case: 7 x 3 x 2 x 2 = 84 checks, so the
family-wise false-alarm rate is <= 84e-6. Cells with expected count 0 must be observed 0 times,
exactly. `test_harness_detects_*` run the same checks on deliberately wrong rules and require
them to fail, which shows the checks have power.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.verify import penalties, sampling
from sglang_dflash.verify.acceptance import greedy_verify
from sglang_dflash.verify.penalties import PenaltyParams, commit_output_counts, penalize_block_logits
from sglang_dflash.verify.sampling import (
    MEMORY_ENV,
    TOP_K_ALL,
    SamplingRows,
    filtered_probs,
    murmur_hash32,
    rows_per_draw,
    sample_target_tokens,
    sampled_verify,
)

ALPHA = 1e-6
N_TRIALS = 40_000
WIDTH = 4  # B: bonus + 3 proposals


@pytest.fixture(scope="module")
def sglang_sampler():
    """SGLang's sampler module (imports sglang: ~8 s, once)."""
    from sglang.srt.layers import sampler

    return sampler


def rows_of(temperatures, top_ks, top_ps, min_ps, seeds=None, need_filter=True) -> SamplingRows:
    return SamplingRows(
        temperatures=torch.as_tensor(temperatures, dtype=torch.float32),
        top_ks=torch.as_tensor(top_ks, dtype=torch.int32),
        top_ps=torch.as_tensor(top_ps, dtype=torch.float32),
        min_ps=torch.as_tensor(min_ps, dtype=torch.float32),
        seeds=None if seeds is None else torch.as_tensor(seeds, dtype=torch.int64),
        need_filter=need_filter,
    )


# ------------------------------------------------------------------------------------------
# The filtered distribution


def oracle_filtered(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float):
    """One row of SGLang's pytorch-backend distribution, written plainly in float64.

    Returns (probs, margin): margin is the distance of the closest top-p / min-p comparison from
    its threshold, so callers can skip rows that float32 rounding could decide either way.
    """
    z = [v / temperature for v in logits]
    top = max(z)
    e = [math.exp(v - top) for v in z]
    p = [v / sum(e) for v in e]
    if top_k == TOP_K_ALL and top_p == 1.0 and min_p == 0.0:
        return p, math.inf
    order = sorted(range(len(p)), key=lambda i: -p[i])
    threshold = min_p * p[order[0]]  # the max probability survives top-k and top-p
    keep, before, margin = set(), 0.0, math.inf
    for rank, i in enumerate(order):
        if rank < top_k and before <= top_p and p[i] >= threshold:
            keep.add(i)
        if rank < top_k and p[i] >= threshold:  # the top-p comparison decides this token
            margin = min(margin, abs(before - top_p))
        if rank < top_k and before <= top_p and min_p > 0:  # the min-p comparison decides it
            margin = min(margin, abs(p[i] - threshold))
        before += p[i]
    total = sum(p[i] for i in keep)
    return [p[i] / total if i in keep else 0.0 for i in range(len(p))], margin


# name: (top_k, top_p, min_p). With the statistical tests' SHAPES, every filter of a combination
# is the one that binds in some context (test_each_filter_of_a_combination_binds).
FILTERS = {
    "temperature": (TOP_K_ALL, 1.0, 0.0),
    "top_k": (3, 1.0, 0.0),
    "top_p": (TOP_K_ALL, 0.72, 0.0),
    "min_p": (TOP_K_ALL, 1.0, 0.2),
    "top_k+top_p": (3, 0.72, 0.0),
    "top_p+min_p": (TOP_K_ALL, 0.72, 0.2),
    "all_three": (3, 0.72, 0.2),
}


@pytest.mark.parametrize("name", [*FILTERS, "greedy", "mixed"])
def test_filtered_probs_matches_plain_oracle(name):
    g = torch.Generator().manual_seed(1)
    n, vocab = 64, 50
    logits = torch.randn(n, vocab, generator=g) * 2.5
    temperatures = torch.rand(n, generator=g) * 1.5 + 0.2
    if name == "greedy":
        params = [(1, 1.0, 0.0)] * n
    elif name == "mixed":  # every row its own parameters
        params = [
            (int(k), float(p), float(m))
            for k, p, m in zip(
                torch.randint(1, 30, (n,), generator=g),
                torch.rand(n, generator=g) * 0.9 + 0.1,
                torch.rand(n, generator=g) * 0.5,
            )
        ]
        params[::5] = [(TOP_K_ALL, 1.0, 0.0)] * len(params[::5])
    else:
        params = [FILTERS[name]] * n
    top_ks, top_ps, min_ps = (list(c) for c in zip(*params))
    got = filtered_probs(
        logits, temperatures, torch.tensor(top_ks), torch.tensor(top_ps), torch.tensor(min_ps)
    )
    checked = 0
    for i in range(n):
        want, margin = oracle_filtered(logits[i].tolist(), float(temperatures[i]), *params[i])
        if margin < 1e-5:  # float32 vs float64 could legitimately disagree at this boundary
            continue
        want = torch.tensor(want, dtype=torch.float32)
        assert torch.equal(got[i] > 0, want > 0), f"row {i}: support differs"
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)
        checked += 1
    assert checked >= n - 2


def test_top_k_and_top_p_are_joint_not_sequential():
    # probs [.4, .3, .2, .1], top_k 2, top_p .5: top-p judged on the original probabilities keeps
    # both top-2 tokens (.4 <= .5 before the second); sequential would renormalise to
    # [.57, .43] first and keep only the first (.57 > .5).
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    got = filtered_probs(logits, torch.ones(1), torch.tensor([2]), torch.tensor([0.5]), torch.zeros(1))
    torch.testing.assert_close(got, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_min_p_is_relative_to_the_max_probability():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    got = filtered_probs(logits, torch.ones(1), torch.tensor([TOP_K_ALL]), torch.ones(1), torch.tensor([0.4]))
    torch.testing.assert_close(got, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))  # threshold .2


def test_filtered_probs_matches_sglang_torch_sampler_including_ties(sglang_sampler):
    g = torch.Generator().manual_seed(2)
    n, vocab = 48, 40
    logits = torch.randn(n, vocab, generator=g) * 2
    # Ties at the boundaries: equal logits straddling rank top_k and the top-p cut.
    logits[:16, 1:6] = logits[:16, 0:1]
    logits[16:32, ::2] = logits[16:32, :1]
    temperatures = torch.rand(n, generator=g) + 0.3
    top_ks = torch.randint(1, 12, (n,), generator=g, dtype=torch.int32)
    top_ks[::3] = TOP_K_ALL
    top_ps = torch.rand(n, generator=g) * 0.8 + 0.2
    min_ps = torch.rand(n, generator=g) * 0.4
    min_ps[::2] = 0.0
    # SGLang's Sampler.forward: logits.div_(temperatures); softmax; the pytorch-backend filter.
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    # Rows 32..39: top_p equal to the mass before rank 3, exactly (in float32): rank 3 is kept
    # (the torch path's "<= top_p"; FlashInfer's smallest-prefix rule would drop it).
    sorted_probs = probs.sort(dim=-1, descending=True).values
    top_ps[32:40] = (torch.cumsum(sorted_probs, -1) - sorted_probs)[32:40, 3]
    top_ks[32:40], min_ps[32:40] = TOP_K_ALL, 0.0
    _, weights, token_ids, _ = sglang_sampler.top_k_top_p_min_p_sampling_from_probs_torch(
        probs, top_ks, top_ps, min_ps, True, None, None, return_filtered_probs=True
    )
    want = torch.zeros_like(probs).scatter_(1, token_ids.long(), weights / weights.sum(-1, keepdim=True))
    got = filtered_probs(logits, temperatures, top_ks, top_ps, min_ps)
    assert torch.equal(got, want)
    assert ((got[32:40] > 0).sum(-1) == 4).all()


def test_top_k_all_constant_matches_sglang(sglang_sampler):
    from sglang.srt.sampling.sampling_params import TOP_K_ALL as SGLANG_TOP_K_ALL

    assert TOP_K_ALL == SGLANG_TOP_K_ALL


# ------------------------------------------------------------------------------------------
# Seeded noise: bit-identical to SGLang


def test_murmur_hash_matches_sglang_triton_kernel():
    """Runs SGLang's Triton murmur kernel in the Triton interpreter (a subprocess, ~6 s)."""
    seeds = [0, 1, 42, -1, 2**40 + 7, -(2**63), 2**63 - 1, 0x123456789ABCDEF0]
    positions = [0, 7, 123456, 2**31 + 5, 2**32 + 3, 5, 99, 2**40]
    cols = list(range(0, 70000, 997))
    script = (
        "import json, sys, torch\n"
        "from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32_kernel\n"
        "s, p, c = (torch.tensor(v, dtype=torch.int64) for v in json.loads(sys.argv[1]))\n"
        "out = torch.empty((len(s), len(c)), dtype=torch.uint32)\n"
        "murmur_hash32_kernel[(len(s), 1)](s, p, c, out, len(s), len(c), BLOCK_SIZE=128)\n"
        "print(json.dumps(out.to(torch.int64).tolist()))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps([seeds, positions, cols])],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if run.returncode != 0 and "interpret" in run.stderr.lower():
        pytest.skip(f"Triton interpreter unavailable: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    want = torch.tensor(json.loads(run.stdout.strip().splitlines()[-1]))
    got = murmur_hash32(torch.tensor(seeds), torch.tensor(positions), torch.tensor(cols))
    assert torch.equal(got, want)


def test_seeded_gumbel_is_finite_at_the_hash_extremes(monkeypatch):
    extremes = torch.tensor([[0, 1, 2**31, 2**32 - 2, 2**32 - 1]])
    monkeypatch.setattr(sampling, "murmur_hash32", lambda *args: extremes)
    got = sampling.seeded_gumbel(torch.zeros(1), torch.zeros(1), torch.arange(5))
    # multinomial_with_seed: x = h / (2**32 - 1); -log(-clamp(log x, min=float64 min, max=-2**-32))
    x = [h / 4294967295 for h in extremes[0].tolist()]
    logs = [max(min(math.log(v) if v > 0 else -math.inf, -(2.0**-32)), -1.7976931348623157e308) for v in x]
    want = torch.tensor([[-math.log(-v) for v in logs]], dtype=torch.float64)
    assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.fixture
def sglang_seeded(sglang_sampler, monkeypatch):
    """SGLang's seeded sampling on CPU: our murmur (checked above against the Triton kernel) for
    `sgl_kernel.murmur_hash32_cpu`, and `multinomial_with_seed` without torch.compile."""
    monkeypatch.setattr(sglang_sampler, "murmur_hash32", murmur_hash32)
    monkeypatch.setattr(
        sglang_sampler, "multinomial_with_seed", sglang_sampler.multinomial_with_seed.__wrapped__
    )
    return sglang_sampler


def test_seeded_draws_equal_sglang_filter_path(sglang_seeded):
    g = torch.Generator().manual_seed(3)
    n, vocab = 256, 60
    logits = torch.randn(n, vocab, generator=g) * 2
    temperatures = torch.rand(n, generator=g) + 0.3
    top_ks = torch.randint(2, 30, (n,), generator=g, dtype=torch.int32)
    top_ps = torch.rand(n, generator=g) * 0.7 + 0.3
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=g)
    positions = torch.randint(0, 2**33, (n,), generator=g)
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    # min_p off: SGLang's pytorch path asserts when min_p meets a seed (layers/sampler.py:829-833).
    want = sglang_seeded.top_k_top_p_min_p_sampling_from_probs_torch(
        probs, top_ks, top_ps, torch.zeros(n), False, seeds, positions
    )
    rows = rows_of(temperatures, top_ks, top_ps, torch.zeros(n), seeds)
    got = sample_target_tokens(logits, rows, positions)
    assert torch.equal(got, want.long())


@pytest.mark.parametrize("need_filter", [False, True])
def test_seeded_draws_equal_sglang_simple_path(sglang_seeded, need_filter):
    g = torch.Generator().manual_seed(4)
    n, vocab = 256, 60
    logits = torch.randn(n, vocab, generator=g) * 2
    temperatures = torch.rand(n, generator=g) + 0.3
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=g)
    positions = torch.randint(0, 2**20, (n,), generator=g)
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    want = sglang_seeded.sampling_from_probs_torch(probs, seeds, positions)
    rows = rows_of(temperatures, [TOP_K_ALL] * n, [1.0] * n, [0.0] * n, seeds, need_filter)
    got = sample_target_tokens(logits, rows, positions)
    assert torch.equal(got, want.long())


# ------------------------------------------------------------------------------------------
# Verify contract, greedy rows, reproducibility


def test_certain_target_accepts_the_matching_prefix():
    # One-hot targets: the target surely emits 8, 2, 7, 1 after the four window positions.
    candidates = torch.tensor([[5, 8, 2, 4]])
    logits = torch.full((1, 4, 10), -1e4)
    logits[0, torch.arange(4), torch.tensor([8, 2, 7, 1])] = 0.0
    rows = rows_of([1.0], [TOP_K_ALL], [1.0], [0.0])
    accept_len, out_tokens, bonus = sampled_verify(candidates, logits, rows)
    assert accept_len.tolist() == [2] and bonus.tolist() == [7]
    assert out_tokens.tolist() == [[8, 2, 7, 0]]


def test_greedy_rows_equal_greedy_verify_in_a_mixed_batch():
    g = torch.Generator().manual_seed(5)
    bs, vocab = 12, 300
    logits = torch.randn(bs, WIDTH, vocab, generator=g)
    # 99 tied maxima: argmax takes the first (token 5); top_k 1 would take torch.sort's first.
    logits[:, :, 5::3] = logits.amax(-1, keepdim=True) + 1
    predict = logits.argmax(-1)
    # Greedy rows propose the target's argmax with one error at a varying place.
    candidates = torch.cat([torch.randint(0, vocab, (bs, 1), generator=g), predict[:, :-1]], dim=1)
    candidates[torch.arange(bs), 1 + torch.arange(bs) % (WIDTH - 1)] += 1
    candidates %= vocab
    greedy = torch.arange(bs) % 2 == 0
    top_ks = torch.where(greedy, 1, 5).to(torch.int32)
    rows = rows_of(torch.where(greedy, 1.0, 0.9), top_ks, torch.full((bs,), 0.8), torch.zeros(bs))
    want = greedy_verify(candidates, predict)
    for seed in range(5):
        got = sampled_verify(candidates, logits, rows, generator=torch.Generator().manual_seed(seed))
        for w, o in zip(want, got):
            assert torch.equal(o[greedy], w[greedy])
        accept_len, out_tokens, bonus = got
        cols = torch.arange(WIDTH)[None, :]
        assert torch.all(out_tokens[cols > accept_len[:, None]] == 0)
        assert torch.equal(out_tokens.gather(1, accept_len[:, None]).squeeze(1), bonus)


def _random_block(seed: int, bs: int = 6, vocab: int = 30):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, WIDTH, vocab, generator=g) * 2
    candidates = torch.randint(0, vocab, (bs, WIDTH), generator=g)
    candidates[:, 1:] = logits[:, :-1].argmax(-1)  # likely proposals: acceptances happen
    positions = torch.randint(0, 1000, (bs, 1), generator=g) + torch.arange(WIDTH)
    return logits, candidates, positions


def test_seeded_verify_is_reproducible_and_independent_of_the_batch():
    logits, candidates, positions = _random_block(6)
    bs = logits.shape[0]
    seeds = torch.arange(bs) * 7919 + 11
    filters = dict(top_ks=[TOP_K_ALL, 4, TOP_K_ALL, 1, 8, TOP_K_ALL], top_ps=[1.0, 0.9, 0.7, 1.0, 1.0, 1.0])
    rows = rows_of([0.8] * bs, filters["top_ks"], filters["top_ps"], [0.0, 0.0, 0.1, 0, 0.05, 0], seeds)
    first = sampled_verify(candidates, logits, rows, positions)
    again = sampled_verify(candidates, logits, rows, positions)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # Each request alone (an unfiltered row alone skips the sort: need_filter False), and the
    # batch reversed: the same tokens.
    for i in range(bs):
        one = SamplingRows(
            rows.temperatures[i : i + 1],
            rows.top_ks[i : i + 1],
            rows.top_ps[i : i + 1],
            rows.min_ps[i : i + 1],
            seeds[i : i + 1],
            need_filter=bool(sampling._row_has_filter(rows.top_ks, rows.top_ps, rows.min_ps)[i]),
        )
        alone = sampled_verify(candidates[i : i + 1], logits[i : i + 1], one, positions[i : i + 1])
        assert all(torch.equal(a[0], f[i]) for a, f in zip(alone, first))
    flip = torch.arange(bs - 1, -1, -1)
    flipped_rows = rows_of(
        rows.temperatures[flip], rows.top_ks[flip], rows.top_ps[flip], rows.min_ps[flip], seeds[flip]
    )
    flipped = sampled_verify(candidates[flip], logits[flip], flipped_rows, positions[flip])
    assert all(torch.equal(a, f[flip]) for a, f in zip(flipped, first))
    # A different seed changes the draws (the seed is used at all).
    other = rows_of(rows.temperatures, rows.top_ks, rows.top_ps, rows.min_ps, seeds + 1)
    draws = [
        sample_target_tokens(logits.reshape(-1, 30), r.repeat_rows(WIDTH), positions.reshape(-1))
        for r in (rows, other)
    ]
    assert not torch.equal(*draws)


def test_unseeded_verify_is_reproducible_with_the_same_generator():
    logits, candidates, _ = _random_block(7)
    rows = rows_of([1.0] * 6, [TOP_K_ALL] * 6, [0.9] * 6, [0.0] * 6)
    runs = [
        sampled_verify(candidates, logits, rows, generator=torch.Generator().manual_seed(9)) for _ in range(2)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_seeded_mode_requires_positions():
    logits, candidates, _ = _random_block(8)
    rows = rows_of([1.0] * 6, [TOP_K_ALL] * 6, [1.0] * 6, [0.0] * 6, seeds=list(range(6)))
    with pytest.raises(ValueError, match="positions"):
        sampled_verify(candidates, logits, rows)


def test_rows_from_sampling_info():
    info = SimpleNamespace(
        temperatures=torch.tensor([[0.7], [1.0]]),
        top_ks=torch.tensor([TOP_K_ALL, 1], dtype=torch.int32),
        top_ps=torch.tensor([0.9, 1.0]),
        min_ps=torch.zeros(2),
        sampling_seed=None,
        need_top_k_sampling=True,
        need_top_p_sampling=True,
        need_min_p_sampling=False,
    )
    rows = SamplingRows.from_sampling_info(info)
    assert rows.temperatures.shape == (2,) and rows.need_filter
    assert rows.is_greedy.tolist() == [False, True]
    assert rows.repeat_rows(3).top_ks.tolist() == [TOP_K_ALL] * 3 + [1] * 3


# ------------------------------------------------------------------------------------------
# Statistical tests: the emitted tokens follow the target's law


VOCAB = 7  # tokens 0..5 carry a SHAPE in a per-context order; token 6 has logit -inf everywhere
# Target probabilities after temperature, one shape per context. With FILTERS' values:
# flat -> top_k binds (top-p keeps 4, min-p 6); peaked -> min_p binds (1; top-p keeps 2);
# two_head -> top_p binds (2; top-k keeps 3, min-p 4). Every margin to a threshold is >= .02.
SHAPES = {
    "flat": [0.2, 0.19, 0.18, 0.17, 0.14, 0.12],
    "peaked": [0.7, 0.12, 0.08, 0.05, 0.03, 0.02],
    "two_head": [0.4, 0.34, 0.11, 0.1, 0.03, 0.02],
}
CONTEXT_SHAPES = ["flat", "peaked", "two_head", "flat", "peaked", "two_head", "flat"]
TEMPERATURE = 0.8
BONUS = 2  # the window's first candidate (emitted by the previous step)
BONUS_ORDER = [0, 1, 4, 3, 5, 2]  # after BONUS the likely tokens lead to flat and peaked contexts


def bigram_logits() -> torch.Tensor:
    """[VOCAB, VOCAB]: row x = target logits after token x (its shape in a random token order)."""
    g = torch.Generator().manual_seed(10)
    table = torch.full((VOCAB, VOCAB), -math.inf)
    for x in range(VOCAB):
        order = torch.tensor(BONUS_ORDER) if x == BONUS else torch.randperm(6, generator=g)
        table[x, order] = torch.tensor(SHAPES[CONTEXT_SHAPES[x]]).log() * TEMPERATURE
    return table


def analytic_conditionals(table: torch.Tensor, flt: tuple) -> torch.Tensor:
    """[VOCAB, VOCAB] float64 from the plain oracle: row x = filtered target law after x."""
    return torch.tensor(
        [oracle_filtered(table[x].tolist(), TEMPERATURE, *flt)[0] for x in range(VOCAB)], dtype=torch.float64
    )


def proposal_table(cond: torch.Tensor, kind: str) -> torch.Tensor:
    """[VOCAB] draft: the proposal after each token (a deterministic draft, like DFlash's argmax)."""
    table = []
    for x in range(VOCAB):
        p = cond[x]
        support = [t for t in range(VOCAB) if p[t] > 0]
        if kind == "likely":
            table.append(int(p.argmax()))
        elif kind == "unlikely":
            table.append(min(support, key=lambda t: float(p[t])))
        else:  # outside: a filtered-out token with raw mass if there is one, else the -inf token
            outside = [t for t in range(6) if p[t] == 0]
            table.append(outside[-1] if outside else 6)
    return torch.tensor(table)


def chi2_test(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """Pearson's statistic of counts against probabilities, its threshold at ALPHA, and the count
    observed in zero-probability cells (which must be 0). Cells expected < 5 times are pooled."""
    from scipy.stats import chi2

    observed, probs = observed.flatten().double(), probs.flatten().double()
    possible = probs > 0
    expected = probs * observed.sum()
    small = (expected < 5) & possible
    big = possible & ~small
    obs = torch.cat([observed[big], observed[small].sum()[None]])
    exp = torch.cat([expected[big], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    # A single possible outcome leaves nothing to test but the zero cells.
    threshold = float(chi2.isf(ALPHA, len(exp) - 1)) if len(exp) > 1 else math.inf
    return stat, threshold, int(observed[~possible].sum())


def simulate(verify, table, draft, flt, seeded: bool):
    """N independent trials: (first emitted token, second emitted token, accept_len of step 1).

    Step 1 verifies [BONUS, d1, d2, d3]. When it accepts nothing, the second token comes from a
    second step whose window starts at the first token. Trial i uses seed i (seeded mode).
    """
    n = N_TRIALS
    rows = rows_of(
        [TEMPERATURE] * n, [flt[0]] * n, [flt[1]] * n, [flt[2]] * n, torch.arange(n) if seeded else None
    )
    generator = torch.Generator().manual_seed(11)

    def window(first: torch.Tensor) -> torch.Tensor:
        cols = [first]
        for _ in range(WIDTH - 1):
            cols.append(draft[cols[-1]])
        return torch.stack(cols, dim=1)  # [n, B]

    start = torch.full((n,), 100)
    cand1 = window(torch.full((n,), BONUS))
    acc1, out1, _ = verify(cand1, table[cand1], rows, start[:, None] + torch.arange(WIDTH), generator)
    # The second step's window starts at the new bonus, at position start + acc1 + 1.
    cand2 = window(out1[:, 0])
    pos2 = (start + 1)[:, None] + torch.arange(WIDTH)
    _, out2, _ = verify(cand2, table[cand2], rows, pos2, generator)
    second = torch.where(acc1 >= 1, out1[:, 1], out2[:, 0])
    return out1[:, 0], second, acc1


def law_checks(verify, flt, kind, seeded) -> list[tuple[str, float, float, int]]:
    """(check, statistic, threshold, outside-support count) for the joint law of the first two
    emitted tokens and for the law of step 1's accept_len."""
    table = bigram_logits()
    cond = analytic_conditionals(table, flt)
    draft = proposal_table(cond, kind)
    first, second, acc = simulate(verify, table, draft, flt, seeded)
    joint_obs = torch.zeros(VOCAB, VOCAB).index_put_((first, second), torch.ones(N_TRIALS), accumulate=True)
    joint_law = cond[BONUS][:, None] * cond
    # P(accept_len >= a) = prod_{t < a} p(d_{t+1} | c_t) along the draft chain c = [BONUS, d1, ..].
    chain, reach = [BONUS], [1.0]
    for _ in range(WIDTH - 1):
        chain.append(int(draft[chain[-1]]))
        reach.append(reach[-1] * float(cond[chain[-2], chain[-1]]))
    reach.append(0.0)
    acc_law = torch.tensor([reach[a] - reach[a + 1] for a in range(WIDTH)])
    acc_obs = torch.bincount(acc, minlength=WIDTH)
    what = f"top_k/top_p/min_p={flt} proposals={kind} seeded={seeded}"
    return [
        (f"joint(e1, e2) {what}", *chi2_test(joint_obs, joint_law)),
        (f"accept_len {what}", *chi2_test(acc_obs, acc_law)),
    ]


def our_verify(candidates, logits, rows, positions, generator):
    return sampled_verify(candidates, logits, rows, positions if rows.seeds is not None else None, generator)


@pytest.mark.parametrize("seeded", [False, True], ids=["generator", "seeded"])
@pytest.mark.parametrize("kind", ["likely", "unlikely", "outside"])
@pytest.mark.parametrize("name", list(FILTERS))
def test_emitted_tokens_follow_the_target_law(name, kind, seeded):
    for what, stat, threshold, outside in law_checks(our_verify, FILTERS[name], kind, seeded):
        # Exact: a token outside the filtered support (e.g. a rejected-by-filter proposal) is
        # never emitted; for kind "outside" that means d1 is never accepted (acc_law[0] == 1).
        assert outside == 0, f"{what}: {outside} emitted tokens outside the target's support"
        assert stat <= threshold, f"{what}: chi2 {stat:.1f} > {threshold:.1f} (alpha {ALPHA})"


@pytest.mark.parametrize("name", ["temperature", "all_three"])
def test_chunked_draws_follow_the_target_law(name):
    """Unseeded rows drawn 997 at a time (each chunk takes its own noise from the generator):
    still the target's law."""

    def chunked_verify(candidates, logits, rows, positions, generator):
        return sampled_verify(candidates, logits, rows, None, generator, max_rows=997)

    for what, stat, threshold, outside in law_checks(chunked_verify, FILTERS[name], "likely", False):
        assert outside == 0, what
        assert stat <= threshold, f"{what}: chi2 {stat:.1f} > {threshold:.1f} (alpha {ALPHA})"


@pytest.mark.parametrize("max_rows", [1, 7, 64])
def test_chunked_draws_equal_whole_ones_for_seeded_and_greedy_rows(max_rows):
    g = torch.Generator().manual_seed(9)
    n, vocab = 64, 50
    logits = torch.randn(n, vocab, generator=g) * 2
    top_ks = torch.where(torch.arange(n) % 3 == 0, 1, torch.randint(2, 30, (n,), generator=g))  # 1: greedy
    rows = rows_of(
        torch.rand(n, generator=g) + 0.3,
        top_ks,
        torch.rand(n, generator=g) * 0.5 + 0.5,
        torch.rand(n, generator=g) * 0.1,
        torch.randint(0, 2**62, (n,), generator=g),
    )
    positions = torch.randint(0, 5000, (n,), generator=g)
    whole = sample_target_tokens(logits, rows, positions, max_rows=n)
    assert torch.equal(sample_target_tokens(logits, rows, positions, max_rows=max_rows), whole)


def test_draws_never_take_more_than_max_rows_at_once(monkeypatch):
    """The memory bound itself: no single draw sees more than max_rows rows (without chunks, one
    draw takes all 64)."""
    seen = []
    draw = sampling._draw
    monkeypatch.setattr(sampling, "_draw", lambda logits, *a: seen.append(len(logits)) or draw(logits, *a))
    n = 64
    rows = rows_of([0.9] * n, [TOP_K_ALL] * n, [1.0] * n, [0.0] * n)
    sample_target_tokens(torch.randn(n, 50), rows, max_rows=24)
    assert seen == [24, 24, 16]


def test_rows_per_draw(monkeypatch):
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    assert rows_per_draw(151936) == 73  # 1024 MB / (96 B x 151,936)
    assert rows_per_draw(151936, 64) == 4
    assert rows_per_draw(10**9, 1) == 1
    monkeypatch.setenv(MEMORY_ENV, "2048")
    assert rows_per_draw(151936) == 147
    with pytest.raises(ValueError, match="must be positive"):
        rows_per_draw(100, 0)


def test_each_filter_of_a_combination_binds():
    """Dropping any one filter of a combination changes the law in some context (test of the test)."""
    table = bigram_logits()
    off = (TOP_K_ALL, 1.0, 0.0)
    for name, flt in FILTERS.items():
        law = analytic_conditionals(table, flt)
        for x in range(VOCAB):  # no float32-vs-float64 ambiguity at any threshold
            assert oracle_filtered(table[x].tolist(), TEMPERATURE, *flt)[1] >= 0.01, (name, x)
        if name != "temperature":
            assert not torch.equal(law, analytic_conditionals(table, off)), name
        for i in range(3):
            if flt[i] != off[i]:
                dropped = tuple(off[j] if j == i else flt[j] for j in range(3))
                assert not torch.equal(law, analytic_conditionals(table, dropped)), (name, i)


def test_seeded_output_equals_autoregressive_seeded_sampling():
    """Seeded verify emits exactly the tokens of seeded one-token-per-step sampling (the
    non-speculative engine in deterministic mode), whatever the draft proposes."""
    table = bigram_logits()
    n, length, start = 3000, 10, 100
    params = [*FILTERS.values(), (1, 1.0, 0.0)]  # every filter, and greedy rows
    top_ks, top_ps, min_ps = (torch.tensor([params[i % len(params)][j] for i in range(n)]) for j in range(3))
    rows = rows_of([TEMPERATURE] * n, top_ks, top_ps, min_ps, seeds=torch.arange(n) * 7919 - 3)

    reference, last = [], torch.full((n,), BONUS)
    for step in range(length):  # the token after position start + step
        last = sample_target_tokens(table[last], rows, torch.full((n,), start + step))
        reference.append(last)
    reference = torch.stack(reference, dim=1)

    g = torch.Generator().manual_seed(14)
    likely = table.argmax(dim=1)
    emitted = torch.zeros(n, length + 1, dtype=torch.int64)
    count, bonus = torch.zeros(n, dtype=torch.int64), torch.full((n,), BONUS)
    while int(count.min()) < length:
        chain = [bonus]
        for _ in range(WIDTH - 1):  # half the rows propose the likeliest token, half random ones
            guess = torch.where(
                torch.arange(n) % 2 == 0, likely[chain[-1]], torch.randint(0, VOCAB, (n,), generator=g)
            )
            chain.append(guess)
        candidates = torch.stack(chain, dim=1)
        positions = (start + count)[:, None] + torch.arange(WIDTH)
        accept_len, out_tokens, bonus = sampled_verify(candidates, table[candidates], rows, positions)
        # E.g., count 3, accept_len 1 -> out_tokens[:2] go to columns 3, 4; the rest to the dump
        # column (the last), as do tokens beyond `length`.
        cols = count[:, None] + torch.arange(WIDTH)
        cols = torch.where((torch.arange(WIDTH) <= accept_len[:, None]) & (cols < length), cols, -1)
        emitted.scatter_(1, cols % emitted.shape[1], out_tokens)
        count += accept_len + 1
    assert torch.equal(emitted[:, :length], reference)


# Negative controls: the same checks must reject wrong rules.


def _uniform(shape, generator):
    return torch.rand(shape, generator=generator, dtype=torch.float64)


def verify_resample_without_removing(candidates, logits, rows, positions, generator):
    """Wrong: accept x with probability p(x), but on rejection resample from p *including* x."""
    bs, width, vocab = logits.shape
    p = filtered_probs(
        logits.reshape(-1, vocab),
        rows.repeat_rows(width).temperatures,
        rows.repeat_rows(width).top_ks,
        rows.repeat_rows(width).top_ps,
        rows.repeat_rows(width).min_ps,
    ).view(bs, width, vocab)
    proposed = torch.cat([candidates[:, 1:], candidates[:, :1]], dim=1)  # last column unused
    p_x = p.gather(2, proposed[:, :, None]).squeeze(2)
    accepted = _uniform((bs, width), generator) < p_x
    draws = torch.multinomial(p.reshape(-1, vocab), 1, generator=generator).view(bs, width)
    draws = torch.where(accepted, proposed, draws)
    draws[:, -1] = torch.multinomial(p[:, -1], 1, generator=generator).squeeze(1)
    return greedy_verify(candidates, draws)


def verify_with_target(transform):
    """Correct rule, wrong target law: `transform(probs [n, V], rows) -> probs`."""

    def verify(candidates, logits, rows, positions, generator):
        bs, width, vocab = logits.shape
        flat = rows.repeat_rows(width)
        probs = torch.softmax(logits.reshape(-1, vocab) / flat.temperatures[:, None], -1)
        probs = transform(probs, flat)
        draws = torch.multinomial(probs, 1, generator=generator).view(bs, width)
        return greedy_verify(candidates, draws)

    return verify


def sequential_top_k_then_top_p(probs, rows):  # SGLang's built-in DFLASH (dflash_utils.py:1069-1098)
    k_probs = filtered_probs(
        probs.log(), torch.ones(len(probs)), rows.top_ks, torch.ones(len(probs)), torch.zeros(len(probs))
    )
    return filtered_probs(
        k_probs.log(),
        torch.ones(len(probs)),
        torch.full_like(rows.top_ks, TOP_K_ALL),
        rows.top_ps,
        torch.zeros(len(probs)),
    )


def ignoring_min_p(probs, rows):  # also the built-in's
    return filtered_probs(
        probs.log(), torch.ones(len(probs)), rows.top_ks, rows.top_ps, torch.zeros(len(probs))
    )


def ignoring_top_k(probs, rows):
    all_k = torch.full_like(rows.top_ks, TOP_K_ALL)
    return filtered_probs(probs.log(), torch.ones(len(probs)), all_k, rows.top_ps, rows.min_ps)


def ignoring_top_p(probs, rows):
    ones = torch.ones(len(probs))
    return filtered_probs(probs.log(), ones, rows.top_ks, ones, rows.min_ps)


def ignoring_temperature(probs, rows):  # the caller tempered the probabilities: undo it
    return torch.softmax(probs.log() * rows.temperatures[:, None], dim=-1)


def verify_sharing_noise_across_the_block(candidates, logits, rows, positions, generator):
    """Wrong: every row of a block hashes the same position, so the draws are dependent."""
    return sampled_verify(candidates, logits, rows, positions[:, :1].expand_as(positions), generator)


@pytest.mark.parametrize(
    "verify, name, kind, seeded",
    [
        (verify_resample_without_removing, "temperature", "likely", False),
        (verify_with_target(sequential_top_k_then_top_p), "top_k+top_p", "likely", False),
        (verify_with_target(ignoring_min_p), "all_three", "likely", False),
        (verify_with_target(ignoring_top_k), "all_three", "likely", False),
        (verify_with_target(ignoring_top_p), "all_three", "likely", False),
        (verify_with_target(ignoring_temperature), "temperature", "likely", False),
        (verify_sharing_noise_across_the_block, "temperature", "likely", True),
    ],
    ids=[
        "resample-without-removing",
        "sequential-filters",
        "ignore-min-p",
        "ignore-top-k",
        "ignore-top-p",
        "ignore-temperature",
        "shared-noise",
    ],
)
def test_harness_detects_wrong_rules(verify, name, kind, seeded):
    results = law_checks(verify, FILTERS[name], kind, seeded)
    assert any(outside > 0 or stat > threshold for _, stat, threshold, outside in results), results


# ------------------------------------------------------------------------------------------
# Penalties and logit_bias: B successive decode steps of SGLang's own penalizers


class _Tokenizer:
    additional_stop_token_ids = {11}
    eos_token_id = 3


class _Req:
    def __init__(self, sampling_params, eos_token_ids):
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.tokenizer = _Tokenizer()


class _Batch:  # what BatchedPenalizerOrchestrator reads (it holds a weakref)
    def __init__(self, reqs):
        self.reqs = reqs
        self.device = "cpu"


def test_penalties_and_logit_bias_equal_successive_sglang_decode_steps(sglang_sampler):
    from sglang.srt.sampling import penaltylib
    from sglang.srt.sampling.sampling_params import SamplingParams

    vocab, width, history_len = 16, 5, 3
    reqs = [
        _Req(SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3), {5}),
        _Req(SamplingParams(frequency_penalty=-0.4, min_new_tokens=6, stop_token_ids=[7]), {5}),
        _Req(SamplingParams(repetition_penalty=0.8, min_new_tokens=5), None),
        _Req(SamplingParams(presence_penalty=-1.1, frequency_penalty=1.9, min_new_tokens=2), {9}),
    ]
    bs = len(reqs)
    g = torch.Generator().manual_seed(12)
    history = torch.tensor([[4, 4, 9], [7, 1, 4], [2, 2, 2], [0, 9, 12]])
    # Repeats inside the window and across history; stop tokens (3, 5, 7, 9, 11) inside it.
    candidates = torch.tensor([[4, 6, 4, 4, 1], [5, 7, 1, 1, 3], [2, 11, 2, 3, 8], [9, 9, 12, 5, 0]])
    logits = torch.randn(bs, width, vocab, generator=g) * 3
    logit_bias = torch.zeros(bs, vocab)
    logit_bias[0, 6], logit_bias[2, [1, 8]] = 2.5, torch.tensor([-3.0, 0.75])

    batch = _Batch(reqs)
    orchestrator = penaltylib.BatchedPenalizerOrchestrator(
        vocab_size=vocab,
        batch=batch,
        penalizers={
            penaltylib.BatchedFrequencyPenalizer,
            penaltylib.BatchedMinNewTokensPenalizer,
            penaltylib.BatchedPresencePenalizer,
            penaltylib.BatchedRepetitionPenalizer,
        },
    )
    for t in range(history_len):
        orchestrator.cumulate_output_tokens(history[:, t])
    want = torch.empty_like(logits)
    for k in range(width):  # the decode step whose input is candidates[:, k]
        orchestrator.cumulate_output_tokens(candidates[:, k])
        additive = torch.zeros(bs, vocab)
        orchestrator.accumulate_additive_penalties(additive)
        scaling = orchestrator.accumulate_scaling_penalties()
        row = logits[:, k] + additive
        row = torch.where(row < 0, row * scaling, row / scaling)  # apply_scaling_penalties
        want[:, k] = row + logit_bias

    params = PenaltyParams.from_reqs(reqs, "cpu", logit_bias=logit_bias)
    stops = orchestrator.penalizers[penaltylib.BatchedMinNewTokensPenalizer].stop_token_penalties
    assert torch.equal(penalties._stop_mask(params.stop_token_ids, vocab), stops == -math.inf)
    counts = torch.zeros(bs, vocab).scatter_add_(1, history, torch.ones(bs, history_len))
    got = penalize_block_logits(logits, candidates, counts, torch.full((bs,), history_len), params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # min_new_tokens lifts inside the window: request 1 bans 7 in rows 0-1 only (3 + k + 1 < 6).
    assert got[1, :2, 7].eq(-math.inf).all() and torch.isfinite(got[1, 2:, 7]).all()


def test_commit_output_counts_folds_the_committed_tokens():
    counts = torch.zeros(2, 10)
    counts[1, 3] = 2
    candidates = torch.tensor([[5, 8, 5, 2], [3, 3, 1, 9]])
    new_counts, num = commit_output_counts(counts, torch.tensor([4, 7]), candidates, torch.tensor([3, 1]))
    assert new_counts[0].tolist() == [0, 0, 0, 0, 0, 2, 0, 0, 1, 0]
    assert new_counts[1].tolist() == [0, 0, 0, 3, 0, 0, 0, 0, 0, 0]
    assert num.tolist() == [7, 8]


# ------------------------------------------------------------------------------------------
# CUDA: the same pure-PyTorch path on the GPU (skipped without one)


@pytest.mark.gpu
def test_cuda_hash_matches_sglang_kernel():
    """SGLang's own seeded-noise hash kernel is the oracle (skipped where SGLang is absent, as
    under `make gpu-check`; the CPU tests compare with its PyTorch statement)."""
    kernel = pytest.importorskip("sglang.kernels.ops.sampling.murmur_hash", reason="needs SGLang")
    seeds = torch.randint(-(2**62), 2**62, (64,))
    positions = torch.randint(0, 2**33, (64,))
    cols = torch.arange(5000)
    want = kernel.murmur_hash32(seeds.cuda().to(torch.uint64), positions.cuda(), cols.cuda())
    assert torch.equal(murmur_hash32(seeds.cuda(), positions.cuda(), cols.cuda()), want.to(torch.int64))


@pytest.mark.gpu
def test_cuda_matches_cpu_without_host_syncs():
    logits, candidates, positions = _random_block(13, bs=32, vocab=30)
    rows = rows_of([0.8] * 32, [TOP_K_ALL, 5] * 16, [0.9] * 32, [0.05] * 32, seeds=torch.arange(32))
    cpu = sampled_verify(candidates, logits, rows, positions)
    cuda_rows = SamplingRows(
        *(t.cuda() for t in (rows.temperatures, rows.top_ks, rows.top_ps, rows.min_ps, rows.seeds))
    )
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = sampled_verify(candidates.cuda(), logits.cuda(), cuda_rows, positions.cuda())
        probs = filtered_probs(
            logits.reshape(-1, 30).cuda(),
            cuda_rows.repeat_rows(WIDTH).temperatures,
            cuda_rows.repeat_rows(WIDTH).top_ks,
            cuda_rows.repeat_rows(WIDTH).top_ps,
            cuda_rows.repeat_rows(WIDTH).min_ps,
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))
    flat = rows.repeat_rows(WIDTH)
    want_probs = filtered_probs(
        logits.reshape(-1, 30), flat.temperatures, flat.top_ks, flat.top_ps, flat.min_ps
    )
    torch.testing.assert_close(probs.cpu(), want_probs, rtol=1e-5, atol=1e-6)

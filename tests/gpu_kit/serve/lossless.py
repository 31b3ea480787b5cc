"""Lossless on CUDA: our DFLASH's greedy outputs against the plain engine's, token for token.

    python -m tests.gpu_kit.serve.lossless TARGET DRAFT [--out results.json] [--device cuda]
                                         [--runs overlap,no-overlap,widths] [--prompts 8]
                                         [--new-tokens 64]
                                         [--prompts-file PAIR/prompts.json]
                                         [--prefix-round] [--engine-args JSON]
                                         [--dflash-args JSON] [--samples 1000]

Our DFLASH with overlap scheduling on and/or off, or with every decode step forced through the
verify widths that have a graph each, in turn (`--runs`), then one plain engine, each through
FlashInfer attention with CUDA graphs on (decode, target verify and the draft step), in bf16.
Each serves the same prompts at batch 1 (one at a time) and all together, and with
`--prefix-round` then a round of prompts that extend the first one, whose tokens the radix
cache then holds (a prefix-cache hit at every request), all with the chosen tokens' logprobs and
the top two; every DFLASH output must equal the plain engine's in the same round.
`--engine-args` adds arguments to both engines (a family's attention backend or dtype),
`--dflash-args` to DFLASH's only (a draft family's own flags).
Prompts are random token ids, or the texts of `--prompts-file` (a trained pair's held-out
prompts, tokenized with the target's tokenizer: there the draft's proposals are accepted, so
the multi-token accept path is what is checked).

* **Near-ties.** In bf16 the decode and the verify kernels round differently (other tilings),
  so where the plain engine's top two logits are within a couple of rounding steps either may
  win. A step is relative to the logits' own magnitude (`rounding_step`: 1/16 for logits in
  [8, 16), 2^-24 for logits near 1e-5, as random weights give), measured by the target's
  transformers forward on CPU at each difference; a difference at a margin of at most
  TIE_STEPS steps is excused, any other fails (exit 1).
* **Resync.** After an excused near-tie the two outputs go their own ways, so the plain engine
  continues from DFLASH's tokens through the tie (at batch 1) and the comparison goes on from
  there, up to MAX_RESYNCS times per output.
* **Logprobs.** Where the tokens agree, the chosen tokens' logprobs are compared too: the
  largest difference is reported per run.
* **Sampled and constrained requests** (`--samples N`, engines then load the target's
  tokenizer): N sampled requests of one prompt on each engine, whose tokens at each position
  after the first (a verify's, not the prefill's) must come from one distribution on both (a
  chi-square homogeneity test at ALPHA per position, tests/support/stats.py), and
  requests under a regex (`GRAMMAR`): N/8 sampled, each of whose texts must match it, and one
  greedy, whose tokens must equal the plain engine's (a difference at a near-tie is excused).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

# DFLASH engines: their Engine arguments. "widths" forces every step through the verify widths
# that get a graph each (`width/verify_widths.py`), in turn (RUN_ENV).
RUNS = {"overlap": {}, "no-overlap": {"disable_overlap_schedule": True}, "widths": {}}
# A margin is a difference of two logits, so in bf16 a whole number of rounding steps of their
# magnitude (1/32 in [4, 8), 1/16 in [8, 16)); a tie broken by rounding is within two.
TIE_STEPS = 2
MANTISSA_BITS = {"bfloat16": 7, "float32": 23}
NEAR_TIE = TIE_STEPS * 2**-4  # two bf16 steps at [8, 16): the rule where the logits are not measured
MAX_RESYNCS = 4  # near-ties followed per output
# `--samples`: the sampled requests' parameters; each position's tokens are tested but the first.
SAMPLED = {"temperature": 1.0, "top_k": 16, "max_new_tokens": 4, "ignore_eos": True}
# Two or three letters from a-h (the tiny tokenizer has tokens of one and of two letters, so
# several token paths spell one text); a greedy and sampled requests under it.
GRAMMAR = "[a-h]{2,3}"
CONSTRAINED = {"temperature": 1.0, "max_new_tokens": 4, "regex": GRAMMAR}
# What the kit passes on CUDA (tests/gpu_kit/README.md, "What the kit changes"); CPU runs use
# SGLang's CPU engine.
CUDA_ARGS = dict(
    attention_backend="flashinfer",
    cuda_graph_backend_prefill="disabled",
    cuda_graph_max_bs_decode=8,
    dtype="bfloat16",
    mem_fraction_static=0.3,
    max_total_tokens=65536,  # tiny models: a small KV pool (and draft store) starts faster
    watchdog_timeout=1800,
    log_level="info",  # the start-up phases (graph captures, our warm-up) for the report
)
CPU_ARGS = dict(
    device="cpu", attention_backend="torch_native", dtype="float32", max_total_tokens=4096, log_level="info"
)


def random_prompts(vocab_size: int, count: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(2, vocab_size) for _ in range(rng.randint(8, 64))] for _ in range(count)]


def text_prompts(path: str, target: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    with open(path) as f:
        texts = [p["text"] for p in json.load(f)][:count]
    return [tokenizer(t)["input_ids"] for t in texts]


@dataclass
class Output:
    """One generation: its token ids, and per position the chosen token's logprob and the top-1
    minus top-2 logprob margin."""

    ids: list
    logprobs: list
    margins: list

    @classmethod
    def from_engine(cls, output: dict) -> "Output":
        meta = output["meta_info"]
        logprobs = [entry[0] for entry in meta["output_token_logprobs"]]
        margins = [entries[0][0] - entries[1][0] for entries in meta["output_top_logprobs"]]
        return cls(list(output["output_ids"]), logprobs, margins)


def first_difference(got: list, want: list):
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def rounding_step(magnitude: float, dtype: str) -> float:
    """The spacing of `dtype` numbers at `magnitude`. E.g., (10, bfloat16) -> 1/16,
    (0.3, bfloat16) -> 1/512, (10, float32) -> 2^-20."""
    exponent = math.floor(math.log2(magnitude)) if magnitude > 0 else -126
    return 2.0 ** (exponent - MANTISSA_BITS[dtype])


def is_near_tie(margin: float, magnitude: Optional[float], dtype: str) -> bool:
    """Whether rounding alone can explain a difference at this margin between the plain engine's
    top two logprobs, at logits of `magnitude` (None: not measured, the fixed NEAR_TIE)."""
    if magnitude is None:
        return margin <= NEAR_TIE
    return margin <= TIE_STEPS * rounding_step(magnitude, dtype)


def follow(
    got: Output,
    plain: Output,
    continue_plain: Callable[[list], Output],
    magnitude: Callable[[list], Optional[float]],
    dtype: str,
    max_resyncs: int = MAX_RESYNCS,
) -> dict:
    """DFLASH's output `got` against the plain engine's `plain` for one prompt, resyncing after
    each near-tie: `continue_plain(prefix)` is the plain engine's output after the prompt and
    DFLASH's first tokens `prefix`; `magnitude(prefix)` the logits' magnitude at the position
    after `prefix`. Returns {"verdict": "identical" | "near-ties only" | False, "ties":
    [(position, margin)], "wrong": (position, margin, magnitude) or None,
    "max_logprob_difference": float}, positions counted from the first generated token.

    E.g., got [5, 9, 7], plain [5, 6, 7] with a margin of 0.01 at position 1 (a near-tie), and
    the plain engine continuing [5, 9] with [7]: "near-ties only", ties [(1, 0.01)]."""
    offset, ties, worst = 0, [], 0.0
    while True:
        k = first_difference(got.ids[offset:], plain.ids)
        same = len(plain.ids) if k is None else k
        pairs = zip(got.logprobs[offset : offset + same], plain.logprobs[:same])
        worst = max([worst, *(abs(a - b) for a, b in pairs)])
        result = {"ties": ties, "wrong": None, "max_logprob_difference": worst}
        if k is None:
            return {**result, "verdict": "near-ties only" if ties else "identical"}
        position, margin = offset + k, plain.margins[k]
        size = magnitude(got.ids[:position])
        if not is_near_tie(margin, size, dtype):
            return {**result, "verdict": False, "wrong": (position, margin, size)}
        ties.append((position, margin))
        offset = position + 1
        if offset >= len(got.ids) or len(ties) > max_resyncs:  # the rest unchecked
            return {**result, "verdict": "near-ties only"}
        plain = continue_plain(got.ids[:offset])


def summary(found: list, name: str) -> dict:
    """A run's results in round `name` (e.g. "bs1") from each prompt's `follow`."""
    out = {
        f"identical_at_{name}": f"{sum(f['verdict'] == 'identical' for f in found)}/{len(found)}",
        f"max_logprob_difference_at_{name}": round(max(f["max_logprob_difference"] for f in found), 6),
    }
    ties = [tie for f in found for tie in f["ties"]]
    if ties:
        out[f"near_ties_at_{name}"] = [f"token {k}: plain's top-2 margin {m:.4f}" for k, m in ties]
    wrong = [f["wrong"] for f in found if f["wrong"] is not None]
    if wrong:
        out[f"wrong_at_{name}"] = [
            f"token {k}: plain's top-2 margin {m:.4f}, logits of "
            + ("unmeasured" if size is None else f"{size:.3g}")
            for k, m, size in wrong
        ]
    return out


def verdict(verdicts: list):
    """The run's verdict from each output's: False if any is, else "near-ties only" if any is,
    else "identical"."""
    if any(v is False for v in verdicts):
        return False
    return "near-ties only" if "near-ties only" in verdicts else "identical"


class LogitScale:
    """|top-1 logit| at the end of a sequence, from the target's transformers forward in float32
    on CPU (loaded at the first call); None, with `why`, where transformers cannot load it."""

    def __init__(self, target: str):
        self.target, self.model, self.why = target, None, None

    def __call__(self, ids: list) -> Optional[float]:
        import torch

        if self.model is None and self.why is None:
            try:
                from transformers import AutoModelForCausalLM

                self.model = AutoModelForCausalLM.from_pretrained(
                    self.target, torch_dtype=torch.float32
                ).eval()
            except Exception as error:  # a start-up choice, reported in the results
                self.why = f"{type(error).__name__}: {error}"[:200]
        if self.model is None:
            return None
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0, -1]
        return float(logits.abs().max())


def accept_length(outputs: list) -> float | None:
    """Tokens per verify step over the outputs (SGLang's spec_verify_ct), None if not reported."""
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outputs)
    return None if not steps else sum(len(o["output_ids"]) for o in outputs) / steps


def block_size(draft: str) -> int:
    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    return int(config.get("block_size") or config.get("dflash_config", {}).get("block_size") or 16)


@contextlib.contextmanager
def run_env(name: str, draft: str, device: str, width1_forward: Optional[str] = None):
    """The environment of one run (the engine's scheduler inherits it): for "dflash widths",
    a forced cycle of every width with its own verify graph (on CPU, its own backend), its
    steps at W = 1 through `width1_forward` when given (SGLANG_DFLASH_WIDTH1_FORWARD: "decode"
    runs them through the target's decode forward, eager beside the verify graphs)."""
    if name != "dflash widths":
        yield
        return
    from sglang_dflash.width.verify_widths import graph_widths

    env = {"SGLANG_DFLASH_TEST_WIDTHS": ",".join(str(w) for w in sorted(graph_widths(block_size(draft))))}
    if width1_forward:
        env["SGLANG_DFLASH_WIDTH1_FORWARD"] = width1_forward
    if device == "cpu":
        env["SGLANG_DFLASH_VERIFY_GRAPHS"] = "eager"
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def engine(target: str, draft, device: str, **extra):
    """An engine of the target (with our DFLASH and `draft`, unless None): (engine, start-up
    seconds); shut down after."""
    import sglang as sgl

    args = dict(CUDA_ARGS if device == "cuda" else CPU_ARGS, model_path=target, skip_tokenizer_init=True)
    if draft is not None:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=draft)
        args.update(speculative_num_draft_tokens=block_size(draft))
    args.update(extra)  # a family's own attention backend or dtype replaces the default
    start = time.perf_counter()
    served = sgl.Engine(**args)
    started = time.perf_counter() - start
    try:
        if draft is not None:
            impl = served.get_server_info()["internal_states"][0].get("dflash_implementation", "")
            assert impl.startswith("sglang-dflash"), f"DFLASH is served by {impl or 'SGLang built-in'}"
        yield served, started
    finally:
        served.shutdown()


def generate(served, prompts: list, new_tokens: int) -> list:
    """Greedy outputs, with the chosen tokens' logprobs and the top two."""
    sampling = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    return served.generate(
        input_ids=prompts, sampling_params=sampling, return_logprob=True, top_logprobs_num=2
    )


def rounds(ids: list, prefix_round: bool) -> dict:
    """{round: prompts}: "bs1" served one at a time, f"bs{n}" all together, and "prefix" (with
    `prefix_round`) the first prompt extended by the first tokens of each other one, served
    together after the others, so every request starts with a prefix the radix cache holds.
    E.g., ids [[5, 6], [7, 8, 9], [3]] -> {"bs1": ids, "bs3": ids, "prefix": [[5, 6, 7, 8, 9],
    [5, 6, 3]]}."""
    out = {"bs1": ids, f"bs{len(ids)}": ids}
    if prefix_round and len(ids) > 1:
        out["prefix"] = [ids[0] + p[:PREFIX_TAIL] for p in ids[1:]]
    return out


PREFIX_TAIL = 4  # tokens each prefix-round prompt adds after the cached first prompt


def serve_prompts(served, prompts: dict, new_tokens: int) -> tuple[dict, dict]:
    """({round: [Output]}, stats) for `rounds(...)`: "bs1" one prompt at a time, the others
    each as one batch, in order."""
    out = {}
    for name, batch in prompts.items():
        if name == "bs1":
            out[name] = [generate(served, [p], new_tokens)[0] for p in batch]
        else:
            out[name] = generate(served, batch, new_tokens)
    stats = {f"accept_length_at_{name}": accept_length(outs) for name, outs in out.items()}
    return {name: [Output.from_engine(o) for o in outs] for name, outs in out.items()}, stats


def sample(served, prompt: list, samples: int) -> dict:
    """`--samples`' requests on one engine: {"samples": [each sampled output's ids],
    "constrained": [each sampled text under GRAMMAR], "greedy_constrained":
    the greedy output under it (an Output), "accept_length_sampled"}, all of one prompt,
    submitted together."""
    sampled = served.generate(input_ids=[prompt] * samples, sampling_params=SAMPLED)
    constrained = served.generate(input_ids=[prompt] * max(samples // 8, 1), sampling_params=CONSTRAINED)
    greedy = served.generate(
        input_ids=[prompt],
        sampling_params=dict(CONSTRAINED, temperature=0),
        return_logprob=True,
        top_logprobs_num=2,
    )[0]
    return {
        "samples": [list(o["output_ids"]) for o in sampled],
        "constrained": [o["text"] for o in constrained],
        "greedy_constrained": Output.from_engine(greedy),
        "accept_length_sampled": accept_length(sampled),
    }


def compare_samples(got: dict, plain: dict, dtype: str) -> dict:
    """DFLASH's `sample` against the plain engine's: the chi-square p-value of the sampled
    tokens at each position after the first (`sampled_ok` when every one is at least ALPHA),
    the constrained texts that do not match GRAMMAR,
    and whether the greedy constrained output is the plain engine's (a difference where the
    plain engine's top two are a near-tie by the fixed rule is excused)."""
    import re

    from tests.support.stats import ALPHA, homogeneity_pvalue

    positions = range(1, SAMPLED["max_new_tokens"])
    pvalues = [
        float(homogeneity_pvalue([o[k] for o in got["samples"]], [o[k] for o in plain["samples"]]))
        for k in positions
    ]
    outside = [t for t in got["constrained"] + plain["constrained"] if not re.fullmatch(GRAMMAR, t)]
    mine, theirs = got["greedy_constrained"], plain["greedy_constrained"]
    k = first_difference(mine.ids, theirs.ids)
    if k is None and len(mine.ids) == len(theirs.ids):
        greedy = "identical"
    else:
        k = min(len(mine.ids), len(theirs.ids)) if k is None else k
        tie = k < len(theirs.margins) and is_near_tie(theirs.margins[k], None, dtype)
        greedy = "near-tie" if tie else f"differs at token {k}"
    return {
        "sampled_chi_square_p": [round(p, 4) for p in pvalues],  # at tokens 2, 3, ...
        "sampled_ok": min(pvalues) >= ALPHA,
        "constrained_outside_grammar": outside,
        "greedy_constrained": greedy,
        "accept_length_sampled": got["accept_length_sampled"],
    }


def samples_verdict(found: dict):
    """The sampled round's part of the verdict: False, "near-ties only" or "identical"."""
    if not found["sampled_ok"] or found["constrained_outside_grammar"]:
        return False
    greedy = found["greedy_constrained"]
    return {"identical": "identical", "near-tie": "near-ties only"}.get(greedy, False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target")
    p.add_argument("draft")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--runs", default="overlap,no-overlap", help=f"DFLASH engines, from {','.join(RUNS)}")
    p.add_argument("--prompts", type=int, default=8, help="prompts; served one at a time, then together")
    p.add_argument(
        "--prompts-file", help="a JSON list of {'text': ...}, tokenized with the target's tokenizer"
    )
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--prefix-round", action="store_true", help="then prompts extending the first (radix cache)"
    )
    p.add_argument("--engine-args", default="{}", help="JSON: more sgl.Engine arguments for both engines")
    p.add_argument("--dflash-args", default="{}", help="JSON: more sgl.Engine arguments for DFLASH's")
    p.add_argument(
        "--samples", type=int, default=0, help="then N sampled requests, and N/8 under a grammar, per engine"
    )
    p.add_argument(
        "--width1-forward",
        choices=["decode", "verify"],
        help="the widths run's steps at W = 1: the target's decode forward, or a verify over one token",
    )
    args = p.parse_args(argv)
    extra = json.loads(args.engine_args)
    if args.samples:
        extra["skip_tokenizer_init"] = False  # the grammar requests need the target's tokenizer
    if args.prompts_file:
        ids = text_prompts(args.prompts_file, args.target, args.prompts)
    else:
        with open(os.path.join(args.target, "config.json")) as f:
            ids = random_prompts(json.load(f)["vocab_size"], args.prompts)
    dtype = extra.get("dtype") or (CUDA_ARGS if args.device == "cuda" else CPU_ARGS)["dtype"]
    prompts = rounds(ids, args.prefix_round)
    results = {"target": args.target, "draft": args.draft, "dtype": dtype, "engine_args": extra, "runs": {}}
    sampled = {}  # engine: `sample(...)`

    def save():  # after every engine: a run cut short still leaves what finished
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    outputs = {}
    for name in args.runs.split(","):
        run = f"dflash {name}"
        print(f"== {run}", flush=True)
        with run_env(run, args.draft, args.device, args.width1_forward):
            spec = dict(RUNS[name], **extra, **json.loads(args.dflash_args))
            with engine(args.target, args.draft, args.device, **spec) as (served, started):
                outputs[run], stats = serve_prompts(served, prompts, args.new_tokens)
                if args.samples:
                    sampled[run] = sample(served, ids[0], args.samples)
                proposals = served.get_server_info()["internal_states"][0].get("dflash_proposals")
        results["runs"][run] = {"startup_s": round(started, 1), "proposals": proposals}
        results["runs"][run].update({k: round(v, 2) for k, v in stats.items() if v is not None})
        save()
    print("== plain", flush=True)
    verdicts, scale = [], LogitScale(args.target)
    with engine(args.target, None, args.device, **extra) as (plain_engine, started):
        plain, _ = serve_prompts(plain_engine, prompts, args.new_tokens)
        if args.samples:
            sampled["plain"] = sample(plain_engine, ids[0], args.samples)
        results["runs"]["plain"] = {"startup_s": round(started, 1)}

        def continue_plain(prompt: list, prefix: list) -> Output:
            """The plain engine's own continuation after DFLASH's tokens `prefix` (batch 1)."""
            return Output.from_engine(
                generate(plain_engine, [prompt + prefix], args.new_tokens - len(prefix))[0]
            )

        for run in outputs:
            for name, batch in prompts.items():
                found = [
                    follow(
                        got,
                        want,
                        functools.partial(continue_plain, prompt),
                        lambda prefix, prompt=prompt: scale(prompt + prefix),
                        dtype,
                    )
                    for prompt, got, want in zip(batch, outputs[run][name], plain[name])
                ]
                verdicts += [f["verdict"] for f in found]
                results["runs"][run].update(summary(found, name))
                print(f"{run}, {name}: {results['runs'][run][f'identical_at_{name}']} identical", flush=True)
            if args.samples:
                found = compare_samples(sampled[run], sampled["plain"], dtype)
                verdicts.append(samples_verdict(found))
                results["runs"][run]["sampled"] = found
                print(f"{run}, sampled: {found}", flush=True)
    results["tie_rule"] = (
        f"{TIE_STEPS} {dtype} rounding steps at the logits' magnitude (transformers, float32, CPU)"
        if scale.why is None
        else f"fixed margin {NEAR_TIE} (the logits were not measured: {scale.why})"
    )
    results["lossless"] = verdict(verdicts)
    save()
    return 0 if results["lossless"] else 1


if __name__ == "__main__":
    sys.exit(main())

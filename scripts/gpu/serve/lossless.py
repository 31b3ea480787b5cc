"""Lossless on CUDA: our DFLASH's greedy outputs against the plain engine's, token for token.

    python -m scripts.gpu.serve.lossless TARGET DRAFT [--out results.json] [--device cuda]
                                         [--runs overlap,no-overlap,widths] [--prompts 8]
                                         [--new-tokens 64]
                                         [--prompts-file PAIR/prompts.json]

One plain engine, then our DFLASH with overlap scheduling on and/or off, or with every decode step
forced through the verify widths that have a graph each, in turn (`--runs`), each through
FlashInfer attention with CUDA graphs on (decode, target verify and the draft step), in bf16.
Each serves the same prompts at batch 1 (one at a time) and all together; every DFLASH output
must equal the plain engine's at the same batch size. Prompts are random token ids, or the texts
of `--prompts-file` (a trained pair's held-out prompts, tokenized with the target's tokenizer:
there the draft's proposals are accepted, so the multi-token accept path is what is checked).

A difference is reported with its first position and the plain engine's top-2 logprob margin
there. In bf16 the decode and the verify kernels round differently (other tilings), so where the
plain engine's top two logits are within a couple of bf16 steps either may win: a difference at
such a near-tie (margin at most NEAR_TIE) is reported, not failed; any other fails (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

# DFLASH engines: their Engine arguments. "widths" forces every step through the verify widths
# that get a graph each (`width/verify_widths.py`), in turn (RUN_ENV).
RUNS = {"overlap": {}, "no-overlap": {"disable_overlap_schedule": True}, "widths": {}}
# Two bf16 steps of a logit in [8, 16): the margins of a tie broken by rounding. A margin is a
# difference of two bf16 logits, so it is a whole number of steps (1/32 in [4, 8), 1/16 in [8, 16)).
NEAR_TIE = 2 * 2**-4
# What the kit passes on CUDA (docs/gpu.md, "Serving on a GPU"); CPU runs use SGLang's CPU engine.
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


def margins(output: dict):
    """Per generated position, the top-1 minus top-2 logprob; None without logprobs."""
    top = output["meta_info"].get("output_top_logprobs")
    return None if top is None else [entries[0][0] - entries[1][0] for entries in top]


def first_difference(got: list, want: list):
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def compare(got: list, want: list) -> list:
    """Per prompt, None where DFLASH's output ids equal the plain engine's, else (the first
    differing position, the plain engine's top-2 logprob margin there). `got` [(ids, _)],
    `want` [(ids, margins)]."""
    out = []
    for (got_ids, _), (want_ids, plain_margins) in zip(got, want):
        k = first_difference(got_ids, want_ids)
        out.append(None if k is None else (k, plain_margins[k]))
    return out


def verdict(differences: list):
    """ "identical" without differences; "near-ties only" where each is at a margin of at most
    NEAR_TIE (bf16 rounding between the verify and decode kernels, not a wrong token); else False."""
    if not differences:
        return "identical"
    return "near-ties only" if all(margin <= NEAR_TIE for _, margin in differences) else False


def accept_length(outputs: list) -> float | None:
    """Tokens per verify step over the outputs (SGLang's spec_verify_ct), None if not reported."""
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outputs)
    return None if not steps else sum(len(o["output_ids"]) for o in outputs) / steps


def block_size(draft: str) -> int:
    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    return int(config.get("block_size") or config.get("dflash_config", {}).get("block_size") or 16)


@contextlib.contextmanager
def run_env(name: str, draft: str, device: str):
    """The environment of one run (the engine's scheduler inherits it): for "dflash widths",
    a forced cycle of every width with its own verify graph (on CPU, its own backend)."""
    if name != "dflash widths":
        yield
        return
    from sglang_dflash.width.verify_widths import graph_widths

    env = {"SGLANG_DFLASH_TEST_WIDTHS": ",".join(str(w) for w in sorted(graph_widths(block_size(draft))))}
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


def serve(target: str, draft, device: str, ids: list, new_tokens: int, **extra) -> tuple[dict, float, dict]:
    """({batch size: [(output ids, top-2 margins or None)]}, start-up seconds, stats)."""
    import sglang as sgl

    args = dict(CUDA_ARGS if device == "cuda" else CPU_ARGS, model_path=target, skip_tokenizer_init=True)
    if draft is not None:
        args.update(speculative_algorithm="DFLASH", speculative_draft_model_path=draft)
        args.update(speculative_num_draft_tokens=block_size(draft))
    start = time.perf_counter()
    engine = sgl.Engine(**args, **extra)
    started = time.perf_counter() - start
    try:
        if draft is not None:
            impl = engine.get_server_info()["internal_states"][0].get("dflash_implementation", "")
            assert impl.startswith("sglang-dflash"), f"DFLASH is served by {impl or 'SGLang built-in'}"
        sampling = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        # The plain engine's top-2 logprobs tell a bf16 near-tie from a real difference.
        extra = {} if draft is not None else dict(return_logprob=True, top_logprobs_num=2)
        out = {1: [engine.generate(input_ids=p, sampling_params=sampling, **extra) for p in ids]}
        out[len(ids)] = engine.generate(input_ids=ids, sampling_params=sampling, **extra)
        stats = {f"accept_length_at_bs{bs}": accept_length(outs) for bs, outs in out.items()}
        return {bs: [(o["output_ids"], margins(o)) for o in outs] for bs, outs in out.items()}, started, stats
    finally:
        engine.shutdown()


def main() -> int:
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
    args = p.parse_args()
    if args.prompts_file:
        ids = text_prompts(args.prompts_file, args.target, args.prompts)
    else:
        with open(os.path.join(args.target, "config.json")) as f:
            ids = random_prompts(json.load(f)["vocab_size"], args.prompts)
    runs = {"plain": (None, {})}
    runs.update({f"dflash {name}": (args.draft, RUNS[name]) for name in args.runs.split(",")})
    outputs, results = {}, {"target": args.target, "draft": args.draft, "runs": {}}
    for name, (draft, extra) in runs.items():
        print(f"== {name}", flush=True)
        with run_env(name, args.draft, args.device):
            outputs[name], started, stats = serve(
                args.target, draft, args.device, ids, args.new_tokens, **extra
            )
        results["runs"][name] = {"startup_s": round(started, 1)}
        if draft is not None:
            results["runs"][name].update({k: round(v, 2) for k, v in stats.items() if v is not None})
        if args.out:  # after every engine: a run cut short still leaves what finished
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    found = []  # (position, plain's margin) of every first difference
    for name in [n for n in runs if n != "plain"]:
        for bs in (1, len(ids)):
            differences = compare(outputs[name][bs], outputs["plain"][bs])
            found += [d for d in differences if d is not None]
            same = differences.count(None)
            where = [f"token {k}: plain's top-2 margin {m:.3f}" for k, m in filter(None, differences)]
            results["runs"][name][f"identical_at_bs{bs}"] = f"{same}/{len(ids)}"
            if where:
                results["runs"][name][f"first_differences_at_bs{bs}"] = where
            print(f"{name}, batch {bs}: {same} of {len(ids)} prompts identical to the plain engine")
            for line in where:
                print(f"  differs from {line}")
    results["lossless"] = verdict(found)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if results["lossless"] else 1


if __name__ == "__main__":
    sys.exit(main())

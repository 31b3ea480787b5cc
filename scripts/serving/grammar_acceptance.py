"""Acceptance length of DFLASH on a JSON workload, with and without grammar-aware proposals.

    python scripts/serving/grammar_acceptance.py [--target DIR --draft DIR] [--prompts N] [--max-new-tokens N]

Without --target/--draft it serves the shipped tiny pair (`sglang_dflash.assets.tiny_pair()`)
on its held-out code prompts. Each prompt is generated greedily three times, one request at a
time: unconstrained, and under a JSON schema with grammar-aware proposals on
(`SGLANG_DFLASH_GRAMMAR_PROPOSALS=1`, the default) and off. Without them the draft proposes as
if unconstrained and the grammar mask rejects every illegal proposal at verification; with them
the draft proposes the best token the grammar allows. Both are lossless, so the constrained
outputs must be identical; the script checks that, and prints the mean acceptance length
(tokens committed per verify step, bonus included) of each run. Runs on CUDA if available,
otherwise on SGLang's CPU engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts.demo import add_pair_args, choose_device, engine_args, pair_from_args, quiet_warnings  # noqa: E402

PROPOSALS_ENV = "SGLANG_DFLASH_GRAMMAR_PROPOSALS"

# A record a code model can fill: a function's name, its arguments, and a line of its body.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "args": {"type": "array", "items": {"type": "string"}},
        "body": {"type": "string"},
    },
    "required": ["name", "args", "body"],
    "additionalProperties": False,
}


def acceptance_length(outputs: list) -> float:
    """Tokens committed per verify step, pooled over requests (SGLang's per-request histogram of
    accepted drafts; each step also commits one token of the target's own)."""
    steps = tokens = 0
    for o in outputs:
        for accepted, count in enumerate(o["meta_info"].get("spec_correct_drafts_histogram") or []):
            steps += count
            tokens += (accepted + 1) * count
    return tokens / steps if steps else float("nan")


def run(target, draft, prompts, sampling, engine_args, proposals: bool = True) -> list:
    """Each prompt alone through a fresh DFLASH engine; returns the outputs."""
    import sglang as sgl

    # Read by the worker at start-up, in the scheduler processes, which inherit it.
    with mock.patch.dict(os.environ, {PROPOSALS_ENV: "1" if proposals else "0"}):
        engine = sgl.Engine(
            **{"log_level": "error", **engine_args},
            model_path=target,
            speculative_algorithm="DFLASH",
            speculative_draft_model_path=draft,
        )
    try:
        return [engine.generate(p, sampling) for p in prompts]
    finally:
        engine.shutdown()


def measure(target, draft, prompts, max_new_tokens, engine_args, unconstrained: bool = True) -> dict:
    """Acceptance lengths of the runs (the unconstrained one optional), whether the two
    constrained runs gave identical outputs, and how many outputs parse as JSON."""
    greedy = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    constrained = dict(greedy, json_schema=json.dumps(SCHEMA))
    plan = [
        ("unconstrained", greedy, True),
        ("json, grammar-aware proposals", constrained, True),
        ("json, plain proposals", constrained, False),
    ]
    runs = {}
    for name, sampling, proposals in plan[0 if unconstrained else 1 :]:
        print(f"== {name} ({len(prompts)} prompts) ...", flush=True)
        runs[name] = run(target, draft, prompts, sampling, engine_args, proposals)
    a, b = runs["json, grammar-aware proposals"], runs["json, plain proposals"]
    return {
        "acceptance": {name: acceptance_length(out) for name, out in runs.items()},
        "identical": all(x["output_ids"] == y["output_ids"] for x, y in zip(a, b)),
        "valid_json": sum(_is_json(o["text"]) for o in a),
        "outputs": runs,
    }


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_args(parser)
    parser.add_argument("--prompts", type=int, default=31, help="held-out prompts used")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    target, draft = pair_from_args(parser, args)
    quiet_warnings()

    from sglang_dflash.assets import tiny_pair_prompts

    device = choose_device()
    prompts = tiny_pair_prompts()[: args.prompts]
    result = measure(target, draft, prompts, args.max_new_tokens, engine_args(device))
    print()
    for name, value in result["acceptance"].items():
        print(f"mean acceptance length, {name:32s}: {value:.2f}")
    print(f"constrained outputs identical with and without grammar-aware proposals: {result['identical']}")
    print(f"outputs that parse as JSON: {result['valid_json']} of {len(prompts)}")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

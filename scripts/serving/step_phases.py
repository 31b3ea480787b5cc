"""Step-time breakdown of DFLASH decode steps at fixed batch sizes: draft, verify, accept,
injection, and the scheduler overhead between steps; with `--features`, what structured
outputs, logprobs and custom logit processors add to a step.

Starts a DFLASH server (this package's worker) with `SGLANG_DFLASH_STEP_TIMING` set, so the
worker appends one record per step (see `sglang_dflash/step_timer.py`), then for each batch
size sends that many equal requests at once and reads the records of the steps that ran at
exactly that batch size:

    python scripts/serving/step_phases.py --target T --draft D --batch-sizes 1,4,16 \\
        [--simulate-acc-len 4] [--input-len 256 --output-len 128] [--server-args="..."]

`--features plain,json,logprobs,processor` repeats every batch size with each kind of request
(a JSON schema; `return_logprob` with 5 top logprobs; SGLang's `DisallowedTokensLogitsProcessor`,
which makes the server start with --enable-custom-logit-processor). The grammar walk appears
as its own phase, `grammar`, and the logprob gathering as `logprobs`; the grammar mask and the
processors run inside `accept`.

or reports an existing record file (e.g. from a server you started with the variable set):

    python scripts/serving/step_phases.py --records steps.jsonl [--batch-sizes 1,4,16]

Per batch size it prints mean and p50 ms of each phase, of the step (sum of phases), of the
step interval (start to next start) and of the scheduler overhead = interval - phases (the
timer's own record writing excluded). Timing mode synchronizes the device around every phase,
so these are attribution numbers, not throughput. `--simulate-acc-len` sets
SGLANG_SIMULATE_ACC_LEN for the server (fixed acceptance, for comparing step costs at equal
acceptance); its output is labelled simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
import time
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts.serving.lib import report, server  # noqa: E402
from scripts.serving.lib.stats import percentile  # noqa: E402

PHASE_ORDER = ("draft", "grammar", "verify", "accept", "logprobs", "inject")

# A schema that keeps the model writing for as long as the run asks: at least 64 free strings.
JSON_SCHEMA = {
    "type": "object",
    "properties": {"lines": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
    "required": ["lines"],
}


def feature_request(feature: str) -> tuple[dict, dict]:
    """(extra sampling params, extra request fields) for one kind of request."""
    if feature == "plain":
        return {}, {}
    if feature == "json":
        return {"json_schema": json.dumps(JSON_SCHEMA)}, {}
    if feature == "logprobs":
        return {}, {"return_logprob": True, "top_logprobs_num": 5}
    if feature == "processor":
        from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

        processor = DisallowedTokensLogitsProcessor.to_str()
        return {"custom_params": {"token_ids": [1]}}, {"custom_logit_processor": processor}
    raise ValueError(f"unknown feature {feature!r}; choose from plain, json, logprobs, processor")


def read_records(path: str, offset: int = 0) -> list:
    """Step records from `path`, starting at byte `offset` (a partial last line is skipped)."""
    with open(path) as f:
        f.seek(offset)
        lines = f.read().split("\n")
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def intervals(records: list) -> list:
    """(record, interval ms, overhead ms) for each decode step followed by another decode step
    of the same process and batch size: interval = start to next start; overhead = interval -
    the step's phases - the timer's write of this record (`io_ms` of the next one)."""
    out = []
    for cur, nxt in zip(records, records[1:]):
        if cur["kind"] != "decode" or nxt["kind"] != "decode":
            continue
        if cur["pid"] != nxt["pid"] or cur["bs"] != nxt["bs"]:
            continue
        interval = (nxt["t_start"] - cur["t_start"]) * 1e3
        overhead = interval - sum(cur["phases"].values()) - nxt.get("io_ms", 0.0)
        out.append((cur, interval, overhead))
    return out


def _stat(values: list) -> dict:
    return {"mean": sum(values) / len(values) if values else None, "p50": percentile(values, 50)}


def breakdown(records: list, batch_size: int, skip: int = 0) -> Optional[dict]:
    """Mean/p50 ms per phase, step, interval and overhead over the decode steps at `batch_size`
    (the first `skip` of them dropped); None if there are none."""
    steps = [r for r in records if r["kind"] == "decode" and r["bs"] == batch_size][skip:]
    if not steps:
        return None
    chosen = {id(r) for r in steps}
    gaps = [(iv, oh) for r, iv, oh in intervals(records) if id(r) in chosen]
    names = [p for p in PHASE_ORDER if any(p in r["phases"] for r in steps)]
    names += sorted({p for r in steps for p in r["phases"]} - set(names))
    return {
        "batch_size": batch_size,
        "steps": len(steps),
        "phases_ms": {p: _stat([r["phases"].get(p, 0.0) for r in steps]) for p in names},
        "step_ms": _stat([sum(r["phases"].values()) for r in steps]),
        "interval_ms": _stat([iv for iv, _ in gaps]),
        "overhead_ms": _stat([oh for _, oh in gaps]),
    }


def _fmt(stat: dict) -> str:
    mean, p50 = stat["mean"], stat["p50"]
    return "-" if mean is None else f"{mean:7.3f} /{p50:7.3f}"


def format_table(rows: list, label: Optional[str] = None) -> str:
    names = []
    for row in rows:
        names += [p for p in row["phases_ms"] if p not in names]
    columns = [*names, "step", "overhead", "interval"]
    title = "== DFLASH decode step breakdown, ms (mean / p50)" + (f"  [{label}]" if label else "") + " =="
    lines = [title, f"{'bs':>4} {'steps':>6} " + " ".join(f"{c:>17}" for c in columns) + f" {'tau':>5}"]
    for row in rows:
        cells = [_fmt(row["phases_ms"].get(p, {"mean": None, "p50": None})) for p in names]
        cells += [_fmt(row["step_ms"]), _fmt(row["overhead_ms"]), _fmt(row["interval_ms"])]
        tau = row.get("accept_length")
        lines.append(
            f"{row['batch_size']:>4} {row['steps']:>6} "
            + " ".join(f"{c:>17}" for c in cells)
            + f" {'-' if tau is None else f'{tau:5.2f}'}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ server runs


def run_batch(
    url: str, batch_size: int, input_len: int, output_len: int, vocab: int, seed: int, feature: str = "plain"
) -> dict:
    """`batch_size` equal-length greedy requests in one call; returns their mean accept length."""
    import requests

    rng = random.Random(seed)
    ids = [[rng.randrange(2, vocab) for _ in range(input_len)] for _ in range(batch_size)]
    extra_sampling, extra_fields = feature_request(feature)
    sampling = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True, **extra_sampling}
    response = requests.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": sampling, **extra_fields}, timeout=3600
    )
    response.raise_for_status()
    out = response.json()
    metas = [o["meta_info"] for o in (out if isinstance(out, list) else [out])]
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    return {"accept_length": sum(m["completion_tokens"] for m in metas) / verify if verify else None}


def measure(args, records_path: str, env: dict) -> list:
    device = server.detect_device() if args.device == "auto" else args.device
    extra = ["--max-running-requests", str(max(args.batch_sizes))] + shlex.split(args.server_args)
    if "processor" in args.features:
        extra.append("--enable-custom-logit-processor")
    env = dict(env, SGLANG_DFLASH_STEP_TIMING=records_path)
    target, draft = (args.target, args.draft) if args.target else server.default_models()
    # The breakdown is of a step at the full width B, unless --adaptive lets the policy choose.
    name = "dflash" if args.adaptive else "dflash-fixed"
    config = server.ServerConfig(name, target, draft, args.num_draft_tokens, device, extra, env)
    log = os.path.join(os.path.dirname(records_path), "server-bench-step.log")
    print(f"starting the DFLASH server ({device}); step records -> {records_path}", flush=True)
    rows = []
    with server.ServerProcess(config, log) as proc:
        vocab = target_vocab(target) or args.vocab
        run_batch(proc.url, 1, 8, 8, vocab, seed=0)  # warm-up
        for feature in args.features:
            for bs in args.batch_sizes:
                server.flush_cache(proc.url)
                offset = os.path.getsize(records_path) if os.path.exists(records_path) else 0
                acc = run_batch(
                    proc.url, bs, args.input_len, args.output_len, vocab, seed=bs, feature=feature
                )
                time.sleep(0.2)
                row = breakdown(read_records(records_path, offset), bs, args.skip_steps)
                if row is None:
                    raise SystemExit(
                        f"no decode step records at batch size {bs} in {records_path}: is the worker "
                        "instrumented with StepTimer (SGLANG_DFLASH_STEP_TIMING)?"
                    )
                rows.append({**row, **acc, "feature": feature})
                print(f"[{feature}] " + format_table(rows[-1:], None).splitlines()[-1], flush=True)
    return rows


def target_vocab(target: str) -> Optional[int]:
    try:
        with open(os.path.join(target, "config.json")) as f:
            config = json.load(f)
    except OSError:
        return None
    return (config.get("text_config") or config).get("vocab_size")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", help="report this step-record file instead of starting a server")
    server.add_launch_args(p)
    p.add_argument(
        "--batch-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        help="default: 1,4,16 (with --records: every batch size in the file)",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="new tokens per request")
    p.add_argument("--skip-steps", type=int, default=2, help="first decode steps dropped per batch size")
    p.add_argument("--vocab", type=int, default=1000, help="prompt id range if the target config has none")
    p.add_argument("--simulate-acc-len", type=float, help="SGLANG_SIMULATE_ACC_LEN for the server")
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="let the verify width adapt (default: every step at the full width B)",
    )
    p.add_argument(
        "--features",
        type=lambda s: s.split(","),
        default=["plain"],
        help="kinds of request, each run at every batch size: plain, json, logprobs, processor",
    )
    p.add_argument("--output", help="write the breakdown as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.records and not args.batch_sizes:
        args.batch_sizes = [1, 4, 16]
    sim_env = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_SIMULATE_ACC_")}
    if args.simulate_acc_len is not None:
        sim_env["SGLANG_SIMULATE_ACC_LEN"] = str(args.simulate_acc_len)
    label = report.simulated_label(sim_env) if not args.records else None
    if args.records:
        records = read_records(args.records)
        sizes = args.batch_sizes or sorted({r["bs"] for r in records if r["kind"] == "decode"})
        rows = [r for r in (breakdown(records, bs, args.skip_steps) for bs in sizes) if r]
    else:
        out_dir = tempfile.mkdtemp(prefix="dflash-steps-")
        rows = measure(args, os.path.join(out_dir, "steps.jsonl"), sim_env if label else {})
    for feature in dict.fromkeys(r.get("feature", "plain") for r in rows):
        tag = ", ".join(x for x in (label, None if feature == "plain" else f"requests: {feature}") if x)
        print(format_table([r for r in rows if r.get("feature", "plain") == feature], tag or None))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"label": label, "simulated": bool(label), "rows": rows}, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())

"""Load test an SGLang server over a concurrency sweep, or compare servers it starts itself.

Against a running server (native /generate or OpenAI chat, both streamed):

    python scripts/serving/load_test.py --url http://127.0.0.1:30000 --concurrency 1,2,4,8 \\
        --num-requests 64 --max-new-tokens 256 [--endpoint chat] [--dataset gsm8k --dataset-path F]

Compare mode starts each server in turn (no speculation; DFLASH by this package; DFLASH by
SGLang's built-in worker, GPU only) and runs the same sweep against each:

    python scripts/serving/load_test.py --compare --target T --draft D --concurrency 1,4,16 --duration 60

With `--rounds R` the servers run side by side instead: all start first, and each level is
measured R times per server, the servers taking turns (the order reversed every other round,
the idle ones paused), so that a machine whose speed drifts during the run favours none of them.
Each level then pools its R rounds, and the per-round throughputs are kept in results.json.

Without --target the launch modes serve the tiny trained pair shipped in the package (a code
model: use `--dataset code`, its held-out prompts; on other text its acceptance is low). Per
level it reports TTFT, TPOT and per-token ITL (mean/p50/p90/p99), output tokens/s, requests/s,
errors and timeouts, and the mean acceptance length with its distribution; it writes
results.json, summary.csv, requests.csv and PNG plots to --output-dir.
`--simulate-acc-len X` runs (or declares) SGLANG_SIMULATE_ACC_LEN=X (with `--simulate-geometric`,
each request and position accepted independently at the rate of that mean: ours only); such
results are labelled simulated everywhere and are never real speedups.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import shlex
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts.serving.lib import prompts as prompt_sources  # noqa: E402
from scripts.serving.lib import report, runner, server  # noqa: E402
from sglang_dflash import knobs  # noqa: E402


def int_list(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def token_range(text: str) -> tuple[int, int]:
    """ "128" -> (128, 128); "64-192" -> (64, 192)."""
    low, _, high = text.partition("-")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected N or LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def output_length(bounds: tuple[int, int], index: int) -> int:
    """Request `index`'s max_new_tokens: drawn from `bounds` by a generator seeded with the
    index, so every server in a comparison gets the same length for the same request."""
    low, high = bounds
    return low if low == high else random.Random(index).randint(low, high)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("server (one of --url, --configs, --compare)")
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000")
    where.add_argument(
        "--configs", help=f"start these servers in turn, comma-separated from {','.join(server.CONFIGS)}"
    )
    where.add_argument("--compare", action="store_true", help="= --configs " + ",".join(server.CONFIGS))
    server.add_launch_args(where)

    load = p.add_argument_group("load")
    load.add_argument("--endpoint", choices=["generate", "chat"], default="generate")
    load.add_argument(
        "--dataset",
        choices=["synthetic", "code", "random-ids", "jsonl", "gsm8k", "mt-bench"],
        default="synthetic",
    )
    load.add_argument(
        "--input-len",
        type=int,
        default=256,
        help="random-ids: prompt length in tokens (--skip-tokenizer-init)",
    )
    load.add_argument("--dataset-path", help="JSONL file for jsonl / gsm8k / mt-bench")
    load.add_argument("--num-prompts", type=int, help="use only the first N prompts")
    load.add_argument("--tokenizer", help="chat template for /generate with chat prompts (default: server's)")
    load.add_argument("--model", default="default", help="model name in OpenAI requests")
    load.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    load.add_argument("--num-requests", type=int, default=64, help="measured requests per level")
    load.add_argument("--duration", type=float, help="seconds per level instead of --num-requests")
    load.add_argument("--warmup", type=int, default=-1, help="warm-up requests per level (-1: = concurrency)")
    load.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each level R times per server, the servers taking turns",
    )
    load.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    load.add_argument("--no-flush-cache", action="store_true", help="keep the radix cache between levels")

    sampling = p.add_argument_group("sampling")
    sampling.add_argument(
        "--max-new-tokens",
        type=token_range,
        default=(256, 256),
        help="N, or LOW-HIGH: each request's length drawn uniformly (the same per request on every server)",
    )
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")

    out = p.add_argument_group("output")
    out.add_argument("--output-dir", help="default: load_test_results/<timestamp>")
    out.add_argument(
        "--simulate-acc-len", type=float, help="SGLANG_SIMULATE_ACC_LEN (labels output simulated)"
    )
    out.add_argument(
        "--simulate-geometric",
        action="store_true",
        help="with --simulate-acc-len: each request's positions accepted independently "
        "(SGLANG_DFLASH_SIMULATE_ACC_METHOD=geometric; ours only, so not with dflash-builtin)",
    )
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.compare:
        args.configs = ",".join(server.CONFIGS)
    if bool(args.url) == bool(args.configs):
        p.error("give either --url or --configs/--compare")
    if args.configs and any(c not in server.CONFIGS for c in args.configs.split(",")):
        p.error(f"--configs: choose from {', '.join(server.CONFIGS)}")
    if args.dataset == "random-ids" and args.endpoint == "chat":
        p.error("--dataset random-ids sends token ids: use --endpoint generate")
    if args.simulate_geometric and (
        args.simulate_acc_len is None or "dflash-builtin" in (args.configs or "")
    ):
        p.error("--simulate-geometric: needs --simulate-acc-len, and SGLang's built-in does not know it")
    if args.rounds < 1 or (args.rounds > 1 and args.url):
        p.error("--rounds: R >= 1, and above 1 only for the servers this script starts (--configs/--compare)")
    return args


def sampling_params(args, index: int = 0) -> dict:
    params = {"max_new_tokens": output_length(args.max_new_tokens, index), "temperature": args.temperature}
    if args.top_p is not None:
        params["top_p"] = args.top_p
    if args.top_k is not None:
        params["top_k"] = args.top_k
    if args.ignore_eos:
        params["ignore_eos"] = True
    return params


def payload_fn(args, url: str, prompts: list):
    """Request index -> payload, cycling through the prompts."""
    from scripts.serving.lib import client

    if args.endpoint == "chat":
        messages = [p.as_messages() for p in prompts]
        return lambda i: client.chat_payload(
            messages[i % len(messages)], sampling_params(args, i), args.model
        )
    if prompts[0].input_ids is not None:
        return lambda i: client.generate_payload(
            None, sampling_params(args, i), input_ids=prompts[i % len(prompts)].input_ids
        )
    template = None
    if any(p.text is None for p in prompts):
        template = chat_template(args.tokenizer or server_tokenizer(url))
    texts = [p.as_text(template) for p in prompts]
    return lambda i: client.generate_payload(texts[i % len(texts)], sampling_params(args, i))


def server_tokenizer(url: str) -> str:
    import requests

    info = requests.get(url + "/model_info", timeout=30).json()
    return info.get("tokenizer_path") or info["model_path"]


def chat_template(tokenizer_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return lambda messages: tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def server_kind(url: str) -> str:
    """baseline / dflash / dflash-builtin / <other speculative algorithm>, from /server_info."""
    info = server.server_info(url)
    algorithm = info.get("speculative_algorithm")
    if not algorithm:
        return "baseline"
    if algorithm != "DFLASH":
        return algorithm.lower()
    impl = info["internal_states"][0].get("dflash_implementation", "")
    return "dflash" if impl.startswith("sglang-dflash") else "dflash-builtin"


def level_spec(args, concurrency: int) -> runner.LevelSpec:
    return runner.LevelSpec(
        concurrency=concurrency,
        num_requests=None if args.duration else args.num_requests,
        duration=args.duration,
        warmup=concurrency if args.warmup < 0 else args.warmup,
        timeout=args.timeout,
        flush_cache=not args.no_flush_cache,
        progress=not args.no_progress,
    )


def sweep(args, url: str, name: str, prompts: list) -> dict:
    make_payload = payload_fn(args, url, prompts)
    levels = [
        runner.run_level(url, args.endpoint, make_payload, level_spec(args, c)) for c in args.concurrency
    ]
    return {"server": name, "url": url, "endpoint": args.endpoint, "levels": levels}


def sweep_in_turns(args, procs: dict, prompts: list) -> list:
    """Every level on every server (name -> running `ServerProcess`), `args.rounds` rounds each,
    the servers taking turns: round r runs them in order, round r+1 in reverse, each resumed for
    its turn and paused after it."""
    payloads = {name: payload_fn(args, proc.url, prompts) for name, proc in procs.items()}
    levels: dict = {name: [] for name in procs}
    for proc in procs.values():
        proc.pause()
    for concurrency in args.concurrency:
        turn = {
            name: runner.Level(procs[name].url, args.endpoint, payloads[name], level_spec(args, concurrency))
            for name in procs
        }
        for r in range(args.rounds):
            for name in list(procs) if r % 2 == 0 else list(procs)[::-1]:
                procs[name].resume()
                if r == 0:
                    turn[name].warm_up()
                turn[name].measure()
                procs[name].pause()
        for name in procs:
            procs[name].resume()
            levels[name].append(turn[name].result())
            procs[name].pause()
    for proc in procs.values():
        proc.resume()
    return [
        {"server": name, "url": procs[name].url, "endpoint": args.endpoint, "levels": levels[name]}
        for name in procs
    ]


def launch_and_sweep(args, prompts: list, out_dir: str, env: dict) -> tuple:
    if args.target:
        target, draft = args.target, args.draft
    else:
        target, draft = server.default_models()
    device = server.detect_device() if args.device == "auto" else args.device
    runs, skipped, configs = [], [], []
    for name in args.configs.split(","):
        config = server.ServerConfig(
            name, target, draft, args.num_draft_tokens, device, shlex.split(args.server_args), env
        )
        reason = config.skip_reason()
        if reason:
            print(f"== {name}: {reason}", flush=True)
            skipped.append({"server": name, "reason": reason})
        else:
            configs.append(config)
    if args.rounds > 1:
        with contextlib.ExitStack() as stack:
            procs = {}
            for config in configs:
                print(f"== {config.name}: starting the server ({device}) ...", flush=True)
                log = os.path.join(out_dir, f"server-{config.name}.log")
                procs[config.name] = stack.enter_context(server.ServerProcess(config, log))
                procs[config.name].pause()  # (idle, it would poll on a core while the next starts)
            return sweep_in_turns(args, procs, prompts), skipped
    for config in configs:
        print(f"== {config.name}: starting the server ({device}) ...", flush=True)
        with server.ServerProcess(config, os.path.join(out_dir, f"server-{config.name}.log")) as proc:
            runs.append(sweep(args, proc.url, config.name, prompts))
    return runs, skipped


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.no_plots:
        report.require_plotting()  # before any work: the plots come last
    prompts = prompt_sources.load(args.dataset, args.dataset_path, args.num_prompts, args.input_len)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = args.output_dir or os.path.join("load_test_results", stamp)
    os.makedirs(out_dir, exist_ok=True)

    sim_env = {k: v for k, v in os.environ.items() if k.startswith(report.SIMULATION_PREFIX)}  # SGLang's
    if args.simulate_acc_len is not None:
        sim_env["SGLANG_SIMULATE_ACC_LEN"] = str(args.simulate_acc_len)
    if args.simulate_geometric or knobs.value("SGLANG_DFLASH_SIMULATE_ACC_METHOD") == "geometric":
        sim_env["SGLANG_DFLASH_SIMULATE_ACC_METHOD"] = "geometric"
    label = report.simulated_label(sim_env)
    if label:
        print(f"!! {label}", flush=True)

    if args.url:
        runs, skipped = [sweep(args, args.url.rstrip("/"), server_kind(args.url), prompts)], []
    else:
        runs, skipped = launch_and_sweep(args, prompts, out_dir, sim_env if label else {})
    results = {
        "tool": "sglang-dflash scripts/serving/load_test.py",
        "created": stamp,
        "label": label,
        "simulated": bool(label),
        "args": vars(args),
        "skipped": skipped,
        "runs": runs,
        "speedups": report.speedups(runs) if len(runs) > 1 else [],
    }

    report.write_json(os.path.join(out_dir, "results.json"), results)
    report.write_csv(os.path.join(out_dir, "summary.csv"), report.summary_rows(results))
    report.write_csv(os.path.join(out_dir, "requests.csv"), report.request_rows(results))
    plots = [] if args.no_plots else report.plot(results, out_dir)
    print()
    for run in runs:
        print(report.summary_table(run, label) + "\n")
    if results["speedups"]:
        print(report.speedup_table(results["speedups"], label) + "\n")
    print(f"results: {out_dir}/results.json, summary.csv, requests.csv" + (", " if plots else ""), end="")
    print(", ".join(os.path.basename(p) for p in plots))
    failed = sum(
        lvl["summary"]["requests"] - lvl["summary"]["completed"] for r in runs for lvl in r["levels"]
    )
    if failed:
        print(f"{failed} request(s) failed or timed out (see results.json error_kinds)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

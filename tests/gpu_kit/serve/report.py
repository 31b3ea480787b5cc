"""The kit's report: the race table and start-up times, from the results the steps left.

    python -m tests.gpu_kit.serve.report STATE_DIR > report.md

Reads STATE_DIR/lossless*.json, STATE_DIR/race-baseline/, race-width1/ and
race-<acc>-<server>[@<tag>]/results.json
(scripts/serving/load_test.py) and those runs' server logs, for SGLang's CUDA-graph capture lines, our
draft-graph and warm-up lines, the seconds from the first log line to "ready to roll", and our
`draft_forward=` start-up line.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re

SERVERS = ("baseline", "dflash", "dflash-builtin")
NAMES = {"baseline": "no speculation", "dflash": "sglang-dflash", "dflash-builtin": "SGLang built-in"}
STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def startup(log_text: str) -> dict:
    """Seconds of the start-up phases that a server log states. E.g. "Capture decode cuda
    graph end. bs=[1, 2], elapsed=33.10 s" -> {"capture decode cuda graph": 33.1}."""
    out = {}
    for name, seconds in re.findall(r"Capture (.+?) end\..*?elapsed=([\d.]+) s", log_text):
        out[f"capture {name}"] = float(seconds)
    draft = re.search(
        r"DFLASH draft step: CUDA graphs for batch sizes .*?\(([\d.]+) GB, ([\d.]+) s;", log_text
    )
    if draft:
        out["capture draft step (sglang-dflash)"] = float(draft.group(2))
    warm = re.search(r"DFLASH warm-up .*?: ([\d.]+) s", log_text)
    if warm:
        out["warm-up (sglang-dflash)"] = float(warm.group(1))
    timings = re.search(r"Engine startup timings \(s\): (.*)", log_text)
    if timings:  # SGLang's own: load_weight=..., kv_cache_allocation=..., cuda_graph={...}, ...
        for name, seconds in re.findall(r"(\w+)=([\d.]+)", timings.group(1)):
            if float(seconds) > 0:
                out[f"sglang {name}"] = float(seconds)
    stamps = STAMP.findall(log_text)
    ready = re.search(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]]*\][^\n]*ready to roll", log_text)
    if stamps and ready:
        parse = datetime.datetime.fromisoformat
        out["log start to ready"] = (parse(ready.group(1)) - parse(stamps[0])).total_seconds()
    return out


def race_rows(state: str) -> list[dict]:
    """One row per (acceptance, concurrency, server) measured."""
    rows = []
    for path in sorted(glob.glob(os.path.join(state, "race-*", "results.json"))):
        # race-baseline, race-width1 or race-<acceptance>-<server>, the acceptance geo-<mean>
        # when geometric; @<tag> after it for a second set of levels (one table holds both)
        folder = os.path.basename(os.path.dirname(path))
        acc, server = re.match(r"race-(?:((?:geo-)?[\d.]+)-)?([^@]+)", folder).groups()
        with open(path) as f:
            results = json.load(f)
        for run in results["runs"]:
            for level in run["levels"]:
                s = level["summary"]
                rows.append(
                    dict(
                        acc=acc,
                        server=server,
                        concurrency=level["concurrency"],
                        tok_s=s["output_throughput"],
                        tpot_ms=s["tpot_ms"]["mean"],
                        accept=(s.get("acceptance") or {}).get("accept_length_sglang"),
                        failed=s["requests"] - s["completed"],
                        widths=(level.get("server_acceptance") or {}).get("verify_width_histogram") or {},
                    )
                )
    return rows


def fmt(x, spec=".0f") -> str:
    return "-" if x is None else format(x, spec)


def acceptance_order(acc: str) -> tuple:
    """SGLang's simulated acceptances first, then the geometric ones (geo-<mean>), by mean."""
    return (acc.startswith("geo-"), float(acc.removeprefix("geo-")))


def widths_cell(hist: dict) -> str:
    """The verify widths chosen at a level, most used first, with their shares: `8 61%, 4 30%`."""
    total = sum(hist.values())
    if not total:
        return "-"
    top = sorted(hist.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{w} {n / total:.0%}" for w, n in top)


def race_table(rows: list[dict]) -> str:
    """Per acceptance and concurrency: tok/s and TPOT of each server, ours (adaptive) / the
    built-in, / no speculation and / ours at B (`dflash-fixed`), and the widths ours chose.
    The baseline runs once (acceptance does not apply to it) and is repeated in each block.
    A geometric acceptance (geo-<mean>) is ours only: no built-in there."""
    base = {r["concurrency"]: r for r in rows if r["server"] == "baseline"}
    lines = [
        "| simulated acceptance | concurrency | no speculation tok/s | sglang-dflash tok/s (TPOT ms) "
        "| SGLang built-in tok/s (TPOT ms) | ours at B tok/s | ours / built-in | ours / no speculation "
        "| ours / ours at B | widths chosen |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    speculated = [r for r in rows if r["server"] not in ("baseline", "width1")]
    for acc in sorted({r["acc"] for r in speculated}, key=acceptance_order):
        for c in sorted({r["concurrency"] for r in rows}):
            got = {r["server"]: r for r in rows if r["acc"] == acc and r["concurrency"] == c}
            ours, builtin, plain = got.get("dflash"), got.get("dflash-builtin"), base.get(c)
            fixed = got.get("dflash-fixed")

            def cell(r):
                return "-" if r is None else f"{fmt(r['tok_s'])} ({fmt(r['tpot_ms'], '.1f')})"

            def ratio(a, b):
                ok = a and b and a["tok_s"] and b["tok_s"]
                return f"{a['tok_s'] / b['tok_s']:.2f}x" if ok else "-"

            plain_cell = fmt(plain["tok_s"]) if plain else "-"
            fixed_cell = fmt(fixed["tok_s"]) if fixed else "-"
            lines.append(
                f"| {acc} | {c} | {plain_cell} | {cell(ours)} | {cell(builtin)} | {fixed_cell} "
                f"| {ratio(ours, builtin)} | {ratio(ours, plain)} | {ratio(ours, fixed)} "
                f"| {widths_cell(ours['widths']) if ours else '-'} |"
            )
    return "\n".join(lines)


WIDTH1_GOAL = 1.03  # a W = 1 step within 3% of a plain decode step


def width1_table(rows: list[dict]) -> str:
    """Ours with every step at width 1 (the kit's width1 step) against no speculation, per
    concurrency: a W = 1 step emits one token per request, as plain decode does, so the
    baseline's throughput over ours is our step's time over the plain step's. '' when not run."""
    base = {r["concurrency"]: r for r in rows if r["server"] == "baseline"}
    ours = sorted((r for r in rows if r["server"] == "width1"), key=lambda r: r["concurrency"])
    if not ours:
        return ""
    lines = [
        "| concurrency | no speculation tok/s (TPOT ms) | ours at W = 1 tok/s (TPOT ms) "
        f"| W = 1 step / plain step | within {WIDTH1_GOAL - 1:.0%} |",
        "|---|---|---|---|---|",
    ]
    for r in ours:
        plain = base.get(r["concurrency"])
        ok = plain and plain["tok_s"] and r["tok_s"]
        ratio = plain["tok_s"] / r["tok_s"] if ok else None
        verdict = "-" if ratio is None else ("yes" if ratio <= WIDTH1_GOAL else "no")
        plain_cell = f"{fmt(plain['tok_s'])} ({fmt(plain['tpot_ms'], '.1f')})" if plain else "-"
        lines.append(
            f"| {r['concurrency']} | {plain_cell} | {fmt(r['tok_s'])} ({fmt(r['tpot_ms'], '.1f')}) "
            f"| {fmt(ratio, '.3f')}x | {verdict} |"
        )
    return "\n".join(lines)


def startup_table(state: str) -> str:
    lines = ["| server log | phase | seconds |", "|---|---|---|"]
    for log in sorted(glob.glob(os.path.join(state, "race-*", "server-*.log"))):
        with open(log, errors="replace") as f:
            phases = startup(f.read())
        where = os.path.relpath(log, state)
        lines += [f"| {where} | {name} | {seconds:.1f} |" for name, seconds in phases.items()]
    return "\n".join(lines)


def norm_paths(state: str) -> list[str]:
    """The `draft_forward=` start-up lines of our DFLASH servers: which kernels served the fused
    draft layers (the norm path: FlashInfer's CuTe DSL or its CUDA JIT)."""
    found = set()
    for log in glob.glob(os.path.join(state, "race-*", "server-*.log")) + glob.glob(
        os.path.join(state, "*.log")
    ):
        with open(log, errors="replace") as f:
            found.update(m.strip() for m in re.findall(r"(draft_forward=[^\n]*)", f.read()))
    return sorted(found)


def body(state: str) -> str:
    """The lossless verdicts, the race table and the start-up phases, as markdown."""
    out = []
    for lossless in sorted(glob.glob(os.path.join(state, "lossless*.json"))):
        with open(lossless) as f:
            result = json.load(f)
        out.append(f"## Lossless, greedy: {os.path.basename(lossless)}\n")
        for name, run in result["runs"].items():
            out.append(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in run.items()))
        if "tie_rule" in result:
            out.append(f"- near-tie rule: {result['tie_rule']}")
        out.append(f"- lossless: {result.get('lossless', 'not finished')}\n")
    rows = race_rows(state)
    if rows:
        out.append("## Race (dummy weights, SGLANG_SIMULATE_ACC_LEN; simulated, not real speedups)\n")
        out.append(race_table(rows) + "\n")
        width1 = width1_table(rows)
        if width1:
            out.append("## The W = 1 step against a plain decode step (SGLANG_DFLASH_TEST_WIDTHS=1)\n")
            out.append(width1 + "\n")
        machines = set()
        for path in glob.glob(os.path.join(state, "race-*", "machine.txt")):
            with open(path) as f:
                machines.add(f.read().strip())
        if len(machines) > 1:
            out.append(
                f"**Measured on {len(machines)} different machines**: the ratios are not side by side.\n"
            )
        else:
            out.append(f"Measured on one machine: {next(iter(machines), 'unknown')}.\n")
        failed = sum(r["failed"] for r in rows)
        if failed:
            out.append(f"{failed} request(s) failed or timed out: see the results.json files\n")
    startups = startup_table(state)
    if startups.count("\n") > 1:
        out.append("## Start-up, from the server logs\n")
        out.append(startups + "\n")
    paths = norm_paths(state)
    if paths:
        out.append("## Draft layers as served\n\n" + "\n".join(f"- `{p}`" for p in paths) + "\n")
    return "\n".join(out)


def main(state: str) -> None:
    print("# GPU serving check\n")
    print(body(state))

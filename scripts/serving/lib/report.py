"""Load-test outputs: summary and speedup tables, JSON, CSV and PNG plots.

`results` is the JSON document `serving/load_test.py` writes: {"label", "simulated", "runs": [{"server",
"levels": [{"concurrency", "summary", "server_acceptance", "requests"}, ...]}, ...], ...}.
A run with simulated acceptance carries its label in every output: table titles, JSON,
each CSV row and plot titles.
"""

from __future__ import annotations

import csv
import json
import os
import textwrap
from typing import Optional

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


# The environment of a simulated-acceptance run: SGLang's knobs, and our geometric method.
SIMULATION_PREFIX = "SGLANG_SIMULATE_ACC_"  # SGLang's (ours, SGLANG_DFLASH_SIMULATE_ACC_METHOD, from knobs)
SIMULATION_KNOBS = (
    "SGLANG_SIMULATE_ACC_METHOD",
    "SGLANG_SIMULATE_ACC_TOKEN_MODE",
    "SGLANG_DFLASH_SIMULATE_ACC_METHOD",
)


def simulated_label(env: dict) -> Optional[str]:
    """The warning label of a simulated-acceptance run, or None for a real one."""
    value = env.get("SGLANG_SIMULATE_ACC_LEN")
    if value in (None, "", "-1"):
        return None
    extra = [f"{k}={env[k]}" for k in SIMULATION_KNOBS if k in env]
    knobs = ", ".join([f"SGLANG_SIMULATE_ACC_LEN={value}", *extra])
    return f"SIMULATED ACCEPTANCE ({knobs}): system efficiency only, not a real speedup"


def accept_length(level: dict) -> tuple[Optional[float], str]:
    """Mean acceptance length of a level and where it came from."""
    client_side = level["summary"].get("acceptance") or {}
    if client_side.get("accept_length_mean") is not None:
        return client_side["accept_length_mean"], "requests"
    server_side = level.get("server_acceptance") or {}
    if server_side.get("accept_length_mean") is not None:
        return server_side["accept_length_mean"], "prometheus"
    if client_side.get("accept_length_sglang") is not None:
        return client_side["accept_length_sglang"], "requests (completion/verify)"
    info = (level.get("server_info_avg_accept_length") or {}).get("after")
    if info is not None:
        return info, "server_info (lifetime)"
    return None, ""


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pcts(stat: dict) -> str:
    return "/".join(_fmt(stat.get(k)) for k in ("p50", "p90", "p99"))


def summary_table(run: dict, label: Optional[str]) -> str:
    title = f"== {run['server']} @ {run['url']} ({run['endpoint']})"
    lines = [title + (f"  [{label}]" if label else "") + " =="]
    header = (
        f"{'conc':>5} {'reqs':>5} {'ok':>5} {'err':>4} {'tmo':>4} {'out tok/s':>10} {'req/s':>7} "
        f"{'TTFT p50/90/99 ms':>22} {'TPOT p50/90/99 ms':>20} {'ITL p50/90/99 ms':>20} {'accept len':>11}"
    )
    lines.append(header)
    for level in run["levels"]:
        s = level["summary"]
        tau, _ = accept_length(level)
        lines.append(
            f"{level['concurrency']:>5} {s['requests']:>5} {s['completed']:>5} {s['errors']:>4} "
            f"{s['timeouts']:>4} {_fmt(s['output_throughput']):>10} {_fmt(s['request_throughput'], 2):>7} "
            f"{_pcts(s['ttft_ms']):>22} {_pcts(s['tpot_ms']):>20} {_pcts(s['itl_ms']):>20} "
            f"{_fmt(tau, 2):>11}"
        )
    return "\n".join(lines)


def speedups(runs: list) -> list:
    """Per concurrency: each speculative run's output throughput and TPOT p50 against baseline,
    and ours against the built-in when both ran."""
    by_name = {run["server"]: {lvl["concurrency"]: lvl["summary"] for lvl in run["levels"]} for run in runs}
    base = by_name.get("baseline")
    rows = []
    for conc in sorted({c for levels in by_name.values() for c in levels}):
        row = {"concurrency": conc}
        for name, levels in by_name.items():
            if name == "baseline" or conc not in levels:
                continue
            row[f"{name}_output_throughput"] = levels[conc]["output_throughput"]
            if base and conc in base:
                row[f"{name}_speedup"] = _ratio(
                    levels[conc]["output_throughput"], base[conc]["output_throughput"]
                )
                row[f"{name}_tpot_speedup"] = _ratio(
                    base[conc]["tpot_ms"]["p50"], levels[conc]["tpot_ms"]["p50"]
                )
        if "dflash" in by_name and "dflash-builtin" in by_name and conc in by_name["dflash-builtin"]:
            ours, theirs = by_name["dflash"].get(conc), by_name["dflash-builtin"][conc]
            if ours:
                row["dflash_vs_builtin"] = _ratio(ours["output_throughput"], theirs["output_throughput"])
        rows.append(row)
    return rows


def _ratio(a, b) -> Optional[float]:
    return a / b if a is not None and b else None


def speedup_table(rows: list, label: Optional[str]) -> str:
    if not rows:
        return ""
    keys = [k for k in rows[0] if k != "concurrency"]
    for row in rows[1:]:
        keys += [k for k in row if k != "concurrency" and k not in keys]
    title = "== speedups (output tokens/s vs baseline; tpot = TPOT p50 baseline / this)"
    lines = [title + (f"  [{label}]" if label else "") + " =="]
    lines.append(f"{'conc':>5} " + " ".join(f"{k:>26}" for k in keys))
    for row in rows:
        digits = {k: (1 if k.endswith("throughput") else 2) for k in keys}
        cells = " ".join(f"{_fmt(row.get(k), digits[k]):>26}" for k in keys)
        lines.append(f"{row['concurrency']:>5} {cells}")
    return "\n".join(lines)


def summary_rows(results: dict) -> list:
    rows = []
    for run in results["runs"]:
        for level in run["levels"]:
            s = level["summary"]
            tau, source = accept_length(level)
            row = {"server": run["server"], "endpoint": run["endpoint"], "concurrency": level["concurrency"]}
            row["simulated_acceptance"] = results.get("label") or ""
            for key in ("requests", "completed", "errors", "timeouts", "duration_s", "input_tokens"):
                row[key] = s[key]
            for key in ("output_tokens", "output_throughput", "request_throughput"):
                row[key] = s[key]
            for name in LATENCIES:
                for stat, value in s[name].items():
                    row[f"{name[:-3]}_{stat}_ms"] = value
            row["accept_length_mean"], row["accept_length_source"] = tau, source
            rows.append(row)
    return rows


def request_rows(results: dict) -> list:
    rows = []
    for run in results["runs"]:
        for level in run["levels"]:
            for request in level["requests"]:
                rows.append({"server": run["server"], "concurrency": level["concurrency"], **request})
    for row in rows:
        row["simulated_acceptance"] = results.get("label") or ""
    return rows


def write_csv(path: str, rows: list) -> None:
    fields: list = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:  # lists and dicts (e.g. a request's step histogram) as JSON text
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})


def write_json(path: str, results: dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)


def require_plotting() -> None:
    """Exit with one line if matplotlib (the `bench` extra) is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(
            "error: the plots need matplotlib: pip install 'sglang-dflash[bench]' "
            "(or pip install matplotlib), or pass --no-plots"
        )


def plot(results: dict, out_dir: str) -> list:
    """throughput.png, latency.png, and when runs reported them, acceptance.png and widths.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = results.get("label")
    suffix = "\n" + textwrap.fill(label, 72) if label else ""
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in results["runs"]:
        conc = [lvl["concurrency"] for lvl in run["levels"]]
        axes[0].plot(
            conc, [lvl["summary"]["output_throughput"] for lvl in run["levels"]], "o-", label=run["server"]
        )
        axes[1].plot(
            conc, [lvl["summary"]["request_throughput"] for lvl in run["levels"]], "o-", label=run["server"]
        )
    for ax, ylabel in zip(axes, ("output tokens / s", "requests / s")):
        _concurrency_axis(ax, results)
        ax.set(ylabel=ylabel, ylim=(0, None))
        ax.legend()
    fig.suptitle("Throughput vs concurrency" + suffix, fontsize=10)
    paths.append(_save(fig, out_dir, "throughput.png"))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {"p50": "-", "p90": "--", "p99": ":"}
    for ax, name in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms")):
        for i, run in enumerate(results["runs"]):
            conc = [lvl["concurrency"] for lvl in run["levels"]]
            for stat, style in styles.items():
                values = [lvl["summary"][name][stat] for lvl in run["levels"]]
                ax.plot(conc, values, style, marker="o", color=f"C{i}", label=f"{run['server']} {stat}")
        _concurrency_axis(ax, results)
        ax.set(title=name[:-3].upper(), ylabel="ms", ylim=(0, None))
    axes[0].legend(fontsize=7)
    fig.suptitle("Latency percentiles vs concurrency" + suffix, fontsize=10)
    paths.append(_save(fig, out_dir, "latency.png"))

    spec_runs = [run for run in results["runs"] if any(_histogram(lvl) for lvl in run["levels"])]
    if spec_runs:
        width = max(7.5, 6 * len(spec_runs))
        fig, axes = plt.subplots(1, len(spec_runs), figsize=(width, 4.6), squeeze=False)
        for ax, run in zip(axes[0], spec_runs):
            levels = [lvl for lvl in run["levels"] if _histogram(lvl)]
            width = 0.8 / len(levels)
            for j, lvl in enumerate(levels):
                hist = _histogram(lvl)
                total = sum(hist.values())
                xs = sorted(hist)
                tau, _ = accept_length(lvl)
                ax.bar(
                    [x - 0.4 + width * (j + 0.5) for x in xs],
                    [hist[x] / total for x in xs],
                    width,
                    label=f"c={lvl['concurrency']} (mean {_fmt(tau, 2)})",
                )
            ax.set_xticks(sorted({x for lvl in levels for x in _histogram(lvl)}))
            ax.set(title=run["server"], xlabel="accepted tokens per verify step (bonus included)")
            ax.set(ylabel="fraction of steps")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
        fig.suptitle("Acceptance length distribution" + suffix, fontsize=10)
        paths.append(_save(fig, out_dir, "acceptance.png"))

    width_runs = [run for run in results["runs"] if any(_widths(lvl) for lvl in run["levels"])]
    if width_runs:
        fig, axes = plt.subplots(1, len(width_runs), figsize=(6 * len(width_runs), 4.2), squeeze=False)
        for ax, run in zip(axes[0], width_runs):
            levels = [lvl for lvl in run["levels"] if _widths(lvl)]
            labels = [str(lvl["concurrency"]) for lvl in levels]
            all_widths = sorted({w for lvl in levels for w in _widths(lvl)})
            bottom = [0.0] * len(levels)
            for w in all_widths:
                shares = [_widths(lvl).get(w, 0) / sum(_widths(lvl).values()) for lvl in levels]
                ax.bar(labels, shares, bottom=bottom, label=f"W={w}" + (" (no draft)" if w == 1 else ""))
                bottom = [b + x for b, x in zip(bottom, shares)]
            ax.set(title=run["server"], xlabel="concurrency", ylabel="fraction of decode steps")
            ax.legend(fontsize=7)
        fig.suptitle("Verify width chosen per decode step" + suffix, fontsize=10)
        paths.append(_save(fig, out_dir, "widths.png"))
    return paths


def _widths(level: dict) -> dict:
    """{verify width: decode steps}, from the server's counters (empty if it did not report)."""
    hist = (level.get("server_acceptance") or {}).get("verify_width_histogram") or {}
    return {int(k): v for k, v in hist.items()}


def _concurrency_axis(ax, results: dict) -> None:
    levels = sorted({lvl["concurrency"] for run in results["runs"] for lvl in run["levels"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrency")
    ax.grid(alpha=0.3)


def _histogram(level: dict) -> dict:
    """{accept length: steps}, from the requests or else the server's counters."""
    hist = (level["summary"].get("acceptance") or {}).get("accept_length_histogram")
    if not hist:
        hist = (level.get("server_acceptance") or {}).get("accept_length_histogram")
    return {int(k): v for k, v in (hist or {}).items()}


def _save(fig, out_dir: str, name: str) -> str:
    """Save as PNG; the figure title (with any simulated label) also goes in the PNG's Title."""
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    title = fig.get_suptitle().replace("\n", " ") or name
    fig.savefig(path, dpi=110, metadata={"Title": title})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

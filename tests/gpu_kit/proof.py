"""The GPU numbers from one command, in priority order, within a deadline (`make gpu-proof`).

    python -m tests.gpu_kit.proof [--steps lossless,lossless-widths,race-6.5,bench-draft-step]
                                [--deadline 540]
                                [--bundle .gpu-bundle] [--state .gpu-bundle/state] [--out DIR]
                                [--device cuda|cpu] [--lossless-pairs trained,random]
                                [--lossless-runs overlap[,no-overlap]] [--race-concurrency 1,8,32]
                                [--race-seconds 10] [--race-servers dflash,dflash-builtin,baseline]
                                [--families gpt_oss,gemma4,...] [--matrix-parallel 3]

Made for a GPU machine lent by the command: 10 minutes a command, 64 MiB carried, a fresh bare
machine each time (Python, a CUDA PyTorch and nvcc; no SGLang, FlashInfer or package index).
Everything else travels in `.gpu-bundle/serve` (tests/gpu_kit/bundle.py --serve) and FlashInfer's
precompiled kernels in `.gpu-bundle/aot` (tests/gpu_kit/aot.py).

Prerequisites, overlapped: the bundle is unpacked first (everything needs it); then, at once,
`sglang_dflash._C` builds and SGLang's own JIT kernels compile in background processes on the
CPU cores, the draft-step benchmark starts on the idle GPU, and the models and SGLang's import
are checked in the foreground. The steps, in the order given (default: priority order):

  lossless          per pair, the plain engine against our DFLASH (overlap on;
                    `lossless-no-overlap` for off), greedy, FlashInfer, CUDA graphs including
                    the draft step's: the shipped trained pair, whose proposals are accepted,
                    and a random pair whose draft repeats a target layer (serve/lossless.py)
  lossless-widths   the same, every decode step forced through the verify widths with a
                    graph each, in turn (SGLANG_DFLASH_TEST_WIDTHS; width/verify_widths.py)
  race-<acc>        a Qwen3-8B-shaped target and its DFlash draft, dummy weights,
                    SGLANG_SIMULATE_ACC_LEN=<acc>: the --race-servers in order (our DFLASH,
                    SGLang's built-in, ours at B as dflash-fixed, no speculation once per state),
                    at each concurrency for --race-seconds; race-geo-<acc>: ours only, each
                    request and position accepted independently at the rate of that mean
  bench-draft-step  the draft step against its memory-bound limit (scripts/bench/draft_step.py),
                    started during the prerequisites; this step collects it
  standin-tests     the sgl_kernel stand-in's kernels against PyTorch (a second call)
  matrix            `make gpu-matrix`: each target family of --families (default all, in
                    priority order: tests/gpu_kit/serve/families.py), its tiny pair built on the
                    machine, the plain engine against our DFLASH (serve/lossless.py: greedy at
                    batch 1, all prompts together, then a prefix-cache round), up to
                    --matrix-parallel families at once, each in its own process

Before each step (and each race server) the time it is expected to take is compared with the
time left to the deadline: a step that cannot finish is skipped and the skip reported. Every
child runs under the time left. After every step the report (`gpu-proof-report.md`), the
step records (`gpu-proof.json`) and one archive of the results and logs
(`gpu-proof-results.tar.gz`) are in --out, so a command stopped at its limit still returns
what finished. The report times every server's start-up phases, so
the next estimate is a measurement.

On CPU (`--device cpu`) the same steps run on SGLang's CPU engine with the tiny models (the
race too), the GPU-only pieces skipped and said so: tests/engine/test_gpu_kit_rehearsal.py runs it, so a
broken script is found in CI, not on the GPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu_kit.serve import report  # noqa: E402

DEFAULT_STEPS = "lossless,lossless-widths,race-6.5,bench-draft-step"
STEPS = (
    "lossless",
    "lossless-widths",
    "lossless-no-overlap",
    "bench-draft-step",
    "standin-tests",
    "matrix",
    "width1",
)  # race-<acc>, race-more-<acc>
# make gpu-first, the first command whenever a GPU is at hand (tests/gpu_kit/README.md): what
# its deadline must hold by the CUDA estimates (tests/unit/gpu_kit/test_proof.py checks it), then
# what runs while time is left, in order. One plain engine per lossless pair: its tokens are
# the oracle of one DFLASH run that cycles through every verify width with overlap on.
FIRST_MUST = ("lossless-widths", "race-3")
FIRST_IF_TIME = ("race-more-3", "race-6.5", "width1", "bench-draft-step")
# Each plan's defaults for the options not given (proof: make gpu-proof and the targets that
# give their own --steps).
PLANS = {
    "proof": dict(
        steps=DEFAULT_STEPS, race_concurrency="1,8,32", race_more_concurrency="", width1_concurrency="1,8",
        race_seconds=10.0, bench_batch_sizes="1,8,32",
    ),
    "first": dict(
        steps=",".join(FIRST_MUST + FIRST_IF_TIME), race_concurrency="1,32,128,256",
        race_more_concurrency="8,64", width1_concurrency="1,32", race_seconds=6.0,
        bench_batch_sizes="1",  # the draft step, plan-free against split-KV, at bs 1
    ),
}  # fmt: skip
# GPU tests that need SGLang's kit (the sgl_kernel stand-in): here, not in make gpu-check.
STANDIN_TESTS = ("tests/unit/gpu_kit/test_sgl_kernel_standin.py",)
RACE_SERVERS = ("dflash", "dflash-builtin", "baseline")  # ours, the built-in, no speculation
REPORT_MARGIN = 10.0  # seconds kept at the end for the last report
RESULTS_ARCHIVE = "gpu-proof-results.tar.gz"  # in --out: results.json/csv, server and step logs

# Expected seconds, per device: what a step is allowed to start with. The CUDA ones were
# measured on an H100 (2026-11-26, tests/gpu_kit/README.md, "Time plan"), rounded up.
ESTIMATES = {
    "cuda": {
        "unpack": 15,  # measured 9-10 s
        "lossless-engine": 35,  # per engine of a lossless pair: 21-51 s to start, then 8 x 64 tokens
        # An 8B dummy server: its start-up (about 25 s, graphs included) and its load test's own
        # start and end; then each level for --race-seconds plus its drain ("race-level"). Three
        # levels of 10 s measured 83-92 s: 55 + 3 x (10 + 5) = 100.
        "race-server": 55,
        "race-level": 5,
        "bench-draft-step": 5,  # collected; it ran in the background (about 25 s)
        "standin-tests": 150,  # compiles FlashInfer's GELU modules, which nothing else needs
        "matrix-family": 150,  # a guess (not run yet): two engines, Triton's kernels compiled on first use
    },
    "cpu": {
        "unpack": 1,
        "lossless-engine": 15,
        "race-server": 25,
        "race-level": 5,
        "bench-draft-step": 1,
        "standin-tests": 30,
        "matrix-family": 60,
    },
}


MODELS_ESTIMATE = 5  # the foreground prerequisites, on either device: the kit's models built,
IMPORT_ESTIMATE = 30  # then SGLang imported and the plugin found (H100: 17 s, then 21 s)


@dataclass
class StepRecord:
    name: str
    status: str  # "ok" | "failed" | "skipped" | "cut at the deadline"
    seconds: float = 0.0
    estimate: Optional[float] = None
    note: str = ""
    started_at: float = 0.0  # seconds since the command started


@dataclass
class Proof:
    """The run's clock, folders and records; writes the report after every step."""

    device: str
    deadline: float  # seconds from start
    state: str
    out: str
    start: float = field(default_factory=time.monotonic)
    records: list = field(default_factory=list)
    env: dict = field(default_factory=lambda: dict(os.environ))
    background: dict = field(default_factory=dict)  # name -> (Popen, log path, started_at)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.deadline - self.elapsed()

    def estimate(self, what: str) -> float:
        return ESTIMATES[self.device][what]

    # ------------------------------------------------------------ children

    def log_path(self, name: str) -> str:
        return os.path.join(self.results, "logs", re.sub(r"[^\w.+-]+", "-", name).strip("-") + ".log")

    def run(self, name: str, cmd: list, env: Optional[dict] = None) -> int:
        """Run `cmd` to its end or to the deadline (minus the report's margin), its output into
        its log (in the results) and onto ours. Returns its exit status (124 when cut)."""
        limit = self.left() - REPORT_MARGIN
        path = self.log_path(name)
        with open(path, "a") as log:
            log.write("$ " + shlex.join(cmd) + "\n")
            log.flush()
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, text=True, errors="replace",
            )  # fmt: skip
            try:
                return _tee(proc, log, max(limit, 1.0))
            finally:
                _stop(proc)

    def start_background(self, name: str, cmd: list, env: Optional[dict] = None) -> None:
        path = self.log_path(name)
        log = open(path, "a")
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.background[name] = (proc, path, self.elapsed())
        print(f"== {name}: started in the background ({os.path.relpath(path, self.out)})", flush=True)

    def wait_background(self, name: str, why: str) -> StepRecord:
        """Wait for a background child (up to the deadline); its record."""
        proc, path, started = self.background.pop(name)
        ended = None if proc.poll() is None else self._last_write(path)
        try:
            proc.wait(timeout=max(self.left() - REPORT_MARGIN, 1.0))
            status = "ok" if proc.returncode == 0 else "failed"
            note = why if status == "ok" else f"{why}; exit {proc.returncode}: {_tail(path)}"
        except subprocess.TimeoutExpired:
            _stop(proc)
            status, note = "cut at the deadline", why
        seconds = (self.elapsed() if ended is None else ended) - started
        record = StepRecord(name, status, round(seconds, 1), note=note, started_at=round(started, 1))
        self.add(record)
        return record

    def _last_write(self, path: str) -> float:
        """When a finished child last wrote its log, in seconds since the start: its end, for
        one collected later than it finished."""
        return self.elapsed() - max(time.time() - os.path.getmtime(path), 0.0)

    # ------------------------------------------------------------ records and report

    def add(self, record: StepRecord) -> None:
        self.records.append(record)
        print(
            f"== {record.name}: {record.status} ({record.seconds:.0f} s) {record.note}".rstrip(), flush=True
        )
        self.write()

    def skip(self, name: str, why: str, estimate: Optional[float] = None) -> None:
        self.add(
            StepRecord(name, "skipped", estimate=estimate, note=why, started_at=round(self.elapsed(), 1))
        )

    def step(self, name: str, estimate: float, body) -> Optional[StepRecord]:
        """Run `body()` (-> (ok, note)) as a step, unless its estimate exceeds the time left."""
        left = self.left() - REPORT_MARGIN
        if estimate > left:
            self.skip(
                name, f"needs about {estimate:.0f} s, {max(left, 0):.0f} s left before the deadline", estimate
            )
            return None
        print(f"\n== {name} (about {estimate:.0f} s; {left:.0f} s left)", flush=True)
        begin = self.elapsed()
        try:
            ok, note = body()
            status = "ok" if ok else "failed"
        except Exception as error:  # a step's failure is recorded; the next step still runs
            status, note = "failed", f"{type(error).__name__}: {error}"
        if status == "failed" and self.left() <= REPORT_MARGIN + 1:
            status = "cut at the deadline"
        record = StepRecord(name, status, round(self.elapsed() - begin, 1), estimate, note, round(begin, 1))
        self.add(record)
        return record

    @property
    def results(self) -> str:
        """Where the steps leave their results and logs (kept in the state: a later call on the
        same machine skips what is measured); packed into --out after every step."""
        return os.path.join(self.state, "results")

    def write(self) -> None:
        """The report, the step records and one archive of the results and logs, in --out (a
        few files: the device tool brings back a limited number)."""
        import tarfile

        if os.path.isdir(self.results):
            partial = os.path.join(self.out, RESULTS_ARCHIVE + ".partial")
            with tarfile.open(partial, "w:gz") as tar:
                tar.add(self.results, arcname="results")
            os.replace(partial, os.path.join(self.out, RESULTS_ARCHIVE))
        data = dict(
            device=self.device,
            deadline_s=self.deadline,
            elapsed_s=round(self.elapsed(), 1),
            machine=machine(),
            steps=[asdict(r) for r in self.records],
        )
        with open(os.path.join(self.out, "gpu-proof.json"), "w") as f:
            json.dump(data, f, indent=1)
        with open(os.path.join(self.out, "gpu-proof-report.md"), "w") as f:
            f.write(render(data, self.results, self.state, self.out))


def _tee(proc: subprocess.Popen, log, limit: float) -> int:
    """Copy the child's output to its log and our stdout until it ends or `limit` passes."""
    import selectors

    end = time.monotonic() + limit
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        if time.monotonic() > end:
            log.write(f"\n[gpu_proof] cut after {limit:.0f} s: the deadline\n")
            return 124
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            if line:
                log.write(line)
                sys.stdout.write(line)
                continue
        if proc.poll() is not None:
            rest = proc.stdout.read()
            log.write(rest)
            sys.stdout.write(rest)
            log.flush()
            return proc.returncode


def _stop(proc: subprocess.Popen) -> None:
    """Stop a child and every process it started (servers start schedulers)."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait)
                break
            except (subprocess.TimeoutExpired, ProcessLookupError):
                continue


def _tail(path: str, lines: int = 3) -> str:
    with open(path, errors="replace") as f:
        return " | ".join(line.strip() for line in f.readlines()[-lines:])


def machine() -> str:
    gpu = ""
    try:
        gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
        gpu = gpu.splitlines()[0] if gpu else ""
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"{socket.gethostname()} {os.cpu_count()} cores {gpu}".strip()


# ---- the report ------------------------------------------------------------------------------


def render(data: dict, results: str, state: str, out: str) -> str:
    lines = [f"# GPU proof on {data['device']}: {data['machine']}\n"]
    lines.append(f"Deadline {data['deadline_s']:.0f} s; {data['elapsed_s']:.0f} s used.\n")
    lines += ["| step | status | seconds | estimate | started at | note |", "|---|---|---|---|---|---|"]
    for s in data["steps"]:
        est = "-" if s["estimate"] is None else f"{s['estimate']:.0f}"
        note = s["note"].replace("|", "/").replace("\n", " ")[:300]
        lines.append(
            f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | {est} | {s['started_at']:.0f} | {note} |"
        )
    lines.append("")
    lines.append(report.body(results))
    matrix_rows = [s for s in data["steps"] if s["name"].startswith("matrix ")]
    if matrix_rows:
        from tests.gpu_kit.serve.families import BY_NAME

        lines += [
            "## Target families (make gpu-matrix)\n",
            "| family | what | status | comparison |",
            "|---|---|---|---|",
        ]
        for s in matrix_rows:
            name = s["name"].removeprefix("matrix ")
            what = BY_NAME[name].what if name in BY_NAME else ""
            note = s["note"].replace("|", "/").replace("\n", " ")[:400]
            lines.append(f"| {name} | {what} | {s['status']} | {note} |")
        lines.append("")
    lossless_logs = sorted(glob.glob(os.path.join(results, "logs", "lossless*.log")))
    lossless_logs += sorted(glob.glob(os.path.join(results, "logs", "matrix-*.log")))
    if lossless_logs:
        lines += ["## Start-up of the lossless engines\n", "| engine | phase | seconds |", "|---|---|---|"]
        for path in lossless_logs:
            name = os.path.basename(path).removesuffix(".log")
            family = f"{name.removeprefix('matrix-')}: " if name.startswith("matrix-") else ""
            for engine, text in engines_in(path):
                engine = family + engine  # a matrix family's engines carry its name
                lines += [f"| {engine} | {k} | {v:.1f} |" for k, v in report.startup(text).items()]
                lines += [
                    f"| {engine} | {m} | |" for m in sorted(set(re.findall(r"draft_forward=\S+[^\n]*", text)))
                ]
        lines.append("")
    bench = os.path.join(results, "logs", "bench-draft-step.log")
    if os.path.isfile(bench):
        with open(bench) as f:
            lines += ["## Draft step (scripts/bench/draft_step.py)\n", "```", f.read().rstrip(), "```\n"]
    compiled = device_compiled(state)
    if compiled:
        lines.append(
            "## Compiled on the device (not carried: add to tests/gpu_kit/aot.py MODULES)\n\n"
            + "\n".join(f"- {c}" for c in compiled)
            + "\n"
        )
    return "\n".join(lines)


def engines_in(log: str) -> list[tuple[str, str]]:
    """tests/gpu_kit/serve/lossless.py's log split at its "== <engine>" lines: [(engine, text)]."""
    with open(log, errors="replace") as f:
        parts = re.split(r"^== (.+)$", f.read(), flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def device_compiled(state: str) -> list[str]:
    """FlashInfer modules this run JIT-compiled (a carried AOT module is never compiled)."""
    found = glob.glob(os.path.join(state, ".cache", "flashinfer", "*", "*", "cached_ops", "*", "*.so"))
    return sorted(os.path.basename(os.path.dirname(p)) for p in found)


# ---- the steps -------------------------------------------------------------------------------


def race_args(models: str, device: str, concurrency: str, seconds: float) -> list:
    if device == "cuda":
        target, draft = os.path.join(models, "qwen3-8b"), os.path.join(models, "qwen3-8b-dflash")
        server = "--load-format dummy --skip-tokenizer-init --attention-backend flashinfer"
        server += " --cuda-graph-backend-prefill disabled --cuda-graph-bs-decode " + concurrency.replace(
            ",", " "
        )
        server += f" --max-running-requests {max(int(c) for c in concurrency.split(','))}"
        server += " --context-length 4096 --dtype bfloat16 --mem-fraction-static 0.85 --watchdog-timeout 1800"
        load = ["--input-len", "256", "--max-new-tokens", "256"]
    else:
        target, draft = os.path.join(models, "tiny-target"), os.path.join(models, "tiny-draft")
        server = "--skip-tokenizer-init"
        load = ["--input-len", "32", "--max-new-tokens", "32"]
    args = ["--target", target, "--draft", draft, "--num-draft-tokens", "16", "--device", device]
    # "=": the value starts with "--", which argparse would read as an option
    args += [
        f"--server-args={server}",
        "--dataset",
        "random-ids",
        "--ignore-eos",
        "--concurrency",
        concurrency,
    ]
    return args + load + ["--duration", str(seconds), "--no-plots", "--no-progress"]


def race_estimate(device: str, levels: int, seconds: float) -> float:
    """One race server: its start-up, then each level for `seconds` and its drain."""
    return ESTIMATES[device]["race-server"] + levels * (seconds + ESTIMATES[device]["race-level"])


def lossless_estimate(device: str, runs: str) -> float:
    """One pair's lossless step: the plain engine and each DFLASH run of `runs`, plus the
    transformers oracle's load."""
    return 10 + (2 + runs.count(",")) * ESTIMATES[device]["lossless-engine"]


def race_folder(acc: str, server: str, tag: str = "") -> str:
    """Where a race server's results go: race-baseline (acceptance does not apply to it) or
    race-<acc>-<server>, with @<tag> for a second set of levels (serve/report.py reads both)."""
    folder = "race-baseline" if server == "baseline" else f"race-{acc}-{server}"
    return folder + (f"@{tag}" if tag else "")


def race_servers(acc: str, servers: str, device: str) -> list:
    """The servers a race step starts, in order: the built-in neither under our geometric
    acceptance (it does not know it) nor on CPU (it refuses it)."""
    found = []
    for server in servers.split(","):
        if server == "dflash-builtin" and (acc.startswith("geo-") or device != "cuda"):
            continue
        found.append(server)
    return found


def race(proof: Proof, acc: str, args, levels: Optional[str] = None, tag: str = "") -> None:
    """The servers of `--race-servers` in order (ours, the built-in, ours at B, no speculation
    once per state and set of levels): one serving/load_test.py each, at `levels` (default
    --race-concurrency). `acc`: SGLang's simulated acceptance, or geo-<mean> for ours only,
    each request and position drawn independently. `tag` names a second set of levels."""
    levels = args.race_concurrency if levels is None else levels
    if not levels:
        proof.skip(f"race-{acc}" + (f" ({tag})" if tag else ""), "no levels given")
        return
    common = race_args(os.path.join(proof.state, "models"), proof.device, levels, args.race_seconds)
    geometric = acc.startswith("geo-")
    kept = race_servers(acc, args.race_servers, proof.device)
    for server in args.race_servers.split(","):
        folder = race_folder(acc, server, tag)
        name = (f"race-{acc} {server}" if server != "baseline" else "race baseline") + (
            f" ({tag})" if tag else ""
        )
        if os.path.isfile(os.path.join(proof.results, folder, "results.json")):
            proof.skip(name, f"measured earlier in this state ({folder})")
            continue
        if server not in kept:
            if not geometric:  # the geometric acceptance is ours only: nothing to say
                proof.skip(name, "SGLang's built-in DFLASH refuses the CPU")
            continue
        cmd = [sys.executable, "scripts/serving/load_test.py", "--configs", server, *common]
        cmd += ["--output-dir", os.path.join(proof.results, folder)]
        if server != "baseline":
            cmd += ["--simulate-acc-len", acc.removeprefix("geo-")]
            cmd += ["--simulate-geometric"] if geometric else []
        race_server(proof, name, folder, cmd, len(levels.split(",")), args.race_seconds)


def race_server(proof: Proof, name: str, folder: str, cmd: list, levels: int, seconds: float, env=None):
    """One load_test.py server as a step, its estimate from its levels."""

    def body():
        rc = proof.run(name, cmd, env=env)
        # Which machine measured it: the report compares only runs of one machine side by side.
        os.makedirs(os.path.join(proof.results, folder), exist_ok=True)
        with open(os.path.join(proof.results, folder, "machine.txt"), "w") as f:
            f.write(machine())
        return rc == 0, "" if rc == 0 else f"exit {rc}: {missing_op(proof.log_path(name))}"

    return proof.step(name, race_estimate(proof.device, levels, seconds), body)


WIDTH1_FOLDER = "race-width1"  # serve/report.py's W = 1 table reads it beside race-baseline


def width1(proof: Proof, args) -> None:
    """The W = 1 step against a plain decode step: our server with every step forced to width 1
    (SGLANG_DFLASH_TEST_WIDTHS=1), at --width1-concurrency. A W = 1 step emits one token per
    request, as plain decode does, so its throughput against the baseline's at the same
    concurrency is the two steps' time ratio (the report's W = 1 table)."""
    levels = args.width1_concurrency
    if not levels:
        proof.skip("width1", "no levels given")
        return
    if os.path.isfile(os.path.join(proof.results, WIDTH1_FOLDER, "results.json")):
        proof.skip("width1", f"measured earlier in this state ({WIDTH1_FOLDER})")
        return
    common = race_args(os.path.join(proof.state, "models"), proof.device, levels, args.race_seconds)
    cmd = [sys.executable, "scripts/serving/load_test.py", "--configs", "dflash", *common]
    cmd += ["--output-dir", os.path.join(proof.results, WIDTH1_FOLDER)]
    env = dict(proof.env, SGLANG_DFLASH_TEST_WIDTHS="1")  # no simulated acceptance: W = 1 accepts none
    env.pop("SGLANG_SIMULATE_ACC_LEN", None)
    race_server(proof, "width1", WIDTH1_FOLDER, cmd, len(levels.split(",")), args.race_seconds, env)


def plan_estimates(device: str, steps, args) -> dict:
    """{piece: seconds}: what each piece of `steps` is allowed to start with on `device`, as the
    runner checks it, the foreground prerequisites first (_C, SGLang's JIT warm-up and the
    draft-step benchmark run beside them, in the background); a race's baseline once per set
    of levels. The deadline must hold their sum and REPORT_MARGIN."""
    plan = {
        "unpack": ESTIMATES[device]["unpack"],
        "models": MODELS_ESTIMATE,
        "import SGLang": IMPORT_ESTIMATE,
    }
    lossless_runs = {
        "lossless": args.lossless_runs,
        "lossless-widths": "widths",
        "lossless-no-overlap": "no-overlap",
    }
    measured = set()  # race folders: a server measured earlier in the plan is skipped
    for name in steps:
        if name in lossless_runs:
            for pair in args.lossless_pairs.split(","):
                plan[f"{name} {pair}"] = lossless_estimate(device, lossless_runs[name])
        elif name == "width1" and args.width1_concurrency:
            plan[name] = race_estimate(device, len(args.width1_concurrency.split(",")), args.race_seconds)
        elif name.startswith("race-"):
            more = name.startswith("race-more-")
            acc = name.removeprefix("race-more-" if more else "race-")
            levels = args.race_more_concurrency if more else args.race_concurrency
            for server in race_servers(acc, args.race_servers, device) if levels else []:
                folder = race_folder(acc, server, "more" if more else "")
                if folder not in measured:
                    measured.add(folder)
                    plan[f"{name} {server}"] = race_estimate(
                        device, len(levels.split(",")), args.race_seconds
                    )
        elif name in ESTIMATES[device]:
            plan[name] = ESTIMATES[device][name]
        elif name == "matrix":
            plan[name] = ESTIMATES[device]["matrix-family"]  # its first families; the rest as time allows
    return plan


def missing_op(log: str) -> str:
    """The line that names why a server died (a stand-in op that raised, an import), else the tail."""
    with open(log, errors="replace") as f:
        text = f.readlines()
    for needle in ("NotImplementedError", "ModuleNotFoundError", "ImportError", "Error:"):
        hits = [line.strip() for line in text if needle in line]
        if hits:
            return hits[-1][:300]
    return " | ".join(line.strip() for line in text[-3:])


def lossless_pairs(proof: Proof) -> dict:
    """{name: (target, draft, extra lossless.py args)}: the shipped trained pair (head_dim 64,
    block 8, its held-out code prompts: the draft's proposals are accepted, so multi-token
    acceptance is checked), then the random head_dim-128 pair whose draft repeats a layer
    ([1, 1]) and accepts almost nothing (the bonus path, and the race's attention kernels)."""
    models = os.path.join(proof.state, "models")
    pair = os.path.join(ROOT, "sglang_dflash", "assets", "tiny_pair")
    return {
        "trained": (
            os.path.join(pair, "target"),
            os.path.join(pair, "draft"),
            ["--prompts-file", os.path.join(pair, "prompts.json")],
        ),
        # Its widths run takes W = 1 through the decode forward (eager beside the verify graphs,
        # `target_forward.replays_decode`); the trained pair's, through width 1's verify graph.
        "random": (
            os.path.join(models, "tiny-target"),
            os.path.join(models, "tiny-draft"),
            ["--width1-forward", "decode"],
        ),
    }


def lossless(proof: Proof, runs: str, pairs: str) -> None:
    """One step per pair: the plain engine, then our DFLASH with `runs` (lossless.py)."""
    known = lossless_pairs(proof)
    for pair in pairs.split(","):
        if pair not in known:
            proof.skip(f"lossless {pair}", f"unknown pair (one of {', '.join(known)})")
            continue
        target, draft, extra = known[pair]
        out = os.path.join(proof.results, f"lossless-{pair}-{runs.replace(',', '+')}.json")
        cmd = [sys.executable, "-m", "tests.gpu_kit.serve.lossless", target, draft, *extra]
        cmd += ["--device", proof.device, "--runs", runs, "--out", out]
        if proof.device == "cpu":
            cmd += ["--prompts", "4", "--new-tokens", "24"]
        name = f"lossless {pair} ({runs})"

        def body(cmd=cmd, out=out, name=name):
            rc = proof.run(name, cmd)
            verdict = json.load(open(out)).get("lossless") if os.path.isfile(out) else None
            return rc == 0, f"lossless: {verdict}" if verdict is not None else f"exit {rc}"

        proof.step(name, lossless_estimate(proof.device, runs), body)


# Prompts, new tokens and sampled requests per family: on CUDA the prompts whose near-tie rate
# `families.py nearties` measures, fewer on CPU.
MATRIX_PROMPTS = {"cuda": ("6", "32", "1000"), "cpu": ("3", "12", "200")}


def runs_alone(family) -> bool:
    """Whether a matrix family's engines run with no other family's beside them: a hybrid target
    sizes its Mamba state pool from the device memory free when it measures it (SGLang's
    `kv_cache_configurator._profile_available_bytes`), which engines starting beside it would
    be taking at that moment."""
    return family.builder == "hybrid"


def matrix(proof: Proof, families: str, parallel: int) -> None:
    """Each family's lossless comparison (`serve/families.py run`) in its own process, at most
    `parallel` at once (a hybrid target's alone, `runs_alone`), started in priority order while
    its estimate fits before the deadline;
    a record per family, its note the comparison's summary or the first missing op."""
    from tests.gpu_kit.serve.families import select

    models = os.path.join(proof.state, "models", "families")
    prompts, tokens, samples = MATRIX_PROMPTS[proof.device]
    running: list = []  # (name, results file, runs alone)

    def collect() -> None:
        name, out, _ = running.pop(0)
        record = proof.wait_background(name, "")
        record.note = family_note(out) if record.status == "ok" else missing_op(proof.log_path(name))
        proof.write()

    for family in select(families):
        name, out = f"matrix {family.name}", os.path.join(proof.results, f"matrix-{family.name}.json")
        if os.path.isfile(out) and json.load(open(out)).get("lossless") is not None:
            proof.skip(name, f"measured earlier in this state ({os.path.basename(out)})")
            continue
        alone = runs_alone(family)
        while running and (len(running) >= (1 if alone else parallel) or running[-1][2]):
            collect()
        estimate = proof.estimate("matrix-family")
        if estimate > proof.left() - REPORT_MARGIN:
            proof.skip(name, f"needs about {estimate:.0f} s, {max(proof.left(), 0):.0f} s left", estimate)
            continue
        cmd = [sys.executable, "-m", "tests.gpu_kit.serve.families", "run", family.name, "--models", models]
        cmd += ["--out", out, "--device", proof.device, "--prompts", prompts, "--new-tokens", tokens]
        cmd += ["--samples", samples]
        proof.start_background(name, cmd)
        running.append((name, out, alone))
    while running:
        collect()


def family_note(path: str) -> str:
    """One family's comparison in a line: the verdict, identical outputs per round, near-ties,
    the largest logprob difference and the acceptance, then the sampled round's p-values and
    grammar results where it ran, from lossless.py's results."""
    if not os.path.isfile(path):
        return "no results"
    results = json.load(open(path))
    dflash = results.get("runs", {}).get("dflash overlap", {})
    rounds = [k.removeprefix("identical_at_") for k in dflash if k.startswith("identical_at_")]
    parts = [f"lossless: {results.get('lossless')}", f"{results.get('dtype')}"]
    parts.append("identical " + ", ".join(f"{r} {dflash[f'identical_at_{r}']}" for r in rounds))
    ties = sum(len(dflash.get(f"near_ties_at_{r}", [])) for r in rounds)
    diff = max((dflash.get(f"max_logprob_difference_at_{r}", 0.0) for r in rounds), default=0.0)
    accept = [dflash.get(f"accept_length_at_{r}") for r in rounds]
    parts += [f"near-ties {ties}", f"max logprob difference {diff:.3g}"]
    parts.append("acceptance " + " / ".join("-" if a is None else f"{a:.2f}" for a in accept))
    startup = {run: v.get("startup_s") for run, v in results.get("runs", {}).items()}
    parts.append("start-up " + ", ".join(f"{run} {s} s" for run, s in startup.items()))
    if dflash.get("sampled"):
        found = dflash["sampled"]
        p = ", ".join(f"{v:g}" for v in found["sampled_chi_square_p"])
        parts.append(f"sampled chi-square p {p}")
        outside = len(found["constrained_outside_grammar"])
        parts.append(f"grammar: {outside} outside, greedy {found['greedy_constrained']}")
    if dflash.get("proposals"):
        parts.append(f"proposals: {dflash['proposals']}")
    return "; ".join(parts)


def prerequisites(proof: Proof, args, steps: list[str]) -> bool:
    """Unpack, then overlap: _C, SGLang's JIT warm-ups and the draft-step benchmark in the
    background; models and SGLang's import in the foreground. False: stop here."""
    py = sys.executable
    serve = os.path.join(args.bundle, "serve")
    if os.path.isdir(serve):
        cmd = [py, "-m", "tests.gpu_kit.serve.unpack", serve, proof.state, os.path.join(args.bundle, "aot")]
        record = proof.step("unpack", proof.estimate("unpack"), lambda: (proof.run("unpack", cmd) == 0, ""))
        if record is None or record.status != "ok":
            return False
        site = os.path.join(proof.state, "site")
        standin = os.path.join(ROOT, "tests", "gpu_kit", "serve", "standin")
        path = [site, standin, ROOT] + [p for p in [proof.env.get("PYTHONPATH")] if p]
        proof.env.update(
            PYTHONPATH=os.pathsep.join(path),
            SGLANG_DFLASH_SGL_KERNEL_STANDIN="1",
            SGLANG_DFLASH_GPU_KIT="1",
            SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND="python",
            SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK="1",
        )
    else:
        proof.skip("unpack", f"no serve bundle at {serve}: SGLang as installed here")
    # FlashInfer's and SGLang's JIT caches in the state: kept between calls while the machine is
    # held; the report lists any FlashInfer module compiled here (it was not carried).
    proof.env.update(PYTHONUNBUFFERED="1", FLASHINFER_WORKSPACE_BASE=proof.state)
    proof.env.update(SGLANG_JIT_CACHE_DIR=os.path.join(proof.state, "sglang-jit"))
    proof.env.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    if proof.device == "cuda":
        from tests.gpu_kit.aot import cuda_home

        try:  # part of SGLang's JIT cache key: one value for every process
            proof.env.setdefault("CUDA_HOME", cuda_home())
        except SystemExit as error:
            print(f"== CUDA_HOME not set: {error}", flush=True)
        headers = cuda_library_headers(py)
        if headers:
            proof.env["CPATH"] = os.pathsep.join(filter(None, [proof.env.get("CPATH"), headers]))
        build = dict(
            proof.env,
            SGLANG_DFLASH_BUILD_CUDA="1",
            SGLANG_DFLASH_CUDA_ARCHS=os.environ.get("SGLANG_DFLASH_CUDA_ARCHS", "90"),
        )
        proof.start_background("build _C", [py, "setup.py", "-q", "build_ext", "--inplace"], env=build)
        warm = ["--matrix"] if "matrix" in steps else []  # and the matrix families' modules
        proof.start_background("SGLang JIT warm-up", [py, "-m", "tests.gpu_kit.serve.warm_jit", *warm])
        if "bench-draft-step" in steps:
            cmd = [py, "scripts/bench/draft_step.py", "--repeats", "3", "--iters", "10"]
            cmd += ["--batch-sizes", args.bench_batch_sizes]
            cmd += ["--json", os.path.join(proof.results, "bench-draft-step.json")]
            proof.start_background("bench-draft-step", cmd)
    else:
        proof.skip("build _C", "no CUDA: the package's CPU path (make install built what applies)")
        proof.skip("SGLang JIT warm-up", "no CUDA")
    ok = proof.step(
        "models",
        MODELS_ESTIMATE,
        lambda: (
            proof.run("models", [py, "-m", "tests.gpu_kit.serve.models", os.path.join(proof.state, "models")])
            == 0,
            "",
        ),
    )
    check = (
        "import sglang\nfrom importlib.metadata import entry_points\n"
        "from sglang.srt.entrypoints.engine import Engine\n"
        "plugins = [e.value for e in entry_points(group='sglang.srt.plugins')]\n"
        "assert 'sglang_dflash.plugin:register' in plugins, plugins\n"
        "print('sglang', sglang.__version__, 'plugins', plugins)\n"
    )
    imported = proof.step(
        "import SGLang, find the plugin",
        IMPORT_ESTIMATE,
        lambda: (proof.run("import", [py, "-c", check]) == 0, ""),
    )
    # The engines need our extension (else they serve the PyTorch injection, and say so). They
    # need not wait for SGLang's JIT warm-up: a kernel still compiling there is waited for at its
    # file lock and then found in the cache.
    if "build _C" in proof.background:
        proof.wait_background("build _C", "background, beside the steps above")
    return bool(ok and ok.status == "ok" and imported and imported.status == "ok")


def cuda_library_headers(py: str) -> str:
    """A folder holding only cuBLAS's and cuRAND's headers (FlashInfer's JIT includes them), when
    the toolkit lacks them; '' otherwise."""
    probe = subprocess.run(
        ["nvcc", "-x", "cu", "-E", "-"], input="#include <cublasLt.h>\n", capture_output=True, text=True
    )
    if probe.returncode == 0:
        return ""
    from tests.gpu_kit.aot import library_headers

    try:
        return library_headers(os.path.join(ROOT, ".gpu-bundle", "headers"))
    except (SystemExit, ImportError) as error:  # a module compiled here then fails and says so
        print(f"== no cuBLAS/cuRAND headers for FlashInfer's JIT: {error}", flush=True)
        return ""


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, the options it leaves out taken from its --plan."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--plan", choices=sorted(PLANS), default="proof", help="proof: make gpu-proof; first: make gpu-first"
    )
    p.add_argument("--steps")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds from the start")
    p.add_argument("--bundle", default=os.path.join(ROOT, ".gpu-bundle"))
    p.add_argument("--state", default=os.path.join(ROOT, ".gpu-bundle", "state"))
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, ".gpu-bundle", "proof"))
    p.add_argument("--device", choices=["cuda", "cpu"])
    p.add_argument("--race-concurrency")
    p.add_argument("--race-more-concurrency", help="the levels of race-more-<acc>")
    p.add_argument("--width1-concurrency", help="the levels of the width1 step")
    p.add_argument("--race-seconds", type=float)
    p.add_argument("--race-servers", default=",".join(RACE_SERVERS), help="in this order")
    p.add_argument("--bench-batch-sizes", help="the draft-step benchmark's batch sizes")
    p.add_argument("--lossless-runs", default="overlap", help="DFLASH engines of the lossless step")
    p.add_argument("--lossless-pairs", default="trained,random", help="model pairs of the lossless step")
    p.add_argument("--families", default="", help="the matrix step's families (default: all, by priority)")
    p.add_argument("--matrix-parallel", type=int, default=None, help="families at once (3 on CUDA, 1 on CPU)")
    args = p.parse_args(argv)
    for key, value in PLANS[args.plan].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(os.path.join(args.state, "results", "logs"), exist_ok=True)
    proof = Proof(args.device, args.deadline, os.path.abspath(args.state), os.path.abspath(args.out))
    steps = [s for s in args.steps.split(",") if s]
    print(
        f"== gpu_proof on {args.device}: steps {', '.join(steps)}; deadline {args.deadline:.0f} s", flush=True
    )
    proof.write()
    if not prerequisites(proof, args, steps):
        for name in steps:
            proof.skip(name, "a prerequisite failed")
        return 1
    for name in steps:
        if name == "lossless":
            lossless(proof, args.lossless_runs, args.lossless_pairs)
        elif name == "lossless-no-overlap":
            lossless(proof, "no-overlap", args.lossless_pairs)
        elif name == "lossless-widths":  # every verify width's graph in turn
            lossless(proof, "widths", args.lossless_pairs)
        elif name.startswith("race-more-"):  # a second set of levels, its folders tagged "more"
            race(proof, name.removeprefix("race-more-"), args, args.race_more_concurrency, "more")
        elif name.startswith("race-"):
            race(proof, name.removeprefix("race-"), args)
        elif name == "width1":
            width1(proof, args)
        elif name == "standin-tests":
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-q",
                "-p",
                "no:cacheprovider",
                "--timeout=240",
            ]
            cmd += list(STANDIN_TESTS)
            proof.step(name, proof.estimate(name), lambda: (proof.run(name, cmd) == 0, ""))
        elif name == "matrix":
            matrix(proof, args.families, args.matrix_parallel or (3 if proof.device == "cuda" else 1))
        elif name == "bench-draft-step":
            if "bench-draft-step" in proof.background:
                proof.wait_background("bench-draft-step", "started during the prerequisites")
            else:
                proof.skip(name, "needs CUDA" if proof.device != "cuda" else "not started")
        else:
            proof.skip(name, f"unknown step (one of {', '.join(STEPS)}, race-[more-][geo-]<acceptance>)")
    for name in list(proof.background):
        proof.wait_background(name, "background")
    proof.write()
    return 0 if all(r.status in ("ok", "skipped") for r in proof.records) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Starting `python -m sglang.launch_server` for the benchmark scripts, and small HTTP helpers.

`ServerConfig` names what to serve; `ServerProcess(config, log_path)` starts it with the
device's defaults (on CPU: SGLang's CPU engine, `torch_native` attention, float32, one OMP
thread, a capped KV pool; on CUDA: SGLang's own), waits for `/health_generate`, checks which
DFLASH implementation answers, and logs the server's output to a file. Configurations:

  baseline        no speculation
  dflash          DFLASH served by this package (checked through /server_info)
  dflash-builtin  DFLASH served by SGLang's built-in worker (SGLANG_DFLASH_IMPL=builtin; GPU only)
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import requests

# dflash: this package, verify width adaptive (the CPU default); dflash-fixed: this package with
# the width fixed at B (SGLANG_DFLASH_ADAPTIVE_WIDTH=0); dflash-builtin: SGLang's own worker.
CONFIGS = ("baseline", "dflash", "dflash-fixed", "dflash-builtin")
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32"]
CPU_ARGS += ["--max-total-tokens", "8192"]


def detect_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class ServerConfig:
    name: str  # one of CONFIGS
    target: str
    draft: Optional[str] = None
    num_draft_tokens: Optional[int] = None
    device: str = "cpu"
    extra_args: list = field(default_factory=list)
    env: dict = field(default_factory=dict)  # e.g. SGLANG_SIMULATE_ACC_LEN

    def skip_reason(self) -> Optional[str]:
        if self.name == "dflash-builtin" and self.device != "cuda":
            return "SGLang's built-in DFLASH worker refuses device=cpu (GPU only); skipped"
        if self.name != "baseline" and not self.draft:
            return f"{self.name} needs a draft model (--draft)"
        return None

    def command(self, port: int) -> list:
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.target]
        args += ["--host", "127.0.0.1", "--port", str(port)]
        args += CPU_ARGS if self.device == "cpu" else []
        if self.name != "baseline":
            # Prometheus counters: acceptance and chosen widths per level.
            args += ["--enable-metrics"] if "--enable-metrics" not in self.extra_args else []
            args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", self.draft]
            if self.num_draft_tokens:
                args += ["--speculative-num-draft-tokens", str(self.num_draft_tokens)]
        return args + list(self.extra_args)

    def environment(self) -> dict:
        env = dict(os.environ)
        if self.device == "cpu":
            env.update(CPU_ENV)
        env.pop("SGLANG_DFLASH_IMPL", None)
        if self.name == "dflash-builtin":
            env["SGLANG_DFLASH_IMPL"] = "builtin"
        if self.name == "dflash-fixed":
            env["SGLANG_DFLASH_ADAPTIVE_WIDTH"] = "0"
        if self.name == "baseline":  # simulated acceptance means nothing without speculation
            env.pop("SGLANG_SIMULATE_ACC_LEN", None)
        env.update({k: str(v) for k, v in self.env.items()})
        return env


def free_port() -> int:
    """A free port below the kernel's ephemeral range, where SGLang's HTTP port lives: a server
    binds its port only after a start-up of many seconds, and a port from the ephemeral range
    (what bind(0) gives) can meanwhile become some connection's local port ("address already in
    use"), as SGLang also knows for its NCCL port (`get_free_port_below_ephemeral`)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = list(range(30000, ephemeral_low))
    random.shuffle(candidates)
    for port in candidates[:64]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running server; `stop()` (or the context manager) shuts it down."""

    def __init__(self, config: ServerConfig, log_path: str, startup_timeout: float = 600.0):
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = config.command(self.port)
        self._log.write("$ " + shlex.join(cmd) + "\n")
        self._log.flush()
        self.process = subprocess.Popen(
            cmd, env=config.environment(), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_ready(startup_timeout)
            self._check_implementation()
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"server exited with code {self.process.returncode}; log {self.log_path}:\n"
                    + self.log_tail()
                )
            # uvicorn failing to bind leaves SGLang's processes running, never ready.
            if "error while attempting to bind on address" in self.log_tail(5):
                raise RuntimeError(f"server could not bind port {self.port}; log {self.log_path}")
            try:
                if requests.get(self.url + "/health_generate", timeout=10).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout:.0f} s; log {self.log_path}")

    def _check_implementation(self) -> None:
        if self.config.name == "baseline":
            return
        impl = server_info(self.url)["internal_states"][0].get("dflash_implementation", "")
        ours = impl.startswith("sglang-dflash")
        if ours != (self.config.name != "dflash-builtin"):
            raise RuntimeError(f"{self.config.name}: DFLASH is served by {impl or 'SGLang built-in'}")

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP to its group): an idle SGLang scheduler
        polls on a whole core, which would slow the server measured beside it."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.alive():
            os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()  # a paused server cannot handle SIGINT
        if self.alive():
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def server_info(url: str) -> dict:
    response = requests.get(url + "/server_info", timeout=30)
    response.raise_for_status()
    return response.json()


def loads(url: str) -> dict:
    """The first DP rank's load snapshot (`/v1/loads`)."""
    response = requests.get(url + "/v1/loads", timeout=30)
    response.raise_for_status()
    return response.json()["loads"][0]


def flush_cache(url: str, timeout: float = 60.0) -> None:
    """`/flush_cache` refuses while requests are running or just finished; retry until idle."""
    deadline = time.time() + timeout
    while True:
        response = requests.post(url + "/flush_cache", timeout=30)
        if response.status_code == 200:
            return
        if time.time() > deadline:
            raise TimeoutError(f"/flush_cache kept failing: {response.text.strip()}")
        time.sleep(0.5)


def prometheus_samples(url: str, prefix: str = "sglang:") -> Optional[dict]:
    """`/metrics` as {(name, frozenset(labels)): value}, or None when metrics are off."""
    from prometheus_client.parser import text_string_to_metric_families

    response = requests.get(url + "/metrics", timeout=30)
    if response.status_code != 200:
        return None
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


# Histogram buckets {le: count} and per-position counters {k: count}, by series, summed over
# label sets into these keys of `dflash_counters`.
_BUCKETED = {
    "sglang:dflash_accepted_drafts_per_step_bucket": "buckets",
    "sglang:dflash_verify_width_bucket": "widths",
}
_PER_POSITION = {
    "sglang:dflash_position_accepted_total": "positions",
    "sglang:dflash_position_verified_total": "verified",
}


def dflash_counters(samples: Optional[dict]) -> Optional[dict]:
    """This package's acceptance counters (see `sglang_dflash/integration/metrics.py`), summed over label
    sets; None if the server does not export them."""
    if not samples:
        return None
    out = {"verify_steps": 0.0, "accepted_drafts": 0.0, "discarded_steps": 0.0}
    out.update({key: {} for key in (*_BUCKETED.values(), *_PER_POSITION.values())})
    found = False
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if name == "sglang:dflash_verify_steps_total":
            out["verify_steps"] += value
            found = True
        elif name == "sglang:dflash_accepted_drafts_total":
            out["accepted_drafts"] += value
        elif name == "sglang:dflash_discarded_steps_total":
            out["discarded_steps"] += value
        elif name in _BUCKETED or name in _PER_POSITION:
            series = out[_BUCKETED.get(name) or _PER_POSITION[name]]
            key = float(labels["le"]) if name in _BUCKETED else int(labels["position"])
            series[key] = series.get(key, 0.0) + value
    return out if found else None


def _histogram_window(before: dict, after: dict) -> dict:
    """Per-bucket counts between two cumulative Prometheus histogram snapshots {le: count},
    keyed by the integer bucket (buckets are 0, 1, 2, ...)."""
    cumulative = {le: after[le] - before.get(le, 0.0) for le in after}
    hist, below = {}, 0.0
    for le in sorted(cumulative):
        if le != float("inf"):
            hist[int(le)] = cumulative[le] - below
            below = cumulative[le]
    return {k: int(c) for k, c in hist.items() if c}


def dflash_window(before: Optional[dict], after: Optional[dict]) -> dict:
    """Server-side acceptance between two `dflash_counters` snapshots (empty if unavailable)."""
    if before is None or after is None:
        return {}
    steps = after["verify_steps"] - before["verify_steps"]
    if steps <= 0:
        return {}
    accepted = after["accepted_drafts"] - before["accepted_drafts"]
    # accept length = accepted drafts + 1
    hist = {n + 1: c for n, c in _histogram_window(before["buckets"], after["buckets"]).items()}
    widths = _histogram_window(before.get("widths", {}), after.get("widths", {}))

    def position_rate(k: int) -> Optional[float]:
        accepted_k = after["positions"][k] - before["positions"].get(k, 0.0)
        verified_k = after.get("verified", {}).get(k, steps) - before.get("verified", {}).get(k, 0.0)
        return accepted_k / verified_k if verified_k > 0 else None

    return {
        "verify_steps": steps,
        "discarded_steps": after.get("discarded_steps", 0.0) - before.get("discarded_steps", 0.0),
        "accept_length_mean": 1.0 + accepted / steps,
        "accept_length_histogram": hist,
        "position_accept_rate": {k: position_rate(k) for k in sorted(after["positions"])},
        # Decode steps per chosen verify width (1 = speculation off for the step).
        "verify_width_histogram": widths,
        "verify_width_mean": (sum(w * c for w, c in widths.items()) / sum(widths.values()))
        if widths
        else None,
    }


def default_models() -> tuple:
    """(target, draft) when no --target is given: the tiny trained pair shipped in the package."""
    from sglang_dflash.assets import TINY_PAIR, tiny_pair

    print(f"no --target: using the shipped tiny pair {TINY_PAIR}", flush=True)
    return tiny_pair()


def add_launch_args(group, devices=("auto", "cpu", "cuda"), server_args: str = "") -> None:
    """The arguments of the scripts that start a server: models, verify width, device, extras."""
    group.add_argument("--target", help="target model path (default: the shipped tiny pair)")
    group.add_argument("--draft", help="DFlash draft path")
    group.add_argument("--num-draft-tokens", type=int, help="--speculative-num-draft-tokens B")
    group.add_argument("--device", choices=list(devices), default=devices[0])
    group.add_argument(
        "--server-args",
        default=server_args,
        help='extra launch_server arguments as one string; write --server-args="--flag value"',
    )

"""`StepTimer`: per-phase wall times of each decode step, for `scripts/serving/step_phases.py`.

Off by default, and then free: `phase()` hands back one shared no-op context manager and
`end_step()` returns at once. Set `SGLANG_DFLASH_STEP_TIMING=<path>` to switch it on in every
scheduler process; each step then appends one JSON line to `<path>`:

    {"pid": 123, "kind": "decode", "bs": 4, "width": 8, "t_start": 812.1034, "t_end": 812.1101,
     "phases": {"draft": 2.1, "verify": 3.4, "accept": 0.2, "inject": 0.9}, "io_ms": 0.02}

`counts` (when any) are events counted in the step: `target_attention_plans`, how many times the
target's attention backend planned (`init_forward_metadata`, or on a CUDA-graph replay
`init_forward_metadata_out_graph`; a plan that calls the other counts once), and with a
backend per verify width, `target_attention_plans_w<W>` those of width W's own backend.
`width` is the step's verify width (decode steps; 1 = no draft) and `probe` whether the width
policy chose it to measure it rather than as the best (`width/policy.py`). `t_start` / `t_end` are
`time.perf_counter()` seconds at the first phase's start and the last phase's end; `phases` are
milliseconds (a phase entered twice in a step adds up); `io_ms` is the time this timer spent
writing the *previous* record, so a reader can take it out of the gap between steps.

Timing mode only: when on, the timer synchronizes the device before and after every phase, so
each phase's time is its own device work. That serializes host and device (overlap scheduling no
longer hides anything), so step times under timing mode are not throughput numbers.

See docs/measuring.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Callable, Optional

from sglang_dflash import knobs

ENV_VAR = "SGLANG_DFLASH_STEP_TIMING"  # a file that can be opened for appending (`knobs.py`)

_NULL = contextlib.nullcontext()


def _synchronizer(device) -> Callable[[], None]:
    """Waits for the device's queued work: `torch.cuda.synchronize` and friends; nothing on CPU."""
    import torch

    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "cpu":
        return lambda: None
    return getattr(torch, kind).synchronize


class StepTimer:
    """`with timer.phase("draft"): ...` around each phase, `timer.end_step(bs)` after the step."""

    def __init__(self, path: Optional[str] = None, device=None):
        self.enabled = bool(path)
        self.path = path
        self._file = None
        self._sync = _synchronizer(device) if self.enabled else None
        self._phases: dict[str, float] = {}
        self._t_start: Optional[float] = None
        self._t_end: Optional[float] = None
        self._io_ms = 0.0
        self._counts: dict[str, int] = {}
        self._inside: set[str] = set()  # names of the counted calls running now

    @classmethod
    def from_env(cls, device=None) -> "StepTimer":
        return cls(knobs.value(ENV_VAR), device)

    def phase(self, name: str):
        if not self.enabled:
            return _NULL
        return self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name: str):
        self._sync()
        start = time.perf_counter()
        if self._t_start is None:
            self._t_start = start
        try:
            yield
        finally:
            self._sync()
            end = time.perf_counter()
            self._t_end = end
            self._phases[name] = self._phases.get(name, 0.0) + (end - start) * 1e3

    def counted(self, fn: Callable, name: str) -> Callable:
        """`fn`, counting its calls under `name` in each step's record (`fn` itself when off).
        Calls made inside another counted call of the same name count once."""
        if not self.enabled:
            return fn

        def wrapper(*args, **kwargs):
            if name in self._inside:
                return fn(*args, **kwargs)
            self._counts[name] = self._counts.get(name, 0) + 1
            self._inside.add(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside.discard(name)

        return wrapper

    def count_attention_plans(self, backend, width: Optional[int] = None) -> None:
        """Count the target's attention plans (eager and graphed) in each step's record; those
        of a verify width's own backend (`width/verify_widths.py`) also under
        `target_attention_plans_w<width>`."""
        if not self.enabled:
            return
        for method in ("init_forward_metadata", "init_forward_metadata_out_graph"):
            if hasattr(backend, method):
                fn = getattr(backend, method)
                if width is not None:
                    fn = self.counted(fn, f"target_attention_plans_w{width}")
                setattr(backend, method, self.counted(fn, "target_attention_plans"))

    def end_step(
        self, batch_size: int, kind: str = "decode", width: Optional[int] = None, probe: bool = False
    ) -> None:
        """Close the step: write its record (if any phase ran) and start the next one."""
        if not self.enabled or self._t_start is None:
            return
        record = {
            "pid": os.getpid(),
            "kind": kind,
            "bs": int(batch_size),
            **({} if width is None else {"width": int(width), "probe": bool(probe)}),
            "t_start": self._t_start,
            "t_end": self._t_end,
            "phases": {name: round(ms, 6) for name, ms in self._phases.items()},
            **({"counts": self._counts} if self._counts else {}),
            "io_ms": round(self._io_ms, 6),
        }
        self._phases, self._t_start, self._t_end, self._counts = {}, None, None, {}
        io_start = time.perf_counter()
        if self._file is None:
            self._file = open(self.path, "a")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._io_ms = (time.perf_counter() - io_start) * 1e3

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

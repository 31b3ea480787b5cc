"""`DeviceStepClock`: each decode step's device time, from CUDA events read without blocking.

On a GPU the host runs ahead of the device: under overlap scheduling the scheduler launches step
k and only then waits for step k-1's results, so the host interval between two step starts is
about step k-1's device time, charged to step k. For the width policy that is the wrong step
(a narrow step after a wide one would look expensive). This clock charges each step its own
time: an event recorded on the forward stream when the step starts and one when it has
launched its last work; the device time between them is the step's, stalls inside it
included. (The scheduler's work between two steps is not in it; it is about the same at every
width.)

Nothing here waits for the device: `poll` reads the events that have completed (`query()`) and
leaves the others for later, so a step's cost reaches the policy a step or two after it ran.

E.g., steps A (bs 8, W 4) and B (bs 8, W 8) launched, the device halfway through B:
poll() -> [((8, 4, ctx), 0.012)]; B's comes at a later poll.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

MAX_PENDING = 64  # steps whose events are still in flight; older ones are dropped unread


class DeviceStepClock:
    def __init__(self, make_event: Optional[Callable[[], Any]] = None):
        if make_event is None:
            import torch

            def make_event():
                return torch.cuda.Event(enable_timing=True)

        self._make_event = make_event
        self._spare: list = []  # read events, recorded again by later steps
        self._pending: deque = deque()  # (record, begin event, end event or None)
        self.dropped = 0  # steps dropped unread (more than MAX_PENDING in flight)

    def _event(self):
        return self._spare.pop() if self._spare else self._make_event()

    def begin(self, record: Any) -> None:
        """A decode step starts; `record` (e.g. its batch size, width and context) comes back
        with its time. None: a step whose time is not wanted (a cold start-up step)."""
        if self._pending and self._pending[-1][2] is None:  # a step that never ended: unread
            self._spare.append(self._pending.pop()[1])
            self.dropped += 1
        if record is None:
            return
        event = self._event()
        event.record()
        self._pending.append((record, event, None))
        if len(self._pending) > MAX_PENDING:
            _, begin, end = self._pending.popleft()
            self._spare.extend(e for e in (begin, end) if e is not None)
            self.dropped += 1

    def end(self) -> None:
        """The step begun last has launched its last work."""
        if self._pending and self._pending[-1][2] is None:
            record, begin, _ = self._pending[-1]
            event = self._event()
            event.record()
            self._pending[-1] = (record, begin, event)

    def poll(self) -> list[tuple[Any, float]]:
        """(record, seconds) of every step whose events have completed, oldest first."""
        done = []
        while self._pending:
            record, begin, end = self._pending[0]
            if end is None or not end.query():
                break
            self._pending.popleft()
            done.append((record, begin.elapsed_time(end) / 1e3))
            self._spare.extend((begin, end))
        return done

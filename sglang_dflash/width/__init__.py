"""How many tokens each decode step verifies: the adaptive policy (`policy.py`: acceptance and
step-cost estimates, the choice), each step's width and how a step without draft runs the
target (`step.py`), the widths with a verify backend and graph of their own (`verify_widths.py`; SGLang's
backends and graph runners built for them in `verify_runners.py`, which imports SGLang when
called) and each step's device time on CUDA (`device_clock.py`).

Imports `cpu/` (how the CPU engine's verify attention runs) and the knob names. No SGLang at
import time. See docs/verify-width.md.
"""

"""How many tokens each decode step verifies: the adaptive policy (`policy.py`: acceptance and
step-cost estimates, the choice) and each step's width and how a step without draft runs the
target (`step.py`).

Imports `cpu/` (how the CPU engine's verify attention runs) and the knob names. No SGLang at
import time. See docs/verify-width.md.
"""

"""A server or engine under load: `load_test.py` (concurrency sweeps, servers side by side),
`step_phases.py` (each decode step split into its phases), `grammar_acceptance.py`, `soak.py`
and `keepalive_race.py`; `lib/` holds their shared parts. See docs/measuring.md."""

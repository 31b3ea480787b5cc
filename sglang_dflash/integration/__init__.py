"""Where this package meets SGLang's scheduler, pools and server arguments: DFLASH argument
resolution and the targets refused at start-up (`server_args.py`, `unserved_targets.py`), the
scheduler-process hooks and request admission (`scheduler_hooks.py`, `admission.py`), the
target's verify forward (`target_forward.py`), its KV pool, the final hidden states returned to
requests that ask and hybrid targets' linear state (`target_pool.py`, `returned_hidden_states.py`,
`linear_state.py`), the draft KV store as an SGLang pool and its prefill/decode check
(`draft_pool.py`, `draft_context.py`), Prometheus metrics (`metrics.py`), and the decode step's
record and the results the scheduler gets back (`decode_step.py`).

Every module here works on SGLang's objects. Imports the stages below it (`draft/`, `propose/`,
`verify/`, `checkpoint/`, `cpu/`), never the worker or the plugin.
See docs/serving.md and docs/serving-past-one-engine.md.
"""

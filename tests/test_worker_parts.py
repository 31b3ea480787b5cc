"""The pieces around the worker's step: the knobs read once from the environment, the verify
width of each step, the proposal interface, and the module layout (no import circle, no
environment read in the worker)."""

import ast
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_dflash import knobs as knobs_module
from sglang_dflash.knobs import Knobs
from sglang_dflash.propose.proposers import ArgmaxProposer, ProposalInputs, proposer_for
from sglang_dflash.width.policy import WidthPolicy
from sglang_dflash.width.step import COLD_DECODE_STEPS, StepWidth, decode_when_off

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_knob_is_read_from_its_variable():
    env = {
        "SGLANG_DFLASH_GRAMMAR_PROPOSALS": "0",
        "SGLANG_DFLASH_ADAPTIVE_WIDTH": "1",
        "SGLANG_DFLASH_FAIR_SLACK": "off",
        "SGLANG_DFLASH_WIDTH1_FORWARD": "decode",
        "SGLANG_DFLASH_DRAFT_CUDA_GRAPH": "0",
        "SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN": "512",
        "SGLANG_DFLASH_VERIFY_GRAPHS": "eager",
        "SGLANG_DFLASH_DEFERRED_INJECTION": "0",
        "SGLANG_DFLASH_STEP_TIMING": "steps.jsonl",
        "SGLANG_ENABLE_LILICORR_SAMPLING": "0",
        "SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION": "1",
        "SGLANG_DFLASH_TEST_SKIP_DRAFT_TRANSFER": "1",
        "SGLANG_DFLASH_TEST_SKIP_DRAFT_HICACHE": "1",
        "SGLANG_DFLASH_TEST_SKIP_STATE_COMMIT": "1",
        "SGLANG_DFLASH_TEST_WIDTH1_STEPS": "3",
        "SGLANG_DFLASH_TEST_WIDTHS": "1,4, 2",
        "SGLANG_DFLASH_CHECK_RANKS": "1",
        "SGLANG_DFLASH_TRACE_PROPOSALS": "trace.jsonl",
    }
    got = Knobs.from_env(env, simulated=False)
    assert got == Knobs(
        grammar_proposals=False,
        adaptive_width="1",
        fair_slack="off",
        width1_forward="decode",
        draft_graphs="0",
        draft_plan_free="512",
        verify_graphs="eager",
        deferred_injection=False,
        step_timing="steps.jsonl",
        lilicorr_sampling=False,
        skip_decode_injection=True,
        skip_draft_transfer=True,
        skip_draft_hicache=True,
        skip_state_commit=True,
        width1_steps=3,
        widths=(1, 4, 2),
        check_ranks=True,
        trace_proposals="trace.jsonl",
    )
    assert len(got.aids_on()) == 9
    # Unset: the defaults, and no aid in the start-up line.
    assert Knobs.from_env({}, simulated=False) == Knobs()
    assert Knobs().aids_on() == []
    # "1" switches a test aid on; anything else leaves it off, as before.
    assert not Knobs.from_env({"SGLANG_DFLASH_TEST_SKIP_DECODE_INJECTION": "yes"}, simulated=False).aids_on()


def test_the_knobs_module_lists_every_variable_it_reads():
    """Each `*_ENV` name is documented in the module's docstring, one line each."""
    names = [value for key, value in vars(knobs_module).items() if key.endswith("_ENV")]
    assert len(names) == 20
    for name in names:
        assert name in knobs_module.__doc__, name


def test_the_worker_reads_no_environment_variable():
    for module in ("worker.py", "runtime.py", "width/step.py", "propose/proposers.py"):
        tree = ast.parse(open(os.path.join(ROOT, "sglang_dflash", module)).read())
        names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        names |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert not names & {"environ", "getenv"}, module


def test_no_import_circle_between_plugin_hooks_and_worker():
    """The plugin registers; the worker imports neither the plugin nor the scheduler hooks."""
    for module in ("worker", "runtime", "integration/scheduler_hooks"):
        tree = ast.parse(open(os.path.join(ROOT, "sglang_dflash", f"{module}.py")).read())
        imported = {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
        }
        assert "sglang_dflash.plugin" not in imported, module
        if module != "integration/scheduler_hooks":
            assert "sglang_dflash.integration.scheduler_hooks" not in imported, module


@pytest.mark.sglang
def test_importing_the_worker_loads_neither_plugin_nor_hooks():
    code = (
        "import sys, sglang_dflash.worker; "
        "print(sorted(set(sys.modules) & {'sglang_dflash.plugin', "
        "'sglang_dflash.integration.scheduler_hooks'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------ the verify width


def _width(num_draft_tokens=8, device="cpu", tp_size=1, **knobs):
    return StepWidth(num_draft_tokens, device, tp_size, Knobs(**knobs))


def test_the_width_is_fixed_or_adaptive_as_chosen_at_start_up():
    assert _width(adaptive_width="0").policy is None
    assert _width(adaptive_width="0").choose(4, 100, ["a"] * 4) == 8
    assert isinstance(_width().policy, WidthPolicy)  # CPU default
    assert _width(device="cuda").policy is None  # verify graphs exist for the full width only
    assert _width(tp_size=2, adaptive_width="1").policy is None
    assert "fixed: SGLANG_DFLASH_ADAPTIVE_WIDTH=0" in _width(adaptive_width="0").describe()


def test_width1_steps_turn_the_draft_off_for_the_first_steps():
    width = _width(adaptive_width="0", width1_steps=2)
    assert [width.choose(1, 10, ["a"]) for _ in range(4)] == [1, 1, 8, 8]


def test_forced_widths_are_taken_in_turn():
    width = _width(widths=(1, 2, 8), width1_steps=1)
    assert [width.choose(3, 10, ["a"] * 3) for _ in range(7)] == [1, 2, 8, 1, 2, 8, 1]
    with pytest.raises(ValueError, match="SGLANG_DFLASH_TEST_WIDTHS"):
        _width(widths=(9,))


def test_the_policy_is_fed_only_steady_decode_intervals():
    """The server's first COLD_DECODE_STEPS steps and the step after an extend are not measured."""
    width = _width(adaptive_width="1")
    seen = []
    width.policy.observe_step = lambda bs, w, seconds, context: seen.append(bs)
    width.policy.choose = lambda bs, context, rids: 8
    for bs in range(1, COLD_DECODE_STEPS + 4):
        width.choose(bs, 0, [])
    # Step k's interval is fed at step k+1, and only when step k came after the cold steps.
    assert seen == [COLD_DECODE_STEPS + 1, COLD_DECODE_STEPS + 2]
    width.not_decoding()  # an extend step
    width.choose(50, 0, [])
    width.choose(51, 0, [])
    assert seen == [COLD_DECODE_STEPS + 1, COLD_DECODE_STEPS + 2]  # the step after it is not fed
    width.choose(52, 0, [])
    assert seen[-1] == 51


def test_a_bulk_injection_is_left_out_of_the_step_that_ran_it(monkeypatch):
    """Seconds excluded during a step come off that step's interval only."""
    from sglang_dflash.width import step as step_module

    clock = iter(float(t) for t in range(0, 1000, 10))  # each step starts 10 s after the last
    monkeypatch.setattr(step_module.time, "perf_counter", lambda: next(clock))
    width = _width(adaptive_width="1")
    seen = []
    width.policy.observe_step = lambda bs, w, seconds, context: seen.append(seconds)
    width.policy.choose = lambda bs, context, rids: 8
    for _ in range(COLD_DECODE_STEPS + 1):
        width.choose(4, 0, [])
    width.exclude(2.5)  # this step flushed the queue
    width.choose(4, 0, [])
    width.choose(4, 0, [])
    assert seen == [7.5, 10.0]


def test_how_a_step_without_draft_runs_the_target():
    assert decode_when_off("cpu", None, "batched")[0] is False  # a verify over one token
    assert decode_when_off("cpu", None, "per-request")[0] is True
    assert decode_when_off("cuda", None, "batched")[0] is True
    assert decode_when_off("cpu", "decode", "batched") == (
        True,
        "decode forward (SGLANG_DFLASH_WIDTH1_FORWARD=decode)",
    )
    with pytest.raises(ValueError, match="SGLANG_DFLASH_WIDTH1_FORWARD must be decode or verify"):
        decode_when_off("cpu", "fast", "batched")


# ------------------------------------------------------------------ proposals


def test_argmax_proposals_with_and_without_logits_agree():
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(50, 16, generator=gen)
    head = SimpleNamespace(
        logits=lambda hidden: hidden @ lm_head.T, argmax=lambda hidden: (hidden @ lm_head.T).argmax(-1)
    )
    proposer = proposer_for(SimpleNamespace(), head)
    assert isinstance(proposer, ArgmaxProposer) and proposer.name == "argmax"
    window = torch.randn(3, 6, 16, generator=gen)  # [bs, W, H]
    hidden = window[:, 1:]  # the proposal rows
    anchor, positions = torch.zeros(3, dtype=torch.long), torch.arange(6).repeat(3, 1)
    plain = proposer(window, ProposalInputs(anchor, positions))
    ranked = proposer(window, ProposalInputs(anchor, positions, grammar_rows=[True, False, True]))
    assert plain.logits is None and plain.q is None
    assert ranked.logits.shape == (3, 5, 50)
    assert torch.equal(plain.tokens, ranked.tokens)
    assert torch.equal(ranked.tokens, (hidden @ lm_head.T).argmax(-1))


def test_a_width1_decode_forward_gives_the_target_a_plain_decode_batch():
    """The DECODE forward at W = 1 hands the target no speculative input (SGLang's Triton backend
    plans a decode from any spec_info's `kv_indptr`, which the draft's input lacks), with its
    lengths and token, and puts the batch back as it was."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_dflash.integration.target_forward import decode_forward

    seen = {}

    class Target:
        def forward_batch_generation(self, batch, **kwargs):
            seen.update(spec_info=batch.spec_info, mode=batch.forward_mode, seq_lens=batch.seq_lens.tolist())
            seen.update(seq_lens_cpu=batch.seq_lens_cpu.tolist(), input_ids=batch.input_ids.tolist())
            return "result"

    draft_input = object()
    batch = SimpleNamespace(
        spec_info=draft_input,
        forward_mode=ForwardMode.TARGET_VERIFY,
        seq_lens=torch.tensor([5, 9]),
        seq_lens_cpu=torch.tensor([5, 9]),
        seq_lens_sum=14,
        input_ids=None,
        out_cache_loc=None,
    )
    bonus, slots = torch.tensor([[3], [4]]), torch.tensor([[20], [21]])
    assert decode_forward(Target(), batch, bonus, slots) == "result"
    assert seen == dict(
        spec_info=None, mode=ForwardMode.DECODE, seq_lens=[6, 10], seq_lens_cpu=[6, 10], input_ids=[3, 4]
    )
    assert batch.spec_info is draft_input and batch.forward_mode == ForwardMode.TARGET_VERIFY
    assert batch.seq_lens.tolist() == [5, 9] and batch.seq_lens_sum == 14


def test_the_scheduler_keeps_host_lengths_for_the_step_whatever_the_targets_backend(monkeypatch):
    """SGLang's Triton backend says it needs no host sequence lengths; the decode step reads
    them (draft planning, the width policy's context), so the worker's backends still ask for
    them. Without the step among them, SGLang's own decision would be False."""
    from sglang.srt.managers import overlap_utils

    from sglang_dflash.worker import DFlashWorker

    monkeypatch.setattr(
        overlap_utils,
        "get_exec",
        lambda: SimpleNamespace(overlap=SimpleNamespace(enable_two_batch_overlap=False)),
    )
    monkeypatch.setattr(overlap_utils, "get_spec", lambda: SimpleNamespace(speculative_algorithm="DFLASH"))
    triton_like = SimpleNamespace(needs_cpu_seq_lens=False)
    worker = SimpleNamespace(
        target_worker=SimpleNamespace(model_runner=SimpleNamespace(attn_backend=triton_like))
    )
    backends = DFlashWorker.spec_v2_attn_backends.fget(worker)
    assert overlap_utils.decide_needs_cpu_seq_lens(backends) is True
    assert overlap_utils.decide_needs_cpu_seq_lens((triton_like,)) is False  # the base class's answer

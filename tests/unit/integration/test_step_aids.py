"""StepAids: each aid resolved once from the knobs; off, a call that does nothing; on, the aid."""

import json
from types import SimpleNamespace

import torch

from sglang_dflash.integration.step_aids import StepAids, skipped
from sglang_dflash.knobs import Knobs, SimulatedAcceptance
from tests.support.tensors import T
from tests.support.thread_group import ThreadGroup

ONE_RANK = SimpleNamespace(size=1)


def test_with_every_aid_off_the_step_calls_nothing_and_keeps_the_verified_run():
    aids = StepAids.from_knobs(Knobs(), ONE_RANK, 4)
    assert aids.check_ranks is skipped and aids.trace is skipped and aids.trace_features is skipped
    verified = (T([1]), T([[5, 6]]), T([6]))
    assert aids.accepted(T([[5, 7, 8, 9]]), torch.zeros(4, 10), verified) is verified


def test_simulated_acceptance_replaces_the_verified_run():
    """At a mean of the full width, every proposal is accepted, whatever was verified."""
    setting = SimulatedAcceptance(mean=4.0, method="geometric", token_mode="real-draft-token")
    aids = StepAids.from_knobs(Knobs(simulated_acceptance=setting), ONE_RANK, 4)
    candidates = T([[5, 7, 8, 9]])
    accept_len, out_tokens, _ = aids.accepted(candidates, torch.zeros(4, 10), (T([0]), None, None))
    assert accept_len.tolist() == [3] and out_tokens[0, :3].tolist() == [7, 8, 9]


def test_the_trace_writes_one_line_per_request(tmp_path):
    path = tmp_path / "trace.jsonl"
    aids = StepAids.from_knobs(Knobs(trace_proposals=str(path)), ONE_RANK, 4)
    step = SimpleNamespace(trace=lambda reqs, file: file.write(json.dumps([r.rid for r in reqs]) + "\n"))
    aids.trace(step, [SimpleNamespace(rid="a"), SimpleNamespace(rid="b")])
    assert path.read_text() == '["a", "b"]\n'


def test_the_feature_trace_writes_one_line_per_injection(tmp_path):
    path = tmp_path / "features.jsonl"
    aids = StepAids.from_knobs(Knobs(trace_features=str(path)), ONE_RANK, 4)
    aids.trace_features(T([3, 4]), torch.tensor([[0.5, 1.0], [2.0, -1.0]], dtype=torch.bfloat16))
    assert json.loads(path.read_text()) == {"positions": [3, 4], "features": [[0.5, 1.0], [2.0, -1.0]]}


def test_rank_checks_run_only_past_one_rank_and_catch_a_disagreement():
    assert StepAids.from_knobs(Knobs(check_ranks=True), ONE_RANK, 4).check_ranks is skipped

    def rank_step(tp, tokens):
        aids = StepAids.from_knobs(Knobs(check_ranks=True), tp, 4)
        try:
            aids.check_ranks(tokens=tokens(tp.rank))
        except RuntimeError as error:
            return str(error)

    assert ThreadGroup(2).run(lambda tp: rank_step(tp, lambda rank: T([7]))) == [None, None]
    disagreeing = ThreadGroup(2).run(lambda tp: rank_step(tp, lambda rank: T([rank])))
    assert all("ranks disagree on tokens" in e for e in disagreeing)

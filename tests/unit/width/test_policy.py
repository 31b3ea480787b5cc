"""The verify-width policy's pure parts, against hand-computed values and simulated workloads."""

from types import SimpleNamespace

import numpy as np
import pytest

from sglang_dflash.integration.metrics import resolve_spec_tokens_hook
from sglang_dflash.width.policy import (
    AcceptanceEstimate,
    RequestAcceptance,
    StepCostModel,
    WidthPolicy,
    expected_commit,
    policy_for,
    step_features,
)
from tests.support.width_workload import Workload, run


def test_expected_commit_by_hand():
    assert expected_commit([0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75])
    assert expected_commit([1.0, 1.0, 1.0]) == pytest.approx([1, 2, 3, 4])
    assert expected_commit([0.0, 1.0]) == pytest.approx([1, 1, 1])


def test_step_features_by_hand():
    features = step_features(4, np.array([1, 3]), context=2000, processed=np.array([4, 10]))
    assert features.tolist() == [[1, 4, 0, 0, 4, 2, 0.04], [1, 4, 1, 4, 12, 6, 0.1]]


def test_acceptance_counts_reached_and_accepted_positions():
    est = AcceptanceEstimate(5, decay=1.0, idle_decay=1.0, prior_weight=0.0)
    # Width 4 verifies positions 1..3. Accepted drafts 0, 1, 3 -> position 1 reached by all 3,
    # accepted by 2; position 2 reached by 2, accepted by 1; position 3 reached by 1, accepted by 1.
    est.observe([0, 1, 3], width=4)
    assert est.reached.tolist() == [3, 2, 1, 0]
    assert est.accepted.tolist() == [2, 1, 1, 0]
    # Width 1 verifies nothing: no evidence.
    est.observe([0, 0], width=1)
    assert est.reached.tolist() == [3, 2, 1, 0]


def test_unverified_positions_return_slowly_to_the_prior():
    est = AcceptanceEstimate(3, decay=0.5, idle_decay=0.9, prior=0.6, prior_weight=1.0)
    est.observe([2] * 10, width=3)
    assert est.rates() == pytest.approx([10 / 11 + 0.6 / 11] * 2)
    est.observe([0], width=2)  # position 1 verified (rejected): decays fast; position 2: slowly
    assert est.reached.tolist() == pytest.approx([5 + 1, 9])
    assert est.accepted.tolist() == pytest.approx([5, 9])
    for _ in range(3):
        est.observe([0], width=1)  # no draft: no evidence, slow decay everywhere
    assert est.rates()[1] == pytest.approx((9 * 0.729 + 0.6) / (9 * 0.729 + 1))
    for _ in range(300):
        est.observe([0], width=1)
    assert est.rates() == pytest.approx([0.6, 0.6], abs=1e-6)


def test_cost_model_recovers_a_linear_cost():
    coef = np.array([2.0, 0.3, 1.5, 0.4, 0.05, 0.7, 3.0])  # ms
    model = StepCostModel(forget=1.0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        bs, width = int(rng.integers(1, 33)), int(rng.integers(1, 9))
        context, processed = bs * int(rng.integers(20, 400)), bs * int(rng.integers(1, 9))
        x = step_features(bs, np.array([width]), context, processed)[0]
        model.observe(bs, width, float(x @ coef), context, processed)
    assert model.ready
    widths = np.arange(1, 9)
    expected = step_features(16, widths, 3000, 16 * widths) @ coef
    assert model.predict(16, widths, 3000, 16 * widths) == pytest.approx(expected, rel=1e-4)


def test_cost_model_is_not_ready_without_both_kinds_of_step():
    model = StepCostModel()
    for _ in range(10):
        model.observe(4, 8, 0.01)
        model.observe(4, 2, 0.008)
    assert not model.ready  # never saw a step without the draft
    for _ in range(3):
        model.observe(4, 1, 0.004)
    assert model.ready


def most_common(widths):
    return max(set(widths), key=widths.count)


def test_never_accepted_drafts_turn_speculation_off():
    policy = WidthPolicy(8)
    widths = run(policy, Workload(rate=0.0), bs=1)
    assert most_common(widths) == 1
    assert widths.count(1) >= 0.9 * len(widths)  # the rest are probes


def test_a_draft_accepting_nothing_is_not_chosen_on_a_noisy_cost():
    """Steps without the draft measured slower than steps with it (noise: on a tiny model the
    two cost about the same), and nothing ever accepted: a draft width commits one token a
    step, as no draft does, and its step is never cheaper, so no draft is chosen."""
    policy = WidthPolicy(8)
    for _ in range(50):
        for width, ms in [(1, 4.4), (2, 4.2), (8, 4.0)]:  # the draft widths "cheaper"
            policy.observe_step(1, width, ms * 1e-3)
        policy.observe_acceptance([0], 8)
    assert policy.step_seconds(1)[7] < policy.step_seconds(1)[0] / 1.05  # what the noise says
    assert policy.best_width(1) == 1


def test_always_accepted_drafts_keep_the_full_width():
    policy = WidthPolicy(8)
    widths = run(policy, Workload(rate=1.0), bs=1)
    assert widths.count(8) >= 0.9 * len(widths)


def test_large_batches_on_a_compute_bound_device_turn_speculation_off():
    # At bs 32 the draft (0.8 + 0.8*32 ms) and the wider verify cost more than 0.7 acceptance gains.
    policy = WidthPolicy(8)
    assert most_common(run(policy, Workload(rate=0.7), bs=32)) == 1
    # The same policy, once the load drops to one request, speculates again.
    assert most_common(run(policy, Workload(rate=0.7), bs=1)) > 1


def test_the_chosen_width_maximises_simulated_throughput():
    workload = Workload(rate=0.6)
    policy = WidthPolicy(8)
    run(policy, workload, bs=4)
    chosen = policy.best_width(4)
    commit = expected_commit([0.6] * 7)
    rate = commit / workload.cost(4, np.arange(1, 9))
    assert rate[chosen - 1] >= 0.97 * rate.max()


def test_policy_for_the_switch():
    assert policy_for(8, "cpu", None)[0] is not None
    assert policy_for(8, "cpu", False)[0] is None
    assert policy_for(8, "cuda", None)[0] is None  # verify graphs exist for the full width only
    assert policy_for(8, "cuda", True)[0] is not None
    assert policy_for(1, "cpu", True)[0] is None
    assert policy_for(8, "cpu", True, tp_size=2)[0] is None  # ranks would choose apart


def test_a_recent_measurement_overrides_the_model():
    policy = WidthPolicy(8)
    for _ in range(50):
        for width, ms in [(1, 4.0), (2, 8.0), (8, 12.0)]:
            policy.observe_step(1, width, ms * 1e-3)
    policy.observe_step(1, 5, 0.050)  # width 5 measured far above the model's line
    model = policy.cost.predict(1, np.arange(1, 9))
    assert model[4] < 0.02
    seconds = policy.step_seconds(1)
    assert seconds[4] == pytest.approx(0.050)
    # Measured widths keep their own averages; the others follow the model.
    assert seconds[[0, 1, 7]] == pytest.approx([0.004, 0.008, 0.012])
    assert seconds[[2, 3, 5, 6]] == pytest.approx(model[[2, 3, 5, 6]])


def test_a_measurement_at_a_nearby_batch_size_scales_the_model():
    policy = WidthPolicy(8)
    for bs in (1, 2):
        for _ in range(50):
            for width, ms in [(1, 4.0), (2, 8.0), (8, 12.0)]:
                policy.observe_step(bs, width, bs * ms * 1e-3)
    # Width 4 measured at bs 8 at three times the model's line (set directly: a real
    # observation would also move the model).
    policy.recent[(8, 4)] = (3 * policy.cost.predict(8, np.array([4]))[0], 0.0, 0.0, policy.steps)
    model = policy.cost.predict(16, np.arange(1, 9))
    seconds = policy.step_seconds(16)
    assert seconds[3] == pytest.approx(3 * model[3])
    assert seconds[[2, 4, 5, 6]] == pytest.approx(model[[2, 4, 5, 6]])  # never measured
    # Width 8 was measured at bs 2 and bs 1: the nearer (2) corrects it.
    assert seconds[7] == pytest.approx(model[7] * 0.024 / policy.cost.predict(2, np.array([8]))[0])


def test_a_new_batch_size_is_measured_at_both_ends_first():
    policy = WidthPolicy(8)
    run(policy, Workload(rate=0.7), bs=1)
    first = []
    for _ in range(2):
        first.append(policy.choose(32))
        assert policy.probing
        policy.observe_step(32, first[-1], 0.01)
    assert first == [1, 8]
    policy.choose(32)
    assert not policy.probing or policy.steps % policy.probe_every == 0


def test_results_are_charged_to_the_step_that_committed_them():
    """Under overlap scheduling a step's results are handled in the next step's interval: a
    wide probe looks cheap and the narrow step after it dear. At bs 32 no draft is best here
    (by 13%); charged where they land, the results would make the full width look best."""
    workload = dict(
        rate=0.75, rest_ms=2.0, per_req_ms=0.2, draft_ms=0.48, per_token_ms=0.12, per_result_ms=0.1
    )
    commit = expected_commit([0.75] * 7)
    true_cost = Workload(**workload).cost(32, np.arange(1, 9)) + 0.1e-3 * 32 * commit
    rate = commit / true_cost
    assert rate[0] > 1.1 * rate[1:].max()
    widths = run(WidthPolicy(8), Workload(**workload), bs=32, steps=1000)
    assert widths.count(1) >= 0.9 * len(widths)
    # Control: without the results' attribution the policy speculates at a loss.
    widths = run(WidthPolicy(8), Workload(**workload), bs=32, steps=1000, tell_results=False)
    assert widths.count(1) < 0.5 * len(widths)


def test_growing_contexts_do_not_make_an_old_measurement_look_cheap():
    """Every step's cost grows with the contexts (from 100 to 600 tokens a request, then a new
    wave). No draft is measured on most steps and stays current; a draft width measured at
    shorter contexts would look cheaper than it is now. No draft is best at every context."""
    workload = dict(
        rate=0.8,
        rest_ms=2.0,
        per_req_ms=0.2,
        draft_ms=0.48,
        per_token_ms=0.12,
        per_result_ms=0.05,
        per_kilotoken_ms=1.0,
        context=100,
        max_context=600,
    )
    commit = expected_commit([0.8] * 7)
    for context in (100, 600):
        sim = Workload(**workload)
        sim.context = context
        rate = commit / (sim.cost(32, np.arange(1, 9)) + 0.05e-3 * 32 * commit)
        assert rate[0] > 1.1 * rate[1:].max()
    widths = run(WidthPolicy(8), Workload(**workload), bs=32, steps=1500)
    assert widths.count(1) >= 0.9 * len(widths)

    # Control: the draft widths measured early in a wave (100 tokens a request), no draft
    # measured late (600). Told the contexts, the policy carries the old measurements to today's
    # context; without them, they look cheap and it drafts at a loss.
    def fed(tell_context: bool) -> WidthPolicy:
        policy, sim = WidthPolicy(8), Workload(**workload)
        for context, width in [(100, 8), (100, 2)] * 20 + [(600, 1)] * 20:
            sim.context = context
            policy.steps += 1
            policy.observe_acceptance([int(sim.rng.geometric(0.2)) - 1 for _ in range(32)], 8)
            policy.observe_step(32, width, float(sim.cost(32, [width])[0]), 32 * context * tell_context)
        return policy

    assert fed(tell_context=True).best_width(32, 32 * 600) == 1
    assert fed(tell_context=False).best_width(32, 0) > 1


def test_request_acceptance_by_hand():
    requests = RequestAcceptance(prior_weight=1.0, decay=1.0)
    # Width 4 proposes positions 1..3: a request that accepted none tried position 1; one that
    # accepted all 3 tried positions 1..3.
    requests.observe(["a", "b"], [0, 3], 4, step=1)
    assert requests.counts["a"][:2] == (0, 1) and requests.counts["b"][:2] == (3, 3)
    assert requests.rate("a", prior=0.5) == pytest.approx(0.25)
    assert requests.rate("b", prior=0.5) == pytest.approx(0.875)
    assert requests.rate("new", prior=0.5) == 0.5  # no evidence: the batch's rate
    assert requests.worst(["a", "b", "new"], prior=0.5) == pytest.approx(0.25)
    assert requests.worst([], prior=0.5) == 0.5
    requests.observe(["a"], [0], 1, step=2)  # width 1: no evidence
    assert requests.rate("a", prior=0.5) == pytest.approx(0.25)


def test_requests_unseen_for_a_while_are_forgotten():
    requests = RequestAcceptance(idle_steps=4)
    requests.observe(["old"], [1], 8, step=1)
    requests.observe(["new"], [1], 8, step=8)  # (pruned every idle_steps steps)
    assert set(requests.counts) == {"new"}


def poor_neighbour_workload(**kwargs):
    """Seven well-drafted requests and one poorly drafted, at bs 8. The draft costs more than a
    step without it (7.2 vs 6.0 ms): the full width gives the batch 1.5x the tokens a second of
    no draft, and the poor request a third of its own."""
    return Workload(
        rate=[0.9] * 7 + [0.1], rest_ms=1.0, per_req_ms=0.5, draft_ms=0.8, per_token_ms=0.12, **kwargs
    )


def test_a_poorly_drafted_request_is_not_slowed_by_its_neighbours():
    workload = poor_neighbour_workload()
    seconds = workload.cost(8, np.arange(1, 9))
    batch = np.mean([expected_commit([r] * 7) for r in workload.rate], axis=0) / seconds
    poor = expected_commit([0.1] * 7) / seconds
    assert batch[7] > 1.5 * batch[0] and poor[1:].max() < 0.7 * poor[0]
    widths = run(WidthPolicy(8), workload, bs=8, steps=1000)
    assert widths.count(1) >= 0.9 * len(widths)  # the rest are probes
    # Control: with the batch's throughput alone, the full width.
    widths = run(WidthPolicy(8, fair_slack=None), poor_neighbour_workload(), bs=8, steps=1000)
    assert most_common(widths) == 8


def test_a_narrower_width_that_slows_no_request_is_chosen():
    """A request at 0.5 among ones at 0.9, with a cheap draft: the full width would slow it by
    23%, widths 2 to 5 would not. Over the run, the poor request commits its tokens no more
    than 10% slower than without the draft (its acceptance is estimated, so a little noise),
    and the batch gets most of the full width's gain."""
    kwargs = dict(rest_ms=3.0, per_req_ms=0.5, draft_ms=0.3, per_token_ms=0.3)
    rates = [0.9] * 3 + [0.5]
    seconds = Workload(rate=rates, **kwargs).cost(4, np.arange(1, 9))
    batch_commit = np.mean([expected_commit([r] * 7) for r in rates], axis=0)
    poor_commit = expected_commit([0.5] * 7)
    poor = poor_commit / seconds
    assert poor[7] < 0.8 * poor[0] and (poor[1:5] >= poor[0] / 1.05).all()

    def rates_over(widths):  # (the poor request's, the batch's) tokens a second, run-long
        i = np.asarray(widths) - 1
        return poor_commit[i].sum() / seconds[i].sum(), batch_commit[i].sum() / seconds[i].sum()

    poor_rate, batch_rate = rates_over(run(WidthPolicy(8), Workload(rate=rates, **kwargs), bs=4, steps=1000))
    assert poor_rate >= poor[0] / 1.1
    assert batch_rate >= 1.5 / seconds[0]  # (the full width: 1.84x, the best fair width: 1.77x)
    # Control: with the batch's throughput alone, the poor request pays for the full width.
    widths = run(WidthPolicy(8, fair_slack=None), Workload(rate=rates, **kwargs), bs=4, steps=1000)
    assert rates_over(widths)[0] < 0.85 * poor[0]


def test_fair_slack_switch():
    assert policy_for(8, "cpu", None)[0].fair_slack == 0.05
    assert policy_for(8, "cpu", None, fair_slack=0.2)[0].fair_slack == 0.2
    policy, reason = policy_for(8, "cpu", None, fair_slack=None)  # SGLANG_DFLASH_FAIR_SLACK=off
    assert policy.fair_slack is None and "SGLANG_DFLASH_FAIR_SLACK=off" in reason


def test_probes_are_rarer_when_drafting_is_far_from_paying():
    """At bs 32 with a dear draft, no draft is best by far: draft probes are 4 times rarer
    (the full width is still measured within RECENT_STEPS); near a tie they are not."""
    far = dict(rate=0.5, rest_ms=1.0, per_req_ms=0.5, draft_ms=0.8, per_token_ms=0.12)

    def drafted(policy, **workload):
        widths = run(policy, Workload(**workload), bs=32, steps=2000)[-200:]
        return sum(w > 1 for w in widths)

    assert drafted(WidthPolicy(8), **far) <= 2
    assert drafted(WidthPolicy(8, far_probe_factor=1), **far) >= 3


def test_the_result_hook_tells_the_policy_each_live_request_by_id():
    """SGLang's result processing (through `metrics.resolve_spec_tokens_hook`) feeds the policy
    the accepted drafts of the requests still live, under their ids."""
    policy = WidthPolicy(8)

    def req(rid, finished=False):
        return SimpleNamespace(rid=rid, is_retracted=False, finished=lambda: finished)

    batch = SimpleNamespace(reqs=[req("a"), req("b", finished=True), req("c")])
    result = SimpleNamespace(num_correct_drafts_per_req_cpu=[0, 3, 7], speculative_num_draft_tokens=8)
    scheduler = SimpleNamespace(model_worker=SimpleNamespace(metrics=None, width_policy=policy))
    assert (
        resolve_spec_tokens_hook(lambda self, result, batch: "settled", scheduler, result, batch) == "settled"
    )
    assert {rid: c[:2] for rid, c in policy.requests.counts.items()} == {"a": (0, 1), "c": (7, 7)}
    assert policy.processed == 3 + 10  # every request's committed tokens, finished ones included

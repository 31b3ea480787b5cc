"""A simulated server for the width policy's tests: per-position acceptance and a step cost."""

import numpy as np

from sglang_dflash.width.policy import WidthPolicy, step_features


class Workload:
    """A simulated server: per-position acceptance `rate` (every position alike; or a list, one
    rate per request, each request telling the policy its id), and a step cost
    linear in the batch and the verified tokens, with a draft that costs as much as `draft_ms`;
    with `per_kilotoken_ms`, attention over the contexts, which grow by the committed tokens
    from `context` (per request) until they reach `max_context`, then start again (a new wave
    of requests). As under overlap scheduling, a step's results (`per_result_ms` a token) are
    handled, and its acceptance seen, in the next step's interval."""

    def __init__(
        self,
        rate,
        rest_ms=1.0,
        per_req_ms=0.5,
        draft_ms=0.8,
        per_token_ms=0.12,
        per_kilotoken_ms=0.0,
        per_result_ms=0.0,
        context=0,
        max_context=0,
        seed=0,
    ):
        self.rate, self.rng = rate, np.random.default_rng(seed)
        self.rids = [f"r{i}" for i in range(len(rate))] if isinstance(rate, list) else None
        self.coef = np.array([rest_ms, per_req_ms, draft_ms, draft_ms, per_token_ms, per_kilotoken_ms, 0])
        self.coef *= 1e-3
        self.draft_per_kilotoken = per_kilotoken_ms / 2 * 1e-3  # the draft's attention: not modelled
        self.per_result = per_result_ms * 1e-3
        self.start_context, self.max_context, self.context = context, max_context, context
        self.last = None  # (accepted per request, width) of the previous step

    def cost(self, bs: int, widths) -> np.ndarray:
        widths = np.asarray(widths)
        draft_attention = (widths > 1) * self.draft_per_kilotoken * bs * self.context / 1000
        return step_features(bs, widths, bs * self.context) @ self.coef + draft_attention

    def step(
        self, policy: WidthPolicy, bs: int, tell_context=True, tell_results=True
    ) -> tuple[int, float, int]:
        context = bs * self.context if tell_context else 0
        rates = self.rate if self.rids else [self.rate] * bs
        width = policy.choose(bs, context, self.rids or ())
        seconds = float(self.cost(bs, [width])[0])
        accepted = []
        for rate in rates:
            n = 0
            while n < width - 1 and self.rng.random() < rate:
                n += 1
            accepted.append(n)
        if self.last is not None:  # the previous step's results, handled while this one runs
            last_accepted, last_width = self.last
            seconds += self.per_result * (len(last_accepted) + sum(last_accepted))
            policy.observe_acceptance(last_accepted, last_width, self.rids or ())
            if tell_results:
                policy.observe_processed(len(last_accepted) + sum(last_accepted))
        self.last = accepted, width
        policy.observe_step(bs, width, seconds, context)
        self.context += 1 + sum(accepted) / bs
        if self.context > self.max_context:
            self.context = self.start_context
        return width, seconds, bs + sum(accepted)


def run(policy, workload, bs, steps=400, **kwargs):
    widths = [workload.step(policy, bs, **kwargs)[0] for _ in range(steps)]
    return widths[-200:]

"""The target's final hidden states, returned to requests that ask (`return_hidden_states`).

With DFLASH, the logits output's `hidden_states` are the captured target layers the draft is
conditioned on. With --enable-return-hidden-states (or --return-hidden-states-mode) the
target's logits processor also keeps its final hidden states (`keep_final_hidden_states`), and
after each step's injection `hand_over` gives the scheduler those instead, laid out as without
speculation.
"""

from __future__ import annotations

import torch


def keep_final_hidden_states(model) -> bool:
    """Make the target's logits processor keep its final hidden states (`last_hidden_states`)
    when the server returns hidden states; whether it does."""
    from sglang.srt.model_executor.forward_batch_info import get_server_return_hidden_states_mode

    if not get_server_return_hidden_states_mode().need_capture():
        return False
    processor = getattr(model, "logits_processor", None)
    if not hasattr(processor, "keep_last_hidden_states"):
        raise RuntimeError(
            f"the server returns hidden states, but {type(model).__name__} has no SGLang logits "
            "processor to keep them with DFLASH; launch without --enable-return-hidden-states"
        )
    processor.keep_last_hidden_states = True
    return True


def hand_over(batch, logits_output, extend: bool = False) -> None:
    """After injection: `hidden_states` held the draft's captured target layers, which the
    scheduler must not copy out. For requests that asked for hidden states it gets the
    target's final hidden states instead, laid out as without speculation: one row per
    forward token, or after a prefill in LAST mode (--return-hidden-states-mode last) one
    row per request, its last token's (the scheduler decides which, with the rule below)."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    final = logits_output.last_hidden_states
    logits_output.last_hidden_states = None
    if final is not None and batch.return_hidden_states:
        if extend and SchedulerBatchResultProcessor._get_prefill_hidden_capture_mode(batch).is_last():
            # E.g., extend_lens [3, 2] -> rows [2, 4].
            last = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0) - 1
            final = final[last.to(final.device, non_blocking=True)]
    else:
        final = None
    logits_output.hidden_states = final

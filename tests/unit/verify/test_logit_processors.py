"""Custom logit processors over the verify window (`sglang_dflash/verify/logit_processors.py`): the
per-row history, the committed-token bookkeeping, and the application to verify rows against
SGLang's own `apply_custom_logit_processor` (the oracle for processors that read no history)."""

from array import array
from types import SimpleNamespace

import torch

from sglang_dflash.verify.logit_processors import (
    ProcessorHistory,
    apply_over_window,
    deserialize_error,
    window_params,
)


def test_each_row_sees_the_history_of_its_decode_step():
    req = SimpleNamespace(origin_input_ids=array("q", [1, 2]), rid="r")
    rows = window_params({"k": 1, "__req__": req}, array("q", [5]), [7, 8, 9])
    assert [list(r["__req__"].output_ids) for r in rows] == [[5, 7], [5, 7, 8], [5, 7, 8, 9]]
    assert all(r["k"] == 1 and r["__req__"].rid == "r" for r in rows)
    # As SGLang's own processors read it: prompt and outputs, both arrays.
    assert list(rows[0]["__req__"].origin_input_ids + rows[0]["__req__"].output_ids) == [1, 2, 5, 7]
    assert window_params(None, array("q"), [7, 8]) == [None, None]


def test_history_folds_in_each_steps_commit_at_the_next_call():
    history = ProcessorHistory(num_slots=4)
    history.reset(2, [3, 4])
    history.commit([2], [[6, 7, 8]], torch.tensor([2], dtype=torch.int32))
    assert list(history.tokens[2]) == [3, 4]  # not yet: the accept length is still on the device
    history.settle()
    assert list(history.tokens[2]) == [3, 4, 6, 7]
    history.settle()  # idempotent
    assert list(history.tokens[2]) == [3, 4, 6, 7]
    history.reset(2, [])  # the slot's next request
    assert list(history.tokens[2]) == []


class _Ban:
    """A processor that reads no history: bans custom_params["ban"] on its rows."""

    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list):
            logits[row, params["ban"]] = -float("inf")
        return logits


def test_rows_equal_sglangs_own_application():
    from sglang.srt.layers.sampler import apply_custom_logit_processor
    from sglang.srt.sampling.sampling_batch_info import ProcessorEntry

    bs, width, vocab = 3, 4, 10
    params = [{"ban": [1, 2]}, None, {"ban": [5]}]

    class Info(SimpleNamespace):  # the fields of SamplingBatchInfo both functions read
        def __len__(self):
            return bs

    entry = ProcessorEntry(processor=_Ban(), rows=[0, 2], indices=torch.tensor([0, 2]))
    info = Info(custom_params=params, custom_logit_processor={0: entry}, device="cpu")
    logits = torch.randn(bs * width, vocab)

    ours = logits.clone()
    apply_over_window(ours, info, [p for p in params for _ in range(width)])
    theirs = logits.clone()
    apply_custom_logit_processor(theirs, info, num_tokens_in_batch=width)
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours[0:4, 1]).all() and not torch.isinf(ours[4:8]).any()


def test_a_processor_that_cannot_be_loaded_is_named():
    assert "UnpicklingError" in deserialize_error('{"callable": "00ff"}')
    assert "JSONDecodeError" in deserialize_error("not json")
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    assert deserialize_error(DisallowedTokensLogitsProcessor.to_str()) is None

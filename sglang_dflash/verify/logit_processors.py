"""Custom logit processors (`--enable-custom-logit-processor`) at every verify position, as
successive decode steps apply them.

SGLang's sampler calls each processor once per step on the rows of the requests that use it
(`layers/sampler.py`, `apply_custom_logit_processor`), with one `custom_params` dict per row whose
"__req__" entry is the request (a weak proxy to its `Req`): a processor may read the token
history there (`origin_input_ids`, `output_ids`), as SGLang's thinking-budget processors do.
Verify row t is the decode step whose input is window[t], so here each processor is called once
per step on all B rows of its requests, and row t's "__req__" is a view of the request whose
`output_ids` are its committed output tokens followed by window[0..t]: the list a
non-speculative engine holds at that step when it runs without overlap scheduling. (SGLang's
overlap scheduler runs a step before the previous step's token reaches `output_ids`, so there a
processor sees the history one token late; here it always sees the exact one.)

Inside the worker `req.output_ids` lags one step under overlap scheduling, so the committed
output tokens of every request with a processor are kept here (`ProcessorHistory`).

See docs/requests.md.
"""

from __future__ import annotations

from array import array
from typing import Any, Optional, Sequence

import torch


def deserialize_error(serialized: str) -> Optional[str]:
    """Why SGLang cannot load this `custom_logit_processor` string, or None."""
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

    try:
        processor = CustomLogitProcessor.from_str(serialized)
    except Exception as exc:  # anything a malformed payload raises: JSON, hex, dill, pickle
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    if not callable(processor):
        return f"it deserializes to a {type(processor).__name__}, which is not callable"
    return None


class WindowReq:
    """What a processor sees as "__req__" at one verify row: the request, except that
    `output_ids` is the history at that row (an `array("q")`, the type SGLang's `Req` uses, so
    `req.origin_input_ids + req.output_ids` works as it does there)."""

    __slots__ = ("_req", "output_ids")

    def __init__(self, req: Any, output_ids: array):
        self._req = req
        self.output_ids = output_ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)


def window_params(params: Optional[dict], history: array, window: list[int]) -> list:
    """One request's `custom_params` for each of its B verify rows.

    history: committed output tokens before window[0]; window: [bonus, d1 .. d_{B-1}].
    E.g., history [5], window [7, 8, 9] -> "__req__".output_ids [5, 7], [5, 7, 8], [5, 7, 8, 9].
    """
    if not isinstance(params, dict) or "__req__" not in params:
        return [params] * len(window)
    req = params["__req__"]
    return [
        params | {"__req__": WindowReq(req, history + array("q", window[: t + 1]))}
        for t in range(len(window))
    ]


def apply_over_window(logits: torch.Tensor, sampling_info: Any, row_params: Sequence) -> None:
    """Apply the batch's processors to verify logits in place, as SGLang's
    `apply_custom_logit_processor` does for B tokens per request, with per-row params.

    logits [bs * B, V]; row_params [bs * B]: the params of each row (`window_params`).
    """
    bs = len(sampling_info.custom_params)
    width = logits.shape[0] // bs
    offsets = torch.arange(width, device=logits.device)
    for entry in sampling_info.custom_logit_processor.values():
        # Request rows [1, 3], B 2 -> verify rows [2, 3, 6, 7].
        indices = (entry.indices.to(logits.device)[:, None] * width + offsets).flatten()
        selected = logits.index_select(0, indices)
        params = [row_params[i * width + t] for i in entry.rows for t in range(width)]
        result = entry.processor(selected, params)
        logits.index_copy_(0, indices, result.to(logits.dtype))


class ProcessorHistory:
    """Committed output tokens of each request that has a custom logit processor, by request
    slot (`req_pool_idx`); owned by the worker's `Verifier`.

    Invariant, for such a running request: `tokens[slot]` is its committed output tokens before
    its current bonus token. A step's commit is folded in at the start of the next call
    (`settle`), so the step itself never waits for its accept lengths on the host.
    """

    def __init__(self, num_slots: int):
        self.tokens: list[array] = [array("q") for _ in range(num_slots)]
        # (slots, windows [n][B] host lists, commit_lens [n] device) of the last step
        self._pending: Optional[tuple[list[int], list[list[int]], torch.Tensor]] = None

    def settle(self) -> None:
        """Fold the previous step's committed tokens in (one device->host copy)."""
        if self._pending is None:
            return
        slots, windows, commit_lens = self._pending
        self._pending = None
        for slot, window, n in zip(slots, windows, commit_lens.tolist()):
            self.tokens[slot].extend(window[:n])

    def reset(self, slot: int, output_ids: Sequence[int]) -> None:
        """A request (re)starts at a prefill with these output tokens (none, unless retracted)."""
        self.tokens[slot] = array("q", output_ids)

    def row_params(self, sampling_info: Any, slots: list[int], windows: list[list[int]]) -> list:
        """[bs * B] per-row params for `apply_over_window`; slots [bs]; windows [bs][B]."""
        out = []
        for params, slot, window in zip(sampling_info.custom_params, slots, windows):
            out += window_params(params, self.tokens[slot], window)
        return out

    def commit(self, slots: list[int], windows: list[list[int]], commit_lens: torch.Tensor) -> None:
        self._pending = (slots, windows, commit_lens)
